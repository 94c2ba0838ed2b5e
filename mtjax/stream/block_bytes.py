"""What one block holds on a device for its backward, priced from abstract shapes: the
residuals its vjp keeps (traced from the real block with `jax.eval_shape`: nothing runs,
nothing is allocated) and what its kernels hold beyond them while they run (the layer
registry's `working` entries). The step's device plan (mtjax.stream.memory_plan) adds these
to the weights, activations and gradients it holds; tests/test_working_memory.py checks
them against XLA's own memory analysis of the compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from mtjax import expert_groups, model, moe, partid, parts
from mtjax.layers import registry
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LongRows:
    """How the bytes a block keeps are priced for long rows. Tracing a block takes time in
    proportion to its rows' attention chunks (about 0.5 s per thousand tokens of a 70B
    block here), while what it keeps for the backward grows by the same bytes with every
    token: rows longer than `threshold` tokens are priced from traces at 1, 2 and 3 x
    `step` tokens, when those lie on one line."""

    threshold: int = 8192
    step: int = 512

    def price(self, traced, seq: int) -> int:
        """traced(seq), the bytes of a trace at `seq` tokens per row; for long rows, the
        line through short traces where they are affine in the row's length, else the trace."""
        if seq <= self.threshold:
            return traced(seq)
        a, b, c = (traced(i * self.step) for i in (1, 2, 3))
        per_step = b - a
        if c - b != per_step or per_step % self.step:
            return traced(seq)
        return a + per_step // self.step * (seq - self.step)


LONG_ROWS = LongRows()


@functools.lru_cache(maxsize=64)
def residual_bytes(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, policy: str = "none",
                   rows: LongRows = LONG_ROWS) -> int:
    """Bytes a block's vjp keeps beyond its own weights, traced from the real block
    (`jax.eval_shape` of `jax.vjp`: nothing runs, nothing is allocated). Includes
    whatever the attention implementation saves, e.g. [batch, heads, seq, seq] scores.
    `policy`: the block under that model.REMAT_POLICIES entry ("none": the plain block,
    as a recompute keeps it; "dots": its projections and inputs). Long rows: `rows`; a
    chunked feed-forward (model.ffn_chunk_tokens) shorter than the row keeps the same
    bytes a token whatever its chunk, so long rows trace it with chunks of a quarter step."""
    if seq > rows.threshold and 0 < cfg.ffn_chunk_tokens < seq:
        cfg = dataclasses.replace(cfg, ffn_chunk_tokens=min(cfg.ffn_chunk_tokens, rows.step // 4))
    return rows.price(lambda s: _traced_residual_bytes(cfg, spec, batch, s, policy), seq)


@functools.lru_cache(maxsize=64)
def _traced_residual_bytes(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, policy: str) -> int:
    name = partid.block(cfg.layer_specs.index(spec))
    weights = parts.schema(cfg, name, "compute")
    x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype))

    def forward(w, x):  # as the step runs it: a quantized kernel decoded inside (kept for the backward)
        return model.block_forward(cfg, spec, parts.block_tree(cfg, spec, w), x)

    # Against the trained leaves only, as the engine takes it (blockfns.against): a frozen
    # leaf's gradient needs nothing kept (a LoRA block keeps a third less at 4096 tokens).
    trained = set(parts.trained(cfg, name))
    mine = {n: v for n, v in weights.items() if n in trained}
    fixed = {n: v for n, v in weights.items() if n not in trained}
    block = model.remat_block(forward, policy)
    saved = jax.tree.leaves(jax.eval_shape(
        lambda m, f, x: jax.vjp(lambda m, x: block({**f, **m}, x), m, x)[1], mine, fixed, x))
    return _beyond(saved, list(weights.values()))


@functools.lru_cache(maxsize=64)
def split_residual_bytes(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, size: int,
                         rows: LongRows = LONG_ROWS) -> int:
    """Bytes the larger of a split block's sub-part programs keeps for its vjp beyond its
    weights: the router part's (attention included) or a group of `size` experts',
    traced as `residual_bytes` traces a whole block (long rows too)."""
    return rows.price(lambda s: _traced_split_residual_bytes(cfg, spec, batch, s, size), seq)


