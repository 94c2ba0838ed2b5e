"""The architecture of a decoder-only model, read from a Hugging Face ``config.json``.

One frozen dataclass describes every supported family (Llama 2/3, Qwen2/2.5, Qwen3,
Mistral, Phi-3/3.5/4, Gemma 2, Gemma 3, and the mixtures of experts Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE and Llama 4's text model). Family differences are flags (q/k/v bias, q/k
norm, sliding windows, chunked attention, NoPE layers, rope scaling, fused projections,
Gemma's norms, GeGLU and soft-capping, experts), so the model code has no per-family branches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from mtjax import jsonfile, textfile
from mtjax.bounds import AT_LEAST_0, AT_LEAST_1, POSITIVE, out_of_range
from mtjax.errors import MtjaxError
from mtjax.layers.spec import DenseMLP, LayerSpec, MoE, Norms, Rope, SoftmaxAttention

LLAMA4 = "llama4_text"
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", LLAMA4)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", *MOE_MODEL_TYPES)
GEMMA = ("gemma2", "gemma3_text")
# Multimodal checkpoints whose text_config is imported (Gemma3ForConditionalGeneration,
# Llama4ForConditionalGeneration): the model type of each one's language model.
MULTIMODAL = {"gemma3": "gemma3_text", "llama4": LLAMA4}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# config.json's layer_types (read into `layer_specs` here, and nowhere else).
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


class ConfigError(MtjaxError, ValueError):
    """A model configuration mtjax cannot use; the message says what to change."""


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


# What the numbers not checked elsewhere in `ModelConfig.validate` may be (mtjax.bounds).
NUMBER_RANGES = {"rope_theta": POSITIVE, "max_position_embeddings": AT_LEAST_1, "rms_norm_eps": POSITIVE,
                 "initializer_range": AT_LEAST_0, "sliding_window": AT_LEAST_1, "attention_chunk_size": AT_LEAST_1,
                 "num_experts": AT_LEAST_0, "num_experts_per_tok": AT_LEAST_0, "moe_intermediate_size": AT_LEAST_0,
                 "shared_expert_intermediate_size": AT_LEAST_0, "router_aux_loss_coef": AT_LEAST_0}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of one model. Hashable: used as a jit static argument."""

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # biases on q, k and v (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # bias on the attention output (Llama's attention_bias)
    mlp_bias: bool = False  # biases on gate, up and down (Llama's mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    partial_rotary_factor: float = 1.0  # RoPE turns the first rotary_dim features of each head (Phi-4-mini)
    qk_norm_full: bool = False  # RMSNorm over all of q's and all of k's heads at once (OLMoE)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # W keys visible, the query's own included
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () means all FULL
    initializer_range: float = 0.02
    hidden_act: str = "silu"  # MLP gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma)
    rms_norm_offset: bool = False  # every norm scales by (1 + weight), in fp32 (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) in the compute dtype (Gemma)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs and before the MLP (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim's
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    local_rope_theta: float | None = None  # RoPE base of sliding layers where not rope_theta's (Gemma 3)
    local_rope_scaling: RopeScaling | None = None  # their rescaling, with local_rope_theta set
    param_dtype: str = "float32"  # dtype of the checkpoint's tensors (export writes it)
    compute_dtype: str = "float32"  # dtype of activations and streamed weights
    extra_hf: tuple[tuple[str, Any], ...] = ()  # other config.json keys, kept for export
    # Mixture of experts (mtjax.moe); num_experts 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k of the top-k routing
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the k kept router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the training loss
    moe_layers: tuple[int, ...] = ()  # indices of the MoE layers; the others are dense
    # Llama 4: NoPE layers, chunked local attention, L2 q/k norm, NoPE temperature tuning.
    no_rope_layers: tuple[int, ...] = ()  # indices of the layers without RoPE
    attention_chunk_size: int | None = None  # chunked_attention layers: a query sees its own chunk's keys
    qk_l2_norm: bool = False  # q and k RMS-normalised without a weight after RoPE, on RoPE layers only
    attn_temperature_tuning: bool = False  # NoPE layers scale q by log1p(floor((p + 1) / floor_scale)) * temperature_scale + 1
    floor_scale: float = 8192.0
    temperature_scale: float = 0.1  # Hugging Face's attn_scale (not `attn_scale` below, the softmax scale)
    # One mtjax.layers.spec.LayerSpec per layer, given whole (a layer kind of its own,
    # registered in mtjax.layers.registry): `layer_specs` is then these, not built from
    # layer_types, no_rope_layers and moe_layers. () builds them.
    explicit_layer_specs: tuple = ()

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_hidden_layers)
        self.validate()

    def validate(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if problem := out_of_range("model", self, NUMBER_RANGES):
            raise ConfigError(problem)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} turns {self.rotary_dim} of "
                              f"{self.head_dim} head features; it must give an even number in 2..head_dim")
        self._validate_rope_scaling()
        if self.model_type == "phi3" and (self.attention_bias or self.o_proj_bias or self.mlp_bias or self.qk_norm):
            raise ConfigError("phi3 models have no biases and no q/k norm (transformers' Phi-3 has none to load); "
                              "set attention_bias, o_proj_bias, mlp_bias and qk_norm to false")
        if self.explicit_layer_specs and len(self.explicit_layer_specs) != self.num_hidden_layers:
            raise ConfigError(f"explicit_layer_specs has {len(self.explicit_layer_specs)} entries for "
                              f"{self.num_hidden_layers} layers")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        bad = sorted(set(self.layer_types) - {FULL, SLIDING, CHUNKED})
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad}; use {FULL!r}, {SLIDING!r} or {CHUNKED!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding_attention layers need a positive sliding_window")
        if CHUNKED in self.layer_types and not (self.attention_chunk_size or 0) > 0:
            raise ConfigError("chunked_attention layers need a positive attention_chunk_size")
        if not set(self.no_rope_layers) <= set(range(self.num_hidden_layers)):
            raise ConfigError(f"no_rope_layers {list(self.no_rope_layers)} name layers outside 0.."
                              f"{self.num_hidden_layers - 1}")
        if self.attn_temperature_tuning and not self.floor_scale > 0:
            raise ConfigError(f"model.floor_scale must be positive, got {self.floor_scale}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"model.hidden_act must be one of {', '.join(ACTIVATIONS)}, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "local_rope_theta"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"model.{name} must be positive or null, got {getattr(self, name)}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"model.{name} must be float32, bfloat16 or float16")
        if self.moe_layers:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ConfigError(f"MoE layers need 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                                  f"num_experts ({self.num_experts}) and a positive moe_intermediate_size")
            if self.hidden_act != "silu":
                raise ConfigError(f"MoE experts are SwiGLU (silu); model.hidden_act {self.hidden_act!r} is not "
                                  "supported with moe_layers")
            if not set(self.moe_layers) <= set(range(self.num_hidden_layers)):
                raise ConfigError(f"moe_layers {list(self.moe_layers)} name layers outside 0.."
                                  f"{self.num_hidden_layers - 1}")

    @functools.cached_property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """What each layer is made of (mtjax.layers.spec), from layer_types, no_rope_layers,
        moe_layers and the fields they qualify; or `explicit_layer_specs` where given."""
        if self.explicit_layer_specs:
            return tuple(self.explicit_layer_specs)
        return tuple(self._layer_spec(i, t) for i, t in enumerate(self.layer_types))

    def _layer_spec(self, i: int, layer_type: str) -> LayerSpec:
        local = layer_type == SLIDING and self.local_rope_theta is not None  # Gemma 3's sliding layers
        rope = None if i in self.no_rope_layers else (
            Rope(self.local_rope_theta, self.local_rope_scaling) if local else Rope(self.rope_theta, self.rope_scaling))
        mixer = SoftmaxAttention(window=self.sliding_window if layer_type == SLIDING else None,
                                 chunk=self.attention_chunk_size if layer_type == CHUNKED else None,
                                 softcap=self.attn_logit_softcapping, qk_l2_norm=self.qk_l2_norm and rope is not None,
                                 temperature=self.attn_temperature_tuning and rope is None)
        feed_forward = (MoE(router="sigmoid_topk" if self.sigmoid_router else "softmax_topk",
                            shared_expert_gated=self.shared_expert_gated) if i in self.moe_layers else DenseMLP())
        return LayerSpec(mixer, feed_forward, rope, Norms(sandwich=self.sandwich_norms))

    @property
    def rope_interleaved(self) -> bool:
        """RoPE turns adjacent feature pairs (Llama 4's complex form), not the two halves."""
        return self.model_type == LLAMA4

    @property
    def sigmoid_router(self) -> bool:
        """Llama 4's router: top-k of the logits, each kept one's sigmoid scaling its expert's input."""
        return self.model_type == LLAMA4

    @property
    def shared_expert_gated(self) -> bool:
        """The shared expert's output scaled by a sigmoid gate (Qwen2-MoE; Llama 4's is ungated)."""
        return self.model_type == "qwen2_moe"

    def _validate_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if scaling.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {scaling.rope_type!r} is not supported; use {', '.join(ROPE_TYPES)}")
        if scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise ConfigError(f"longrope {name} has {len(getattr(scaling, name))} entries; it needs one "
                                      f"per rotated feature pair ({self.rotary_dim // 2})")

    @property
    def fused_projections(self) -> bool:
        """One qkv_proj and one gate_up_proj tensor per block, as Phi-3 checkpoints hold them."""
        return self.model_type == "phi3"

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE turns (the first ones; the rest pass unchanged)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        """What q k^T is multiplied by before the softmax."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def block_specs(self) -> tuple[LayerSpec, ...]:
        """Distinct layer specs, in first-use order: one compiled function each."""
        return tuple(dict.fromkeys(self.layer_specs))

    def check_context(self, seq_len: int, name: str) -> None:
        """Refuse rows longer than the model's context; `name` is the setting that gave them."""
        if seq_len > self.max_position_embeddings:
            raise ConfigError(f"{name} ({seq_len}) exceeds the model's context (model.max_position_embeddings = "
                              f"{self.max_position_embeddings}); lower {name}")


def differences(old: ModelConfig, new: ModelConfig, ignore: tuple[str, ...] = ()) -> list[str]:
    """'field old -> new' for each field (not in `ignore`) whose value differs; layer_types
    is left out when it only follows a changed num_hidden_layers."""
    if old.num_hidden_layers != new.num_hidden_layers:
        ignore = (*ignore, "layer_types")
    return [f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}" for f in dataclasses.fields(ModelConfig)
            if f.name not in ignore and getattr(old, f.name) != getattr(new, f.name)]


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """Accept both `rope_theta` + `rope_scaling` and the newer `rope_parameters`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # transformers' Phi-3 reads these older names as longrope
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; use {', '.join(ROPE_TYPES)}")
    kwargs = {k: merged[k] for k in ROPE_KEYS[rope_type] if merged.get(k) is not None}
    if rope_type != "linear":
        kwargs["original_max_position_embeddings"] = _pretraining_context(hf, kwargs)
    if rope_type in ("longrope", "yarn"):
        kwargs.setdefault("factor", hf.get("max_position_embeddings", 2048) / kwargs["original_max_position_embeddings"])
    return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def _pretraining_context(hf: dict, rope: dict) -> int:
    """original_max_position_embeddings as transformers resolves it: Phi-3's top-level key
    (4096 when absent) wins; elsewhere rope_parameters' key, else max_position_embeddings."""
    if hf.get("model_type") == "phi3":
        return int(hf.get("original_max_position_embeddings") or 4096)
    return int(rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048))


def _partial_rotary_factor(hf: dict) -> float:
    """Phi-3's share of each head that RoPE turns (other families' transformers code ignores the key)."""
    if hf.get("model_type") != "phi3":
        return 1.0
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    return float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)


