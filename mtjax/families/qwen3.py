"""Qwen3: Qwen2's layout with a per-head RMSNorm on q and k, no default q/k/v biases
(`attention_bias` biases all four projections) and head_dim 128 unless written."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.registry import Family, register


def from_hf(hf: dict) -> dict:
    fields = hf_config.read_common(hf, hf_config.per_layer_types(hf, int(hf["num_hidden_layers"])), head_dim=128)
    return dict(fields, qk_norm=True, o_proj_bias=fields["attention_bias"])


def to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), attention_bias=cfg.o_proj_bias, **hf_config.window_to_hf(cfg))


register(Family("qwen3", "Qwen3ForCausalLM", from_hf, to_hf))
