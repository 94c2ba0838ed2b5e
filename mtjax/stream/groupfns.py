"""The compiled functions of split MoE blocks (mtjax.expert_groups), one set per layer spec
whose feed-forward splits before its experts.

    router_forward(w, x, segments) -> (a, shared, h, weights, stats, out, chosen)
    group_add(w, h, weights, chosen, ids, acc) -> acc + the group's share (acc None: zeros)
    combine(out, a, acc, shared) -> (the block output, the feed-forward's output z)
    output_grad(out, z, dy) -> (dz, dout)   (only where expert_groups.keeps_output)
    group_grad(w, h, weights, chosen, ids, dz, trains) -> (dw, dh, dweights)
    router_grad(w, x, dy, dz, dh, dweights, dstats, dout, segments, trained) -> (dw, dx)

The backward programs take the vjp only against trained leaves (mtjax.roles), as a
whole block's do (mtjax.stream.blockfns): `trained` (static) names the router part's
(None: every leaf), `trains` (static) says whether the group's experts train (False:
no dw, {}; a group with some experts frozen takes them all, and the runner drops the
frozen ones' gradients).

A group's backward recomputes its forward from the kept MLP input and routing, in one
program with its vjp; the router part's backward recomputes attention and the router
from the block's kept input and takes the cotangents of everything it handed on: the
attention residual's (the block output's, dy), the shared expert's (z's: dy itself
unless a sandwich norm sits on the output), the MLP input's and kept weights' summed
over the groups, the router stats' (the load-balancing loss, mtjax.moe) and the output
stage's leaves'. Group programs take the experts' global ids as an argument, so every
group of one size shares one compile.
"""

from __future__ import annotations

import functools

import jax

from mtjax import expert_groups
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig
from mtjax.stream.blockfns import against


@functools.lru_cache(maxsize=8)
def group_fns(cfg: ModelConfig) -> GroupFns:
    return GroupFns(cfg)


class GroupFns:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        specs = [s for s in cfg.block_specs if expert_groups.splits(s)]

        def per_spec(fn, static=()):
            return {s: jax.jit(functools.partial(fn, cfg, s), static_argnames=static) for s in specs}

        self.router_forward = per_spec(_router_forward)
        self.router_grad = per_spec(_router_grad, "trained")
        self.group_add = per_spec(_group_add)
        self.group_grad = per_spec(_group_grad, "trains")
        self.combine = per_spec(expert_groups.combine)
        self.output_grad = per_spec(expert_groups.output_grad)
        self.keeps_output = {s: expert_groups.keeps_output(cfg, s) for s in specs}


def _router_forward(cfg: ModelConfig, spec: LayerSpec, w: dict, x, segments=None):
    (a, shared, h, weights, stats, out), chosen = expert_groups.router_forward(cfg, spec, w, x, segments)
    return a, shared, h, weights, stats, out, chosen


def _router_grad(cfg: ModelConfig, spec: LayerSpec, w: dict, x, dy, dz, dh, dweights, dstats, dout, segments=None,
                 trained=None):
    mine, fixed = against(w, trained)
    _, vjp, _ = jax.vjp(lambda t, x: expert_groups.router_forward(cfg, spec, {**fixed, **t}, x, segments), mine, x,
                        has_aux=True)
    return vjp((dy, dz.reshape(dh.shape), dh, dweights, dstats, dout))


def _group_add(cfg: ModelConfig, spec: LayerSpec, w: dict, h, weights, chosen, ids, acc):
    y = expert_groups.group_forward(cfg, spec, w, h, weights, chosen, ids)
    return y if acc is None else acc + y


def _group_grad(cfg: ModelConfig, spec: LayerSpec, w: dict, h, weights, chosen, ids, dz, trains=True):
    if trains:
        _, vjp = jax.vjp(lambda w, h, p: expert_groups.group_forward(cfg, spec, w, h, p, chosen, ids), w, h, weights)
        return vjp(dz.reshape(h.shape))
    _, vjp = jax.vjp(lambda h, p: expert_groups.group_forward(cfg, spec, w, h, p, chosen, ids), h, weights)
    return {}, *vjp(dz.reshape(h.shape))
