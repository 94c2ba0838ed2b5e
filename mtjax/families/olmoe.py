"""OLMoE: every layer a mixture of `intermediate_size`-wide experts, and one RMSNorm over
all of q's and all of k's heads at once."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.hf_config import FULL
from mtjax.families.registry import Family, register


def from_hf(hf: dict) -> dict:
    layers = int(hf["num_hidden_layers"])
    fields = hf_config.read_common(hf, tuple(hf.get("layer_types") or ()) or (FULL,) * layers,
                                   known=hf_config.EXPERT_KEYS)
    return dict(fields, qk_norm_full=True, o_proj_bias=fields["attention_bias"],
                num_experts=hf_config.experts_from_hf(hf), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), moe_layers=tuple(range(layers)))


def to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), attention_bias=cfg.o_proj_bias,
                num_experts_per_tok=cfg.num_experts_per_tok, router_aux_loss_coef=cfg.router_aux_loss_coef,
                intermediate_size=cfg.moe_intermediate_size,
                num_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk_prob, **hf_config.window_to_hf(cfg))


register(Family("olmoe", "OlmoeForCausalLM", from_hf, to_hf))
