"""What the family modules share to read and write a Hugging Face ``config.json``.

The Llama-shaped keys most families write alike (sizes, norms' epsilon, RoPE, the dtype,
biases), the sliding-window keys, the experts' keys, and the values they become: the
`ConfigError` a config refused raises, `RopeScaling`, and the layer types. A family module
reads config.json with `read_common` and adds its own keys; `write_common` is the way back.

This module imports nothing of mtjax's model code, so mtjax.model_config and every family
module may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from mtjax.errors import MtjaxError


class ConfigError(MtjaxError, ValueError):
    """A model configuration mtjax cannot use; the message says what to change."""


# config.json's layer_types, which ModelConfig.layer_types holds too.
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"

ROPE_TYPES = ("linear", "llama3", "longrope", "yarn")
# The keys of each rope type in a config.json's rope_parameters (besides rope_type and rope_theta).
ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("factor", "short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
             "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-frequency rescaling, one of ROPE_TYPES (formulas in mtjax.rope)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3, longrope, yarn: the pre-training context
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors for rows up to that context
    long_factor: tuple[float, ...] = ()  # longrope: ... for longer rows
    attention_factor: float | None = None  # longrope, yarn: cos/sin multiplier; None: derived from factor
    beta_fast: float = 32.0  # yarn: ramp bounds, in rotations over the pre-training context
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn: with mscale_all_dim, derives attention_factor
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp bounds to whole dimensions

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):  # hashable, also when read back from JSON lists
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))


# The keys `read_common` and `write_common` handle; a family adds its own to `known`.
COMMON_KEYS = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "attention_bias",
    "mlp_bias", "tie_word_embeddings", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "initializer_range", "torch_dtype", "dtype", "partial_rotary_factor",
})
# The experts' keys (`experts_from_hf`, `experts_to_hf`).
EXPERT_KEYS = frozenset({
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "shared_expert_intermediate_size", "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers",
    "qkv_bias",
})


def rope_from_hf(hf: dict, renamed: dict[str, str] | None = None,
                 context: int | None = None) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from both `rope_theta` + `rope_scaling` and the newer
    `rope_parameters`. `renamed`: older rope type names the family reads as another;
    `context`: the pre-training context where the family says it elsewhere than in
    rope_parameters' original_max_position_embeddings (else max_position_embeddings)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    rope_type = (renamed or {}).get(rope_type, rope_type)
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; use {', '.join(ROPE_TYPES)}")
    kwargs = {k: merged[k] for k in ROPE_KEYS[rope_type] if merged.get(k) is not None}
    if rope_type != "linear":
        kwargs["original_max_position_embeddings"] = context or int(
            kwargs.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048))
    if rope_type in ("longrope", "yarn"):
        context = kwargs["original_max_position_embeddings"]
        kwargs.setdefault("factor", hf.get("max_position_embeddings", 2048) / context)
    return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def rope_to_hf(theta: float, scaling: RopeScaling | None, partial_rotary_factor: float = 1.0) -> dict[str, Any]:
    """rope_parameters as transformers 5 writes them: the keys of the rope type only."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        values = dataclasses.asdict(scaling)
        rope.update({k: values[k] for k in ROPE_KEYS[scaling.rope_type] if values[k] is not None})
        rope.update({k: list(rope[k]) for k in ("short_factor", "long_factor") if k in rope},
                    rope_type=values["rope_type"])
    if partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = partial_rotary_factor
    return rope


def one_window_layer_types(hf: dict) -> tuple[str, ...]:
    """Every layer slides when config.json sets a `sliding_window` (one window for the
    whole model, as Mistral's), else none does."""
    return (SLIDING if hf.get("sliding_window") else FULL,) * int(hf["num_hidden_layers"])


def per_layer_types(hf: dict, layers: int) -> tuple[str, ...]:
    """`layer_types` where written; else every layer from `max_window_layers` on slides
    when `use_sliding_window` and a window are set (Qwen2's older rule); else all full."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        first = int(hf.get("max_window_layers", layers))
        return tuple(SLIDING if i >= first else FULL for i in range(layers))
    return (FULL,) * layers


def read_common(hf: dict, layer_types: tuple[str, ...], known: Iterable[str] = (),
                rope: tuple[float, RopeScaling | None] | None = None, head_dim: int | None = None,
                check_act: bool = True) -> dict:
    """The ModelConfig fields of the Llama-shaped keys: `layer_types` as the family derives
    them (the window is kept only where a layer slides), `rope` as the family reads it
    (default: `rope_from_hf`), `head_dim` where the family defaults it otherwise than
    hidden_size / heads. Keys neither here nor in `known` are kept in extra_hf for export.
    A missing required key raises KeyError (from_hf_dict names it)."""
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    theta, scaling = rope or rope_from_hf(hf)
    window = hf.get("sliding_window") if SLIDING in layer_types else None
    if check_act and hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported; these families use silu")
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    known = COMMON_KEYS | set(known)
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or head_dim or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        param_dtype=str(dtype).removeprefix("torch."),
        extra_hf=tuple(sorted((k, freeze(v)) for k, v in hf.items() if k not in known)),
    )


def write_common(cfg) -> dict:
    """The Llama-shaped keys of a ModelConfig's config.json (the inverse of `read_common`)."""
    rope = rope_to_hf(cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor)
    hf = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        dtype=cfg.param_dtype,
        torch_dtype=cfg.param_dtype,
    )
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(rope)
    return hf


def window_to_hf(cfg, per_layer: bool = True) -> dict:
    """The sliding-window keys: with `per_layer`, the window, use_sliding_window and
    layer_types (and max_window_layers for older readers when the sliding layers are the
    last ones) where a layer slides; else the one window of every layer, null when none."""
    if not per_layer:
        return {"sliding_window": cfg.sliding_window}
    if not cfg.sliding_window:
        return {}
    hf = dict(sliding_window=cfg.sliding_window, use_sliding_window=True, layer_types=list(cfg.layer_types))
    first = cfg.layer_types.index(SLIDING)
    if set(cfg.layer_types[first:]) == {SLIDING}:
        hf["max_window_layers"] = first
    return hf


def experts_from_hf(hf: dict) -> int:
    """The expert count (transformers maps num_experts and num_local_experts onto each
    other: either may be written), refusing the routing options mtjax does not have."""
    if hf.get("clip_qkv") is not None:
        raise ConfigError(f"clip_qkv ({hf['clip_qkv']}) is not supported; use a checkpoint with clip_qkv null")
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"router_jitter_noise ({hf['router_jitter_noise']}) is not supported; set it to 0")
    return int(hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"])


def freeze(v):
    """A JSON value as a hashable one (dicts as sorted key-value tuples)."""
    if isinstance(v, dict):
        return tuple(sorted((k, freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(freeze(x) for x in v)
    return v


def thaw(v):
    """The inverse of `freeze`."""
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
        return {k: thaw(x) for k, x in v}
    if isinstance(v, tuple):
        return [thaw(x) for x in v]
    return v
