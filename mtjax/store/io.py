"""A store's chunk I/O: reads and writes of one slot of a (part, kind), in issue order.

    io.read(part, kind, slot, out)            Future[{leaf: array}]
    io.write(part, kind, slot, values, claim) Future[None]; `claim()` runs once the slot's
                                              arrays exist, before the write is queued
    io.wait(); io.io_bytes; io.files(part, kind, slot); io.sync(files, dirs)

Chunk I/O is disk-bound (preadv, pwritev, fsync and crc32c release the GIL): a few chunks
in flight keep the disk busy while the caller computes. Reads have threads of their own:
one the next computation waits for never queues behind the writes of a step's updates,
which nothing waits for until the commit. The reads and writes of one (part, kind) are
chained: each starts after the previous one finished. A failed write marks the store
broken (`check_usable` refuses from then on): no partial step may be committed.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from pathlib import Path

import numpy as np

from mtjax.store import arrays, chunks, durable, layout, manifest
from mtjax.store.errors import StoreError

IO_THREADS = 4


def _rows(handle) -> int:
    """Rows per stored chunk (1 for a scalar)."""
    shape = handle.chunk_layout.read_chunk.shape
    return int(shape[0]) if shape else 1


def ts_message(e: BaseException) -> str:
    return str(e).split(" [tensorstore_spec=")[0]  # drop the multi-KB spec dump


def _outcome(fut: concurrent.futures.Future) -> concurrent.futures.Future:
    """A future that finishes when `fut` does, with its exception but without its result."""
    done = concurrent.futures.Future()

    def copy(f):
        if f.cancelled():
            done.cancel()
        elif f.exception() is not None:
            done.set_exception(f.exception())
        else:
            done.set_result(None)

    fut.add_done_callback(copy)
    return done


class StoreIO:
    """The I/O of one open store (`store`: its root, step, generation and schemas)."""

    def __init__(self, store):
        self.store = store
        self.broken: str | None = None  # why the store refuses to commit until reopened
        self._arrays = arrays.ArrayCache(store.chunk_bytes)
        self._io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="mtjax-store-read")
        self._write_io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="mtjax-store-write")
        self._writeback = durable.Writeback()  # off the I/O threads: a read never queues behind it
        self._chains: dict[tuple[str, str], concurrent.futures.Future] = {}  # the last I/O of each (part, kind)
        self._bytes = [0, 0]  # tensor bytes read, written (finished operations)
        self._lock = threading.Lock()

    def check_usable(self) -> None:
        if self.broken:
            raise StoreError(f"{self.broken}; close and reopen store {self.store.root} to continue from step "
                             f"{self.store.step}")
        if self._arrays is None:
            raise StoreError(f"store {self.store.root} is closed")

    def handles(self, part: str, kind: str, slot: str, create: bool) -> dict:
        store, handles = self.store, {}
        for leaf, s in store.schema(part, kind).items():
            path = layout.slot_dir(store.root, part, kind, slot) / leaf
            try:
                handles[leaf] = self._arrays.get(path, s.shape, s.dtype, create)
            except ValueError as e:
                if create:  # e.g. a full disk while creating the uncommitted slot's array
                    raise StoreError(f"store {store.root}: {part} {kind} tensor {leaf} cannot be created "
                                     f"({ts_message(e)}); the committed step {store.step} is intact") from None
                raise StoreError(f"store {store.root}: {part} {kind} tensor {leaf} cannot be opened "
                                 f"({ts_message(e)}); restore the store from a backup") from None
        return handles

    def check_arrays(self, part: str, kind: str, given: dict, what: str, some: bool = False) -> None:
        """`given` matches the part's schema: every leaf (`some`: a non-empty subset of them)."""
        schema = self.store.schema(part, kind)
        missing, extra = sorted(set(schema) - set(given)), sorted(set(given) - set(schema))
        if some and given:
            schema, missing = {n: schema[n] for n in given if n in schema}, []
        if missing or extra:
            raise StoreError(f"{what} for {part} {kind} does not match the store: missing {missing}, extra {extra}")
        for leaf, s in schema.items():
            a = given[leaf]
            if not isinstance(a, np.ndarray) or a.shape != tuple(s.shape) or a.dtype != s.dtype:
                got = f"{getattr(a, 'shape', '?')} {getattr(a, 'dtype', type(a).__name__)}"
                raise StoreError(f"{what} for {part} {kind} tensor {leaf}: expected a numpy array "
                                 f"{tuple(s.shape)} {np.dtype(s.dtype).name}, got {got}")

    def read(self, part: str, kind: str, slot: str, out: dict | None) -> concurrent.futures.Future:
        store = self.store
        if out is None:
            out = {leaf: np.empty(s.shape, s.dtype) for leaf, s in store.schema(part, kind).items()}
        else:  # every leaf, or some of them (a split MoE block's sub-part)
            self.check_arrays(part, kind, out, "read buffers", some=True)
            bad = [leaf for leaf, a in out.items() if not (a.flags.c_contiguous and a.flags.writeable)]
            if bad:
                raise StoreError(f"read buffers for {part} {kind} must be writable and C-contiguous: {bad}")
        handles = self.handles(part, kind, slot, create=False)  # checks each zarr.json once per session

        def on_error(leaf, e):
            return StoreError(f"store {store.root}: {part} {kind} tensor {leaf} (slot {slot}) is corrupt or "
                              f"unreadable ({ts_message(e)}); restore the store from a backup")

        def start():
            base = layout.slot_dir(store.root, part, kind, slot)
            futs = [(leaf, f) for leaf, h in handles.items() if leaf in out
                    for f in chunks.read_into(self._io, base / leaf, _rows(h), out[leaf])]
            done = arrays.gather(futs, out, on_error)
            return done if store.writable else self._unless_committed_meanwhile(done)

        return self._counted(self._chain(part, kind, start), 0, sum(a.nbytes for a in out.values()))

    def _unless_committed_meanwhile(self, read: concurrent.futures.Future) -> concurrent.futures.Future:
        """A reader's result, unless a writer committed while it read.

        After a commit the writer reuses the slots this reader reads, so the bytes may mix
        two steps: fail rather than return them.
        """
        checked, store = concurrent.futures.Future(), self.store

        def check(f):
            if f.exception() is not None:
                return checked.set_exception(f.exception())
            try:
                now = manifest.read(store.root).generation
            except StoreError as e:
                return checked.set_exception(e)
            if now != store.generation:
                return checked.set_exception(StoreError(
                    f"store {store.root} was committed by its writer while this read ran; "
                    "call refresh() (or reopen the store) and read again"))
            checked.set_result(f.result())

        read.add_done_callback(check)
        return checked

    def write(self, part: str, kind: str, slot: str, values: dict, claim, carry_from: str | None = None
              ) -> concurrent.futures.Future:
        """Write `values` into `slot`; the schema's leaves not in `values` are carried from
        slot `carry_from` (when given): their chunk files hard-linked, no byte written."""
        store = self.store
        try:
            handles = self.handles(part, kind, slot, create=True)
            if not handles:  # a kind with no leaves (a frozen part's master, mtjax.roles): an empty slot
                layout.slot_dir(store.root, part, kind, slot).mkdir(parents=True, exist_ok=True)
        except StoreError as e:
            self.broken = self.broken or f"creating {part} {kind} failed ({e})"  # no partial step may commit
            raise

        def on_error(leaf, e):
            msg = f"writing {part} {kind} tensor {leaf} failed ({ts_message(e)})"
            self.broken = self.broken or msg  # the slot is half-written: refuse to commit it
            return StoreError(f"store {store.root}: {msg}; the committed step {store.step} is intact")

        def start():
            base = layout.slot_dir(store.root, part, kind, slot)
            futs = [(leaf, f) for leaf, h in handles.items() if leaf in values
                    for f in chunks.write_from(self._write_io, base / leaf, _rows(h), values[leaf], self._writeback)]
            carried = [leaf for leaf in handles if leaf not in values]
            if carried and carry_from is not None:
                futs.append((carried[0], self._write_io.submit(self._link, part, kind, carry_from, slot, carried)))
            return arrays.gather(futs, None, on_error)

        claim()
        return self._counted(self._chain(part, kind, start), 1, sum(a.nbytes for a in values.values()))

    def _link(self, part: str, kind: str, src: str, dst: str, leaves: list[str]) -> None:
        """Leaves `leaves` of slot `dst` become slot `src`'s: each chunk file a hard link of
        its (a leaf never rewritten, e.g. a frozen leaf's compute copy, mtjax.roles)."""
        schema = self.store.schema(part, kind)
        for leaf in leaves:
            s, rows = schema[leaf], _rows(self.handles(part, kind, src, create=False)[leaf])
            have = chunks.files(layout.slot_dir(self.store.root, part, kind, src) / leaf, tuple(s.shape),
                                np.dtype(s.dtype).itemsize, rows)
            for f in have:
                to = layout.slot_dir(self.store.root, part, kind, dst) / leaf / f.name
                if to.exists() and os.path.samefile(f, to):
                    continue
                tmp = to.with_name(to.name + ".link")
                tmp.unlink(missing_ok=True)
                os.link(f, tmp)
                os.replace(tmp, to)

    def _counted(self, fut: concurrent.futures.Future, which: int, nbytes: int) -> concurrent.futures.Future:
        def count(f):
            if not f.cancelled() and f.exception() is None:
                with self._lock:
                    self._bytes[which] += nbytes

        fut.add_done_callback(count)
        return fut

    @property
    def io_bytes(self) -> tuple[int, int]:
        with self._lock:
            return tuple(self._bytes)

    def _chain(self, part: str, kind: str, start) -> concurrent.futures.Future:
        """Start after the previous read or write of the same (part, kind) finished.
        The chain keeps each operation's outcome, not its result: a read's arrays live
        only as long as its caller holds them (a reader going part by part, as export
        does, held every part's last read)."""
        with self._lock:
            fut = arrays.after(self._chains.get((part, kind)), start)
            self._chains[(part, kind)] = _outcome(fut)
        return fut

    def pending(self, part: str | None = None) -> list[concurrent.futures.Future]:
        """The last I/O of each (part, kind): all of them, or `part`'s."""
        with self._lock:
            return [f for (p, _), f in self._chains.items() if part is None or p == part]

    def wait(self) -> None:
        """Block until every pending read and write has finished; raise the first failure."""
        errors = [f.exception() for f in concurrent.futures.wait(self.pending()).done if f.exception() is not None]
        with self._lock:
            self._chains = {k: f for k, f in self._chains.items() if not f.done()}
        if errors:
            raise errors[0]

    def files(self, part: str, kind: str, slot: str) -> list[Path]:
        """Every chunk file of one (part, kind)'s slot."""
        base, schema = layout.slot_dir(self.store.root, part, kind, slot), self.store.schema(part, kind)
        return [f for leaf, h in self.handles(part, kind, slot, create=False).items()
                for f in chunks.files(base / leaf, tuple(schema[leaf].shape), np.dtype(schema[leaf].dtype).itemsize,
                                      _rows(h))]

    def sync(self, files: list[Path], dirs: list[Path]) -> None:
        """Make what a commit is about to name durable: its files' data and their names
        (writes only started their writeback; mtjax.store.durable)."""
        try:
            durable.sync(self._io, files, dirs)
        except OSError as e:
            raise StoreError(f"could not make the writes to store {self.store.root} durable ({e}); "
                             f"the committed step {self.store.step} is intact, commit again") from None

    def close(self) -> None:
        """Wait for pending I/O, then stop the I/O threads."""
        try:
            concurrent.futures.wait(self.pending())
        finally:
            self._arrays = None
            for pool in (self._io, self._write_io):
                pool.shutdown(wait=True)
            self._writeback.close()
