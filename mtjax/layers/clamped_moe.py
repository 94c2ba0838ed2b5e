"""gpt-oss's mixture of experts (mtjax.layers.spec.ClampedMoE), a feed-forward kind.

A router projection with a bias (`mlp.gate`, transformers' `mlp.router`) whose top-k
logits' softmax weighs the chosen experts (router kind "topk_softmax",
mtjax.moe.route_topk_softmax); each expert's gate, up and down projections have biases,
and its activation is the clamped SwiGLU (mtjax.moe.clamped_swiglu). The store keeps
every expert's leaves as separate arrays (`mlp.experts.N.{gate,up,down}_proj.{kernel,
bias}`); transformers holds them stacked, gate and up interleaved (mtjax.hf). The router
statistics, and so the load-balancing loss, are those of the softmax over all experts,
as transformers' `load_balancing_loss_func` takes them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mtjax import moe
from mtjax.layers import registry
from mtjax.layers.basic import Dense
from mtjax.layers.spec import ClampedMoE, LayerSpec
from mtjax.model_config import ModelConfig

EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")  # each with kernel and bias, in clamped_experts' order


class Expert(nnx.Module):
    """One expert's three projections, with biases (applied by moe.clamped_experts)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = Dense(d, f, True, cfg, rngs)
        self.up_proj = Dense(d, f, True, cfg, rngs)
        self.down_proj = Dense(f, d, True, cfg, rngs)


class ClampedMixture(nnx.Module):
    """Router (`gate`, with a bias) and the experts; returns (output, router statistics)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        self.cfg, self.router = cfg, registry.router(spec.feed_forward.router)
        self.gate = Dense(cfg.hidden_size, cfg.num_experts, True, cfg, rngs)
        self.experts = nnx.List([Expert(cfg, rngs) for _ in range(cfg.num_experts)])

    # Its stages, split before its experts (the registry entry's split point "experts", as
    # mtjax.layers.feedforward.SparseMoE's): routing, a group of experts, the combine.

    def before_experts(self, flat):
        """Token rows [T, d] -> (kept weights [T, k] fp32, chosen experts [T, k], router
        statistics, zeros: no shared expert)."""
        weights, chosen, probs = self.router.route(self.cfg, self.gate(flat), None)
        return weights, chosen, moe.router_stats(probs, chosen), jnp.zeros_like(flat)

    def routed(self, flat, weights, chosen, kernels=None, ids=None):
        """The experts' weighted sum over the rows routed to them: this module's experts, or
        a group's `kernels` ({"gate_proj.kernel": stacked [n, ...], "gate_proj.bias": ...})
        of global expert ids `ids`."""
        if kernels is None:  # stacked inside the program: the store keeps one array per expert
            kernels = {f"{n}.{leaf}": jnp.stack([getattr(getattr(e, n), leaf)[...] for e in self.experts])
                       for n in EXPERT_LEAVES for leaf in ("kernel", "bias")}
        order = [kernels[f"{n}.{leaf}"] for leaf in ("kernel", "bias") for n in EXPERT_LEAVES]
        return moe.clamped_experts(flat, weights, chosen, *order, self.cfg.swiglu_alpha, self.cfg.swiglu_limit, ids)

    def after_experts(self, routed, shared):
        return routed

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen, stats, _ = self.before_experts(flat)
        return self.routed(flat, weights, chosen).reshape(x.shape), stats


def _flops(cfg: ModelConfig, spec: LayerSpec, tokens: int, executed: bool, dispatch: str) -> float:
    """When `executed` on the CPU ("blocked" dispatch there): ragged_dot's dense lowering
    runs every expert on every row, n - k experts' work beyond the routed rows."""
    if not executed or dispatch != "blocked":
        return 0.0
    return 2.0 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * tokens * (cfg.num_experts - cfg.num_experts_per_tok)


def _inactive(cfg: ModelConfig, spec: LayerSpec) -> int:
    """The experts beyond each token's k: their kernels and biases."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    return (cfg.num_experts - cfg.num_experts_per_tok) * (3 * d * f + 2 * f + d)


def _working(cfg: ModelConfig, spec: LayerSpec, tokens: int, dispatch: str, experts: int | None = None) -> int:
    """Its routed rows' cotangents: ragged_dot on every backend, whatever the `dispatch`
    (mtjax.moe.backward_transient_bytes; no adapters on its experts)."""
    return moe.backward_transient_bytes(tokens * cfg.num_experts_per_tok, experts or cfg.num_experts, cfg.hidden_size,
                                        cfg.moe_intermediate_size, jnp.dtype(cfg.compute_dtype).itemsize, "ragged")


registry.register_feed_forward(ClampedMoE.kind, registry.FeedForwardKind(
    module=ClampedMixture, flops=_flops, inactive_params=_inactive, split_points=("experts",), working=_working))
registry.register_router("topk_softmax", registry.RouterKind(
    route=lambda cfg, logits, bias: moe.route_topk_softmax(logits, cfg.num_experts_per_tok),
    experts=moe.experts_forward))
