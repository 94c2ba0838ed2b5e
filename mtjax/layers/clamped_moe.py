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

    def __call__(self, x):
        cfg, flat = self.cfg, x.reshape(-1, x.shape[-1])
        weights, chosen, probs = self.router.route(cfg, self.gate(flat), None)
        # Stacked inside the program: the store keeps one array per expert.
        kernels = [jnp.stack([getattr(e, n).kernel[...] for e in self.experts]) for n in EXPERT_LEAVES]
        biases = [jnp.stack([getattr(e, n).bias[...] for e in self.experts]) for n in EXPERT_LEAVES]
        y = moe.clamped_experts(flat, weights, chosen, *kernels, *biases, cfg.swiglu_alpha, cfg.swiglu_limit)
        return y.reshape(x.shape), moe.router_stats(probs, chosen)


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


registry.register_feed_forward(ClampedMoE.kind, registry.FeedForwardKind(
    module=ClampedMixture, flops=_flops, inactive_params=_inactive))
registry.register_router("topk_softmax", registry.RouterKind(
    route=lambda cfg, logits, bias: moe.route_topk_softmax(logits, cfg.num_experts_per_tok),
    experts=moe.experts_forward))
