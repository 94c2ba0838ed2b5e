"""The optimizer stage: one part's AdamW update on host-resident state.

The update reads the fp32 master weights, the optimizer state and the gradient, and
writes master, optimizer state and, where one is kept, the compute copy (converted from
the new master by the precision policy, mtjax.precision). Every part gets
the same clip scale, computed from the global gradient norm before any part is updated,
so clipping is exact although parts are updated one at a time.

Two ways, one per kind of optimizer:
- mtjax's own AdamW (an OptimConfig, numba installed, bf16 or fp32 compute) runs as the
  fused loop of mtjax.stream.fused_adamw: one pass over memory, in place on RAM-tier state.
- Any other optax transformation (or mtjax's AdamW without numba) runs as one jitted
  program per part on the CPU backend, its master, optimizer-state and compute-copy inputs
  donated, so RAM-tier state (XLA buffers the program made) is updated in place. XLA
  compiles it to about four passes over memory (46 bytes/param where one pass moves 30).
"""

from __future__ import annotations

import functools
from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax import model, parts, precision, roles, treepath
from mtjax.hostmem import huge_empty
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream import fused_adamw
from mtjax.stream.tiers import host_device


def _update(tx, policy: precision.Policy, master, opt_state, compute, grads, scale):
    del compute  # donated: its buffer receives the new compute copy
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads)
    updates, opt_state = tx.update(grads, opt_state, master)
    master = optax.apply_updates(master, updates)
    return master, opt_state, policy.to_compute_jax(master)


class PartUpdate:
    """AdamW (any optax transformation) applied one part at a time on the host.

    With `optim` (mtjax's own AdamW) and numba installed, the update is the one-pass
    loop of mtjax.stream.fused_adamw: it runs when called, in place on the kinds named in
    `own` (numpy arrays it made before), into new arrays otherwise. Without, it is the
    whole-part optax program on the CPU backend, dispatched asynchronously: its inputs
    are donated (consumed), so RAM-tier state, the XLA buffers of its own earlier results,
    is updated in place; numpy inputs (disk-tier buffers the engine reuses) are only read.
    """

    def __init__(self, cfg: ModelConfig, tx: optax.GradientTransformation, optim: OptimConfig | None = None):
        self.cfg, self.tx = cfg, tx
        self.fused = _fused_for(cfg, tx, optim)  # None: the optax program
        self.cpu = host_device()
        self.policy = precision.policy(cfg)  # each leaf's compute representation
        # keep_unused: jit drops an unread `compute` argument otherwise, and with it the
        # donation, so every update would page-fault a fresh compute-copy buffer.
        self._update = jax.jit(functools.partial(_update, tx, self.policy), donate_argnums=(0, 1, 2), keep_unused=True)
        self._init = jax.jit(tx.init)
        self._convert = jax.jit(self.policy.to_compute_jax, static_argnums=1)

    def init_state(self, master: dict) -> dict:
        """Flat optimizer state of one part from its flat fp32 master weights."""
        return treepath.flatten(self._init(jax.device_put(master, self.cpu)))

    def compute_copy(self, master: dict, part: str | None = None) -> dict:
        """The compute copy of flat master weights of `part` (its frozen leaves quantized
        where the base format says), in XLA buffers the update can donate."""
        return self._convert(jax.device_put(master, self.cpu), None if part is None else str(part))

    def in_place(self, master: dict, opt_tree, compute: dict, grads: dict, scale):
        """(master, opt tree, compute) after one update by the optax program, run where the
        arrays are (a resident part's, on the device); master, opt and compute are donated."""
        return self._update(master, opt_tree, compute, grads, scale)

    def __call__(self, part: str, master: dict, opt: dict, compute: dict | None, grads: dict, scale,
                 own: Collection[str] = (), copy: bool = True, rank: int = 0):
        """(master, opt, compute) of `part` after one update; all flat dicts on the host.

        `own`: the kinds ("master", "opt", "compute") whose arrays the fused update may
        overwrite when they are its own earlier results (the RAM tier's). `copy=False`
        (fused only): no compute copy is written, and None is returned for it. `rank`
        (fused only): where the part comes in the next forward; the loop's threads run
        the pieces of lower ranks first when several updates share them.
        """
        # Buffers (mtjax.roles) are changed by their owner's rule, not by AdamW: `grads`
        # holds a buffer's rule input under its name when the rule is on; without one the
        # buffer passes through unchanged.
        buffers = {n: a for n, a in master.items() if roles.is_buffer(n)}
        if buffers:
            inputs = {n: grads[n] for n in buffers if n in grads}
            grads = {n: g for n, g in grads.items() if n not in buffers}
            master = {n: a for n, a in master.items() if n not in buffers}
            kept = {n: c for n, c in (compute or {}).items() if n in buffers and n not in inputs}
            compute = None if compute is None else {n: c for n, c in compute.items() if n not in buffers}
            new_master, new_opt, new_compute = self(part, master, opt, compute, grads, scale, own, copy, rank)
            buffers.update({n: roles.apply_rule(self.cfg, n, buffers[n], x) for n, x in inputs.items()})
            if new_compute is not None:
                fresh = {n: a for n, a in buffers.items() if n not in kept}  # changed, or never copied
                new_compute = {**kept, **(self.policy.to_compute(fresh) if fresh else {}), **new_compute}
            return {**buffers, **new_master}, new_opt, new_compute
        if self.fused is not None:
            return self._fused(master, opt, compute or {}, grads, scale, own, copy, rank)
        # Arrays read from disk arrive as numpy: place them on the CPU backend, not the
        # default (accelerator) device.
        master, opt, compute, grads = jax.device_put((master, opt, compute, grads), self.cpu)
        opt_tree = treepath.unflatten(jax.eval_shape(self.tx.init, master), opt)
        master, opt_tree, compute = self._update(master, opt_tree, compute, grads, scale)
        return master, treepath.flatten(opt_tree), compute

    def _fused(self, master, opt, compute, grads, scale, own, copy, rank):
        state = self.fused.state  # where mu, nu and the counts are in `opt`
        scalars, counts = self.fused.step(opt[state.count], opt[state.schedule_count], scale)
        new_opt = dict(zip((state.count, state.schedule_count), counts))
        new_master, new_compute, leaves = {}, {}, []
        for n, p in master.items():
            mu, nu = state.moments(n)
            ins = [_host(a) for a in (p, opt[mu], opt[nu])]
            outs = [_target(a, kind in own, np.float32) for a, kind in zip(ins, ("master", "opt", "opt"))]
            dtype, rounded = self.policy.leaf(n, p).dtype, None
            if copy and dtype != np.float32:  # the loop writes it (bf16: `_fused_for`)
                rounded = _target(_host(compute[n]) if n in compute else None, "compute" in own, dtype, p.shape)
            grad = np.ascontiguousarray(np.asarray(grads[n]))  # host sync: the gradient transfer
            if grad.dtype != precision.BF16:  # the loop reads a bf16 gradient as it is
                grad = grad.astype(np.float32, copy=False)
            leaves.append(fused_adamw.Leaf(*ins, grad, (*outs, rounded), decay=len(p.shape) > 1))
            new_master[n], new_opt[mu], new_opt[nu], new_compute[n] = *outs, rounded
        self.fused.run(leaves, scalars, rank)
        if copy:  # an fp32 copy is the new master; a copy, since it may be overwritten
            new_compute.update({n: np.array(new_master[n]) for n, c in new_compute.items() if c is None})
        return new_master, {o: new_opt[o] for o in opt}, new_compute if copy else None


