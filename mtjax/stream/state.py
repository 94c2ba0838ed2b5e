"""State access: a part's state in its tiers, the writes made to them, and its compute copy.

    state.read(part, kind) / state.write(part, kind, arrays)
    state.wait_writes()                  re-raise write errors; the tiers readable again
    state.compute_into(part, out, fresh) the current compute weights, into a staging slot
    state.round_master(part)             the derived compute copy (no compute copy kept)
    state.write_kept(store)              RAM-tier state into the store (a commit)

Every write is tracked until it finishes, so that `wait_writes` re-raises its error. The
writes made since the last update began computing and the ones before them are tracked
apart too (`throttle`): an update waits for those of the update before last before it
makes new state, so a disk slower than the updates leaves at most one more part's new
state waiting in host memory.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np

from mtjax.precision import Policy
from mtjax.stream.tiers import Tiers
from mtjax.stream.trace import Tracer


class State:
    """Reads and writes of the tiers. `derived_compute`: no compute copy is kept; the
    staged copy is rounded from master by `policy` (docs/device.md). `on_write(part)`
    is told of each new master or optimizer state (read-ahead drops its stale reads)."""

    def __init__(self, tiers: Tiers, tracer: Tracer, policy: Policy, derived_compute: bool, on_write=None):
        self.tiers, self.tracer, self.policy, self.derived_compute = tiers, tracer, policy, derived_compute
        self.on_write = on_write
        self._writes: list[cf.Future] = []
        # Writes made since the last update began computing, and between the two before.
        self._last_writes: list[cf.Future] = []
        self._earlier_writes: list[cf.Future] = []
        self._lock = threading.Lock()  # update workers add writes concurrently

    def kept_in_ram(self) -> list[str]:
        """The kinds of state the RAM tier holds (a derived compute copy is not held)."""
        return [k for k in self.tiers.kinds_in("ram") if not (k == "compute" and self.derived_compute)]

    def read(self, part: str, kind: str) -> dict:
        with self.tracer.span("read", part):
            return self.tiers.read(part, kind).result()

    def write(self, part: str, kind: str, arrays: dict) -> None:
        if kind != "compute" and self.on_write is not None:
            self.on_write(part)
        with self.tracer.span("write", part):
            fut = self.tiers.write(part, kind, arrays)
        self.track(fut)

    def track(self, fut: cf.Future) -> None:
        """Follow `fut` (a write, or what waits for writes) until `wait_writes`."""
        with self._lock:
            # Keep only unfinished or failed writes: a finished one must not pin its arrays.
            self._writes = [f for f in self._writes if not f.done() or f.exception()] + [fut]
            self._last_writes.append(fut)

    def wait_writes(self) -> None:
        """Host sync: re-raise write errors, and make the state readable from the tiers."""
        with self._lock:
            writes, self._writes = self._writes, []
        for fut in writes:
            fut.result()
        self.tiers.wait()  # also lets the store drop the results of finished reads

    def throttle(self) -> list[cf.Future]:
        """An update is about to make new state: the writes it must wait for first (those
        of the update before last; their errors are raised by `wait_writes`)."""
        with self._lock:
            older = self._earlier_writes
            self._earlier_writes, self._last_writes = self._last_writes, []
        return older

    def round_master(self, part: str, out: dict | None = None, submit=None) -> dict:
        """The derived compute copy of `part`: its master weights converted by the precision
        policy into `out` ({leaf: array}: every leaf, or a split MoE block's sub-part's;
        new arrays when None), its pieces run by `submit` (`precision.round_into`)."""
        master = {n: np.asarray(a) for n, a in self.read(part, "master").items()}
        if out is None:
            return self.policy.to_compute(master)
        self.policy.into(master, out, part, submit=submit)
        return out

    def compute_into(self, part: str, out: dict, fresh: dict | None, submit=None) -> None:
        """The current compute weights of `part` into `out` (all its leaves, or some: a
        split MoE block's sub-part); `fresh` is its update's new copy (staged without a
        round trip through the tier); `submit`: the threads of a derived copy's rounding."""
        if self.derived_compute:
            self.round_master(part, out, submit)  # the updated master, straight into the slot
        elif fresh is not None:
            # A copy on disk is handed on without the frozen leaves (mtjax.roles), which the
            # update never writes: they are read from the tier.
            rest = {n: buf for n, buf in out.items() if n not in fresh}
            reading = self.tiers.read(part, "compute", out=rest) if rest else None
            # np.asarray waits for the update (host sync on this worker thread).
            for n, buf in out.items():
                if n in fresh:
                    np.copyto(buf, np.asarray(fresh[n]))
            if reading is not None:
                reading.result()
        else:
            self.tiers.read(part, "compute", out=out).result()

    def write_kept(self, store) -> None:
        """Write the RAM-tier state (a derived compute copy rounded from master) into
        `store`, one part at a time: its host copies are freed before the next part's."""
        for kind in self.tiers.kinds_in("ram"):
            for part in store.parts:
                if kind == "compute" and self.derived_compute:
                    arrays = self.round_master(part)
                else:
                    arrays = {n: np.asarray(a) for n, a in self.read(part, kind).items()}
                store.write(part, kind, arrays).result()
