"""Page-aligned, pre-touched host buffers, reused across reads (and by the engine's staging).

A fresh numpy array pays a page fault on the first write to every page (150-220 ms per
GiB on the project machines), which costs more than reading the bytes from disk. So
reads land in buffers allocated once, aligned to a page (which also makes them eligible
for zero-copy `device_put`), and touched once up front.
"""

from __future__ import annotations

import math
import queue

import numpy as np

PAGE = 4096


def _align(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def slab(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of `nbytes` whose pages are already faulted in."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE
    out = raw[start:start + nbytes]
    out[::PAGE] = 0  # touch every page now, not during the first read
    return out


def carve(memory: np.ndarray, schema: dict) -> dict[str, np.ndarray]:
    """{name: array} views into one slab, each leaf starting on a page boundary."""
    out, offset = {}, 0
    for name, spec in schema.items():
        dtype = np.dtype(spec.dtype)
        n = math.prod(spec.shape) * dtype.itemsize
        out[name] = memory[offset:offset + n].view(dtype).reshape(spec.shape)
        offset += _align(n)
    return out


def slab_bytes(schema: dict) -> int:
    return sum(_align(math.prod(s.shape) * np.dtype(s.dtype).itemsize) for s in schema.values())


def empty_like_schema(schema: dict) -> dict[str, np.ndarray]:
    """One set of aligned, pre-touched buffers matching `schema` ({name: ShapeDtypeStruct})."""
    return carve(slab(slab_bytes(schema)), schema)


class BufferPool:
    """`count` reusable buffer sets for one schema; `acquire` blocks until a set is free.

    >>> pool = BufferPool(store.schema("block.0", "compute"), count=2)
    >>> bufs = pool.acquire()
    >>> store.read("block.0", "compute", out=bufs).result()
    >>> ...                     # use bufs; release only when nothing reads them any more
    >>> pool.release(bufs)

    On the CPU backend `jax.device_put` of these buffers aliases them: release a set only
    after every computation that reads its device copy has finished.
    """

    def __init__(self, schema: dict, count: int = 2):
        if count < 1:
            raise ValueError("a BufferPool needs at least one buffer set")
        self.schema = dict(schema)
        self.nbytes = slab_bytes(self.schema) * count
        self._free: queue.Queue = queue.Queue()
        self._ids = set()
        for _ in range(count):
            bufs = empty_like_schema(self.schema)
            self._ids.add(self._key(bufs))
            self._free.put(bufs)

    @staticmethod
    def _key(bufs: dict) -> int:
        return next(iter(bufs.values())).ctypes.data if bufs else 0

    def acquire(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """A free buffer set (blocks while all are in use); raises queue.Empty on timeout."""
        return self._free.get(timeout=timeout)

    def release(self, bufs: dict[str, np.ndarray]) -> None:
        if self._key(bufs) not in self._ids:
            raise ValueError("release() got buffers that do not belong to this pool")
        self._free.put(bufs)
