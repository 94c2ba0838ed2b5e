"""The built-in feed-forward kinds (a dense gated MLP, a mixture of experts) and router kinds.

Their registry entries: the dense MLP ("dense") and the mixture of experts ("moe",
routing and expert dispatch in mtjax.moe) with its routers: "softmax_topk" (top-k of the
softmax, renormalised with norm_topk_prob), "sigmoid_topk" (Llama 4: top-k of the
logits, each kept one's sigmoid scaling its expert's input), and DeepSeek's group-limited
ones (mtjax.moe.route_grouped): "sigmoid_group_topk" (V3: sigmoid scores, chosen with a
correction bias) and "softmax_group_topk" (V2). Each expert is a module of its own, so
the store holds every expert's weights as separate arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mtjax import lora, moe
from mtjax.layers import registry
from mtjax.layers.basic import Dense
from mtjax.layers.spec import DenseMLP, LayerSpec, MoE
from mtjax.model_config import ModelConfig


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with the tanh GELU (Gemma);
    `width` wide (default: the dense intermediate_size); gate and up one [d, 2f] kernel when fused."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
        d, f = cfg.hidden_size, width or cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        if cfg.fused_projections:
            self.gate_up_proj = Dense(d, 2 * f, cfg.mlp_bias, cfg, rngs)
        else:
            self.gate_proj = Dense(d, f, cfg.mlp_bias, cfg, rngs)
            self.up_proj = Dense(d, f, cfg.mlp_bias, cfg, rngs)
        self.down_proj = Dense(f, d, cfg.mlp_bias, cfg, rngs)
        self.fused = cfg.fused_projections

    def __call__(self, x):
        if self.fused:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class RouterGate(Dense):
    """The router's projection to one logit per expert, with the router kind's correction
    bias [E] (`e_score_correction_bias`, zeros at first) where it keeps one."""

    def __init__(self, cfg: ModelConfig, correction_bias: bool, rngs: nnx.Rngs):
        super().__init__(cfg.hidden_size, cfg.num_experts, False, cfg, rngs)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32)) \
            if correction_bias else None

    def correction(self):
        """The correction bias, or None."""
        return None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]


EXPERT_KERNELS = ("gate_proj", "up_proj", "down_proj")  # each expert's, in moe.experts_forward's order


class ExpertAdapter(nnx.Module):
    """A routed expert's LoRA factors over a kernel it runs stacked (mtjax.lora: its gate
    and up projections together): A [in, r] as PEFT draws it, B [r, out] zero."""

    def __init__(self, d_in: int, d_out: int, rank: int, rngs: nnx.Rngs):
        self.lora_a = nnx.Param(lora.init_a(rngs.params(), d_in, rank))
        self.lora_b = nnx.Param(jnp.zeros((rank, d_out), jnp.float32))


class SparseMoE(nnx.Module):
    """Router (`gate`), the experts (each a SwiGLU MLP of its own) and a shared expert
    where the config has one: scaled by a sigmoid gate (Qwen2-MoE) or not (Llama 4). The
    spec's router kind routes and weighs. Returns (output, router statistics)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        spec = spec.feed_forward
        self.cfg, self.router = cfg, registry.router(spec.router)
        self.gate = RouterGate(cfg, self.router.correction_bias, rngs)
        self.experts = nnx.List([MLP(cfg, rngs, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, rngs, shared) if shared else None
        gated = shared and spec.shared_expert_gated
        self.shared_expert_gate = Dense(cfg.hidden_size, 1, False, cfg, rngs) if gated else None
        self.expert_leaves = tuple(f"{n}.kernel" for n in EXPERT_KERNELS)  # what `routed` stacks

    def add_expert_adapters(self, rank: int, rngs: nnx.Rngs) -> None:
        """Fresh LoRA adapters on every routed expert (mtjax.lora.EXPERT_MODULES): one over
        its gate and up projections, one on its down projection."""
        d, f = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        for expert in self.experts:
            expert.gate_up_proj = ExpertAdapter(d, 2 * f, rank, rngs)
            expert.down_proj.add_adapter(rank, self.cfg.lora.scale, rngs)
        self.expert_leaves += tuple(f"{m}.{x}" for m in lora.EXPERT_MODULES for x in (lora.A, lora.B))

    # Its stages, split before its experts (the registry entry's split point "experts"):
    # a split block's router part runs `before_experts`, each group of experts `routed`,
    # and the combine `after_experts` (mtjax.expert_groups); `__call__` runs all three.

    def before_experts(self, flat):
        """Token rows [T, d] -> (kept weights [T, k] fp32, chosen experts [T, k], router
        statistics, the shared expert's output [T, d]: zeros without one)."""
        weights, chosen, probs = self.router.route(self.cfg, self.gate(flat), self.gate.correction())
        return weights, chosen, moe.router_stats(probs, chosen), self.shared(flat)

    def routed(self, flat, weights, chosen, kernels=None, ids=None):
        """The experts' weighted sum over the rows routed to them: this module's experts, or
        a group's `kernels` ({"gate_proj.kernel": stacked [n, in, out], ...}, with the
        experts' adapters where they have them) of global expert ids `ids`
        (moe.experts_forward); adapted kernels with their deltas (mtjax.lora.expert_kernels)."""
        if kernels is None:  # stacked inside the program: the store keeps one array per expert
            kernels = {n: jnp.stack([_leaf(e, n) for e in self.experts]) for n in self.expert_leaves}
        scale = self.cfg.lora.scale if self.cfg.lora is not None else 0.0
        stacked = lora.expert_kernels(kernels, scale)
        return self.router.experts(flat, weights, chosen, *stacked, ids, total=self.cfg.num_experts)

    def after_experts(self, routed, shared):
        """The feed-forward's output [T, d]: the experts' sum plus the shared expert's."""
        return routed if self.shared_expert is None else routed + shared

    def shared(self, flat):
        """The shared expert's output, scaled by its sigmoid gate where it has one; 0 without one."""
        if self.shared_expert is None:
            return jnp.zeros_like(flat)
        if self.shared_expert_gate is None:
            return self.shared_expert(flat)
        return jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen, stats, shared = self.before_experts(flat)
        return self.after_experts(self.routed(flat, weights, chosen), shared).reshape(x.shape), stats


def _leaf(module: nnx.Module, name: str):
    """The array at dotted `name` ("gate_proj.kernel") under `module`."""
    for part in name.split("."):
        module = getattr(module, part)
    return module[...]


class DenseFeedForward(MLP):
    """A layer's dense MLP: the MLP's output and no router statistics."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)

    def __call__(self, x):
        return super().__call__(x), {}


def _no_flops(cfg: ModelConfig, spec: LayerSpec, tokens: int, executed: bool, dispatch: str) -> float:
    return 0.0


def _moe_flops(cfg: ModelConfig, spec: LayerSpec, tokens: int, executed: bool, dispatch: str) -> float:
    """When `executed`: the padding rows and blocks its expert `dispatch` adds (0 for ragged_dot)."""
    if not executed:
        return 0.0
    routed = tokens * cfg.num_experts_per_tok
    padding = moe.dispatch_rows(routed, cfg.num_experts, dispatch) - routed
    return 2.0 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * padding


def _moe_inactive(cfg: ModelConfig, spec: LayerSpec) -> int:
    """The experts beyond each token's k: gate, up and down kernels, no biases."""
    return (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def _moe_working(cfg: ModelConfig, spec: LayerSpec, tokens: int, dispatch: str, experts: int | None = None) -> int:
    """What its expert `dispatch` holds beyond the residuals (mtjax.moe.backward_transient_bytes),
    the adapted kernels' deltas included where LoRA targets the experts."""
    adapted = cfg.lora is not None and cfg.lora.adapts_experts
    return moe.backward_transient_bytes(tokens * cfg.num_experts_per_tok, experts or cfg.num_experts, cfg.hidden_size,
                                        cfg.moe_intermediate_size, jnp.dtype(cfg.compute_dtype).itemsize, dispatch,
                                        total=cfg.num_experts, adapted=adapted)


# The dense MLP holds nothing beyond its residuals that XLA keeps at the block's peak
# (tests/test_working_memory.py: a dense Qwen3.5 block is priced by its residuals and mixer).
registry.register_feed_forward(DenseMLP.kind, registry.FeedForwardKind(
    module=DenseFeedForward, flops=_no_flops, inactive_params=lambda cfg, spec: 0))
registry.register_feed_forward(MoE.kind, registry.FeedForwardKind(
    module=SparseMoE, flops=_moe_flops, inactive_params=_moe_inactive, split_points=("experts",),
    working=_moe_working))
registry.register_router("softmax_topk", registry.RouterKind(
    route=lambda cfg, logits, bias: moe.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob),
    experts=moe.experts_forward))
registry.register_router("sigmoid_topk", registry.RouterKind(
    route=lambda cfg, logits, bias: moe.route_sigmoid(logits, cfg.num_experts_per_tok),
    experts=moe.input_scaled_experts))


def _grouped(sigmoid: bool):
    def route(cfg: ModelConfig, logits, bias):
        return moe.route_grouped(logits, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                 cfg.routed_scaling_factor, sigmoid, cfg.norm_topk_prob, bias)
    return route


registry.register_router("sigmoid_group_topk", registry.RouterKind(
    route=_grouped(sigmoid=True), experts=moe.experts_forward, correction_bias=True))
registry.register_router("softmax_group_topk", registry.RouterKind(
    route=_grouped(sigmoid=False), experts=moe.experts_forward))
