"""A thread pool that runs the waiting job of lowest rank first, not the oldest.

    pool = RankedPool(threads)
    fut = pool.submit(rank, fn, *args)   # a concurrent.futures.Future
    pool.shutdown()

The fused AdamW's kernel threads are one such pool shared by every update in flight
(mtjax.stream.updates runs several parts' updates at once, each cut into pieces for all
the cores). First come, first served interleaves their pieces, so every update finishes
near the end of them all, and the embedding, the part the next forward stages first,
waits behind blocks it needs much later. Ranked by the forward's need, a part's pieces
run before those of any part the forward needs later: the updates finish in the order
the next step stages their parts. Equal ranks run in the order they came.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import itertools
import threading


class RankedPool:
    def __init__(self, threads: int, name: str = "mtjax-ranked"):
        self._heap: list = []  # (rank, arrival, future, fn, args)
        self._arrivals = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, rank: int, fn, *args) -> cf.Future:
        fut = cf.Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("submit after shutdown")
            heapq.heappush(self._heap, (rank, next(self._arrivals), fut, fn, args))
            self._ready.notify()
        return fut

    @property
    def waiting(self) -> int:
        """Jobs submitted and not yet taken by a thread."""
        with self._ready:
            return len(self._heap)

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._heap and not self._closed:
                    self._ready.wait()
                if not self._heap:  # closed and drained
                    return
                _, _, fut, fn, args = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Run the jobs already submitted, then stop the threads."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for t in self._threads:
            t.join()
