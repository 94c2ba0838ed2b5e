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

Where the device's client can map host memory for its DMA engines (PJRT's `DmaMap`, the
client's `dma_map` in jaxlib; a GPU client), each staging buffer is mapped once, when
its pool makes it, and a mapped buffer goes to the device in one `device_put` that DMAs
straight out of it, with no copy into XLA's pinned pool. Where the client has no
`dma_map` or refuses it (the CPU: UNIMPLEMENTED), or refuses one buffer, that buffer
takes the path above; `Placement.mapped_error` says why.

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
import threading
import warnings

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from mtjax.hostmem import PAGE, BufferPool, aligned_empty, shape_key
from mtjax.observers import Observers
from mtjax.stream import schedule, step_parts
from mtjax.stream.budget import DeviceLedger
from mtjax.stream.mesh import DeviceMesh
from mtjax.stream.tiers import host_device

STAGE_THREADS = 4  # leaves of a part copied into pinned memory at once (a block has 7 large ones)


HOST_MEMORY_LIMIT = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # read once, when XLA's GPU client starts
DEFAULT_HOST_MEMORY_GIB = 64  # XLA's cap on its pinned host pool when the variable is unset


def pinned_host_bytes(cfg, stream, batch: int, seq: int, accum: int) -> int:
    """The pinned host memory a streamed run of `cfg` holds at once, from its settings
    alone (no JAX backend needed): the staging sets the step description gives
    (`schedule.staging_sets`) for a step that streams every part whole, plus every kept
    block input when activations wait in host memory (`traffic.h2d_activations`). The
    engine's own schedule stages no more: resident parts cross nothing, and a split
    block's sub-parts stage in its place."""
    groups = step_parts.groups(cfg.num_hidden_layers, stream.keep_every)
    sets = schedule.staging_sets(cfg, stream, groups, step_parts.train_parts(cfg, groups), {})
    kept = len(groups) * accum * batch * seq * cfg.hidden_size * np.dtype(cfg.compute_dtype).itemsize
    return sum(count * nbytes for _, count, nbytes in sets) + (kept if stream.activations == "host" else 0)


