"""A layer spec: what one decoder layer is made of, as a frozen, hashable value.

`ModelConfig.layer_specs` gives one per layer. A spec is a jit static argument: layers
with equal specs share one compiled function. The sizes every layer shares (hidden size,
heads, head_dim, expert counts, biases) stay in the ModelConfig; a spec holds what may
differ from layer to layer and which registry entry (mtjax.layers.registry) builds each
part: `mixer.kind`, `feed_forward.kind` and, for a mixture of experts, `router`.

This module imports nothing from mtjax, so any module may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary embedding of a layer: its base and rescaling (a model_config.RopeScaling or None)."""

    theta: float
    scaling: Any = None


@dataclasses.dataclass(frozen=True)
class SoftmaxAttention:
    """Causal softmax attention over the config's heads x head_dim: full, or over a sliding
    `window` of keys (the query's own included), or within `chunk`-sized chunks of positions."""

    kind: ClassVar[str] = "softmax_attention"
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    qk_l2_norm: bool = False  # q and k RMS-normalised without a weight after RoPE (Llama 4's RoPE layers)
    temperature: bool = False  # queries scaled by position (Llama 4's NoPE layers, mtjax.model.temperature)
    sinks: bool = False  # a learned logit per head in every softmax denominator (gpt-oss; leaf `sinks` [heads])
    output_gate: bool = False  # q_proj also yields a gate per head; the output times its sigmoid (Qwen3-Next, Qwen3.5)

    @property
    def label(self) -> str:
        window, chunk = f"_window{self.window}" if self.window else "", f"_chunk{self.chunk}" if self.chunk else ""
        return "attention" + window + chunk


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek V2/V3, mtjax.layers.latent): every head's keys
    and values expanded from one low-rank latent per token plus one shared rotary key,
    causal over all earlier tokens; the sizes are the config's (q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, head_dim as the rotary part, v_head_dim)."""

    kind: ClassVar[str] = "latent_attention"

    @property
    def label(self) -> str:
        return "latent_attention"


@dataclasses.dataclass(frozen=True)
class GatedDeltaNet:
    """Gated delta-net linear attention (Qwen3-Next, Qwen3.5; mtjax.layers.delta_net) of the
    config's linear_* sizes. `grouped`: q, k, v, z and b, a come from two fused projections
    laid out per key head (Qwen3-Next's in_proj_qkvz, in_proj_ba), else from four."""

    kind: ClassVar[str] = "gated_delta_net"
    grouped: bool = False

    @property
    def label(self) -> str:
        return "delta_net"


@dataclasses.dataclass(frozen=True)
class DenseMLP:
    """The gated MLP of the config's intermediate_size and hidden_act."""

    kind: ClassVar[str] = "dense"

    @property
    def label(self) -> str:
        return "dense"


@dataclasses.dataclass(frozen=True)
class MoE:
    """A mixture of the config's num_experts SwiGLU experts, top-k routed by `router` (a
    router kind of the registry), with the config's shared expert where it has one."""

    kind: ClassVar[str] = "moe"
    router: str = "softmax_topk"
    shared_expert_gated: bool = False  # the shared expert's output scaled by a sigmoid gate (Qwen2-MoE)

    @property
    def label(self) -> str:
        return "moe"


@dataclasses.dataclass(frozen=True)
class ClampedMoE:
    """gpt-oss's mixture of the config's num_experts experts: a router with a bias (top-k
    logits, then their softmax: `router`), each expert's projections with biases and the
    clamped SwiGLU (swiglu_alpha, swiglu_limit); no shared expert (mtjax.layers.clamped_moe)."""

    kind: ClassVar[str] = "clamped_moe"
    router: str = "topk_softmax"

    @property
    def label(self) -> str:
        return "clamped_moe"


@dataclasses.dataclass(frozen=True)
class Norms:
    """RMSNorm before the mixer and before the feed-forward; with `sandwich` (Gemma) also
    on the mixer's and the feed-forward's outputs before their residual adds."""

    sandwich: bool = False


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: x + mixer(norm(x)), then x + feed_forward(norm(x))."""

    mixer: Any  # a mixer spec (SoftmaxAttention, or another registered kind's)
    feed_forward: Any  # a feed-forward spec (DenseMLP, MoE, or another registered kind's)
    rope: Rope | None = None  # None: no rotary embedding (NoPE)
    norms: Norms = Norms()

    @property
    def label(self) -> str:
        """A short readable name (the named scopes of profiles), e.g. "attention_window4_nope_moe"."""
        parts = (getattr(self.mixer, "label", self.mixer.kind), "nope" if self.rope is None else None,
                 getattr(self.feed_forward, "label", self.feed_forward.kind))
        return "_".join(p for p in parts if p)
