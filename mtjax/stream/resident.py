"""Resident parts: state that stays on the device across steps and is updated there.

    res = Resident(["block.2", "head"], update, placement)
    res.load(part, master, opt)       # once, from the tiers (start, resume)
    res.weights(part)                 # the compute weights the step's programs read
    res.add_grad(part, grads)         # the step's summed gradient stays on the device
    res.finish()                      # {part: squared norm}, for the exact global clip (host sync)
    res.update(scale)                 # each part's update, dispatched on the device
    res.to_host(part, kind)           # host copies, for a commit, params() and opt_state()

A resident part crosses no link in a step: its weights are not staged, its gradient does
not leave, and its update is the optax program of `PartUpdate` (the same AdamW as the
reference trainer's) run where the arrays are, its inputs donated so it updates in place.
Only a commit brings the state to the host (docs/pipeline.md, "Resident parts").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import treepath
from mtjax.optim import sum_of_squares
from mtjax.stream.staging import Placement
from mtjax.stream.update import PartUpdate


def _sq_f32(grads: dict):
    return sum_of_squares({n: g.astype(jnp.float32) for n, g in grads.items()})


class Resident:
    def __init__(self, names, update: PartUpdate, placement: Placement):
        self.names = tuple(names)
        self.update_, self.placement = update, placement
        self._state: dict[str, dict] = {}  # part -> {"compute": flat, "master": flat, "opt": tree}
        self._grads: dict[str, dict] = {}  # this step's summed gradients
        self._sq_fn = jax.jit(_sq_f32)
        # A buffer of its own even in fp32 (the update donates master and compute apart).
        self._copy = jax.jit(lambda master: {n: jnp.copy(w).astype(update.dtype) for n, w in master.items()})

    def __contains__(self, part: str) -> bool:
        return part in self.names

    def __bool__(self) -> bool:
        return bool(self.names)

    @property
    def nbytes(self) -> int:
        """Device bytes held for the run: every resident part's state and an fp32 gradient sum."""
        total = 0
        for st in self._state.values():
            for kind in ("compute", "master", "opt"):
                total += sum(a.nbytes for a in jax.tree.leaves(st[kind]))
            total += sum(a.nbytes for a in jax.tree.leaves(st["master"]))  # the gradient sum
        return total

    def load(self, part: str, master: dict, opt: dict) -> None:
        """Place `part`'s fp32 master weights and flat optimizer state on the device; its
        compute weights are master rounded there (as every staged copy is)."""
        put = lambda tree: jax.device_put(tree, self.placement.on_device, may_alias=False)  # noqa: E731
        master = put({n: np.asarray(a) for n, a in master.items()})
        template = jax.eval_shape(self.update_.tx.init, master)
        opt = treepath.unflatten(template, put({n: np.asarray(a) for n, a in opt.items()}))
        self._state[part] = {"master": master, "opt": opt, "compute": self._copy(master)}

    def weights(self, part: str) -> dict:
        return self._state[part]["compute"]

    def add_grad(self, part: str, grads: dict) -> None:
        assert part not in self._grads, f"{part} got two gradients in one step"
        self._grads[part] = grads

    def finish(self) -> dict[str, np.float32]:
        """{part: squared norm of its gradient} of this step (waits for the device)."""
        return {p: np.float32(self._sq_fn(g)) for p, g in self._grads.items()}

    def drop(self) -> None:
        """Forget this step's gradients (a failed or non-finite step)."""
        self._grads.clear()

    def update(self, scale) -> None:
        """Every resident part's update with the step's clip `scale`; asynchronous."""
        scale = jax.device_put(np.float32(scale), self.placement.on_device)
        for part, grads in self._grads.items():
            st = self._state[part]
            st["master"], st["opt"], st["compute"] = self.update_.in_place(st["master"], st["opt"], st["compute"],
                                                                           grads, scale)
        self._grads.clear()

    def to_host(self, part: str, kind: str) -> dict[str, np.ndarray]:
        """Flat host copies of one kind of `part`'s state (the device's next update may
        overwrite the device arrays in place)."""
        tree = self._state[part][kind]
        flat = treepath.flatten(tree) if kind == "opt" else tree
        return self.placement.to_host(flat)
