"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention, the layers off
`mlp_only_layers` and on the `decoder_sparse_step` a mixture of `moe_intermediate_size`-wide
experts. Qwen2-MoE adds a shared expert scaled by a sigmoid gate and says its q/k/v
biases with `qkv_bias`; neither slides a window."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.hf_config import FULL, ConfigError
from mtjax.families.registry import Family, register


def _moe_fields(hf: dict, name: str) -> dict:
    """The fields both share: the Qwen2 layout's, and the experts'."""
    if hf.get("use_sliding_window"):
        raise ConfigError(f"use_sliding_window is not supported for {name}; set it to false")
    layers = int(hf["num_hidden_layers"])
    experts = hf_config.experts_from_hf(hf)
    # transformers' rule: a layer is dense when listed in mlp_only_layers or off the sparse step.
    step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(hf_config.read_common(hf, (FULL,) * layers, known=hf_config.EXPERT_KEYS),
                num_experts=experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), moe_layers=sparse)


def _moe_to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), num_experts_per_tok=cfg.num_experts_per_tok,
                router_aux_loss_coef=cfg.router_aux_loss_coef, num_experts=cfg.num_experts,
                norm_topk_prob=cfg.norm_topk_prob, moe_intermediate_size=cfg.moe_intermediate_size,
                decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers],
                **hf_config.window_to_hf(cfg))


def qwen2_moe_from_hf(hf: dict) -> dict:
    return dict(_moe_fields(hf, "qwen2_moe"), attention_bias=bool(hf.get("qkv_bias", True)),
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)))


def qwen2_moe_to_hf(cfg) -> dict:
    return dict(_moe_to_hf(cfg), qkv_bias=cfg.attention_bias,
                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)


def qwen3_moe_from_hf(hf: dict) -> dict:
    fields = _moe_fields(hf, "qwen3_moe")
    return dict(fields, qk_norm=True, o_proj_bias=fields["attention_bias"])


def qwen3_moe_to_hf(cfg) -> dict:
    return dict(_moe_to_hf(cfg), attention_bias=cfg.o_proj_bias)


register(Family("qwen2_moe", "Qwen2MoeForCausalLM", qwen2_moe_from_hf, qwen2_moe_to_hf,
                defaults={"shared_expert_gated": True}))
register(Family("qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_from_hf, qwen3_moe_to_hf))
