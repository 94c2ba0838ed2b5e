"""A MoE block split into sub-parts that stream one after another: its router part and
groups of its experts (for a block whose weights the device budget cannot hold at once).

    router part   the block's stages up to its feed-forward's split point (mtjax.model.Block):
                  a = x + mixer(norm(x)),  h = the MLP input norm(a),
                  (weights, chosen, stats) = route(h),  s = shared expert(h) (or 0)
    group j       y_j = its experts' weighted sum over the rows routed to them
    block output  the output stage: a + z, z = (y_0 + y_1 + ...) + s, summed in the order
                  the whole block sums (with sandwich norms a + norm(z): the backward then
                  keeps z and the norm's weight, `keeps_output`)

Routing happens once, in the router part (whatever the router: softmax top-k, sigmoid
top-1); a group only takes the MLP input, the kept weights and the chosen experts, so
it assumes nothing about how they were scored. The router part's leaves are every
block leaf outside `mlp.experts.*`; a group's are its experts' (the store keeps one
array per expert, so a group reads alone). Sub-parts are mtjax.partid.PartIds: block 3's
router part (named "block.3/router") and its group J ("block.3/experts.J").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import lora, model, precision, treepath
from mtjax.layers import registry
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig
from mtjax.partid import PartId

EXPERTS = "mlp.experts."


def splits(spec: LayerSpec) -> bool:
    """Whether a block of `spec` can be split into a router part and expert groups: its
    feed-forward's registry entry has the "experts" split point."""
    return "experts" in registry.feed_forward(spec).split_points


def split_blocks(cfg: ModelConfig) -> tuple[int, ...]:
    """The blocks of `cfg` that can be split (`splits`)."""
    return tuple(i for i, spec in enumerate(cfg.layer_specs) if splits(spec))


def expert_of(leaf: str) -> int | None:
    """The expert a block leaf belongs to ("mlp.experts.3.up_proj.kernel" -> 3), or None."""
    return int(leaf[len(EXPERTS):].split(".")[0]) if leaf.startswith(EXPERTS) else None


def groups_of(num_experts: int, size: int) -> tuple[tuple[int, ...], ...]:
    """Experts 0 .. E-1 in groups of `size` (the last may be smaller)."""
    return tuple(tuple(range(s, min(s + size, num_experts))) for s in range(0, num_experts, size))


def names(block: PartId | str, groups: tuple) -> tuple[PartId, ...]:
    """The sub-parts of a split block, in forward order: its router part, then its groups."""
    block = PartId(block)
    return (block.router(), *(block.experts(j) for j in range(len(groups))))


def group_ids(name: PartId, groups: tuple) -> tuple[int, ...] | None:
    """The experts of sub-part `name` (None for the router part)."""
    return None if name.group is None else groups[name.group]


def leaves(schema: dict, name: PartId, groups: tuple) -> list[str]:
    """The leaves of sub-part `name` among a split block's `schema` ({leaf: ...})."""
    ids = group_ids(name, groups)
    if ids is None:
        return [n for n in schema if expert_of(n) is None]
    mine = set(ids)
    return [n for n in schema if expert_of(n) in mine]


# The leaves of an expert's projections a group program takes: with LoRA on the routed
# experts (mtjax.lora.EXPERTS) their adapters too, which sit in the expert, so in its group.
EXPERT_LEAF_KINDS = ("kernel", "bias", lora.A, lora.B)


def kernels(flat: dict, ids: tuple[int, ...]) -> dict:
    """A group's staged leaves {global leaf name: array} as the group program takes them:
    {leaf name in the expert, e.g. "gate_proj.kernel": [one array per expert, in `ids`
    order]}, for every kernel and bias of its first expert (all experts have the same)."""
    first = f"{EXPERTS}{ids[0]}."
    names = sorted(n[len(first):] for n in flat if n.startswith(first) and n.rpartition(".")[2] in EXPERT_LEAF_KINDS)
    return {n: [flat[f"{EXPERTS}{e}.{n}"] for e in ids] for n in names}


