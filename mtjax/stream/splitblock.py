"""A split MoE block's forward and backward, sub-part by sub-part (mtjax.expert_groups).

Forward: the router part runs every micro-batch (attention, routing, shared expert);
the experts some token reached are then known on the host (`Routing`: one device read
per split block and step), and each expert group, staged with only those experts, adds
its share to every micro-batch's output. The MLP input and routing of each micro-batch
are kept for the backward (with a sandwich norm on the block's output, also the
feed-forward's output z and the norm's weight, from which the backward first takes z's
cotangent). Backward: each group (in reverse) recomputes its forward from them inside
its vjp; the router part then recomputes attention and routing from the block's kept
input and takes the summed cotangents of the MLP input and kept weights, with the block
output's, z's and the router stats' (the load-balancing loss).

An expert no token reached stays on the host: a device zero of its shape stands in for
it in the group's program (it gets no rows, so its gradient is exactly zero there, and
its host update still runs: moments and weight decay change it).

Frozen leaves (mtjax.roles) get no gradient: the router part's vjp is taken against its
trained leaves, and a group whose experts are all frozen (LoRA's base, `block.*/mlp.*`)
takes none against its kernels, only against the MLP input and kept weights.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import expert_groups, partid, parts, roles
from mtjax.errors import MtjaxError
from mtjax.layers.spec import LayerSpec
from mtjax.partid import PartId


class RoutingCancelled(MtjaxError):
    """The step ended before a split block's routing was known (it failed elsewhere)."""


