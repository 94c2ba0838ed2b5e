"""Host memory for the streaming engine: page-aligned buffers, huge-page arrays, and one
fenced pool of reused buffer sets.

A fresh numpy array pays a page fault on the first write to every page (150-220 ms per
GiB on the CPU machines), which costs more than reading the bytes from disk. So bytes
that arrive every step (staged compute weights, the optimizer's disk-tier reads) land in
buffers allocated once, aligned to a page (which also makes `device_put` of them
zero-copy on the CPU backend), touched once, and reused through `BufferPool`.

The pool's rule: a buffer set goes back into use only after the computations that read
it are done. On the CPU backend `device_put` of an aligned buffer aliases it, and on a
GPU the copy out of it is asynchronous, so `release(buffers, fence)` records the outputs
of the last readers and `acquire` waits for them before handing the set out again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import threading

import jax
import numpy as np

PAGE = 4096
HUGE_PAGE = 2 << 20

def aligned_empty(shape, dtype) -> np.ndarray:
    """A page-aligned array of zeros, every page already written (no page faults later)."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = max(count * dtype.itemsize, 1)
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    out = raw[start:start + nbytes]
    out.fill(0)  # np.zeros would not do: calloc leaves large mappings unfaulted
    return out.view(dtype)[:count].reshape(shape)


ALIAS_ALIGN = 64  # bytes: the alignment at which XLA's CPU client aliases a host array


def huge_empty(shape, dtype) -> np.ndarray:
    """An array for long-lived host state, on transparent huge pages where the kernel
    offers them (Linux, THP in "madvise" or "always" mode).

    A memory-bound pass over state on 2 MiB pages runs ~9% faster here than on 4 KiB
    pages (fewer TLB misses), and faulting it in costs about half. Arrays under 2 MiB,
    and systems without madvise, get np.empty's memory aligned to 64 bytes: the CPU
    backend's `device_put` aliases such an array instead of copying it (the staging of
    fp32 master weights, mtjax.stream.stager, relies on it).
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        raw = np.empty(nbytes + ALIAS_ALIGN, np.uint8)
        start = -raw.ctypes.data % ALIAS_ALIGN
        return raw[start:start + nbytes].view(dtype).reshape(shape)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE)  # anonymous; unmapped when the array is freed
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def fix_mmap_threshold(nbytes: int = 256 << 10) -> bool:
    """Serve every host allocation >= nbytes with its own mmap, returned on free (glibc).

    glibc raises its mmap threshold after large frees, after which transient
    multi-MiB buffers (optimizer outputs, gradients) come from heap arenas that do not
    shrink: host RSS then grows with depth. Fixing the threshold keeps it flat. Returns
    whether it was applied (False off glibc).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, int(nbytes)))  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


class ShapeKey(tuple):
    """`shape_key`'s tuple, which computes its hash once: a block of hundreds of experts
    has a key of thousands of leaves, and the planner looks one up for every transfer of
    every schedule it prices (mtjax.stream.schedule.staging_sets)."""

    def __hash__(self):
        if "hash" not in self.__dict__:
            self.__dict__["hash"] = tuple.__hash__(self)
        return self.__dict__["hash"]


def shape_key(arrays) -> ShapeKey:
    """What makes two buffer sets interchangeable: each leaf's name, shape and dtype."""
    return ShapeKey((n, tuple(a.shape), np.dtype(a.dtype).str) for n, a in arrays.items())