def _fused_for(cfg: ModelConfig, tx, optim: OptimConfig | None):
    """The one-pass AdamW for `tx` when it is `make_optimizer(optim)` (its state laid out
    as the loop reads it), numba is installed and every compute dtype is bf16 or fp32;
    otherwise None."""
    if optim is None or not all(fused_adamw.supports(d) for d in precision.policy(cfg).dtypes):
        return None
    if not fused_adamw.FusedAdamW.state.describes(tx):  # not the chain make_optimizer builds
        return None
    return fused_adamw.FusedAdamW(optim)


def _host(a):
    """A host array of `a` (jax CPU arrays viewed, read-only)."""
    return None if a is None else np.asarray(a)


def _target(a, writable: bool, dtype, shape=None) -> np.ndarray:
    """Where an update of `a` goes: `a` itself when it may be overwritten and is a
    writable C-contiguous array of `dtype`; else a new array, on huge pages when it will
    be updated in place from now on (RAM tier)."""
    if writable and isinstance(a, np.ndarray) and a.flags.writeable and a.flags.c_contiguous and a.dtype == dtype:
        return a
    shape = a.shape if a is not None else shape
    return huge_empty(shape, dtype) if writable else np.empty(shape, dtype)


@functools.lru_cache(maxsize=8)
def update_for(cfg: ModelConfig, optim: OptimConfig) -> PartUpdate:
    """The update of an OptimConfig, shared by every engine that uses it."""
    return PartUpdate(cfg, make_optimizer(optim), optim=optim)


def _part_leaf_names(cfg: ModelConfig, tx, part: parts.Part):
    """(per-part opt leaf name, whole-model opt leaf name) pairs of one part."""
    path = f"blocks.{part.name.block}" if part.name.is_block else part.name.kind  # in the whole model's tree
    leaves = sorted(parts.schema(cfg, part.name, "master"), key=len, reverse=True)
    for name in parts.schema(cfg, part.name, "opt", tx):
        leaf = next((x for x in leaves if name == x or name.endswith("." + x)), None)
        yield name, name if leaf is None else f"{name[: -len(leaf)]}{path}.{leaf}"


def split_opt_state(cfg: ModelConfig, tx: optax.GradientTransformation, full) -> dict[str, dict]:
    """The inverse of `full_opt_state`: {part name: flat per-part optimizer state}."""
    named = treepath.flatten(full)
    return {p.name: {mine: np.asarray(named[whole]) for mine, whole in _part_leaf_names(cfg, tx, p)}
            for p in parts.parts(cfg)}


def full_opt_state(cfg: ModelConfig, tx: optax.GradientTransformation, per_part: dict[str, dict]):
    """The optimizer state of the whole model, shaped as `tx.init(params)` would make it.

    A per-part leaf named `<prefix>.<param leaf>` (e.g. "0.mu.mlp.up_proj.kernel") is
    the whole model's `<prefix>.<part path>.<param leaf>`; other leaves (step counts)
    are the same in every part and appear once.
    """
    template = jax.eval_shape(tx.init, parts.trained_only(cfg, model.abstract_params(cfg)))  # frozen leaves: none
    named = {}
    for p in parts.parts(cfg):
        for mine, whole in _part_leaf_names(cfg, tx, p):
            named.setdefault(whole, per_part[p.name][mine])
    return treepath.unflatten(template, named)