class Routing:
    """The experts of each split block that some token of the pass reached ({block index:
    bool [E]}): set by the forward, awaited by the prefetch worker staging the groups."""

    def __init__(self):
        self._cond = threading.Condition()
        self.reached: dict[int, np.ndarray] = {}
        self._cancelled = False

    def reset(self) -> None:
        with self._cond:
            self.reached, self._cancelled = {}, False

    def set(self, block: int, reached: np.ndarray) -> None:
        with self._cond:
            self.reached[block] = reached
            self._cond.notify_all()

    def cancel(self) -> None:
        """Wake a worker waiting for routing that will not come."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def wait(self, block: int) -> np.ndarray:
        with self._cond:
            self._cond.wait_for(lambda: block in self.reached or self._cancelled)
            if block not in self.reached:
                raise RoutingCancelled(f"the pass ended before block {block}'s routing was known")
            return self.reached[block]


class SplitBlocks:
    """What the engine needs for the split MoE blocks of its schedule: which leaves a
    sub-part stages, the zeros standing in for unreached experts, the block's passes."""

    def __init__(self, fns, ledger, mesh):
        self.fns, self.ledger, self.mesh = fns, ledger, mesh  # mesh: mtjax.stream.mesh.DeviceMesh
        self.routing = Routing()
        self._zeros: dict = {}
        self._ids: dict = {}
        self._trained: dict = {}

    def staged(self, name: PartId, sub: dict, groups: tuple) -> list[str]:
        """The leaves of sub-part `name` (its leaves' schema `sub`, of a block split into
        `groups`) that cross: the router part's all; a group's, those of its experts some
        token reached (waits for the forward's routing)."""
        if expert_groups.group_ids(name, groups) is None:
            return list(sub)
        reached = self.routing.wait(name.block)
        return [n for n in sub if reached[expert_groups.expert_of(n)]]

    def complete(self, name: PartId, sub: dict, groups: tuple, weights: dict):
        """A sub-part's staged weights as its program takes them: a group's in
        `expert_groups.kernels` form, device zeros for the experts left behind."""
        ids = expert_groups.group_ids(name, groups)
        if ids is None:
            return weights
        full = {n: weights[n] if n in weights else self._zero(leaf) for n, leaf in sub.items()}
        return expert_groups.kernels(full, ids)

    def trained(self, i: int, groups: tuple) -> tuple:
        """(the router part's trained leaves, None: all of them; whether each group's
        experts train, some of them at least) of split block `i` (mtjax.roles)."""
        if (i, groups) not in self._trained:
            specs = parts.leaves(self.fns.cfg, partid.block(i))
            trains = {n for n, leaf in specs.items() if leaf.role == roles.TRAINED}
            router = expert_groups.leaves(specs, partid.block(i).router(), groups)
            mine = tuple(n for n in router if n in trains)
            self._trained[i, groups] = (None if len(mine) == len(router) else mine, tuple(
                any(n in trains for n in expert_groups.leaves(specs, name, groups))
                for name in expert_groups.names(partid.block(i), groups)[1:]))
        return self._trained[i, groups]

    def _zero(self, leaf) -> jax.Array:
        key = (tuple(leaf.shape), np.dtype(leaf.dtype))
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(*key), self.mesh.replicated)
        return self._zeros[key]

    def _bytes(self, kept: tuple) -> int:
        """One device's bytes of a micro-batch's kept routing (rows split over the devices)."""
        return sum(self.mesh.share(a.nbytes) for a in jax.tree.leaves(kept))

    def ids(self, ids: tuple[int, ...]) -> jax.Array:
        if ids not in self._ids:
            self._ids[ids] = jax.device_put(np.asarray(ids, np.int32), self.mesh.replicated)
        return self._ids[ids]

    def forward(self, i: int, spec: LayerSpec, groups: tuple, take, release, xs: list, segments: list, keep: bool):
        """(outputs, router stats, kept MLP inputs and routing or None) of every micro-batch."""
        g = self.fns
        slot, w = take(partid.block(i).router())
        outs = [g.router_forward[spec](w, x, seg) for x, seg in zip(xs, segments)]
        release(slot, [o[0] for o in outs])
        reached = np.any([np.asarray(o[4]["counts"]) > 0 for o in outs], axis=0)  # host sync: which experts cross
        self.routing.set(i, reached)
        ys = [None] * len(outs)
        for j, ids in enumerate(groups):
            slot, w = take(partid.block(i).experts(j))
            ys = [g.group_add[spec](w, h, wt, c, self.ids(ids), y) for (_, _, h, wt, _, _, c), y in zip(outs, ys)]
            release(slot, ys)
        combined = [g.combine[spec](out, a, y, s) for (a, s, _, _, _, out, _), y in zip(outs, ys)]
        kept = None
        if keep:  # (h, weights, chosen), and (z, the output stage's leaves) where its backward needs them
            extra = g.keeps_output[spec]
            kept = [(h, wt, c) + ((z, out) if extra else ())
                    for (_, _, h, wt, _, out, c), (_, z) in zip(outs, combined)]
            for k in kept:
                self.ledger.hold(self._bytes(k), "a split block's kept routing", "routing")
        return [y for y, _ in combined], [o[4] for o in outs], kept

    def backward(self, i: int, spec: LayerSpec, groups: tuple, take, release, accumulate, xs: list, kept: list,
                 dys: list, dstats: list, segments: list):
        """(gradients w.r.t. the block input of every micro-batch, the block's summed
        gradient {leaf: array}); `accumulate(acc, grads)` sums over micro-batches."""
        g = self.fns
        # The cotangents of the feed-forward's output z and of the output stage's leaves.
        if g.keeps_output[spec]:
            dzs, douts = zip(*(g.output_grad[spec](out, z, dy) for (_, _, _, z, out), dy in zip(kept, dys)))
        else:
            dzs, douts = dys, [{}] * len(dys)
        router_trained, trains = self.trained(i, groups)
        grads, dhs, dws = {}, [None] * len(dys), [None] * len(dys)
        for j in reversed(range(len(groups))):
            slot, w = take(partid.block(i).experts(j))
            acc = None
            for m, ((h, wt, c, *_), dz) in enumerate(zip(kept, dzs)):
                dw, dh, dwt = g.group_grad[spec](w, h, wt, c, self.ids(groups[j]), dz, trains=trains[j])
                acc = accumulate(acc, dw)
                dhs[m] = dh.astype(jnp.float32) if dhs[m] is None else dhs[m] + dh
                dws[m] = dwt if dws[m] is None else dws[m] + dwt
            release(slot, [dhs, acc])
            grads.update(expert_groups.named(acc, groups[j]))
        slot, w = take(partid.block(i).router())
        acc, dxs = None, []
        for x, dy, dz, k, dh, dwt, ds, dout, seg in zip(xs, dys, dzs, kept, dhs, dws, dstats, douts, segments):
            dw, dx = g.router_grad[spec](w, x, dy, dz, dh.astype(k[0].dtype), dwt, ds, dout, seg,
                                         trained=router_trained)
            acc = accumulate(acc, dw)
            dxs.append(dx)
            self.ledger.free(self._bytes(k), "routing")
        release(slot, dxs)
        grads.update(acc)
        return dxs, grads