_HF_KNOWN = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "attention_bias",
    "mlp_bias", "tie_word_embeddings", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "initializer_range", "torch_dtype", "dtype", "partial_rotary_factor",
    "architectures",  # rewritten from model_type on export
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "shared_expert_intermediate_size", "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers",
    "qkv_bias",
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern", "use_bidirectional_attention",
}

# transformers' defaults for the keys a Gemma config.json may leave out (the multimodal
# Gemma 3 checkpoints write a text_config of only the keys that differ from these).
_GEMMA_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None,
                        hidden_activation="gelu_pytorch_tanh"),
}
_GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' defaults, global and local


def _language_model(hf: dict) -> dict:
    """The text_config of a multimodal config (MULTIMODAL), with the top-level keys that govern it."""
    text = dict(hf.get("text_config") or {})
    for key in ("tie_word_embeddings", "dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
                "transformers_version"):
        if key in hf:
            text[key] = hf[key]  # transformers ties and sets dtype by the top-level config
    return dict(text, model_type=MULTIMODAL[hf["model_type"]])


def _gemma_layer_types(hf: dict, model_type: str, layers: int) -> tuple[str, ...]:
    """transformers' default: Gemma 2 alternates sliding and global; Gemma 3 slides all but every 6th."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    every = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                                                  or 6)
    return tuple(SLIDING if (i + 1) % every else FULL for i in range(layers))


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
        out[prefix + "rope_theta"], out[prefix + "rope_scaling"] = _rope_from_hf({"rope_parameters": rope, **context})
    return out


def _gemma_fields(hf: dict, model_type: str) -> dict:
    """The ModelConfig fields that Gemma 2 and 3 set beyond the Llama-shaped ones."""
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation {act!r} is not supported; Gemma uses gelu_pytorch_tanh")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention is not supported: mtjax trains causal language models")
    fields = dict(hidden_act=act, rms_norm_offset=True, embed_scale=True, sandwich_norms=True,
                  query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                  qk_norm=model_type == "gemma3_text",
                  o_proj_bias=bool(hf.get("attention_bias", False)))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        fields[key] = float(hf[key]) if hf.get(key) is not None else None
    if model_type == "gemma3_text":
        fields.update(_gemma3_rope(hf))
        fields["attn_logit_softcapping"] = None  # transformers' Gemma 3 attention never caps
    return fields


# transformers' Llama4TextConfig defaults for the keys whose default is not the generic one.
_LLAMA4_DEFAULTS = dict(rope_theta=500000.0, intermediate_size=8192, intermediate_size_mlp=16384,
                        num_local_experts=16, num_experts_per_tok=1, attention_chunk_size=8192, rms_norm_eps=1e-5)
_LLAMA4_KEYS = {"intermediate_size_mlp", "moe_layers", "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers",
                "no_rope_layer_interval", "attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale"}


def _llama4_rope_flags(hf: dict, layers: int) -> list[bool]:
    """Whether each layer turns RoPE: `no_rope_layers` (1: RoPE, 0: NoPE), else NoPE every
    `no_rope_layer_interval`-th layer, as transformers derives it."""
    flags = hf.get("no_rope_layers")
    if flags:
        return [bool(f) for f in flags[:layers]]
    every = int(hf.get("no_rope_layer_interval", 4))
    return [(i + 1) % every != 0 for i in range(layers)]


def _llama4_layer_types(hf: dict, layers: int) -> tuple[str, ...]:
    """`layer_types` where written; else transformers' rule: RoPE layers chunked (when
    attention_chunk_size is set), NoPE layers full."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    chunked = hf.get("attention_chunk_size") is not None
    return tuple(CHUNKED if rope and chunked else FULL for rope in _llama4_rope_flags(hf, layers))


