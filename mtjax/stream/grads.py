"""The device->host stage for gradients: copy each part's gradient (already summed over
the step's micro-batches on the device, in fp32) to host memory on a worker thread, so
the device loop never waits. One micro-batch's gradient stays in the compute dtype (the
update reads bf16 as it is) unless the step's schedule says it is widened to fp32
(`Schedule.widens_grads`: it is spilled or reduce-scattered, which take fp32).

`finish` returns the squared global norm (a host float32), which fixes the clip scale
before any part is updated. Each part's squared norm is reduced on the device, from the
gradient the backward left there, and only that scalar comes back beside the copy (on a
GPU the host's single-threaded XLA CPU reduction of every gradient cost more than the
device's); the multi-process path reduces its own rows after the reduce-scatter. `take(part)` hands a part's summed
gradient to its (deferred) update. A buffer's rule input travels in its part's gradient
dict under the buffer's name (mtjax.roles), outside the norm. With `spill`, sums wait in checksummed files
(mtjax.store.pending) instead of host memory (used when the master weights live on disk).
A step's finished sums are named by its tag (`finish(tag)`, file keys `pending_key(part,
tag)`). A durable spill (one-copy stores) keeps a taken sum's files: the commit protocol
(mtjax.store.commit) deletes them once the part's new state is committed. In a
multi-process run (`hosts`) each sum waits whole in host memory until `finish`, which
reduce-scatters them across the processes on the caller's thread, in the order they
arrived, once the step's device work is done: a cross-process program running beside the
step's own multi-device programs (their all-reduces) deadlocked on the CPU backend. A
process then keeps, parks and updates only its own rows.
"""

from __future__ import annotations

import concurrent.futures as cf

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import roles
from mtjax.optim import sum_of_squares
from mtjax.store.layout import pending_key
from mtjax.store.pending import PendingFiles
from mtjax.stream.staging import Placement


def _to_f32(g: dict) -> dict:
    return {n: x.astype(jnp.float32) for n, x in g.items()}


class GradSink:
    def __init__(self, placement: Placement, tracer, spill: PendingFiles | None = None, hosts=None):
        self.placement, self.tracer, self.spill, self.hosts = placement, tracer, spill, hosts
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="mtjax-grads")
        self._to_f32 = jax.jit(_to_f32)
        self._sq_fn = jax.jit(sum_of_squares)
        self._sums: dict[str, dict] = {}  # this step's sums (when not spilled)
        self._sq: dict[str, np.float32] = {}  # this step's squared norm per part
        self._current: list[str] = []  # parts with a sum in this step, in arrival order
        self._ready: dict[str, tuple[dict | None, str]] = {}  # last step's (sums, tag) awaiting their update
        self._futures: list[cf.Future] = []
        self.last_sq: dict[str, np.float32] = {}  # the last finished step's squared norm per part

    def add(self, part: str, grads: dict, widen: bool) -> None:
        """Queue a part's device gradient for this step (one per part); returns at once
        (the copy is asynchronous). `widen`: the step's `Schedule.widens_grads`."""
        assert part not in self._current, f"{part} got two gradients in one step"
        self._current.append(part)
        sq = None
        if self.hosts is None:  # on the device, queued behind the backward; the scalar alone comes back
            sq = self._sq_fn(self.placement.mesh.one_copy(roles.without_buffers(grads)))
            sq.copy_to_host_async()
        grads = self.placement.start_to_host(grads)
        self._futures.append(self._pool.submit(self._accumulate, part, grads, sq, widen))

    def _accumulate(self, part: str, grads: dict, sq, widen: bool) -> None:
        with self.tracer.span("d2h", part):
            host = self.placement.host_arrays(grads)
        # Widened only where the schedule says (its host-memory price counts the same).
        narrow = any(x.dtype != jnp.float32 for x in host.values())
        acc = self._to_f32(host) if widen and narrow else dict(host)
        if self.hosts is not None:  # reduce-scattered by `finish`
            self._sums[part] = acc
            return
        self._sq[part] = np.float32(sq)
        if self.spill:
            # np.asarray inside waits for the sum (host sync on this worker thread).
            self.spill.put(part + ".sum", acc)
        else:
            self._sums[part] = acc

    def finish(self, tag: str = "ready") -> jax.Array:
        """The squared global norm of this step's gradients; re-raises worker errors."""
        for fut in self._futures:
            fut.result()
        self._futures.clear()
        if self.hosts is not None:
            self._reduce_scatter()
        for part in self._current:
            self._ready[part] = (self._sums.pop(part, None), tag)
            if self.spill:
                self.spill.rename(part + ".sum", pending_key(part, tag))
        self._current.clear()
        self.last_sq = self._sq  # per part, to name the parts of a non-finite step
        sq, self._sq = np.float32(sum(self._sq.values(), np.float32(0))), {}
        return sq

    def _reduce_scatter(self) -> None:
        """This step's whole sums -> this process's rows of their sums over the processes."""
        jax.block_until_ready(list(self._sums.values()))  # the step's device work is done
        for part in self._current:
            with self.tracer.span("reduce_scatter", part):
                acc, self._sq[part] = self.hosts.reduce_scatter(self._sums.pop(part))
            if self.spill:
                self.spill.put(part + ".sum", acc)
            else:
                self._sums[part] = acc

    def drop_ready(self) -> None:
        """Drop the sums `finish` made ready (a non-finite step): no update will use them."""
        for part, (_, tag) in self._ready.items():
            if self.spill:
                self.spill.forget(pending_key(part, tag))
        self._ready.clear()

    def discard(self) -> None:
        """Drop this step's sums (the step failed); last step's stay pending."""
        cf.wait(self._futures)
        self._futures.clear()
        for part in self._current:
            if self.spill and part + ".sum" in self.spill:
                self.spill.take(part + ".sum")
        self._current.clear()
        self._sums.clear()
        self._sq.clear()

    def pending(self) -> list[str]:
        return list(self._ready)

    def ready_tag(self) -> str | None:
        """The tag of the finished sums not yet applied (one step's), or None."""
        tags = {tag for _, tag in self._ready.values()}
        assert len(tags) <= 1, f"sums of several steps pending: {tags}"
        return tags.pop() if tags else None

    def adopt(self, parts: list[str], tag: str) -> None:
        """Resume: the spill already holds these parts' finished sums, under `tag`."""
        for part in parts:
            self._ready[part] = (None, tag)

    def take(self, part: str) -> dict | None:
        """The summed gradient of `part` from the last step, or None if already taken."""
        if part not in self._ready:
            return None
        grads, tag = self._ready.pop(part)
        if not self.spill:
            return grads
        return self.spill.take(pending_key(part, tag), keep=self.spill.durable)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.spill:
            self.spill.close()
