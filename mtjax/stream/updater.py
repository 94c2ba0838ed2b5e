"""The deferred update: step n's optimizer update of each part runs after step n's
backward, once the clip scale is known, and before the part is staged for step n + 1.

    updater.ready(scale)         the step's gradients are final: start every update
    updater.updated(part)        wait for the part's update (the next step's prefetch)
    updater.compute_into(...)    the part's compute weights, into a staging slot
    updater.flush()              apply every pending update (before state is read)

Updates run on a few host threads (one when state is on disk: each update in flight
holds a part's state in read buffers), in the order the forward needs the parts. On disk
an update also starts the reads of the next pending part's master and optimizer state,
so the disk reads it while this part's update computes and its writes queue (two read
buffer sets per part shape); the backward reads the first updates' state the same way
(`read_early`). Before an update makes new state it waits for the writes of the update
before last, so that a disk slower than the updates leaves at most one more part's new
state waiting in host memory. An
update reads master and optimizer state from their tiers, runs `PartUpdate` (the fused
AdamW loop, or the XLA program of another optax transformation), and writes the results
back; the updater tracks those writes and re-raises their errors. Its new compute copy
is also handed to the part's next staging, which copies it into the slot instead of
reading it back from a disk tier (and waiting for its write); with the copy on disk,
updates run at most `schedule.HANDED_AHEAD` parts ahead of that staging, so that the
copies waiting for it stay few. With a one-copy store
the updates of a step wait for its commit (`OneCopy`, mtjax.stream.commit). In a
multi-process run (`hosts`) a part's update is of this process's rows only, and its new
compute copy is all-gathered from every process's rows before it is written: those
updates run on the caller's thread, in part order (`flush`), so that every process
issues the same collectives in the same order.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading

import jax
import numpy as np

from mtjax.stream.commit import OneCopy
from mtjax.stream.grads import GradSink
from mtjax.stream.schedule import HANDED_AHEAD
from mtjax.hostmem import BufferPool
from mtjax.stream.tiers import Tiers, host_device
from mtjax.stream.trace import Tracer
from mtjax.stream.update import PartUpdate


class Updater:
    """The pending updates of the last step, and the tier writes they (and the engine) make.

    `parts`: part names in the order the forward needs them. `derived_compute`: no
    compute copy is kept; the staged copy is rounded from master (docs/pipeline.md).
    `scale`: the clip scale of updates already pending (a resumed one-copy store's).
    """

    def __init__(self, parts: list[str], update: PartUpdate, tiers: Tiers, grads: GradSink, tracer: Tracer,
                 derived_compute: bool, one_copy: OneCopy | None = None, scale: float | None = None,
                 hosts=None, schemas: dict | None = None):
        self.parts, self.update, self.tiers, self.grads, self.tracer = parts, update, tiers, grads, tracer
        self.hosts, self.schemas = hosts, schemas  # schemas: each part's whole compute leaves (hosts only)
        self.derived_compute, self.one_copy = derived_compute, one_copy
        self.scale = None if scale is None else jax.device_put(np.float32(scale), host_device())
        self._writes: list[cf.Future] = []
        # Writes made since the last update began computing, and between the two before.
        self._last_writes: list[cf.Future] = []
        self._earlier_writes: list[cf.Future] = []
        self._writes_lock = threading.Lock()  # update workers add writes concurrently
        workers = 1 if tiers.kinds_in("disk") else max(1, min(8, os.cpu_count() or 1))
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="mtjax-update")
        self._updates: dict[str, cf.Future] = {}  # started, their new compute copy not yet taken
        self._queued: list[str] = []  # to start once fewer than `_max_started` are in `_updates`
        self._max_started = HANDED_AHEAD if tiers.placement["compute"] == "disk" else len(parts)
        self._lock = threading.Lock()  # the prefetch worker takes updates while the caller may start them
        self.read_ahead = hosts is None and any(tiers.placement[k] == "disk" for k in ("master", "opt"))
        self.read_buffers = BufferPool(sets_per_shape=2 if self.read_ahead else 1)  # the optimizer's disk-tier reads
        self._ahead: dict[str, tuple] = {}  # part: its reads started early, as _start_reads returns them
        self._begun: set[str] = set()
        self._ahead_lock = threading.Lock()  # updates run on a worker and on the caller's thread

    # --- reads and writes of the tiers ------------------------------------------------

    def kept_in_ram(self) -> list[str]:
        """The kinds of state the RAM tier holds (a derived compute copy is not held)."""
        return [k for k in self.tiers.kinds_in("ram") if not (k == "compute" and self.derived_compute)]

    def read(self, part: str, kind: str) -> dict:
        with self.tracer.span("read", part):
            return self.tiers.read(part, kind).result()

    def write(self, part: str, kind: str, arrays: dict) -> None:
        if kind != "compute" and part in self._ahead:  # new state from outside its update (a load)
            with self._ahead_lock:
                self._drop_early(part)
        with self.tracer.span("write", part):
            fut = self.tiers.write(part, kind, arrays)
        self._track(fut)

    def _track(self, fut: cf.Future) -> None:
        with self._writes_lock:
            # Keep only unfinished or failed writes: a finished one must not pin its arrays.
            self._writes = [f for f in self._writes if not f.done() or f.exception()] + [fut]
            self._last_writes.append(fut)

    def wait_writes(self) -> None:
        """Host sync: re-raise write errors, and make the state readable from the tiers."""
        with self._writes_lock:
            writes, self._writes = self._writes, []
        for fut in writes:
            fut.result()
        self.tiers.wait()  # also lets the store drop the results of finished reads

    def _start_read_for_update(self, part: str, kind: str):
        """(future of the arrays, buffers to hand back or None): disk reads land in reused
        buffers. Returns at once, so that a part's reads run together."""
        if self.tiers.placement[kind] == "ram":
            return self.tiers.read(part, kind), None
        buffers = self.read_buffers.acquire(self.tiers.schema(part, kind))
        return self.tiers.read(part, kind, out=buffers), buffers

    def _spare(self, part: str) -> bool:
        """Whether read buffer sets for `part`'s disk-tier master and optimizer state are
        free (at most `sets_per_shape` of a shape are held, as the planner prices them)."""
        return all(self.tiers.placement[k] == "ram" or self.read_buffers.spare(self.tiers.schema(part, k))
                   for k in ("master", "opt"))

    def _reads(self, part: str) -> tuple:
        """Start the reads of `part`'s master and optimizer state for its update."""
        return tuple(self._start_read_for_update(part, k) for k in ("master", "opt"))

    def _abandon(self, reads: tuple) -> None:
        """Reads no update will use: their buffers go back once they are done."""
        cf.wait([fut for fut, _ in reads])
        for _, bufs in reads:
            if bufs is not None:
                self.read_buffers.release(bufs)

    def _read_early(self, part: str) -> None:
        """Start `part`'s update reads now (the caller holds `_ahead_lock`)."""
        self._ahead[part] = self._reads(part)

    def _start_reads(self, part: str) -> tuple:
        """The reads of `part`'s master and optimizer state for its update, each (future,
        buffers or None): those started early if any. With read-ahead this also starts the
        reads of the next part whose update is pending and not yet begun (`_begun`: parts
        between here and taking their gradient, which ends their pending), when a read
        buffer set is free for it."""
        with self._ahead_lock:
            self._begun.add(part)
            reads = self._ahead.pop(part, None)
            if reads is None:
                reads = self._reads(part)
            if self.read_ahead:
                pending = self.grads.pending()
                later = self.parts[self.parts.index(part) + 1:]
                nxt = next((p for p in later if p in pending and p not in self._ahead and p not in self._begun), None)
                if nxt is not None and self._spare(nxt):
                    self._read_early(nxt)
        return reads

    def read_early(self, updated) -> None:
        """The step's reads of compute weights are done (its prefetch has loaded every
        transfer) while its backward goes on: start the reads the step's updates (of the
        parts in `updated`: not the resident ones) will make first, in the order they run,
        for as many parts as read buffer sets are free.
        The disk then works through the rest of the backward instead of idling until the
        clip scale is known. A read started now sees every write queued before it (the
        store orders them), and any later write of that state but the update's own drops
        it (`write`)."""
        if not self.read_ahead:
            return
        with self._ahead_lock:
            for part in self.parts:
                if part in updated and part not in self._ahead and part not in self._begun and self._spare(part):
                    self._read_early(part)

    def _drop_early(self, part: str) -> None:
        """Forget `part`'s reads started early, once they are done (the caller holds `_ahead_lock`)."""
        reads = self._ahead.pop(part, None)
        if reads is not None:
            self._abandon(reads)

    # --- the compute copy -----------------------------------------------------------

    def round_master(self, part: str, out: dict | None = None) -> dict:
        """The derived compute copy of `part`: its master weights converted by the precision
        policy into `out` ({leaf: array}: every leaf, or a split MoE block's sub-part's;
        new arrays when None)."""
        master = {n: np.asarray(a) for n, a in self.read(part, "master").items()}
        if out is None:
            return self.update.policy.to_compute(master)
        self.update.policy.into(master, out)
        return out

    def compute_into(self, part: str, out: dict, fresh: dict | None) -> None:
        """The current compute weights of `part` into `out` (all its leaves, or some: a
        split MoE block's sub-part); `fresh` is what `updated` returned for it (the new
        copy, staged without a round trip through the tier)."""
        if self.derived_compute:
            self.round_master(part, out)  # the updated master, straight into the slot
        elif fresh is not None:
            # np.asarray waits for the update (host sync on this worker thread).
            for n, buf in out.items():
                np.copyto(buf, np.asarray(fresh[n]))
        else:
            self.tiers.read(part, "compute", out=out).result()

    # --- the updates ------------------------------------------------------------------

    def _apply(self, part: str) -> dict | None:
        """The deferred optimizer update of `part`, if one is pending; returns the new compute copy."""
        if self.one_copy is not None:
            self.one_copy.check_may_update(part, self.grads)
        if part not in self.grads.pending():
            return None
        # Master and optimizer state are read at once (on disk: the store's I/O threads
        # keep both in flight, and the next part's after them), while the gradient sum
        # comes back from its spill file.
        reads = self._start_reads(part)
        (master, m_bufs), (opt, o_bufs) = reads
        try:
            grads = self.grads.take(part)
        except BaseException:  # a damaged spill file
            self._abandon(reads)
            raise
        finally:
            with self._ahead_lock:
                self._begun.discard(part)  # no longer pending: no read-ahead picks it
        with self.tracer.span("read", part):
            master, opt = master.result(), opt.result()
        # The old compute copy receives the new one (RAM tier only), and RAM-tier state is
        # updated in place: nothing else reads it while its part's update is pending.
        old = self.read(part, "compute") if "compute" in self.kept_in_ram() and self.hosts is None else None
        # The writes of the update before last must be done before this one makes new
        # state: a disk slower than the updates would otherwise let every part's new
        # state wait in host memory for it. One part's may still wait (as priced).
        with self._writes_lock:
            older = self._earlier_writes
            self._earlier_writes, self._last_writes = self._last_writes, []
        with self.tracer.span("write", part):
            cf.wait(older)  # their errors are raised by `wait_writes`
        with self.tracer.span("optimizer", part) if self.update.fused else contextlib.nullcontext():
            master, opt, compute = self.update(part, master, opt, old, grads, self.scale,
                                               own=self.tiers.kinds_in("ram"), copy=not self.derived_compute)
        for bufs in (m_bufs, o_bufs):
            if bufs is not None:
                self.read_buffers.release(bufs, fence=master)
        if not self.update.fused:  # the XLA program runs asynchronously: time it until done
            self.tracer.watch("optimizer", part, master)
        if self.hosts is not None:  # every process's new rows, for the whole compute copy
            with self.tracer.span("all_gather", part):
                compute = self.hosts.all_gather(compute, self.schemas[part])
        self.write(part, "master", master)
        self.write(part, "opt", opt)
        if compute is not None:
            self.write(part, "compute", compute)
        if self.one_copy is not None:
            # Once the new state is on disk the manifest names it and its gradient can go.
            self._track(self.one_copy.part_updated(part))
        # Handed to the part's next staging; the store keeps writing the same (unchanged)
        # arrays meanwhile, and its commit still waits for that write.
        return compute

    def ready(self, scale) -> None:
        """The step's gradients are final and `scale` is their clip scale: start the
        updates (with a one-copy store, at the step's commit instead)."""
        self.scale = jax.device_put(scale, host_device())
        if self.one_copy is not None:
            self.one_copy.step_finished()
        self.wait_writes()
        if self.one_copy is None and self.hosts is None:
            self.start()  # they run while the caller logs, evaluates, fetches data

    def start(self) -> None:
        """Start the pending updates on the update threads, in the order the forward needs
        them: all of them, or (compute copy on disk) the first few, the others as the
        staging takes the earlier ones' copies (`updated`)."""
        with self._lock:
            pending = self.grads.pending()
            self._queued = [p for p in self.parts if p in pending and p not in self._updates]
            self._start_queued()

    def _start_queued(self) -> None:
        while self._queued and len(self._updates) < self._max_started:
            part = self._queued.pop(0)
            self._updates[part] = self._pool.submit(self._apply, part)

    def updated(self, part: str) -> dict | None:
        """The new compute copy of `part` once its pending update is done (None: no update,
        or no copy kept); an update not yet started runs here, on the caller's thread."""
        with self._lock:
            fut = self._updates.pop(part, None)
            if part in self._queued:
                self._queued.remove(part)
            self._start_queued()
        return fut.result() if fut is not None else self._apply(part)

    def settle(self) -> None:
        """Wait for the updates already started and for every write (their part commits
        included), without starting any: a commit changes where the next writes go."""
        with self._lock:
            self._queued = []  # the next `start` queues what is still pending
            started = list(self._updates.values())
        for fut in started:
            fut.result()
        self.wait_writes()

    def flush(self) -> None:
        """Apply every pending update (before reading state, a commit or the end)."""
        for part in self.parts:
            self.updated(part)
        self.wait_writes()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._ahead_lock:  # reads started for updates that will not run (a step that failed)
            ahead, self._ahead = self._ahead, {}
        for reads in ahead.values():
            self._abandon(reads)
