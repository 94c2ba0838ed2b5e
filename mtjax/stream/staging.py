"""Host<->device placement: staging slots and the transfers between host memory and the device.

Compute weights reach the device through staging slots: buffer sets from a
`mtjax.hostmem.BufferPool`, page-aligned and pre-touched (fresh buffers pay page faults:
150-220 ms/GiB on the CPU machines), reused under the pool's fence rule (a set is
refilled only after every computation that reads its device copy has finished). The
staging pool also counts staged weights against the device budget.

Where the backend has a `pinned_host` memory kind and is not the CPU itself, weights go
host buffer -> pinned host array -> device, the fast DMA path, and kept activations and
gradients come back through pinned host memory. The first leg is a host memcpy and the
slow one (9.7 GB/s on the H200 host against 52 GB/s for the DMA, docs/benchmarks.md),
and staging a part as one `device_put` ran the two legs one after the other (8.1 GB/s).
So each leaf of a part is staged on a thread of its own: the leaves' copies into pinned
memory run in parallel, and each leaf's DMA starts as soon as its own copy is done,
under the copies of the others.

Over several devices (a `mtjax.stream.mesh.DeviceMesh`) weights are replicated, one
`device_put` putting a whole copy on every device (through one pinned copy where
pinned), a micro-batch's inputs and kept activations are split along the batch axis,
and a gradient (replicated: summed over the devices inside the program that made it)
leaves from the first device only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from mtjax.hostmem import BufferPool, shape_key
from mtjax.stream.budget import DeviceLedger
from mtjax.stream.mesh import DeviceMesh
from mtjax.stream.tiers import host_device

STAGE_THREADS = 4  # leaves of a part copied into pinned memory at once (a block has 7 large ones)


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

    buffers: dict[str, np.ndarray]
    nbytes: int
    on_device: bool = False


class Placement:
    """Moves arrays between host memory and the devices of `mesh` (default: `device` alone,
    or the first device)."""

    def __init__(self, device: jax.Device | None = None, pinned: bool | None = None,
                 threads: int = STAGE_THREADS, mesh: DeviceMesh | None = None):
        self.mesh = mesh or DeviceMesh([device or jax.local_devices()[0]])
        self.device = self.mesh.devices[0]
        kinds = {m.kind for m in self.device.addressable_memories()}
        # On the CPU backend the device memory is host memory: a pinned copy adds nothing
        # (`pinned=True` forces the path anyway, for tests of the GPU path on the CPU).
        self.pinned = (self.device.platform != "cpu" if pinned is None else pinned) and "pinned_host" in kinds
        self.on_device = self.mesh.replicated  # weights: a whole copy on every device
        self.on_batch = self.mesh.batch  # tokens and hidden states: rows split over the devices
        self.host_kind = "pinned_host" if "pinned_host" in kinds else None
        # Weights and gradients pass through one pinned copy, the first device's.
        self.on_host = SingleDeviceSharding(self.device, memory_kind=self.host_kind) if self.host_kind else None
        self.batch_on_host = self.on_batch.with_memory_kind(self.host_kind) if self.host_kind else None
        self.pinned_error = None
        if self.pinned:
            try:  # once, at start: a backend that lists pinned_host but cannot stage through it
                jax.block_until_ready(jax.device_put(jax.device_put(np.zeros(8, np.float32), self.on_host), self.on_device))
            except Exception as e:  # noqa: BLE001  fall back to plain transfers, and say why
                self.pinned, self.pinned_error = False, f"{type(e).__name__}: {e}"
        # Threads start on first use: none on the CPU path, which never stages through pinned memory.
        self._stagers = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mtjax-stage") \
            if threads > 1 else None

    def _stage(self, buffer: np.ndarray) -> jax.Array:
        pinned = jax.device_put(buffer, self.on_host)  # host buffer -> pinned: a host memcpy
        return jax.device_put(pinned, self.on_device)  # pinned -> device: a DMA, asynchronous

    def to_device(self, buffers: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Staged host buffers -> device arrays (the DMAs asynchronous; may alias the buffers).

        Returns once every leaf's bytes are out of `buffers` or owned by its device copy's
        pending transfer: the caller's fence (the readers of the device copy) covers them.
        """
        if not self.pinned:
            return jax.device_put(buffers, self.on_device)
        if self._stagers is None or len(buffers) < 2:
            return {n: self._stage(b) for n, b in buffers.items()}
        futures = {n: self._stagers.submit(self._stage, b) for n, b in buffers.items()}
        return {n: f.result() for n, f in futures.items()}

    def close(self) -> None:
        if self._stagers is not None:
            self._stagers.shutdown(wait=True)
            self._stagers = None

    def tokens(self, inputs):
        """A micro-batch's inputs (arrays [batch, ...]) on the devices, rows split over them."""
        return jax.device_put(inputs, self.on_batch)

    def start_to_host(self, tree):
        """Start copying device arrays to host memory; returns at once, with what to pass
        to `host_arrays`. With pinned staging the copy is one DMA into pinned host memory
        (the fast path; a plain device->numpy copy is several times slower on GPUs).
        Replicated arrays leave once, from the first device."""
        tree = self.mesh.one_copy(tree)
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

    def to_host(self, flat: dict[str, jax.Array]) -> dict[str, np.ndarray]:
        """Numpy copies of device arrays (a resident part's state for a commit); waits."""
        return {n: np.array(a) for n, a in flat.items()}

    def stash(self, x: jax.Array) -> jax.Array:
        """A kept activation moved to host memory (activations=host); asynchronous."""
        return jax.device_put(x, self.batch_on_host) if self.on_host else jax.device_put(x, host_device())

    def unstash(self, x: jax.Array) -> jax.Array:
        return jax.device_put(x, self.on_batch)