def _llama4_fields(hf: dict, layers: int) -> dict:
    """The ModelConfig fields of a Llama 4 text config beyond the MoE ones: its dense
    layers' MLP is intermediate_size_mlp wide (the experts' intermediate_size is
    moe_intermediate_size here)."""
    chunk = hf.get("attention_chunk_size")
    return dict(intermediate_size=int(hf["intermediate_size_mlp"]),
                no_rope_layers=tuple(i for i, rope in enumerate(_llama4_rope_flags(hf, layers)) if not rope),
                attention_chunk_size=int(chunk) if chunk is not None else None,
                qk_l2_norm=bool(hf.get("use_qk_norm", True)),
                attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
                floor_scale=float(hf.get("floor_scale", 8192)), temperature_scale=float(hf.get("attn_scale", 0.1)),
                o_proj_bias=bool(hf.get("attention_bias", False)))


def _moe_from_hf(model_type: str, hf: dict, layers: int) -> dict:
    """The MoE fields of a ModelConfig from a MoE family's config.json ({} for dense ones)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    if hf.get("clip_qkv") is not None:
        raise ConfigError(f"clip_qkv ({hf['clip_qkv']}) is not supported; use a checkpoint with clip_qkv null")
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"router_jitter_noise ({hf['router_jitter_noise']}) is not supported; set it to 0")
    # transformers maps num_experts and num_local_experts onto each other: either may be written.
    experts = int(hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"])
    if model_type in ("qwen2_moe", "qwen3_moe"):
        # transformers' rule: a layer is dense when listed in mlp_only_layers or off the sparse step.
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    elif model_type == LLAMA4:  # moe_layers wins over interleave_moe_layer_step
        step = int(hf.get("interleave_moe_layer_step", 1))
        listed = hf.get("moe_layers")
        sparse = tuple(sorted(int(i) for i in listed)) if listed is not None else tuple(range(step - 1, layers, step))
    else:
        sparse = tuple(range(layers))
    width = int(hf["moe_intermediate_size" if model_type in ("qwen2_moe", "qwen3_moe") else "intermediate_size"])
    shared = {"qwen2_moe": int(hf.get("shared_expert_intermediate_size", 0)), LLAMA4: width}.get(model_type, 0)
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=width,
        norm_topk_prob=True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        # Llama4ForCausalLM's loss has no load-balancing term, even with output_router_logits: nor has mtjax's.
        router_aux_loss_coef=0.0 if model_type == LLAMA4 else float(hf.get("router_aux_loss_coef", 0.001)),
        moe_layers=sparse,
    )


def from_hf_dict(hf: dict, **overrides) -> ModelConfig:
    """Build a ModelConfig from the contents of a Hugging Face ``config.json``.

    A multimodal Gemma 3 config (model_type gemma3) gives its language model's config."""
    if hf.get("model_type") in MULTIMODAL:
        hf = _language_model(hf)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}, {', '.join(MULTIMODAL)} (their language models)"
        )
    if model_type in GEMMA:
        hf = {**_GEMMA_DEFAULTS[model_type], **hf}
    if model_type == LLAMA4:
        hf = {**_LLAMA4_DEFAULTS, **hf}
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        layers = int(hf["num_hidden_layers"])
        theta, scaling = _rope_from_hf(hf)
        window = hf.get("sliding_window")
        if model_type in ("qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window"):
            raise ConfigError(f"use_sliding_window is not supported for {model_type}; set it to false")
        if model_type in ("mistral", "phi3", "mixtral"):  # one window for every layer, when set
            layer_types = (SLIDING if window else FULL,) * layers
        elif model_type in ("qwen2_moe", "qwen3_moe"):
            layer_types = (FULL,) * layers
        elif model_type in GEMMA:
            layer_types = _gemma_layer_types(hf, model_type, layers)
        elif model_type == LLAMA4:
            layer_types = _llama4_layer_types(hf, layers)
        elif hf.get("layer_types"):
            layer_types = tuple(hf["layer_types"])
        elif model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window") and window:
            first = int(hf.get("max_window_layers", layers))
            layer_types = tuple(SLIDING if i >= first else FULL for i in range(layers))
        else:
            layer_types = (FULL,) * layers
        if SLIDING not in layer_types:
            window = None
        attention_bias = bool(hf.get("attention_bias", False))
        if model_type not in GEMMA and hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported; these families use silu")
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        # Phi-3's top-level pre-training context is the rope scaling's, when there is one.
        known = _HF_KNOWN | ({"original_max_position_embeddings"} if model_type == "phi3" and scaling else set())
        if model_type == LLAMA4:  # its router_aux_loss_coef goes unused (see _llama4_fields): kept as written
            known = (known | _LLAMA4_KEYS) - {"router_aux_loss_coef"}
        kwargs = dict(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            # transformers' Qwen3 defaults head_dim to 128, not hidden // heads.
            head_dim=int(hf.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            # Qwen2 always has q/k/v biases and no attention_bias key; Qwen2-MoE says qkv_bias;
            # Phi-3 never has biases.
            attention_bias={"qwen2": True, "qwen2_moe": bool(hf.get("qkv_bias", True)),
                            "phi3": False}.get(model_type, attention_bias),
            o_proj_bias=attention_bias and model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"),
            mlp_bias=bool(hf.get("mlp_bias", False)) and model_type != "phi3",
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            qk_norm_full=model_type == "olmoe",
            partial_rotary_factor=_partial_rotary_factor(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            initializer_range=float(hf.get("initializer_range", 0.02)),
            param_dtype=str(dtype).removeprefix("torch."),
            extra_hf=tuple(sorted((k, _freeze(v)) for k, v in hf.items() if k not in known)),
            **_moe_from_hf(model_type, hf, layers),
        )
        if model_type in GEMMA:
            kwargs.update(_gemma_fields(hf, model_type))
        if model_type == LLAMA4:
            kwargs.update(_llama4_fields(hf, layers))
    except KeyError as e:
        raise ConfigError(f"config.json lacks the required key {e.args[0]!r}") from None
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v):
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
        return {k: _thaw(x) for k, x in v}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


def load_hf_config(path: str | Path, **overrides) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no config.json at {file}: point at a Hugging Face checkpoint directory")
    try:
        hf = jsonfile.loads(textfile.read(file), str(file))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e})") from None
    return from_hf_dict(hf, **overrides)


