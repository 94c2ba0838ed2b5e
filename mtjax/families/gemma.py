"""Gemma 2 and Gemma 3 (text; a multimodal Gemma 3's language model too): GeGLU, norms
that scale by (1 + weight) and sandwich each sub-layer, embeddings scaled by
sqrt(hidden_size), attention scaled by `query_pre_attn_scalar`, sliding layers
interleaved with global ones; Gemma 2 soft-caps attention scores and logits, Gemma 3
norms q and k per head and gives its sliding layers a RoPE base of their own."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.hf_config import FULL, SLIDING, ConfigError
from mtjax.families.registry import Family, register

_KEYS = {"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
         "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern", "use_bidirectional_attention"}
# transformers' defaults for the keys a Gemma config.json may leave out (the multimodal
# Gemma 3 checkpoints write a text_config of only the keys that differ from these).
_DEFAULTS = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh")
_GEMMA3_DEFAULTS = dict(_DEFAULTS, vocab_size=262208, max_position_embeddings=131072, final_logit_softcapping=None,
                        attn_logit_softcapping=None)
_GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' defaults, global and local


def _layer_types(hf: dict, every: int) -> tuple[str, ...]:
    """`layer_types` where written; else all but every `every`-th layer slide."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    return tuple(SLIDING if (i + 1) % every else FULL for i in range(int(hf["num_hidden_layers"])))


def _fields(hf: dict, layer_types: tuple[str, ...]) -> dict:
    """The fields Gemma 2 and 3 share, the Llama-shaped ones among them."""
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation {act!r} is not supported; Gemma uses gelu_pytorch_tanh")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention is not supported: mtjax trains causal language models")
    fields = hf_config.read_common(hf, layer_types, known=_KEYS, check_act=False)
    fields.update(hidden_act=act, rms_norm_offset=True, embed_scale=True, sandwich_norms=True,
                  query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]), o_proj_bias=fields["attention_bias"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        fields[key] = float(hf[key]) if hf.get(key) is not None else None
    return fields


def _to_hf(cfg) -> dict:
    scalar = cfg.query_pre_attn_scalar
    return dict(hf_config.write_common(cfg), hidden_activation=cfg.hidden_act,
                query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
                attn_logit_softcapping=cfg.attn_logit_softcapping, final_logit_softcapping=cfg.final_logit_softcapping,
                attention_bias=cfg.o_proj_bias, sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types))


def gemma2_from_hf(hf: dict) -> dict:
    hf = {**_DEFAULTS, **hf}
    return _fields(hf, _layer_types(hf, 2))


def _gemma3_rope(hf: dict) -> dict:
    """Global and local RoPE of Gemma 3: transformers 5's per-layer-type `rope_parameters`
    ({"full_attention": {...}, "sliding_attention": {...}}), or the older `rope_theta`,
    `rope_local_base_freq` and `rope_scaling` (which applies to the global layers only)."""
    params = hf.get("rope_parameters") or {}
    if params and set(params) <= {FULL, SLIDING}:
        per_type = {kind: dict(params.get(kind) or {}) for kind in (FULL, SLIDING)}
    else:
        per_type = {FULL: {**(hf.get("rope_scaling") or {}), **params},
                    SLIDING: {"rope_theta": hf.get("rope_local_base_freq", _GEMMA3_THETA[SLIDING])}}
        per_type[FULL].setdefault("rope_theta", hf.get("rope_theta", _GEMMA3_THETA[FULL]))
    out = {}
    for kind, prefix in ((FULL, ""), (SLIDING, "local_")):
        rope = {"rope_theta": _GEMMA3_THETA[kind], **per_type[kind]}
        context = {"max_position_embeddings": hf.get("max_position_embeddings", 2048)}
        out[prefix + "rope_theta"], out[prefix + "rope_scaling"] = hf_config.rope_from_hf(
            {"rope_parameters": rope, **context})
    return out


def gemma3_from_hf(hf: dict) -> dict:
    hf = {**_GEMMA3_DEFAULTS, **hf}
    every = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    # transformers' Gemma 3 attention never caps its scores.
    return dict(_fields(hf, _layer_types(hf, every)), qk_norm=True, attn_logit_softcapping=None, **_gemma3_rope(hf))


def gemma3_to_hf(cfg) -> dict:
    """Gemma 3's RoPE both per layer type (transformers 5) and as rope_theta,
    rope_local_base_freq and rope_scaling (older readers)."""
    hf = _to_hf(cfg)
    local = hf_config.rope_to_hf(cfg.local_rope_theta or cfg.rope_theta, cfg.local_rope_scaling,
                                 cfg.partial_rotary_factor)
    return dict(hf, rope_parameters={FULL: hf["rope_parameters"], SLIDING: local},
                rope_local_base_freq=local["rope_theta"])


register(Family("gemma2", "Gemma2ForCausalLM", gemma2_from_hf, _to_hf))
register(Family("gemma3_text", "Gemma3ForCausalLM", gemma3_from_hf, gemma3_to_hf, multimodal="gemma3"))