class StagingPool:
    """Staging slots for the parts in flight: host buffers from fenced pools, one per
    shape, and the device ledger's count of the weights staged from them.

    `provide` makes a shape's sets up front, as many as the step's schedule says
    (`schedule.staging_sets`); a shape no schedule named gets up to `max_slots` sets,
    made on demand."""

    def __init__(self, placement: Placement, ledger: DeviceLedger, max_slots: int = 4):
        self.placement, self.ledger, self.max_slots = placement, ledger, max_slots
        self._pools: dict[tuple, BufferPool] = {}  # per shape: more sets would only wait for readers anyway

    def provide(self, schema: dict, sets: int) -> None:
        """Make `sets` buffer sets shaped like `schema` now (none beyond them later while
        fewer are held), unless that shape has its sets already."""
        key = shape_key(schema)
        if key in self._pools:
            return
        pool = self._pools[key] = BufferPool(sets_per_shape=sets)
        made = [pool.acquire(schema) for _ in range(sets)]
        for buffers in made:
            pool.release(buffers)

    @property
    def allocated(self) -> int:
        """Slots created, for tests and the memory benchmark."""
        return sum(p.allocated for p in self._pools.values())

    @property
    def allocated_bytes(self) -> int:
        """Host bytes of every slot created."""
        return sum(p.allocated * sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in key)
                   for key, p in self._pools.items())

    def acquire(self, schema: dict) -> Slot:
        """A slot for weights of this schema, safe to overwrite (waits for the readers of
        a reused one: see `BufferPool.acquire`)."""
        pool = self._pools.get(shape_key(schema)) or self._pools.setdefault(shape_key(schema),
                                                                             BufferPool(sets_per_shape=self.max_slots))
        buffers = pool.acquire(schema)
        return Slot(buffers, sum(b.nbytes for b in buffers.values()))

    def put(self, slot: Slot, what: str, leaves=None) -> dict[str, jax.Array]:
        """The slot's weights on the device (only `leaves` of them when given), counted
        against the device budget."""
        buffers = slot.buffers if leaves is None else {n: slot.buffers[n] for n in leaves}
        slot.nbytes = sum(b.nbytes for b in buffers.values())
        self.ledger.hold(slot.nbytes, what, "weights")
        slot.on_device = True
        return self.placement.to_device(buffers)

    def release(self, slot: Slot, fence) -> None:
        """Hand a slot back once its device copy is no longer needed; `fence` are the
        outputs of the last computations that read it. None (a resident part's) is no slot."""
        if slot is None:
            return
        if slot.on_device:
            self.ledger.free(slot.nbytes, "weights")
            slot.on_device = False
        self._pools[shape_key(slot.buffers)].release(slot.buffers, fence)
