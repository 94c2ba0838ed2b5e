"""The kinds of a layer's parts: each token mixer, feed-forward and router kind is one entry.

A LayerSpec (mtjax.layers.spec) names the kind of each of its parts: `spec.mixer.kind`,
`spec.feed_forward.kind` and, for a mixture of experts, `spec.feed_forward.router`. The
model builds a block, the planner and the MFU line count its FLOPs, the device plan its
kernels' working bytes (mixers' and feed-forwards'), and the sampler sizes its decode state by asking these entries,
never by testing which kind a layer is; a new kind is one `register_*` call. The built-in kinds register themselves when
mtjax.model is imported (mtjax.layers.softmax, mtjax.layers.feedforward).

Every entry function takes the ModelConfig (the sizes all layers share) and the
layer's LayerSpec first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from mtjax.errors import MtjaxError
from mtjax.layers.spec import LayerSpec


@dataclasses.dataclass(frozen=True)
class MixerKind:
    """A token mixer.

    module(cfg, spec, rngs): the nnx.Module the block holds as `self_attn`, with
        __call__(x, cos, sin, positions, segments) -> y, hidden states [b, t, d] both;
        decode(x, state, start, cos, sin, positions) -> (y, state): new tokens x [b, t, d]
            at positions start .. start + t - 1 against the state of all earlier ones
            (sampling), returning the state with these tokens in.
        cos and sin are the layer's rotary tables (mtjax.rope), positions [b|1, t].
    flops(cfg, spec, batch, seq, executed): forward FLOPs beyond the 2 per parameter and
        token that every part's matmuls cost (those the planner counts itself).
        `executed`: what the compiled program runs; otherwise only the useful work.
    decode_state(cfg, spec, batch, length): {name: jax.ShapeDtypeStruct} of the state
        `decode` keeps for `length` positions (a KV cache for softmax attention).
    working(cfg, spec, batch, seq, platform, devices): bytes its recompute and backward
        on `platform` ("cpu", "gpu", ...) hold at once beyond the block's vjp residuals
        (which the planner traces from the block itself), over rows of `seq` tokens, one
        device's share where a row is split over `devices`; the device plan's working
        term counts them. Default: none.
    """

    module: Callable
    flops: Callable
    decode_state: Callable
    working: Callable = lambda cfg, spec, batch, seq, platform, devices=1: 0


@dataclasses.dataclass(frozen=True)
class FeedForwardKind:
    """A feed-forward.

    module(cfg, spec, rngs): the nnx.Module the block holds as `mlp`, with
        __call__(x [b, t, d]) -> (y [b, t, d], router statistics: {} unless it routes).
    flops(cfg, spec, tokens, executed, dispatch): forward FLOPs beyond the 2 per
        parameter and token (a MoE's padding rows under its expert `dispatch`,
        mtjax.moe.dispatch, when `executed`).
    inactive_params(cfg, spec): its parameters that one token does not use (the experts
        beyond its k); FLOPs and MFU count a block's parameters minus these.
    split_points: the stages before which a block of it may be split into sub-parts that
        stream one after another (mtjax.expert_groups). "experts": its module has
        before_experts(h) -> (kept weights, chosen experts, router statistics, shared
        output), routed(h, weights, chosen, kernels, ids) over a group of its experts
        (leaves `mlp.experts.N.*`), and after_experts(routed sum, shared) -> its output.
    working(cfg, spec, tokens, dispatch, experts): bytes its recompute and backward over
        `tokens` rows hold at once beyond the block's vjp residuals, as MixerKind.working
        (a MoE's expert `dispatch`, as for `flops`); `experts`: the experts one program
        runs, a group of them where the block is split (None: all). The device plan's
        working term counts the largest block's mixer and feed-forward working bytes
        (mtjax.stream.block_bytes.block_working_bytes). Default: none.
    """

    module: Callable
    flops: Callable
    inactive_params: Callable
    split_points: tuple[str, ...] = ()
    working: Callable = lambda cfg, spec, tokens, dispatch, experts=None: 0


@dataclasses.dataclass(frozen=True)
class RouterKind:
    """How a mixture of experts routes and weighs.

    route(cfg, logits [T, E], bias) -> (kept weights [T, k], chosen experts [T, k],
        probabilities [T, E]); `bias` is the router's correction bias [E] where it has
        one, else None.
    experts(x, weights, chosen, gate, up, down, ids, total): the chosen experts' weighted
        sum over rows x [T, d] (mtjax.moe.experts_forward's arguments).
    correction_bias: the router keeps a per-expert bias for choosing experts, the leaf
        `mlp.gate.e_score_correction_bias` [E]: a buffer (mtjax.roles), never trained.
    """

    route: Callable
    experts: Callable
    correction_bias: bool = False


MIXERS: dict[str, MixerKind] = {}
FEED_FORWARDS: dict[str, FeedForwardKind] = {}
ROUTERS: dict[str, RouterKind] = {}


class UnknownKind(MtjaxError, ValueError):
    """A layer spec names a kind nothing registered."""


def _register(table: dict, what: str, kind: str, entry) -> None:
    if kind in table and table[kind] != entry:
        raise ValueError(f"{what} kind {kind!r} is registered already")
    table[kind] = entry


def register_mixer(kind: str, entry: MixerKind) -> None:
    _register(MIXERS, "mixer", kind, entry)


def register_feed_forward(kind: str, entry: FeedForwardKind) -> None:
    _register(FEED_FORWARDS, "feed-forward", kind, entry)


def register_router(kind: str, entry: RouterKind) -> None:
    _register(ROUTERS, "router", kind, entry)


def _lookup(table: dict, what: str, kind: str):
    try:
        return table[kind]
    except KeyError:
        raise UnknownKind(f"no {what} kind {kind!r} is registered; known: {', '.join(sorted(table))}") from None


def mixer(spec: LayerSpec) -> MixerKind:
    """The entry of `spec`'s token mixer."""
    return _lookup(MIXERS, "mixer", spec.mixer.kind)


def feed_forward(spec: LayerSpec) -> FeedForwardKind:
    """The entry of `spec`'s feed-forward."""
    return _lookup(FEED_FORWARDS, "feed-forward", spec.feed_forward.kind)


def router(kind: str) -> RouterKind:
    """The entry of a router kind (a MoE spec's `router`)."""
    return _lookup(ROUTERS, "router", kind)
