"""Host<->device placement: the only module that calls `jax.device_put`.

Compute weights reach the device through a pool of reused, page-aligned, pre-touched
host buffers (fresh buffers pay page faults: 150-220 ms/GiB on the CPU machines). The
reuse rule: on the CPU backend `device_put` of an aligned buffer is zero-copy and
aliases it, and on a GPU the copy out of it is asynchronous, so a buffer is refilled
only after every computation that reads its device copy has finished (its fence).

Where the backend has a `pinned_host` memory kind and is not the CPU itself, weights go
host buffer -> pinned host array -> device, the fast DMA path, and kept activations and
gradients come back through pinned host memory.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from mtjax.stream.budget import DeviceLedger
from mtjax.stream.tiers import host_device

PAGE = 4096

# The reuse rule of the staging pool. Only tests turn it off, to show the corruption
# that follows when a buffer is refilled while a computation still reads it.
WAIT_FOR_READERS = True


def aligned_empty(shape, dtype) -> np.ndarray:
    """A page-aligned array, touched once so that later fills pay no page faults."""
    dtype = np.dtype(dtype)
    nbytes = max(int(np.prod(shape)) * dtype.itemsize, 1)
    raw = np.zeros(nbytes + PAGE, np.uint8)  # zeros: every page written once
    start = -raw.ctypes.data % PAGE
    return raw[start:start + nbytes].view(dtype)[: int(np.prod(shape))].reshape(shape)


def raise_host_memory_limit(nbytes: int) -> None:
    """Let XLA's pinned host pool hold `nbytes` (GPU; default cap 64 GiB).

    Takes effect only if the GPU backend has not started yet; otherwise export
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB before starting Python (experiments/gpu/smoke.sh does).
    """
    gib = -(-nbytes // 2**30)
    current = int(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64"))
    if gib > current:
        os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(gib)


@dataclasses.dataclass(eq=False)
class Slot:
    """One set of staging buffers, shaped like one part's compute weights."""

    key: tuple
    buffers: dict[str, np.ndarray]
    nbytes: int
    fence: list = dataclasses.field(default_factory=list)  # outputs of the last readers
    on_device: bool = False


def _key(schema: dict) -> tuple:
    return tuple((n, tuple(s.shape), np.dtype(s.dtype).str) for n, s in schema.items())


class Placement:
    """Moves arrays between host memory and one device."""

    def __init__(self, device: jax.Device | None = None):
        self.device = device or jax.devices()[0]
        kinds = {m.kind for m in self.device.addressable_memories()}
        # On the CPU backend the device memory is host memory: a pinned copy adds nothing.
        self.pinned = self.device.platform != "cpu" and "pinned_host" in kinds
        self.on_device = SingleDeviceSharding(self.device)
        self.host_kind = "pinned_host" if "pinned_host" in kinds else None
        self.on_host = SingleDeviceSharding(self.device, memory_kind=self.host_kind) if self.host_kind else None
        self.pinned_error = None
        if self.pinned:
            try:  # once, at start: a backend that lists pinned_host but cannot stage through it
                jax.block_until_ready(jax.device_put(jax.device_put(np.zeros(8, np.float32), self.on_host), self.on_device))
            except Exception as e:  # noqa: BLE001  fall back to plain transfers, and say why
                self.pinned, self.pinned_error = False, f"{type(e).__name__}: {e}"

    def to_device(self, buffers: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Staged host buffers -> device arrays (asynchronous; may alias the buffers)."""
        if self.pinned:
            buffers = jax.device_put(buffers, self.on_host)  # host buffer -> pinned: a host memcpy
        return jax.device_put(buffers, self.on_device)

    def tokens(self, tokens: np.ndarray) -> jax.Array:
        return jax.device_put(tokens, self.on_device)

    def start_to_host(self, tree):
        """Start copying device arrays to host memory; returns at once, with what to pass
        to `host_arrays`. With pinned staging the copy is one DMA into pinned host memory
        (the fast path; a plain device->numpy copy is several times slower on GPUs)."""
        if self.pinned:
            return jax.device_put(tree, self.on_host)
        for leaf in jax.tree.leaves(tree):
            leaf.copy_to_host_async()
        return tree

    def host_arrays(self, tree):
        """Arrays started by `start_to_host`, as arrays on the host CPU backend.

        Blocks until the copies are done: called on the gradient worker thread.
        """
        if self.device.platform == "cpu" and not self.pinned:
            return tree  # already in host RAM, on the CPU backend
        cpu = host_device()
        return jax.tree.map(lambda a: jax.device_put(np.asarray(a), cpu), tree)

    def stash(self, x: jax.Array) -> jax.Array:
        """A kept activation moved to host memory (activations=host); asynchronous."""
        return jax.device_put(x, self.on_host) if self.on_host else jax.device_put(x, host_device())

    def unstash(self, x: jax.Array) -> jax.Array:
        return jax.device_put(x, self.on_device)


class StagingPool:
    """Reused host staging buffers, one set per in-flight part, keyed by shapes."""

    def __init__(self, placement: Placement, ledger: DeviceLedger, max_slots: int = 4):
        self.placement, self.ledger = placement, ledger
        self.max_slots = max_slots  # per shape: more would only wait for readers anyway
        self._free: dict[tuple, list[Slot]] = {}
        self._count: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # slots created, for tests and the memory benchmark

    def acquire(self, schema: dict) -> Slot:
        """A slot for weights of this schema, safe to overwrite.

        Prefers a free slot whose readers have finished, then a new slot (up to
        `max_slots` per shape), then the free slot released longest ago.
        """
        key = _key(schema)
        with self._lock:
            free = self._free.setdefault(key, [])
            ready = [s for s in free if all(a.is_ready() for a in s.fence)]
            if ready or (free and self._count.get(key, 0) >= self.max_slots):
                slot = ready[0] if ready else free[0]
                free.remove(slot)
            else:
                slot = None
                self._count[key] = self._count.get(key, 0) + 1
        if slot is None:
            buffers = {n: aligned_empty(s.shape, s.dtype) for n, s in schema.items()}
            self.allocated += 1
            return Slot(key, buffers, sum(b.nbytes for b in buffers.values()))
        if WAIT_FOR_READERS:
            # Host sync (on the prefetch thread): the last computation reading this
            # buffer's device copy must finish before the buffer is refilled.
            jax.block_until_ready(slot.fence)
        slot.fence = []
        return slot

    def put(self, slot: Slot, what: str) -> dict[str, jax.Array]:
        """The slot's weights on the device, counted against the device budget."""
        self.ledger.hold(slot.nbytes, what)
        slot.on_device = True
        return self.placement.to_device(slot.buffers)

    def release(self, slot: Slot, fence) -> None:
        """Hand a slot back once its device copy is no longer needed; `fence` are the
        outputs of the last computations that read it."""
        if slot.on_device:
            self.ledger.free(slot.nbytes)
            slot.on_device = False
        slot.fence = [a for a in jax.tree.leaves(fence) if isinstance(a, jax.Array)]
        with self._lock:
            self._free.setdefault(slot.key, []).append(slot)
