"""Per-part stage timings of every step, and their Chrome trace (Perfetto) JSON.

Host-side stages (store read, optimizer, store write, device->host wait) are timed
where they run. Device work is dispatched asynchronously, so its span is measured by a
watcher thread that waits for the outputs: it starts when the work was dispatched or
when the previous work on that lane ended, whichever is later, and ends when the
outputs are ready. Each lane (h2d, compute, d2h) has its own watcher: one watcher for
all would take a transfer's end only after the computation queued before it had
finished. The main loop itself never waits for a timing.

An event belongs to the step running when it began, except on a thread inside
`attributed(step)`: the deferred optimizer updates run there, on worker threads, while
one step ends and the next begins, and belong to the step whose forward streams them in
(mtjax.stream.updates). So every event of a step is recorded once that step has
returned and the watchers are drained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import time
from collections import defaultdict
from pathlib import Path

import jax

# "h2d": from staging a part until its device copy is ready; "wait": the training loop
# waiting for the next part to arrive (the stall a slower store or link causes);
# "write": handing new state to the tiers, and an update waiting for earlier writes.
STAGES = ("read", "h2d", "compute", "d2h", "optimizer", "write", "wait")


@dataclasses.dataclass(frozen=True)
class Event:
    stage: str
    part: str
    start: float  # seconds since the tracer started
    end: float
    step: int


class Tracer:
    """`keep_steps`: events of that many most recent steps are kept (None keeps all),
    so a long run does not accumulate them."""

    def __init__(self, keep_steps: int | None = 4):
        self.t0 = time.perf_counter()
        self.step = 0
        self.keep_steps = keep_steps
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._lane_end: dict[str, float] = defaultdict(float)
        self._pending: dict[str, queue.Queue] = {}  # a watcher's queue per lane
        self._watchers: list[threading.Thread] = []
        self._thread = threading.local()  # `attributed`'s step, per thread

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.keep_steps is not None:
            with self._lock:
                self.events = [e for e in self.events if e.step > step - self.keep_steps]

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _step(self) -> int:
        step = getattr(self._thread, "step", None)
        return self.step if step is None else step

    @contextlib.contextmanager
    def attributed(self, step: int | None):
        """Events begun on this thread inside belong to `step` (None: the running step)."""
        outer = getattr(self._thread, "step", None)
        self._thread.step = step
        try:
            yield
        finally:
            self._thread.step = outer

    def _record(self, stage: str, part: str, start: float, end: float, step: int) -> None:
        with self._lock:
            self.events.append(Event(stage, part, start, end, step))

    @contextlib.contextmanager
    def span(self, stage: str, part: str):
        """Time a host-side stage that runs in the calling thread."""
        start, step = self.now(), self._step()
        try:
            yield
        finally:
            self._record(stage, part, start, self.now(), step)

    def watch(self, stage: str, part: str, arrays, since: float | None = None) -> None:
        """Time asynchronous device work from now (or `since`, a `now()` taken when it
        began) until `arrays` are ready."""
        self._lane(stage).put((stage, part, self.now() if since is None else since, self._step(),
                               jax.tree.leaves(arrays)))

    def _lane(self, stage: str) -> queue.Queue:
        with self._lock:
            if stage not in self._pending:
                self._pending[stage] = q = queue.Queue()
                t = threading.Thread(target=self._watch_loop, args=(q,), name=f"mtjax-trace-{stage}", daemon=True)
                self._watchers.append(t)
                t.start()
            return self._pending[stage]

    def _watch_loop(self, pending: queue.Queue) -> None:
        while True:
            item = pending.get()
            if item is None:
                pending.task_done()
                return
            stage, part, dispatched, step, arrays = item
            try:
                jax.block_until_ready(arrays)
            except Exception:  # noqa: BLE001  a failed computation is reported by the step itself
                pass
            end = self.now()
            start = max(dispatched, self._lane_end[stage])
            self._lane_end[stage] = end
            self._record(stage, part, start, end, step)
            del arrays, item  # let the device buffers go
            pending.task_done()

    def drain(self) -> None:
        """Wait until every watched computation has been timed."""
        with self._lock:
            lanes = list(self._pending.values())
        for q in lanes:
            q.join()

    def step_totals(self, step: int) -> dict[str, float]:
        """Seconds per stage in one step (summed over parts)."""
        out = dict.fromkeys(STAGES, 0.0)
        with self._lock:
            for e in self.events:
                if e.step == step:
                    out[e.stage] = out.get(e.stage, 0.0) + e.end - e.start
        return out

    def per_part(self, step: int, stage: str) -> list[tuple[str, float]]:
        """(part, seconds) of every event of one stage in one step, in the order they began."""
        with self._lock:
            events = sorted((e for e in self.events if e.step == step and e.stage == stage), key=lambda e: e.start)
        return [(e.part, e.end - e.start) for e in events]

    def chrome_trace(self) -> dict:
        """The events as Chrome trace JSON (open in https://ui.perfetto.dev)."""
        lanes = {s: i for i, s in enumerate(STAGES)}
        out = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": s}} for s, i in lanes.items()]
        with self._lock:
            for e in self.events:
                out.append({"name": f"{e.stage} {e.part}", "cat": e.stage, "ph": "X", "pid": 1,
                            "tid": lanes.get(e.stage, len(lanes)), "ts": e.start * 1e6,
                            "dur": max(e.end - e.start, 0.0) * 1e6, "args": {"step": e.step}})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        self.drain()
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace()))
        return path

    def close(self) -> None:
        with self._lock:
            lanes, watchers = list(self._pending.values()), list(self._watchers)
        for q in lanes:
            q.put(None)
        for t in watchers:
            t.join()
