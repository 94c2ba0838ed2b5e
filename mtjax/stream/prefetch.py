"""Bounded background prefetch: a worker thread runs ahead of the consumer.

The worker calls `load(item)` for each item of a fixed schedule, at most `depth` items
ahead of the consumer. An exception in the worker is re-raised in the consumer at the
next `get`, and `close` stops the worker and returns what it loaded but nobody took.
`after`, if given, runs on the worker once every item is loaded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

_END = object()


class PrefetchError(RuntimeError):
    """The consumer asked for more items than the schedule has."""


class Prefetcher:
    def __init__(self, items: Sequence, load: Callable, depth: int, name: str = "mtjax-prefetch",
                 after: Callable | None = None):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._items, self._load, self._after = list(items), load, after
        self._slots = threading.Semaphore(depth)  # at most `depth` loaded and not yet taken
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                self._queue.put((item, self._load(item), None))
            if self._after is not None:
                self._after()
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._queue.put((None, None, e))
            return
        self._queue.put((None, _END, None))

    def get(self):
        """(item, loaded value) of the next item; re-raises the worker's exception."""
        item, value, error = self._queue.get()
        if error is not None:
            self._queue.put((None, None, error))  # later calls fail the same way
            raise error
        if value is _END:
            self._queue.put((None, _END, None))
            raise PrefetchError("the prefetch schedule is exhausted")
        self._slots.release()
        return item, value

    def close(self) -> list:
        """Stop the worker; returns the values it loaded that were never taken."""
        self._stop.set()
        self._slots.release()  # wake a worker waiting for room
        self._thread.join()
        left = []
        while not self._queue.empty():
            _, value, error = self._queue.get_nowait()
            if error is None and value is not _END:
                left.append(value)
        return left