def raise_host_memory_limit(nbytes: int, started: bool | None = None) -> bool:
    """Let XLA's pinned host pool hold `nbytes` (GPU; default cap 64 GiB): raises
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, never lowers it. Returns whether the cap holds
    `nbytes`.

    XLA reads the variable once, when its GPU client starts, so `mtjax train` calls this
    before anything starts a JAX backend (mtjax.run.train, with `pinned_host_bytes`).
    Called after a backend started, it changes nothing; when the cap in force is too small
    it warns, in one line, what to export, and returns False. `started`: whether a backend
    has started (None: ask JAX).
    """
    gib = -(-nbytes // 2**30)
    current = int(os.environ.get(HOST_MEMORY_LIMIT, "").strip() or DEFAULT_HOST_MEMORY_GIB)
    if gib <= current:
        return True
    if started is None:
        from jax._src import xla_bridge  # JAX has no public "has a backend started" query

        started = xla_bridge.backends_are_initialized()
    if started:
        warnings.warn(f"XLA's pinned host pool is capped at {current} GiB, below the {gib} GiB staged through it; "
                      f"export {HOST_MEMORY_LIMIT}={gib} before starting Python", stacklevel=2)
        return False
    os.environ[HOST_MEMORY_LIMIT] = str(gib)
    return True


@dataclasses.dataclass(eq=False)
class Slot:
    """One set of staging buffers, shaped like one part's compute weights; or (`pooled`
    False) host arrays the device reads in place, not the pool's (`StagingPool.put_host`)."""

    buffers: dict[str, np.ndarray]
    nbytes: int
    on_device: bool = False
    pooled: bool = True


class Placement:
    """Moves arrays between host memory and the devices of `mesh` (default: `device` alone,
    or the first device)."""

    def __init__(self, device: jax.Device | None = None, pinned: bool | None = None,
                 threads: int = STAGE_THREADS, mesh: DeviceMesh | None = None, mapped: bool = True):
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
        self.client = self.device.client  # whose DMA engines read mapped buffers
        self._mapped: dict[int, int] = {}  # address -> bytes of the buffers mapped for the device's DMA
        self._map_lock = threading.Lock()  # buffers are made on the prefetch and update threads
        self.mapped, self.mapped_error = self._probe_dma_map() if mapped else (False, "not asked for")
        # Threads start on first use: none on the CPU path, which never stages through pinned memory.
        self._stagers = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="mtjax-stage") \
            if threads > 1 else None
        self._observers = Observers()

    @property
    def reads_host(self) -> bool:
        """Whether the device computes on host memory: the CPU backend, no pinned path.
        `device_put` of an aligned host array then makes a device array that aliases it
        (no copy), so the host array must not change while a program may read it."""
        return self.device.platform == "cpu" and not self.pinned

    def observe(self, fn):
        """Call fn(buffer) for every host buffer copied into pinned memory, on the thread
        that copies it, before it does (a buffer mapped for the device's DMA is not copied):
        a seam for tests of the staging threads and of the mapping. Returns the function
        that stops it."""
        return self._observers.add(fn)

    def _probe_dma_map(self) -> tuple[bool, str | None]:
        """Whether the client maps host memory for its DMA (tried once, on a page of our own)."""
        client = self.client
        if not hasattr(client, "dma_map"):
            return False, f"this jaxlib's {self.device.platform} client has no dma_map"
        probe = aligned_empty((PAGE,), np.uint8)
        try:
            client.dma_map(probe.ctypes.data, probe.nbytes)
            client.dma_unmap(probe.ctypes.data)
        except Exception as e:  # noqa: BLE001  XLA raises its own runtime error (UNIMPLEMENTED on the CPU)
            return False, f"{type(e).__name__}: {e}"
        return True, None

    def register(self, buffers: dict[str, np.ndarray]) -> None:
        """Map a new set of staging buffers for the device's DMA, once (where the client can):
        `to_device` then sends them without a copy into pinned memory. They must outlive
        the placement (a `BufferPool` keeps every set it makes); `close` unmaps them."""
        if not self.mapped:
            return
        for b in buffers.values():
            address = b.ctypes.data
            with self._map_lock:
                if address in self._mapped:
                    continue
                try:
                    self.client.dma_map(address, b.nbytes)
                except Exception as e:  # noqa: BLE001  this buffer keeps the pinned path
                    self.mapped_error = f"{type(e).__name__}: {e}"
                    continue
                self._mapped[address] = b.nbytes

    def is_mapped(self, buffer: np.ndarray) -> bool:
        return buffer.ctypes.data in self._mapped

    def _stage(self, buffer: np.ndarray) -> jax.Array:
        self._observers(buffer)
        pinned = jax.device_put(buffer, self.on_host)  # host buffer -> pinned: a host memcpy
        return jax.device_put(pinned, self.on_device)  # pinned -> device: a DMA, asynchronous

    def to_device(self, buffers: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Staged host buffers -> device arrays (the DMAs asynchronous; may alias the buffers).

        Returns once every leaf's bytes are out of `buffers` or owned by its device copy's
        pending transfer: the caller's fence (the readers of the device copy) covers them.
        """
        if not self.pinned or not buffers:
            return jax.device_put(buffers, self.on_device)
        direct = {n: b for n, b in buffers.items() if self.is_mapped(b)}  # DMA straight out of them
        out = jax.device_put(direct, self.on_device) if direct else {}
        rest = {n: b for n, b in buffers.items() if n not in direct}
        if self._stagers is None or len(rest) < 2:
            out.update({n: self._stage(b) for n, b in rest.items()})
        else:
            futures = {n: self._stagers.submit(self._stage, b) for n, b in rest.items()}
            out.update({n: f.result() for n, f in futures.items()})
        return {n: out[n] for n in buffers}

    def close(self) -> None:
        with self._map_lock:
            for address in self._mapped:
                try:
                    self.client.dma_unmap(address)
                except Exception:  # noqa: BLE001  at close: nothing else is left to do with it
                    pass
            self._mapped.clear()
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

    def __init__(self, placement: Placement, ledger: DeviceLedger, max_slots: int = 4,
                 wait_for_readers: bool = True):
        self.placement, self.ledger, self.max_slots = placement, ledger, max_slots
        self.wait_for_readers = wait_for_readers  # BufferPool's reuse rule; off only in the test that shows why
        self._pools: dict[tuple, BufferPool] = {}  # per shape: more sets would only wait for readers anyway

    def _new_pool(self, key: tuple, sets: int) -> BufferPool:
        # Each new buffer set is mapped for the device's DMA once, where the client can.
        pool = self._pools[key] = BufferPool(sets_per_shape=sets, on_new=self.placement.register,
                                             wait_for_readers=self.wait_for_readers)
        return pool

    def provide(self, schema: dict, sets: int) -> None:
        """Make `sets` buffer sets shaped like `schema` now (none beyond them later while
        fewer are held), unless that shape has its sets already."""
        key = shape_key(schema)
        if key in self._pools:
            return
        pool = self._new_pool(key, sets)
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
        key = shape_key(schema)
        pool = self._pools.get(key) or self._new_pool(key, self.max_slots)
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

    def put_host(self, arrays: dict[str, np.ndarray], what: str) -> tuple[Slot, dict[str, jax.Array]]:
        """Host arrays on the device with no staging slot (the CPU backend, where
        `device_put` aliases them: `Placement.reads_host`), counted against the device
        budget as a slot's weights are. Their owner must not change them before every
        program that reads them has finished: the engine's fp32 master weights, updated
        only after the step's gradients are in (mtjax.stream.stager)."""
        slot = Slot(dict(arrays), sum(np.asarray(a).nbytes for a in arrays.values()), pooled=False)
        self.ledger.hold(slot.nbytes, what, "weights")
        slot.on_device = True
        return slot, self.placement.to_device(slot.buffers)

    def forget_ready(self) -> None:
        """Let go of the computed outputs the free slots' fences hold (`BufferPool.forget_ready`)."""
        for pool in self._pools.values():
            pool.forget_ready()

    def release(self, slot: Slot, fence) -> None:
        """Hand a slot back once its device copy is no longer needed; `fence` are the
        outputs of the last computations that read it. None (a resident part's) is no slot."""
        if slot is None:
            return
        if slot.on_device:
            self.ledger.free(slot.nbytes, "weights")
            slot.on_device = False
        if slot.pooled:
            self._pools[shape_key(slot.buffers)].release(slot.buffers, fence)
