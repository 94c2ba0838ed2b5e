"""The compiled functions of split MoE blocks (mtjax.expert_groups), one set per layer spec
whose feed-forward splits before its experts.

    router_forward(w, x, segments) -> (a, shared, h, weights, stats, out, chosen)
    group_add(w, h, weights, chosen, ids, acc) -> acc + the group's share (acc None: zeros)
    combine(out, a, acc, shared) -> (the block output, the feed-forward's output z)
    output_grad(out, z, dy) -> (dz, dout)   (only where expert_groups.keeps_output)
    group_grad(w, h, weights, chosen, ids, dz) -> (dw, dh, dweights)
    router_grad(w, x, dy, dz, dh, dweights, dstats, dout, segments) -> (dw, dx)

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


@functools.lru_cache(maxsize=8)
def group_fns(cfg: ModelConfig) -> GroupFns:
    return GroupFns(cfg)


class GroupFns:
    def __init__(self, cfg: ModelConfig):
        specs = [s for s in cfg.block_specs if expert_groups.splits(s)]

        def per_spec(fn):
            return {s: jax.jit(functools.partial(fn, cfg, s)) for s in specs}

        self.router_forward = per_spec(_router_forward)
        self.router_grad = per_spec(_router_grad)
        self.group_add = per_spec(_group_add)
        self.group_grad = per_spec(_group_grad)
        self.combine = per_spec(expert_groups.combine)
        self.output_grad = per_spec(expert_groups.output_grad)
        self.keeps_output = {s: expert_groups.keeps_output(cfg, s) for s in specs}


def _router_forward(cfg: ModelConfig, spec: LayerSpec, w: dict, x, segments=None):
    (a, shared, h, weights, stats, out), chosen = expert_groups.router_forward(cfg, spec, w, x, segments)
    return a, shared, h, weights, stats, out, chosen


def _router_grad(cfg: ModelConfig, spec: LayerSpec, w: dict, x, dy, dz, dh, dweights, dstats, dout, segments=None):
    _, vjp, _ = jax.vjp(lambda w, x: expert_groups.router_forward(cfg, spec, w, x, segments), w, x, has_aux=True)
    return vjp((dy, dz.reshape(dh.shape), dh, dweights, dstats, dout))


def _group_add(cfg: ModelConfig, spec: LayerSpec, w: dict, h, weights, chosen, ids, acc):
    y = expert_groups.group_forward(cfg, spec, w, h, weights, chosen, ids)
    return y if acc is None else acc + y


def _group_grad(cfg: ModelConfig, spec: LayerSpec, w: dict, h, weights, chosen, ids, dz):
    _, vjp = jax.vjp(lambda w, h, p: expert_groups.group_forward(cfg, spec, w, h, p, chosen, ids), w, h, weights)
    return vjp(dz.reshape(h.shape))