def named(grads: dict, ids: tuple[int, ...]) -> dict:
    """`kernels`' inverse: a group's gradients under their global leaf names."""
    return {f"{EXPERTS}{e}.{n}": g for n, per in grads.items() for e, g in zip(ids, per)}


def router_forward(cfg: ModelConfig, spec: LayerSpec, flat: dict, x, segments=None):
    """The router part: the block's stages up to its feed-forward's split point
    (model.block_until_split): ((attention residual a [b, t, d], shared expert s [T, d],
    MLP input h [T, d], weights [T, k] fp32, router stats, the output stage's leaves
    {leaf: array}: its sandwich norm's weight, or none), chosen experts [T, k]). A
    quantized frozen kernel's bytes (mtjax.precision) are decoded here, on the device."""
    flat = precision.policy(cfg).decoded(flat, _shapes(cfg, spec))
    a, h, (weights, chosen, stats, shared) = model.block_until_split(cfg, spec, flat, x, segments)
    out = {n: flat[n] for n in model.output_leaves(cfg, spec)}
    return (a, shared, h, weights, stats, out), chosen


def group_forward(cfg: ModelConfig, spec: LayerSpec, group: dict, h, weights, chosen, ids):
    """One group's share of the experts' sum [T, d]: its experts' kernels and biases
    (`kernels`' form), global ids `ids` (an int array [n]), over the rows routed to them (a
    quantized frozen expert's bytes decoded first)."""
    shapes, decode = _shapes(cfg, spec), precision.policy(cfg).decoded
    stacked = {n: jnp.stack([decode({n: w}, {n: shapes[f"{EXPERTS}0.{n}"]})[n] for w in per]).astype(h.dtype)
               for n, per in group.items()}
    return model.block_experts(cfg, spec, stacked, h, weights, chosen, ids)


def _shapes(cfg: ModelConfig, spec: LayerSpec) -> dict:
    """{leaf: master shape} of a block of `spec` (every expert's kernels alike)."""
    return {n: s.shape for n, s in treepath.flatten(model.abstract_block(cfg, spec)).items()}


def combine(cfg: ModelConfig, spec: LayerSpec, out: dict, a, acc, shared):
    """(block output, the feed-forward's output z [T, d]) from the groups' summed share
    `acc`, the shared expert's and the router part's `out` leaves (model.block_combine)."""
    return model.block_combine(cfg, spec, out, a, acc, shared)


def keeps_output(cfg: ModelConfig, spec: LayerSpec) -> bool:
    """Whether the block's backward needs the feed-forward's output z and the output
    stage's leaves (a sandwich norm on the output); without, the output stage is a + z and
    z's cotangent is the block output's."""
    return bool(model.output_leaves(cfg, spec))


def output_grad(cfg: ModelConfig, spec: LayerSpec, out: dict, z, dy):
    """(cotangent of z, of the `out` leaves) from the block output's, dy [b, t, d]."""
    _, vjp = jax.vjp(lambda z, o: model.block_output(cfg, spec, o, jnp.zeros(dy.shape, dy.dtype), z), z, out)
    return vjp(dy)


def kept_bytes(cfg: ModelConfig, spec: LayerSpec, hidden: int, tokens: int) -> int:
    """Bytes a split block keeps from its forward to its backward per micro-batch of
    `tokens` rows whose hidden states take `hidden` bytes: the MLP input h, the kept
    weights (fp32) and chosen experts (int32); with `keeps_output` also z and the output
    stage's leaves."""
    kept = hidden + tokens * cfg.num_experts_per_tok * 8
    if keeps_output(cfg, spec):
        kept += hidden + len(model.output_leaves(cfg, spec)) * cfg.hidden_size * np.dtype(cfg.compute_dtype).itemsize
    return kept
