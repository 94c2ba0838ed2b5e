"""Phi-3, 3.5 and 4 (model_type phi3): q, k and v in one `qkv_proj` tensor and gate and
up in one `gate_up_proj`, no biases, partial rotary embeddings (Phi-4-mini), longrope
scaling under older names, and the pre-training context as a top-level key."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.hf_config import ConfigError
from mtjax.families.registry import Family, register


def _partial_rotary_factor(hf: dict) -> float:
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    return float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)


def from_hf(hf: dict) -> dict:
    # transformers' Phi-3 reads "su" and "yarn" as longrope, and its pre-training context
    # from the top-level key (4096 when absent), which is then no key to keep for export.
    rope = hf_config.rope_from_hf(hf, renamed={"su": "longrope", "yarn": "longrope"},
                                  context=int(hf.get("original_max_position_embeddings") or 4096))
    known = {"original_max_position_embeddings"} if rope[1] else set()
    fields = hf_config.read_common(hf, hf_config.one_window_layer_types(hf), known=known, rope=rope)
    return dict(fields, attention_bias=False, mlp_bias=False, partial_rotary_factor=_partial_rotary_factor(hf))


def to_hf(cfg) -> dict:
    hf = dict(hf_config.write_common(cfg), partial_rotary_factor=cfg.partial_rotary_factor,
              **hf_config.window_to_hf(cfg, per_layer=False))
    if cfg.rope_scaling:  # transformers' Phi-3 reads this top-level key first
        hf["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    return hf


def validate(cfg) -> None:
    if cfg.attention_bias or cfg.o_proj_bias or cfg.mlp_bias or cfg.qk_norm:
        raise ConfigError("phi3 models have no biases and no q/k norm (transformers' Phi-3 has none to load); "
                          "set attention_bias, o_proj_bias, mlp_bias and qk_norm to false")


register(Family("phi3", "Phi3ForCausalLM", from_hf, to_hf, defaults={"fused_projections": True}, validate=validate))
