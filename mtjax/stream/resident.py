"""Resident parts: state that stays on the device across steps and is updated there.

    res = Resident(["block.2", "head"], update, placement)
    res.load(part, master, opt, compute)  # once, from the tiers (start, resume)
    res.weights(part)                 # the compute weights the step's programs read
    res.add_grad(part, grads)         # the step's summed gradient stays on the device
    res.finish()                      # {part: squared norm}, for the exact global clip (host sync)
    res.update(scale)                 # each part's update, where its state is
    res.to_host(part, kind)           # host copies, for a commit, params() and opt_state()

A resident part crosses no link in a step: its weights are not staged, its gradient does
not leave, and its update is `PartUpdate`'s AdamW (the reference trainer's) run where the
state is. On an accelerator that is the optax program, its inputs donated so it updates
in place (dispatched, asynchronous). Where the device is the host (one CPU device) and
the update has the one-pass loop (mtjax.stream.fused_adamw), the state is host arrays the
loop updates in place: 28-30 bytes/param where the XLA program moves 46 (measured 1.6-2.1x
faster on one block); the step's programs read the compute weights through `device_put`
views of those arrays (aliases on the CPU backend; fp32 weights are the master itself).
The loop overwrites the arrays only once the step's gradients are summed, and every
program that reads a part's weights in a step feeds its gradient, so none reads a
half-updated array. Only a commit brings the state to the host tiers (docs/residency.md).

A part with frozen leaves (mtjax.roles: LoRA's base, `model.freeze`) holds their compute
copy only, placed once and never updated or brought back: its master, optimizer state,
gradient and update are its trained leaves'. A part with no trained leaf has no update.
A `staged` part (LoRA adapters resident, `stream.adapters`) holds its trained leaves
only: its frozen leaves are staged each step, and the runner reads both together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import parts, roles, treepath
from mtjax.hostmem import huge_empty
from mtjax.optim import sum_of_squares
from mtjax.stream.staging import Placement
from mtjax.stream.update import PartUpdate

def _sq_f32(grads: dict):
    return sum_of_squares({n: g.astype(jnp.float32) for n, g in grads.items()})


def _owned(a) -> np.ndarray:
    """A writable host copy of `a` on huge pages, for state updated in place from now on."""
    a = np.asarray(a)
    out = huge_empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


class Resident:
    def __init__(self, names, update: PartUpdate, placement: Placement, staged=()):
        self.names = tuple(names)
        self.update_, self.placement = update, placement
        # Where the device is the host (one CPU device; over several, each holds a copy of
        # its own): state as host arrays, updated by the fused loop. An update without the
        # loop (a PartUpdate of a plain optax `tx`; StreamEngine's `tx`) runs the optax
        # program an accelerator runs, on the CPU device too.
        self.on_host = (update.fused is not None and placement.device.platform == "cpu"
                        and len(placement.mesh.devices) == 1)
        cfg = update.cfg
        # Each part's frozen leaves: their compute copy is all it holds of them.
        self.frozen = {p: () if p in staged else tuple(n for n, leaf in parts.leaves(cfg, p).items()
                                                       if leaf.role == roles.FROZEN) for p in self.names}
        # part -> {"compute": flat, "master": flat, "opt": tree (flat on host), "frozen": flat compute}
        self._state: dict[str, dict] = {}
        self._views: dict[str, dict] = {}  # part -> device arrays of the host compute weights (on_host)
        self._grads: dict[str, dict] = {}  # this step's summed gradients
        self._sq_fn = jax.jit(_sq_f32)
        # A buffer of its own even in fp32 (the update donates master and compute apart).
        self._copy = jax.jit(lambda master: update.policy.to_compute_jax({n: jnp.copy(w) for n, w in master.items()}))

    def __contains__(self, part: str) -> bool:
        return part in self.names

    def __bool__(self) -> bool:
        return bool(self.names)

    @property
    def _copy_kept(self) -> bool:
        """Whether compute weights are arrays of their own (not the fp32 master itself)."""
        return not self.on_host or not self.update_.policy.master_is_compute

    @property
    def nbytes(self) -> int:
        """Device bytes held for the run: every resident part's state and an fp32 gradient sum."""
        total = 0
        for st in self._state.values():
            for kind in ("compute", "master", "opt", "frozen") if self._copy_kept else ("master", "opt", "frozen"):
                total += sum(np.asarray(a).nbytes if self.on_host else a.nbytes for a in jax.tree.leaves(st[kind]))
            total += sum(a.nbytes for a in jax.tree.leaves(st["master"]))  # the gradient sum
        return total

    def load(self, part: str, master: dict, opt: dict, compute: dict | None = None) -> None:
        """Place `part`'s fp32 master weights and flat optimizer state on the device; its
        compute weights are master rounded there (as every staged copy is), its frozen
        leaves' those of `compute` (the tier's compute copy; only read for them)."""
        frozen = {n: compute[n] for n in self.frozen[part]}
        if self.on_host:
            # Never written: the tier's own arrays serve (the device reads views of them).
            frozen = {n: np.asarray(a) for n, a in frozen.items()}
            master = {n: _owned(np.asarray(a, np.float32)) for n, a in master.items()}
            st = {"master": master, "opt": {n: _owned(a) for n, a in opt.items()}, "frozen": frozen}
            if self._copy_kept:
                st["compute"] = {n: huge_empty(s.shape, s.dtype) for n, s in self.update_.policy.schema(master).items()}
                self.update_.policy.into(master, st["compute"])
            else:
                st["compute"] = master
            self._state[part] = st
            self._views[part] = jax.device_put({**frozen, **st["compute"]}, self.placement.on_device)
            return
        put = lambda tree: jax.device_put(tree, self.placement.on_device, may_alias=False)  # noqa: E731
        master = put({n: np.asarray(a) for n, a in master.items()})
        if master:  # a part with no trained leaf has no optimizer state (mtjax.parts.schema)
            template = jax.eval_shape(self.update_.tx.init, master)
            opt = treepath.unflatten(template, put({n: np.asarray(a) for n, a in opt.items()}))
        self._state[part] = {"master": master, "opt": opt, "compute": self._copy(master), "frozen": put(frozen)}

    def weights(self, part: str) -> dict:
        """Every leaf's compute weights on the device (frozen and trained)."""
        if self.on_host:
            return self._views[part]
        st = self._state[part]
        return {**st["frozen"], **st["compute"]}

    def add_grad(self, part: str, grads: dict) -> None:
        assert part not in self._grads, f"{part} got two gradients in one step"
        self._grads[part] = grads

    def finish(self) -> dict[str, np.float32]:
        """{part: squared norm of its gradient} of this step (waits for the device)."""
        return {p: np.float32(self._sq_fn(roles.without_buffers(g))) if g else np.float32(0)
                for p, g in self._grads.items()}

    def drop(self) -> None:
        """Forget this step's gradients (a failed or non-finite step)."""
        self._grads.clear()

    def update(self, scale) -> None:
        """Every resident part's update with the step's clip `scale`: dispatched on an
        accelerator; where the device is the host, done when this returns."""
        if self.on_host:
            self._update_on_host(np.float32(scale))
            return
        scale = jax.device_put(np.float32(scale), self.placement.on_device)
        for part, grads in self._updated():
            st = self._state[part]
            st["master"], st["opt"], st["compute"] = self.update_.in_place(st["master"], st["opt"], st["compute"],
                                                                           grads, scale)
        self._grads.clear()

    def _update_on_host(self, scale: np.float32) -> None:
        # Every gradient is complete (finish() read their norms), so no program of the
        # step still reads the weights the loop overwrites.
        for part, grads in self._updated():
            st = self._state[part]
            own = ("master", "opt", "compute")
            st["master"], st["opt"], compute = self.update_(part, st["master"], st["opt"], st["compute"], grads, scale,
                                                            own=own, copy=self._copy_kept)
            st["compute"] = compute if self._copy_kept else st["master"]
            self._views[part] = jax.device_put({**st["frozen"], **st["compute"]}, self.placement.on_device)
        self._grads.clear()

    def _updated(self):
        """(part, gradient) of the parts this step updates: those with trained leaves."""
        return [(p, g) for p, g in self._grads.items() if self._state[p]["master"]]

    def to_host(self, part: str, kind: str, frozen: bool = True) -> dict[str, np.ndarray]:
        """Flat host copies of one kind of `part`'s state (the next update may overwrite
        the device arrays in place); the compute copy without its frozen leaves unless
        `frozen` (a commit writes only what a step changes)."""
        if kind == "compute" and frozen and self.frozen[part]:
            return {**self.placement.to_host(self._state[part]["frozen"]), **self.to_host(part, kind, False)}
        tree = self._state[part][kind]
        flat = treepath.flatten(tree) if kind == "opt" and not self.on_host else tree
        return self.placement.to_host(flat)
