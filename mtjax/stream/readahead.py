"""Disk read-ahead of the state an update reads: master and optimizer state on a disk tier.

    ahead = ReadAhead(parts, tiers, grads)
    ahead.early(updated)      the step's prefetch is done: start the first updates' reads
    reads = ahead.start(part) the part's update begins: its reads (started early or now),
                              and the next pending part's reads
    ahead.end(part)           its gradient is taken: no read-ahead picks the part again
    ahead.forget(part)        new state of the part from outside its update: drop its early reads

Disk-tier reads land in reused buffers (`buffers`, a BufferPool), as many sets per part
shape as the step description says (`schedule.read_sets`: two of a shape several parts
have, one for the update computing and one for the next part's reads), made by
`provide`. Read-ahead runs only when master or optimizer state is on disk, and not in a
multi-process run (whose updates run in part order on the caller's thread: one set of a
shape is all they hold).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

from mtjax.hostmem import BufferPool
from mtjax.stream.grads import GradSink
from mtjax.stream.tiers import Tiers

KINDS = ("master", "opt")  # what an update reads


class ReadAhead:
    """Reads of master and optimizer state started before their update needs them.

    A part's reads are a tuple of (future of the arrays, buffers or None) for master and
    optimizer state: `release` hands their buffers back once the update is done with them.
    """

    def __init__(self, parts: list[str], tiers: Tiers, grads: GradSink, enabled: bool):
        self.parts, self.tiers, self.grads, self.enabled = parts, tiers, grads, enabled
        self.buffers = BufferPool(sets_per_shape=1)  # a shape no schedule named: one set
        self._ahead: dict[str, tuple] = {}  # part: its reads started early
        self._begun: set[str] = set()  # parts whose update has begun and not yet taken its gradient
        self._lock = threading.Lock()  # updates run on a worker and on the caller's thread

    def provide(self, part: str, kind: str, sets: int) -> None:
        """Make `sets` read buffer sets for `part`'s `kind` (and every part of its shape):
        a schedule's `reads`. Without read-ahead an update holds one set at a time."""
        self.buffers.provide(self.tiers.schema(part, kind), sets if self.enabled else 1)

    def order(self, parts) -> None:
        """The parts in the order their updates run (the next forward's need)."""
        with self._lock:
            self.parts = list(parts)

    @property
    def reading(self) -> set[str]:
        """The parts whose reads were started early and not yet taken by their update."""
        with self._lock:
            return set(self._ahead)

    def _read(self, part: str, kind: str) -> tuple:
        """(future of the arrays, buffers to hand back or None); returns at once, so that
        a part's reads run together."""
        if self.tiers.placement[kind] == "ram":
            return self.tiers.read(part, kind), None
        buffers = self.buffers.acquire(self.tiers.schema(part, kind))
        return self.tiers.read(part, kind, out=buffers), buffers

    def _spare(self, part: str) -> bool:
        """Whether read buffer sets for `part`'s disk-tier state are free (at most
        `sets_per_shape` of a shape are held, as the planner prices them)."""
        return all(self.tiers.placement[k] == "ram" or self.buffers.spare(self.tiers.schema(part, k)) for k in KINDS)

    def _reads(self, part: str) -> tuple:
        return tuple(self._read(part, k) for k in KINDS)

    def start(self, part: str) -> tuple:
        """The reads of `part`'s master and optimizer state for its update: those started
        early if any. With read-ahead this also starts the reads of the next part whose
        update is pending and not yet begun, when a read buffer set is free for it."""
        with self._lock:
            self._begun.add(part)
            reads = self._ahead.pop(part, None)
            if reads is None:
                reads = self._reads(part)
            if self.enabled:
                pending = self.grads.pending()
                later = self.parts[self.parts.index(part) + 1:]
                nxt = next((p for p in later if p in pending and p not in self._ahead and p not in self._begun), None)
                if nxt is not None and self._spare(nxt):
                    self._ahead[nxt] = self._reads(nxt)
        return reads

    def end(self, part: str) -> None:
        """`part`'s update has taken its gradient: it is no longer pending."""
        with self._lock:
            self._begun.discard(part)

    def early(self, updated) -> list[str]:
        """The step's reads of compute weights are done while its backward goes on: start
        the reads the step's updates (of the parts in `updated`) make first, in the order
        they run, for as many parts as read buffer sets are free. Returns those parts.

        A read started now sees every write queued before it (the store orders them), and
        any later write of that state but the update's own drops it (`forget`)."""
        if not self.enabled:
            return []
        started = []
        with self._lock:
            for part in self.parts:
                if part in updated and part not in self._ahead and part not in self._begun and self._spare(part):
                    self._ahead[part] = self._reads(part)
                    started.append(part)
        return started

    def forget(self, part: str) -> None:
        """New master or optimizer state of `part` from outside its update (a load): its
        reads started early are stale; their buffers go back once they are done."""
        if part not in self._ahead:
            return
        with self._lock:
            reads = self._ahead.pop(part, None)
            if reads is not None:
                self.abandon(reads)

    def release(self, reads: tuple, fence) -> None:
        """The update is done with `reads`' arrays once `fence` is ready."""
        for _, bufs in reads:
            if bufs is not None:
                self.buffers.release(bufs, fence=fence)

    def abandon(self, reads: tuple) -> None:
        """Reads no update will use: their buffers go back once they are done."""
        cf.wait([fut for fut, _ in reads])
        for _, bufs in reads:
            if bufs is not None:
                self.buffers.release(bufs)

    def close(self) -> None:
        """Drop the reads started for updates that will not run (a step that failed)."""
        with self._lock:
            ahead, self._ahead = self._ahead, {}
        for reads in ahead.values():
            self.abandon(reads)