class BufferPool:
    """Reused sets of aligned buffers ({leaf: array}), keyed by the shapes they hold.

    >>> pool = BufferPool(sets_per_shape=2)
    >>> bufs = pool.acquire(store.schema("block.0", "compute"))
    >>> store.read("block.0", "compute", out=bufs).result()
    >>> y = f(jax.device_put(bufs))      # asynchronous; may alias bufs
    >>> pool.release(bufs, fence=y)      # bufs are reused only once y is ready

    `acquire` prefers a free set whose readers have finished, then a new set (up to
    `sets_per_shape` per shape, or what `provide` said for that shape), then waits for the
    free set released longest ago. With none free it makes a new one: a caller holding
    every set never waits on itself. A free set's fence lets go of each array once it is
    computed (at the next acquire or release, or `forget_ready`).
    """

    def __init__(self, sets_per_shape: int = 1, on_new=None, wait_for_readers: bool = True):
        self.sets_per_shape = sets_per_shape
        self.on_new = on_new  # called with each new set, once (staging maps it for the device's DMA)
        # The reuse rule: a set is handed out again only once its fence is ready. Off only
        # to show the corruption that follows when a buffer is refilled while read.
        self.wait_for_readers = wait_for_readers
        self._free: dict[tuple, list[tuple[dict, list]]] = {}  # released (set, fence), oldest first
        self._made: dict[tuple, int] = {}
        self._sets: dict[tuple, int] = {}  # sets of a shape `provide` made, instead of `sets_per_shape`
        self._lock = threading.Lock()  # acquire and release run on different threads
        self.allocated = 0  # sets made, for tests and the memory benchmark
        self.allocated_bytes = 0  # their bytes

    def provide(self, schema: dict, sets: int) -> None:
        """Make `sets` buffer sets shaped like `schema` now, the most that shape gets while
        fewer are held, unless that shape has its sets already."""
        key = shape_key(schema)
        with self._lock:
            if key in self._sets:
                return
            self._sets[key] = sets
        made = [self.acquire(schema) for _ in range(sets - self._made.get(key, 0))]
        for buffers in made:
            self.release(buffers)

    def _most(self, key: tuple) -> int:
        return self._sets.get(key, self.sets_per_shape)

    def acquire(self, schema: dict) -> dict[str, np.ndarray]:
        """A buffer set shaped like `schema` ({leaf: ShapeDtypeStruct}), safe to overwrite."""
        key = shape_key(schema)
        with self._lock:
            self._forget_ready()
            free = self._free.setdefault(key, [])
            pick = next((i for i, (_, fence) in enumerate(free) if not fence), None)  # readers done
            if pick is None and free and self._made.get(key, 0) >= self._most(key):
                pick = 0
            if pick is None:
                self._made[key] = self._made.get(key, 0) + 1
                self.allocated += 1
                self.allocated_bytes += sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in schema.values())
            else:
                buffers, fence = free.pop(pick)
        if pick is None:
            buffers = {n: aligned_empty(s.shape, s.dtype) for n, s in schema.items()}
            if self.on_new is not None:
                self.on_new(buffers)
            return buffers
        if self.wait_for_readers:
            # Host sync (on the caller's thread, the prefetch or update worker): the last
            # computation reading these buffers, or their device copy, must be done.
            jax.block_until_ready(fence)
        return buffers

    def spare(self, schema: dict) -> bool:
        """Whether a set shaped like `schema` can be acquired while fewer than the sets of
        that shape (`sets_per_shape`, or `provide`'s) are held (acquired and not released)."""
        key = shape_key(schema)
        with self._lock:
            return self._made.get(key, 0) - len(self._free.get(key, [])) < self._most(key)

    def release(self, buffers: dict[str, np.ndarray], fence=()) -> None:
        """Hand a set back; `fence` (any pytree) holds the outputs of the last
        computations that read it or its device copy. Non-jax leaves are already done."""
        fence = [a for a in jax.tree.leaves(fence) if isinstance(a, jax.Array)]
        with self._lock:
            self._forget_ready()
            self._free.setdefault(shape_key(buffers), []).append((buffers, fence))

    def forget_ready(self) -> None:
        """Let go of the fence arrays already computed (every set's readers done: a step's end)."""
        with self._lock:
            self._forget_ready()

    def _forget_ready(self) -> None:
        # A fence holds its readers' outputs (a step's hidden states, on the device) only
        # until they are computed: kept longer, they stayed alive until the set's next
        # acquire, the next step, outside every device plan. An empty fence is a ready one.
        for free in self._free.values():
            for i, (buffers, fence) in enumerate(free):
                pending = [a for a in fence if not a.is_ready()]
                if len(pending) < len(fence):
                    free[i] = (buffers, pending)