@functools.lru_cache(maxsize=64)
def _traced_split_residual_bytes(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, size: int) -> int:
    name = partid.block(cfg.layer_specs.index(spec))
    schema = parts.schema(cfg, name, "compute")
    router = {n: schema[n] for n in expert_groups.leaves(schema, name.router(), ())}
    x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype))
    rows, k = batch * seq, cfg.num_experts_per_tok
    h = jax.ShapeDtypeStruct((rows, cfg.hidden_size), x.dtype)
    weights, chosen = jax.ShapeDtypeStruct((rows, k), np.float32), jax.ShapeDtypeStruct((rows, k), np.int32)
    ids = jax.ShapeDtypeStruct((size,), np.int32)
    group = expert_groups.kernels(schema, tuple(range(size)))

    def router_vjp(w, x):
        return jax.vjp(lambda w, x: expert_groups.router_forward(cfg, spec, w, x)[0], w, x)[1]

    def group_vjp(w, h, weights, chosen, ids):
        return jax.vjp(lambda w, h, p: expert_groups.group_forward(cfg, spec, w, h, p, chosen, ids), w, h,
                       weights)[1]

    def traced(fn, weights_in, *args):
        saved = jax.tree.leaves(jax.eval_shape(fn, weights_in, *args))
        return _beyond(saved, jax.tree.leaves(weights_in))

    return max(traced(router_vjp, router, x), traced(group_vjp, group, h, weights, chosen, ids))


def block_working_bytes(cfg: ModelConfig, batch: int, seq: int, dispatch: str | None = None, split: dict | None = None,
                        size: int | None = None, platform: str | None = None, devices: int = 1) -> int:
    """The most any block holds in its recompute and backward beyond its vjp residuals over
    `batch` rows of `seq` tokens (one device's share of rows split over `devices`): its
    mixer's `working` on `platform` (default the backend's here, where the residuals are
    traced) plus its feed-forward's under the MoE `dispatch` (mtjax.moe.dispatch; default
    the backend's here), the layer registry's entries. A block in `split` (its experts in
    groups of `size`) runs its mixer and each expert group in programs of their own: the
    larger of the two. On the CPU, a row split below fp32 adds `promoted_bytes`."""
    platform = platform or jax.default_backend()
    dispatch = dispatch or moe.dispatch(jax.default_backend())
    split = split or {}
    tokens = batch * seq
    promoted = platform == "cpu" and devices > 1 and np.dtype(cfg.compute_dtype).itemsize < 4

    def working(spec: LayerSpec, grouped: bool) -> int:
        mixer = registry.mixer(spec).working(cfg, spec, batch, seq, platform, devices)
        ff = registry.feed_forward(spec).working(cfg, spec, tokens, dispatch, size if grouped else None)
        held = max(mixer, ff) if grouped else mixer + ff
        return held + (promoted_bytes(cfg, spec, batch, seq) if promoted else 0)

    return max(working(spec, grouped) for spec, grouped in {(spec, i in split) for i, spec in enumerate(cfg.layer_specs)})


def promoted_bytes(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int) -> int:
    """What a block below fp32 holds in fp32 on the CPU when its rows' tokens are split
    over devices (stream.split: sequence; `seq` one device's share), beyond its residuals:
    XLA's CPU backend promotes the all-reduce of the weight gradients over the devices to
    fp32 and runs the matmuls that produce them in fp32, on fp32 copies of their inputs
    (the block's input and output gradient, its projections' inputs, the feed-forward's
    [tokens, intermediate] activations) beside the kept residuals. Priced as half what the
    residuals would add traced in fp32: a fit, not a derivation. Over a Qwen3.5 attention
    block in bf16 at 4096 and 8192 tokens split over 2 to 16 devices, with wider
    intermediate, width and heads, XLA's temporaries are 0.89-0.99x the block's price with
    it, 1.07-1.20x without (experiments/bench/split_memory.py; tests/test_sequence_split.py
    checks two of them)."""
    fp32 = dataclasses.replace(cfg, compute_dtype="float32")
    return max(0, residual_bytes(fp32, spec, batch, seq) - residual_bytes(cfg, spec, batch, seq)) // 2


def _beyond(saved: list, weights: list) -> int:
    """Bytes of the `saved` leaves less one leaf per weight of the same shape and dtype
    (the weights appear among the residuals but are counted as staged weights)."""
    unmatched = [(tuple(v.shape), np.dtype(v.dtype)) for v in weights]
    total = 0
    for leaf in saved:
        key = (tuple(leaf.shape), np.dtype(leaf.dtype))
        if key in unmatched:
            unmatched.remove(key)
        else:
            total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    return total
