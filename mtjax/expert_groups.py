"""A MoE block split into sub-parts that stream one after another: its router part and
groups of its experts (for a block whose weights the device budget cannot hold at once).

    router part   x -> a = x + attention(norm(x)),  h = norm(a)  (the MLP input),
                  (weights, chosen, probs) = route(h),  s = shared expert(h) (or 0)
    group j       y_j = its experts' weighted sum over the rows routed to them
    block output  a + ((y_0 + y_1 + ...) + s), summed in the order the whole block sums

Routing happens once, in the router part (whatever the router: softmax top-k, sigmoid
top-1); a group only takes the MLP input, the kept weights and the chosen experts, so
it assumes nothing about how they were scored. The router part's leaves are every
block leaf outside `mlp.experts.*`; a group's are its experts' (the store keeps one
array per expert, so a group reads alone). Sub-part names are "block.3/router" and
"block.3/experts.J", J the group's index.
"""

from __future__ import annotations

import jax.numpy as jnp

from mtjax import model, moe, treepath
from mtjax.layers import feedforward
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig

EXPERTS = "mlp.experts."
ROUTER = "router"


def expert_of(leaf: str) -> int | None:
    """The expert a block leaf belongs to ("mlp.experts.3.up_proj.kernel" -> 3), or None."""
    return int(leaf[len(EXPERTS):].split(".")[0]) if leaf.startswith(EXPERTS) else None


def groups_of(num_experts: int, size: int) -> tuple[tuple[int, ...], ...]:
    """Experts 0 .. E-1 in groups of `size` (the last may be smaller)."""
    return tuple(tuple(range(s, min(s + size, num_experts))) for s in range(0, num_experts, size))


def names(block: str, groups: tuple) -> tuple[str, ...]:
    """The sub-parts of a split block, in forward order: its router part, then its groups."""
    return (f"{block}/{ROUTER}", *(f"{block}/experts.{j}" for j in range(len(groups))))


def owner(name: str) -> str:
    """The part a (sub-)part name belongs to: "block.3/experts.1" -> "block.3"."""
    return name.split("/")[0]


def block_index(name: str) -> int | None:
    """The block index of a (sub-)part name ("block.3/router" -> 3); None for embed, head."""
    part = owner(name)
    return int(part.split(".")[1]) if part.startswith("block.") else None


def group_ids(name: str, groups: tuple) -> tuple[int, ...] | None:
    """The experts of sub-part `name` (None for the router part)."""
    sub = name.split("/")[1]
    return None if sub == ROUTER else groups[int(sub.split(".")[1])]


def leaves(schema: dict, name: str, groups: tuple) -> list[str]:
    """The leaves of sub-part `name` among a split block's `schema` ({leaf: ...})."""
    ids = group_ids(name, groups)
    if ids is None:
        return [n for n in schema if expert_of(n) is None]
    mine = set(ids)
    return [n for n in schema if expert_of(n) in mine]


def kernels(flat: dict, ids: tuple[int, ...]) -> dict:
    """A group's staged leaves {global leaf name: array} as the group program takes them:
    {kernel name: [one array per expert, in `ids` order]}."""
    return {n: [flat[f"{EXPERTS}{e}.{n}.kernel"] for e in ids] for n in feedforward.EXPERT_KERNELS}


def named(grads: dict, ids: tuple[int, ...]) -> dict:
    """`kernels`' inverse: a group's gradients under their global leaf names."""
    return {f"{EXPERTS}{e}.{n}.kernel": g for n, per in grads.items() for e, g in zip(ids, per)}


def _module(cfg: ModelConfig, spec: LayerSpec, flat: dict, dtype):
    """The block module with the leaves of `flat` (the others, never read, are empty)."""
    template = model.abstract_block(cfg, spec)
    full = {n: flat[n].astype(dtype) if n in flat else jnp.zeros((0,), dtype) for n in treepath.flatten(template)}
    return model.block_module(cfg, spec, treepath.unflatten(template, full))


def router_forward(cfg: ModelConfig, spec: LayerSpec, flat: dict, x, segments=None):
    """The router part: ((attention residual a [b, t, d], shared expert s [T, d], MLP input
    h [T, d], weights [T, k] fp32, router stats), chosen experts [T, k])."""
    m = _module(cfg, spec, flat, x.dtype)
    cos, sin, positions = model.block_rotary(cfg, spec, x, segments)
    a = m.attention_residual(x, m.self_attn(m.input_layernorm(x), cos, sin, positions, segments))
    h = m.post_attention_layernorm(a).reshape(-1, x.shape[-1])
    weights, chosen, probs = m.mlp.route(h)
    return (a, m.mlp.shared(h), h, weights, moe.router_stats(probs, chosen)), chosen


def group_forward(cfg: ModelConfig, spec: LayerSpec, group: dict, h, weights, chosen, ids):
    """One group's share of the block output [T, d]: its experts' kernels (`kernels`'
    form), global ids `ids` (an int array [n]), over the rows routed to them."""
    stacked = [jnp.stack(group[n]).astype(h.dtype) for n in feedforward.EXPERT_KERNELS]
    return _module(cfg, spec, {}, h.dtype).mlp.routed(h, weights, chosen, stacked, ids)
