"""The update queue: the deferred optimizer update of each part, run on host threads.

    updates.ready(scale)      the step's gradients are final: start every update
    updates.updated(part)     wait for the part's update; its new compute copy
    updates.settle()          wait for the updates started and every write, start none
    updates.flush()           apply every pending update

Updates run on a few host threads (one when state is on disk: each update in flight
holds a part's state in read buffers), in the order the next forward needs the parts
(`order`: the schedule's `needed`, from its operations). The updates in flight share the
fused AdamW's threads, which run the pieces of the part needed first before the others'
(each update's `rank`), so they finish in that order too, the embedding first. With
the compute copy on disk updates run at most `schedule.HANDED_AHEAD` parts ahead of the
staging that takes their new copies, so that the copies waiting for it stay few. With a
one-copy store the updates of a step wait for its commit (`OneCopy`,
mtjax.store.commit). In a multi-process run (`hosts`) a part's update is of this
process's rows only, and its new compute copy is all-gathered from every process's rows
before it is written: those updates run on the caller's thread, in part order (`flush`),
so that every process issues the same collectives in the same order.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import os
import threading

import jax
import numpy as np

from mtjax.stream.grads import GradSink
from mtjax.stream.readahead import ReadAhead
from mtjax.stream.schedule import HANDED_AHEAD
from mtjax.stream.state import State
from mtjax.stream.tiers import host_device
from mtjax.stream.trace import Tracer
from mtjax.stream.update import PartUpdate


class UpdateQueue:
    """The pending updates of the last step. `scale`: the clip scale of updates already
    pending (a resumed one-copy store's); `schemas`: each part's whole compute leaves
    (hosts only)."""

    def __init__(self, parts: list[str], update: PartUpdate, state: State, ahead: ReadAhead, grads: GradSink,
                 tracer: Tracer, one_copy=None, scale: float | None = None, hosts=None, schemas: dict | None = None):
        self.parts, self.update, self.state, self.ahead = parts, update, state, ahead
        self.grads, self.tracer, self.one_copy, self.hosts, self.schemas = grads, tracer, one_copy, hosts, schemas
        self.scale = None if scale is None else jax.device_put(np.float32(scale), host_device())
        # The step whose forward streams the pending updates in: their timings belong to it
        # (mtjax.stream.trace); None for a resumed store's, which the first step takes.
        self.for_step: int | None = None
        tiers = state.tiers
        workers = 1 if tiers.kinds_in("disk") else max(1, min(8, os.cpu_count() or 1))
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="mtjax-update")
        self._started: dict[str, cf.Future] = {}  # their new compute copy not yet taken
        self._queued: list[str] = []  # to start once fewer than `_max_started` are started
        self._max_started = HANDED_AHEAD if tiers.placement["compute"] == "disk" else len(parts)
        self._lock = threading.Lock()  # the prefetch worker takes updates while the caller may start them

    def order(self, parts) -> None:
        """The parts in the order the next forward needs them (a schedule's `needed`):
        the order updates start and their rank on the fused AdamW's threads."""
        with self._lock:
            self.parts = list(parts)

    def ranked(self, part: str):
        """`submit(fn, *args)` running jobs on the fused AdamW's threads at `part`'s rank
        (where the next forward needs it), or None (no fused loop, or a part not updated here)."""
        with self._lock:
            if self.update.fused is None or part not in self.parts:
                return None
            return functools.partial(self.update.fused.pool.submit, self.parts.index(part))

    @property
    def started(self) -> dict[str, cf.Future]:
        """The updates started whose new compute copy no staging has taken yet, in order."""
        with self._lock:
            return dict(self._started)

    @property
    def queued(self) -> list[str]:
        """The pending updates waiting for a started one's copy to be taken, in order."""
        with self._lock:
            return list(self._queued)

    def _apply(self, part: str) -> dict | None:
        """The deferred optimizer update of `part`, if one is pending; returns the new compute copy."""
        with self.tracer.attributed(self.for_step):
            return self._apply_timed(part)

    def _apply_timed(self, part: str) -> dict | None:
        if self.one_copy is not None:
            self.one_copy.check_may_update(part, self.grads)
        if part not in self.grads.pending():
            return None
        # Master and optimizer state are read at once (on disk: the store's I/O threads
        # keep both in flight, and the next part's after them), while the gradient sum
        # comes back from its spill file.
        reads = self.ahead.start(part)
        (master, _), (opt, _) = reads
        try:
            grads = self.grads.take(part)
        except BaseException:  # a damaged spill file
            self.ahead.abandon(reads)
            raise
        finally:
            self.ahead.end(part)  # no longer pending: no read-ahead picks it
        with self.tracer.span("read", part):
            master, opt = master.result(), opt.result()
        # The old compute copy receives the new one (RAM tier only), and RAM-tier state is
        # updated in place: nothing else reads it while its part's update is pending.
        state = self.state
        old = state.read(part, "compute") if "compute" in state.kept_in_ram() else None
        # Only trained leaves have a gradient and get a new compute copy; the others'
        # (frozen, mtjax.roles) stay as they are, out of the update's reach (on disk the
        # store carries them, mtjax.stream.tiers).
        kept = {} if old is None else {n: a for n, a in old.items() if n not in grads}
        # (a multi-process run's update makes its rows: the whole copy is all-gathered below)
        old = None if old is None or self.hosts is not None else {n: a for n, a in old.items() if n in grads}
        with self.tracer.span("write", part):
            cf.wait(state.throttle())
        with self.tracer.span("optimizer", part) if self.update.fused else contextlib.nullcontext():
            master, opt, compute = self.update(part, master, opt, old, grads, self.scale,
                                               own=state.tiers.kinds_in("ram"), copy=not state.derived_compute,
                                               rank=self.parts.index(part))
        self.ahead.release(reads, fence=master)
        if not self.update.fused:  # the XLA program runs asynchronously: time it until done
            self.tracer.watch("optimizer", part, master)
        if self.hosts is not None:  # every process's new rows, for the whole compute copy
            with self.tracer.span("all_gather", part):
                compute = self.hosts.all_gather(compute, {n: self.schemas[part][n] for n in compute})
        state.write(part, "master", master)
        state.write(part, "opt", opt)
        if compute is not None:
            compute = {**kept, **compute}
            state.write(part, "compute", compute)
        if self.one_copy is not None:
            # Once the new state is on disk the manifest names it and its gradient can go.
            state.track(self.one_copy.part_updated(part))
        # Handed to the part's next staging; the store keeps writing the same (unchanged)
        # arrays meanwhile, and its commit still waits for that write.
        return compute

    def ready(self, scale) -> None:
        """The step's gradients are final and `scale` is their clip scale: start the
        updates (with a one-copy store, at the step's commit instead)."""
        self.scale = jax.device_put(scale, host_device())
        self.for_step = self.tracer.step + 1
        if self.one_copy is not None:
            self.one_copy.step_finished()
        self.state.wait_writes()
        if self.one_copy is None and self.hosts is None:
            self.start()  # they run while the caller logs, evaluates, fetches data

    def start(self) -> None:
        """Start the pending updates on the update threads, in the order the forward needs
        them: all of them, or (compute copy on disk) the first few, the others as the
        staging takes the earlier ones' copies (`updated`)."""
        with self._lock:
            pending = self.grads.pending()
            self._queued = [p for p in self.parts if p in pending and p not in self._started]
            self._start_queued()

    def _start_queued(self) -> None:
        while self._queued and len(self._started) < self._max_started:
            part = self._queued.pop(0)
            self._started[part] = self._pool.submit(self._apply, part)

    def updated(self, part: str) -> dict | None:
        """The new compute copy of `part` once its pending update is done (None: no update,
        or no copy kept); an update not yet started runs here, on the caller's thread."""
        with self._lock:
            fut = self._started.pop(part, None)
            if part in self._queued:
                self._queued.remove(part)
            self._start_queued()
        return fut.result() if fut is not None else self._apply(part)

    def settle(self) -> None:
        """Wait for the updates already started and for every write (their part commits
        included), without starting any: a commit changes where the next writes go."""
        with self._lock:
            self._queued = []  # the next `start` queues what is still pending
            started = list(self._started.values())
        for fut in started:
            fut.result()
        self.state.wait_writes()

    def flush(self) -> None:
        """Apply every pending update (before reading state, a commit or the end)."""
        for part in self.parts:
            self.updated(part)
        self.state.wait_writes()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