def to_hf_dict(cfg: ModelConfig) -> dict:
    """The inverse of `from_hf_dict`: a ``config.json`` transformers can load."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "olmoe": "OlmoeForCausalLM", LLAMA4: "Llama4ForCausalLM"}[cfg.model_type]
    hf = {k: _thaw(v) for k, v in cfg.extra_hf}
    rope = _rope_to_hf(cfg)
    hf.update(
        architectures=[arch],
        model_type=cfg.model_type,
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
    if cfg.model_type in ("llama", "qwen3", "qwen3_moe", "olmoe", LLAMA4):
        hf["attention_bias"] = cfg.o_proj_bias
    if cfg.model_type == "qwen2_moe":
        hf["qkv_bias"] = cfg.attention_bias
    hf.update(_moe_to_hf(cfg))
    if cfg.model_type == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(rope)
    if cfg.model_type == "phi3":  # transformers' Phi-3 reads these top-level keys first
        hf["partial_rotary_factor"] = cfg.partial_rotary_factor
        if cfg.rope_scaling:
            hf["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    if cfg.model_type in GEMMA:
        hf.update(_gemma_to_hf(cfg, rope))
    elif cfg.model_type == LLAMA4:
        hf.update(_llama4_to_hf(cfg))
    elif cfg.sliding_window:
        hf["sliding_window"] = cfg.sliding_window
        if cfg.model_type not in ("mistral", "phi3"):
            hf["use_sliding_window"] = True
            hf["layer_types"] = list(cfg.layer_types)
            full = cfg.layer_types.index(SLIDING)
            if set(cfg.layer_types[full:]) == {SLIDING}:
                # Readers older than `layer_types` slide layers >= max_window_layers.
                hf["max_window_layers"] = full
    elif cfg.model_type in ("mistral", "phi3", "mixtral"):
        hf["sliding_window"] = None
    return hf


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """rope_parameters as transformers 5 writes them: the keys of the rope type only."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        scaling = dataclasses.asdict(cfg.rope_scaling)
        rope.update({k: scaling[k] for k in ROPE_KEYS[cfg.rope_scaling.rope_type] if scaling[k] is not None})
        rope.update({k: list(rope[k]) for k in ("short_factor", "long_factor") if k in rope}, rope_type=scaling["rope_type"])
    if cfg.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    return rope


