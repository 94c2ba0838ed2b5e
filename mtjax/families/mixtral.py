"""Mixtral: Mistral's attention, every layer a mixture of `intermediate_size`-wide experts
with renormalised top-k weights; its checkpoints name the MoE `block_sparse_moe` and an
expert's gate, down and up projections `w1`, `w2` and `w3`."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.registry import Family, register

_EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def from_hf(hf: dict) -> dict:
    fields = hf_config.read_common(hf, hf_config.one_window_layer_types(hf), known=hf_config.EXPERT_KEYS)
    return dict(fields, num_experts=hf_config.experts_from_hf(hf), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                moe_layers=tuple(range(fields["num_hidden_layers"])))


def to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), num_experts_per_tok=cfg.num_experts_per_tok,
                router_aux_loss_coef=cfg.router_aux_loss_coef, intermediate_size=cfg.moe_intermediate_size,
                num_local_experts=cfg.num_experts, **(hf_config.window_to_hf(cfg) or {"sliding_window": None}))


def checkpoint_names(module: list[str]) -> list[str]:
    if module[:1] != ["mlp"]:
        return module
    experts = "experts" in module
    return ["block_sparse_moe", *(_EXPERT_NAMES.get(m, m) if experts else m for m in module[1:])]


register(Family("mixtral", "MixtralForCausalLM", from_hf, to_hf, checkpoint_names=checkpoint_names))
