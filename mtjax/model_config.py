"""The architecture of a decoder-only model, read from a Hugging Face ``config.json``.

One frozen dataclass describes a model of every registered family (mtjax.families: one
module each, which maps its config.json to these fields and back). Family differences
are settable fields (q/k/v bias, q/k norm, sliding windows, chunked attention, NoPE
layers, rope scaling, fused projections, norms, activations and soft-capping, experts,
the router), so the model code has no per-family branches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from mtjax import families, jsonfile, textfile
from mtjax.bounds import AT_LEAST_0, AT_LEAST_1, POSITIVE, out_of_range
from mtjax.errors import MtjaxError
from mtjax.families.hf_config import (  # noqa: F401  (re-exported: mtjax's names for them)
    CHUNKED, FULL, ROPE_TYPES, SLIDING, ConfigError, RopeScaling, thaw)
from mtjax.layers.spec import DenseMLP, LayerSpec, MoE, Norms, Rope, SoftmaxAttention
from mtjax.lora import LoraConfig

# The built-in families' model_types (mtjax.families; a family registered later is supported too).
SUPPORTED_MODEL_TYPES = families.model_types()
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# The behaviour switches a family may turn on (its `defaults`), with their value where it
# does not: a ModelConfig that leaves one None takes its family's.
SWITCHES = {"fused_projections": False, "rope_interleaved": False, "moe_router": "softmax_topk",
            "shared_expert_gated": False}

# model.base_format: how frozen 2-D kernels of blocks are kept (mtjax.precision, mtjax.quant)
BASE_FORMATS = ("compute", "int8", "nf4")


# What the numbers not checked elsewhere in `ModelConfig.validate` may be (mtjax.bounds).
NUMBER_RANGES = {"rope_theta": POSITIVE, "max_position_embeddings": AT_LEAST_1, "rms_norm_eps": POSITIVE,
                 "initializer_range": AT_LEAST_0, "sliding_window": AT_LEAST_1, "attention_chunk_size": AT_LEAST_1,
                 "num_experts": AT_LEAST_0, "num_experts_per_tok": AT_LEAST_0, "moe_intermediate_size": AT_LEAST_0,
                 "shared_expert_intermediate_size": AT_LEAST_0, "router_aux_loss_coef": AT_LEAST_0,
                 "n_group": AT_LEAST_1, "topk_group": AT_LEAST_1, "routed_scaling_factor": POSITIVE,
                 "q_lora_rank": AT_LEAST_0, "kv_lora_rank": AT_LEAST_0, "qk_nope_head_dim": AT_LEAST_0,
                 "v_head_dim": AT_LEAST_0, "ffn_chunk_tokens": AT_LEAST_0, "head_chunk_tokens": AT_LEAST_0,
                 "router_bias_update_rate": AT_LEAST_0, "swiglu_alpha": POSITIVE, "swiglu_limit": POSITIVE,
                 "sequence_devices": AT_LEAST_1,
                 "linear_num_key_heads": AT_LEAST_0, "linear_num_value_heads": AT_LEAST_0,
                 "linear_key_head_dim": AT_LEAST_0, "linear_value_head_dim": AT_LEAST_0,
                 "linear_conv_kernel_dim": AT_LEAST_1}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of one model. Hashable: used as a jit static argument."""

    model_type: str = "llama"  # the family (mtjax.families), by its config.json model_type
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
    base_format: str = "compute"  # frozen 2-D kernels of blocks stored and streamed as: compute (the compute dtype), int8 or nf4 (mtjax.quant)
    # Feed-forwards (dense and MoE) over chunks of this many tokens, each recomputed in the backward
    # (long rows: mtjax.model.Block.feed_forward); 0: whole.
    ffn_chunk_tokens: int = 0
    # The head and loss over chunks of this many tokens (mtjax.loss.head_loss); 0: as many as
    # loss.HEAD_CHUNK_BYTES of fp32 logits hold.
    head_chunk_tokens: int = 0
    # Devices each row's tokens are split over, attention gathering the row's keys and values
    # (mtjax.attention_chunked.split_attention): the stream engine sets it from stream.split.
    sequence_devices: int = 1
    freeze: tuple[str, ...] = ()  # leaves kept as they are, no gradient or optimizer state (mtjax.roles: embed, block.0-15, block.*/mlp.*)
    lora: LoraConfig | None = None  # LoRA adapters over a frozen base (mtjax.lora); the experiment's `lora:` section
    extra_hf: tuple[tuple[str, Any], ...] = ()  # other config.json keys, kept for export
    # Mixture of experts (mtjax.moe); num_experts 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k of the top-k routing
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the k kept router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the training loss
    moe_layers: tuple[int, ...] = ()  # indices of the MoE layers; the others are dense
    # Grouped routing (DeepSeek): experts in n_group groups, each token's k picked from its
    # topk_group best groups; the kept weights times routed_scaling_factor.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every MoE
    # layer's correction bias moves by this much per expert toward balance (mtjax.moe.
    # balance_bias); 0: the bias stays as imported (frozen).
    router_bias_update_rate: float = 0.0
    # gpt-oss's experts (mtjax.moe.clamped_swiglu): (clip(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Multi-head latent attention (DeepSeek V2/V3, mtjax.layers.latent): head_dim is the
    # rotary part of each query and key head, qk_nope_head_dim the rest, v_head_dim the values'.
    q_lora_rank: int = 0  # queries through a rank-q_lora_rank bottleneck with a norm; 0: one q_proj
    kv_lora_rank: int = 0  # the latent every head's keys and values are expanded from
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Llama 4: NoPE layers, chunked local attention, L2 q/k norm, NoPE temperature tuning.
    no_rope_layers: tuple[int, ...] = ()  # indices of the layers without RoPE
    attention_chunk_size: int | None = None  # chunked_attention layers: a query sees its own chunk's keys
    qk_l2_norm: bool = False  # q and k RMS-normalised without a weight after RoPE, on RoPE layers only
    attn_temperature_tuning: bool = False  # NoPE layers scale q by log1p(floor((p + 1) / floor_scale)) * temperature_scale + 1
    floor_scale: float = 8192.0
    temperature_scale: float = 0.1  # Hugging Face's attn_scale (not `attn_scale` below, the softmax scale)
    # Gated delta-net layers (Qwen3-Next, Qwen3.5: mtjax.layers.delta_net): linear attention
    # of linear_num_value_heads heads, keys and queries of linear_num_key_heads heads.
    delta_net_layers: tuple[int, ...] = ()  # indices of the delta-net layers; the others softmax attention
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4  # the causal depthwise convolution's width over q, k and v
    # Behaviour switches (SWITCHES); None takes the family's default (its `defaults`).
    fused_projections: bool | None = None  # fused qkv_proj and gate_up_proj kernels (Phi-3); null: the family's
    rope_interleaved: bool | None = None  # RoPE turns adjacent pairs, not halves (Llama 4); null: the family's
    moe_router: str | None = None  # MoE router kind: softmax_topk or sigmoid_topk (Llama 4); null: the family's
    shared_expert_gated: bool | None = None  # shared expert scaled by a sigmoid gate (Qwen2-MoE); null: the family's

    def __post_init__(self):
        if isinstance(self.freeze, (list, str)):  # from YAML or JSON: one pattern or a list
            object.__setattr__(self, "freeze", (self.freeze,) if isinstance(self.freeze, str) else tuple(self.freeze))
        if isinstance(self.lora, dict):  # from a store's JSON
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if self.lora is not None and self.lora.rank is None:  # a `lora:` section without a rank: no adapters
            object.__setattr__(self, "lora", None)
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_hidden_layers)
        for name, value in SWITCHES.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.family.defaults.get(name, value))
        self.validate()

    @property
    def family(self) -> families.Family:
        """The family of model_type (mtjax.families): its config.json and checkpoint names."""
        return families.get(self.model_type)

    def validate(self) -> None:
        family = self.family
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
        if family.validate:
            family.validate(self)
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
                choices = ("float32, bfloat16, float16 or auto (the faster on this hardware)" if name == "compute_dtype"
                           else "float32, bfloat16 or float16")
                raise ConfigError(f"model.{name} must be {choices}, got {getattr(self, name)!r}")
        if self.base_format not in BASE_FORMATS:
            raise ConfigError(f"model.base_format must be one of {', '.join(BASE_FORMATS)}, got {self.base_format!r}")
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
            if self.num_experts % self.n_group or self.topk_group > self.n_group \
                    or self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise ConfigError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}), with "
                                  f"topk_group ({self.topk_group}) <= n_group and num_experts_per_tok "
                                  f"({self.num_experts_per_tok}) within the experts of topk_group groups")

    @functools.cached_property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """What each layer is made of (mtjax.layers.spec): the family's, where it builds
        them (its `layer_specs`), else from layer_types, no_rope_layers, moe_layers and the
        fields they qualify."""
        if self.family.layer_specs:
            return tuple(self.family.layer_specs(self))
        return self.derived_layer_specs()

    def derived_layer_specs(self) -> tuple[LayerSpec, ...]:
        """The layer specs these fields give (a family's own `layer_specs` may start from them)."""
        return tuple(self._layer_spec(i, t) for i, t in enumerate(self.layer_types))

    def _layer_spec(self, i: int, layer_type: str) -> LayerSpec:
        local = layer_type == SLIDING and self.local_rope_theta is not None  # Gemma 3's sliding layers
        rope = None if i in self.no_rope_layers else (
            Rope(self.local_rope_theta, self.local_rope_scaling) if local else Rope(self.rope_theta, self.rope_scaling))
        mixer = SoftmaxAttention(window=self.sliding_window if layer_type == SLIDING else None,
                                 chunk=self.attention_chunk_size if layer_type == CHUNKED else None,
                                 softcap=self.attn_logit_softcapping, qk_l2_norm=self.qk_l2_norm and rope is not None,
                                 temperature=self.attn_temperature_tuning and rope is None)
        feed_forward = (MoE(router=self.moe_router, shared_expert_gated=self.shared_expert_gated)
                        if i in self.moe_layers else DenseMLP())
        return LayerSpec(mixer, feed_forward, rope, Norms(sandwich=self.sandwich_norms))

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
    def rotary_dim(self) -> int:
        """Features of each head that RoPE turns (the first ones; the rest pass unchanged)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def splits_rows(self) -> bool:
        """Whether each row's tokens are split over devices (`sequence_devices` > 1).
        Layers that flatten [b, t, ...] into rows then go token-major (mtjax.layers.basic.
        rows): a flattened b * t keeps only its major axis's sharding, so the split would be
        lost and XLA would gather every row onto every device."""
        return self.sequence_devices > 1

    def split_over(self, split: str, devices: int) -> ModelConfig:
        """The config a step's programs compute with, its micro-batch spread over `devices`
        as `split` (stream.split) says: "sequence" splits each row's tokens over them,
        "batch" gives each device whole rows and changes nothing. The engine compiles with
        it; the planner prices with it (mtjax.stream.schedule.Schedule.computing)."""
        return dataclasses.replace(self, sequence_devices=devices if split == "sequence" else 1)

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


def from_hf_dict(hf: dict, **overrides) -> ModelConfig:
    """Build a ModelConfig from the contents of a Hugging Face ``config.json``, read by the
    family its model_type names (mtjax.families); a multimodal config gives its language
    model's config."""
    try:
        family, hf = families.match(hf)
        fields = family.from_hf(hf)
    except KeyError as e:
        raise ConfigError(f"config.json lacks the required key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:  # a field of the wrong type, e.g. "hidden_size": "abc"
        if isinstance(e, MtjaxError):  # a refusal that says what to change
            raise
        raise ConfigError(f"config.json holds a value of the wrong type ({e}); compare it with the model's "
                          "original config.json") from None
    return ModelConfig(**{**fields, "model_type": family.model_type, **overrides})


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
    if not isinstance(hf, dict):
        raise ConfigError(f"{file} holds a JSON {type(hf).__name__}, not an object of model settings: point at a "
                          "Hugging Face checkpoint directory")
    return from_hf_dict(hf, **overrides)


def to_hf_dict(cfg: ModelConfig) -> dict:
    """The inverse of `from_hf_dict`: a ``config.json`` transformers can load, written by
    the config's family over the keys it kept (extra_hf)."""
    family = cfg.family
    hf = {k: thaw(v) for k, v in cfg.extra_hf}
    hf.update(architectures=[family.architecture], model_type=family.model_type)
    hf.update(family.to_hf(cfg))
    return hf