def _moe_to_hf(cfg: ModelConfig) -> dict:
    """The MoE keys of a MoE family's config.json (the inverse of `_moe_from_hf`)."""
    if cfg.model_type not in MOE_MODEL_TYPES:
        return {}
    out = dict(num_experts_per_tok=cfg.num_experts_per_tok, router_aux_loss_coef=cfg.router_aux_loss_coef)
    if cfg.model_type in ("mixtral", "olmoe", LLAMA4):  # their experts are intermediate_size wide
        out["intermediate_size"] = cfg.moe_intermediate_size
    if cfg.model_type == LLAMA4:  # its router_aux_loss_coef, unused, is in extra_hf as the checkpoint wrote it
        del out["router_aux_loss_coef"]
        return {**out, "num_local_experts": cfg.num_experts, "moe_layers": list(cfg.moe_layers)}
    if cfg.model_type == "mixtral":
        return {**out, "num_local_experts": cfg.num_experts}
    out.update(num_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk_prob)
    if cfg.model_type != "olmoe":
        out["moe_intermediate_size"] = cfg.moe_intermediate_size
    if cfg.model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        out.update(decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers])
    return out


def _gemma_to_hf(cfg: ModelConfig, rope: dict) -> dict:
    """The Gemma keys of config.json; Gemma 3's RoPE both per layer type (transformers 5)
    and as rope_theta, rope_local_base_freq and rope_scaling (older readers)."""
    scalar = cfg.query_pre_attn_scalar
    hf = dict(hidden_activation=cfg.hidden_act, query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
              attn_logit_softcapping=cfg.attn_logit_softcapping, final_logit_softcapping=cfg.final_logit_softcapping,
              attention_bias=cfg.o_proj_bias, sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types))
    if cfg.model_type == "gemma3_text":
        local = _rope_to_hf(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta or cfg.rope_theta,
                                                rope_scaling=cfg.local_rope_scaling))
        hf.update(rope_parameters={FULL: rope, SLIDING: local}, rope_local_base_freq=local["rope_theta"])
    return hf


def _llama4_to_hf(cfg: ModelConfig) -> dict:
    """The Llama 4 keys of config.json (the inverse of `_llama4_fields`)."""
    floor = cfg.floor_scale
    return dict(intermediate_size_mlp=cfg.intermediate_size, layer_types=list(cfg.layer_types),
                no_rope_layers=[int(i not in cfg.no_rope_layers) for i in range(cfg.num_hidden_layers)],
                attention_chunk_size=cfg.attention_chunk_size, use_qk_norm=cfg.qk_l2_norm,
                attn_temperature_tuning=cfg.attn_temperature_tuning,
                floor_scale=int(floor) if floor.is_integer() else floor, attn_scale=cfg.temperature_scale)
