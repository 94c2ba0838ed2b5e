"""The layer store: every part's compute weights, fp32 master and optimizer state on disk.

    store = mtjax.store.create(path, cfg, tx=None)   # empty arrays, manifest at step 0
    store = mtjax.store.open(path, writable=True)    # .config, .step, .parts
    fut = store.read(part, kind, out=None)           # Future[{leaf: np.ndarray}]
    fut = store.write(part, kind, arrays)            # Future[None], to the uncommitted slot
    store.commit(step, train_state=None)             # atomic: all of the step or none of it
    store.commit_part(part)                          # one-copy stores: one part's update

Each (part, kind) has two slots, "a" and "b". Writes go to the slot the committed
manifest does not name; reads see the latest write; `commit` makes the written slots
(and the train state) current by atomically replacing the manifest. A one-copy store
(`copies=1`) frees the old slot as soon as a part's new state is committed, and commits
each step as "the state before the update + the pending gradients". docs/store.md has
the whole protocol and why a crash at any moment leaves a consistent store.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import threading
import uuid
from pathlib import Path

import numpy as np

from mtjax import model_config
from mtjax import parts as model_parts
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.shard import Shard
from mtjax.store import arrays, chunks, durable, layout, manifest
from mtjax.store.durable import fsync_path
from mtjax.store import train_state as saved_state
from mtjax.store.errors import StoreError
from mtjax.store.lock import WriterLock


IO_THREADS = 4


def _part_name(part) -> str:
    return part.name if isinstance(part, model_parts.Part) else str(part)


def _rows(handle) -> int:
    """Rows per stored chunk (1 for a scalar)."""
    shape = handle.chunk_layout.read_chunk.shape
    return int(shape[0]) if shape else 1


def _ts_message(e: BaseException) -> str:
    return str(e).split(" [tensorstore_spec=")[0]  # drop the multi-KB spec dump


class Store:
    """An open store. Use `create` or `open`, not this constructor."""

    def __init__(self, root: Path, writable: bool, config: ModelConfig | None = None):
        self.root = Path(root)
        self.writable = writable
        self._lock = WriterLock(self.root) if writable else None
        try:
            self._manifest = manifest.read(self.root)
            self._check_identity()
            if writable and (self.root / layout.PREPARED).exists():
                raise StoreError(f"store {self.root} is a shard of a multi-process run stopped inside a commit; "
                                 "resume the run with all of its processes")
            self._prepared: manifest.Manifest | None = None  # a shard's commit waiting for the other processes
            self.config = layout.config_from_json(self._manifest.config)
            self._schemas = self._read_schema()
            if config is not None and (diff := model_config.differences(self.config, config)):
                raise StoreError(f"store {self.root} was written for another model config ({', '.join(diff)}: "
                                 "the store's -> yours); use the store's settings or another store")
            self.parts = [p.name for p in model_parts.parts(self.config)]
            slots = self._manifest.slots
            if (not isinstance(slots, dict) or list(slots) != self.parts
                    or any(not isinstance(slots[p], dict) or set(slots[p]) != set(model_parts.KINDS)
                           or set(slots[p].values()) - {*layout.SLOTS, None} for p in self.parts)):
                raise StoreError(f"{self.root / layout.MANIFEST} has a malformed slot table; restore the store from a backup")
            self._latest = {(p, k): s for p, kinds in self._manifest.slots.items() for k, s in kinds.items()}
            self._pending: dict[tuple[str, str], concurrent.futures.Future] = {}
            self._dirty: set[tuple[str, str]] = set()
            self._arrays = arrays.ArrayCache()
            # Chunk I/O is disk-bound (preadv, pwritev, fsync and crc32c release the GIL): a few
            # chunks in flight keep the disk busy while the caller computes. Reads have threads
            # of their own: one the next computation waits for never queues behind the writes
            # of a step's updates, which nothing waits for until the commit.
            self._io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="mtjax-store-read")
            self._write_io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="mtjax-store-write")
            self._writeback = durable.Writeback()  # off the I/O threads: a read never queues behind it
            self._mutex = threading.Lock()
            self._broken: str | None = None
            self._on_phase = lambda phase: None  # test hook: called at each step of `commit`
            self._commit_mutex = threading.Lock()  # one manifest change at a time
            self._io_bytes = [0, 0]  # tensor bytes read, written (finished operations)
            self._committing = False  # a write issued during `commit` could land in a slot it frees
            # One-copy stores: part commits run in order, on their own thread, after the part's writes.
            self._committer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtjax-store-commit")
            self._part_commits: list[concurrent.futures.Future] = []
            self._check_copies()
            named = self._manifest.train_state
            if named is not None and not (self.root / layout.TRAIN_STATE_DIR / named).exists():
                # Checked before `clean`, which would otherwise delete this store's real train state.
                raise StoreError(f"{self.root / layout.MANIFEST} names train state {named}, which this store does "
                                 "not hold: the manifest comes from another store (or was damaged); put back this "
                                 "store's own manifest.json")
            if writable:
                saved_state.clean(self.root, keep=named)
                if self.copies == 1:
                    self._check_pending_format()
                    self._free_stale()
        except BaseException:
            self.close()
            raise

    def _check_identity(self) -> None:
        """A manifest copied from another store (even one at the same step) is refused."""
        id_file = self.root / layout.STORE_ID
        ours = id_file.read_text().strip() if id_file.exists() else None
        if ours is None and self._manifest.store_id is not None:  # stores made before STORE_ID have neither
            raise StoreError(f"store {self.root} has lost its {layout.STORE_ID} file, which identifies it; if "
                             f"{layout.MANIFEST} is this store's own, write its store_id back: "
                             f"echo {self._manifest.store_id} > {id_file}")
        if ours is not None and self._manifest.store_id != ours:
            raise StoreError(f"{self.root / layout.MANIFEST} comes from another store (id {self._manifest.store_id}, "
                             f"this store is {ours}); put back this store's own manifest.json")

    def _check_copies(self) -> None:
        m = self._manifest
        pending = m.pending
        ok = m.copies in (1, 2) and (pending is None or (
            m.copies == 1 and isinstance(pending, dict) and isinstance(pending.get("tag"), str)
            and isinstance(pending.get("parts"), list) and set(pending["parts"]) <= set(self.parts)
            and isinstance(pending.get("scale"), (int, float))))
        if not ok:
            raise StoreError(f"{self.root / layout.MANIFEST} has a malformed copies/pending entry; "
                             "restore the store from a backup")

    def _check_pending_format(self) -> None:
        """Pending gradients written before they carried a checksum cannot be checked."""
        version = self._manifest.layout_version
        if self.pending and version < layout.PENDING_CRC_VERSION:
            raise StoreError(f"store {self.root} (layout {version}) stopped mid-update with pending gradient files "
                             "in a format without checksums; finish the update with the mtjax that wrote it "
                             "(resume the run there), then continue with this one")

    def _free_stale(self) -> None:
        """One-copy stores: delete what no commit names (a crash can leave both behind):
        chunks of the slots the manifest does not name, and gradients of no pending update."""
        for part, kinds in self._manifest.slots.items():
            for kind, slot in kinds.items():
                if slot is not None:
                    self._free_slot(part, kind, layout.other_slot(slot))
        p = self._manifest.pending
        keep = {layout.pending_file(layout.pending_key(part, p["tag"]), leaf)
                for part in (p["parts"] if p else ()) for leaf in self.schema(part, "master")}
        pending_dir = self.root / layout.PENDING_DIR
        for f in pending_dir.iterdir() if pending_dir.is_dir() else ():
            if f.name not in keep:
                f.unlink(missing_ok=True)

    def _free_slot(self, part: str, kind: str, slot: str) -> None:
        base = layout.slot_dir(self.root, part, kind, slot)
        for leaf in self.schema(part, kind):
            for f in (base / leaf).glob("c*") if (base / leaf).is_dir() else ():
                f.unlink(missing_ok=True)  # chunk keys: "c" (a scalar) or "c.<i>...", and their temp files

    # --- what is stored ----------------------------------------------------------------

    @property
    def shard(self) -> Shard | None:
        """The rows of master and optimizer state this store holds (a multi-process run's
        shard, mtjax.store.shards); None: all of them."""
        h = self._manifest.hosts
        return None if h is None else Shard(int(h["index"]), int(h["count"]))

    @property
    def hosts(self) -> dict | None:
        """A shard's {"index", "count", "run"} (the run id every shard of a run shares)."""
        return None if self._manifest.hosts is None else dict(self._manifest.hosts)

    @property
    def generation(self) -> int:
        """+1 per commit (a shard's commits are named by it across the processes)."""
        return self._manifest.generation

    @property
    def copies(self) -> int:
        """2: every part has two slots (any commit interval); 1: one copy, committed every step."""
        return self._manifest.copies

    @property
    def pending(self) -> dict | None:
        """One-copy stores: {"tag", "parts", "scale"} of the committed gradients whose update
        has not been applied to `parts` yet (None or no parts: the state is complete)."""
        p = self._manifest.pending
        return dict(p, parts=list(p["parts"])) if p and p["parts"] else None

    @property
    def pending_dir(self) -> Path:
        """Where a one-copy store's trainer keeps gradient sums (file names: layout.pending_file)."""
        return self.root / layout.PENDING_DIR

    def check_complete(self, what: str) -> None:
        """Refuse to read weights that still wait for a committed update."""
        if self.pending:
            raise StoreError(f"store {self.root} holds step {self.step} with its last optimizer update still to be "
                             f"applied to {len(self.pending['parts'])} part(s) (its run stopped mid-step); resume the "
                             f"run with `mtjax train ... --run.resume=true` to finish it, then {what}")

    @property
    def step(self) -> int:
        """The last committed step."""
        return self._manifest.step

    @property
    def never_written(self) -> bool:
        """No state was ever committed: a store created and left before its first commit."""
        return all(slot is None for kinds in self._manifest.slots.values() for slot in kinds.values())

    def _read_schema(self) -> dict:
        path = self.root / layout.SCHEMA
        if not path.exists():
            raise StoreError(f"store {self.root} has lost its {layout.SCHEMA} file (the shape and dtype of every "
                             f"array it holds): it cannot be opened; put back {layout.SCHEMA} from a backup of this "
                             "store")
        try:
            schemas = layout.schema_from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{path} is missing or corrupt ({e}); restore the store from a backup") from None
        for part in model_parts.parts(self.config):
            for kind in ("compute", "master"):
                derived = model_parts.schema(self.config, part.name, kind)
                if kind == "master" and self.shard is not None:
                    derived = self.shard.schema(derived)
                stored = schemas.get(part.name, {}).get(kind)
                if stored != derived:
                    raise StoreError(f"{path} does not match the store's model config at {part.name} {kind}; "
                                     "the store was assembled from different models")
        return schemas

    def schema(self, part, kind: str) -> dict:
        """{leaf: ShapeDtypeStruct} of one kind of state of one part."""
        part = _part_name(part)
        try:
            return dict(self._schemas[part][kind])
        except KeyError:
            raise StoreError(f"store {self.root} has no part {part!r} with state kind {kind!r}; "
                             f"parts are {self.parts[0]} ... {self.parts[-1]}, kinds {model_parts.KINDS}") from None

    def nbytes(self, kind: str | None = None, part=None) -> int:
        """Bytes of one committed copy of the state: all kinds, or one; all parts, or one."""
        names = self.parts if part is None else [_part_name(part)]
        kinds = model_parts.KINDS if kind is None else (kind,)
        return sum(model_parts.nbytes(self.schema(p, k)) for p in names for k in kinds)

    def disk_usage(self) -> int:
        """Bytes the store occupies on disk (both slots, train state and metadata)."""
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())

    # --- reads and writes ---------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken:
            raise StoreError(f"{self._broken}; close and reopen store {self.root} to continue from step {self.step}")
        if self._arrays is None:
            raise StoreError(f"store {self.root} is closed")

    def _handles(self, part: str, kind: str, slot: str, create: bool) -> dict:
        handles = {}
        for leaf, s in self.schema(part, kind).items():
            path = layout.slot_dir(self.root, part, kind, slot) / leaf
            try:
                handles[leaf] = self._arrays.get(path, s.shape, s.dtype, create)
            except ValueError as e:
                if create:  # e.g. a full disk while creating the uncommitted slot's array
                    raise StoreError(f"store {self.root}: {part} {kind} tensor {leaf} cannot be created "
                                     f"({_ts_message(e)}); the committed step {self.step} is intact") from None
                raise StoreError(f"store {self.root}: {part} {kind} tensor {leaf} cannot be opened "
                                 f"({_ts_message(e)}); restore the store from a backup") from None
        return handles

    def _check_arrays(self, part: str, kind: str, given: dict, what: str, some: bool = False) -> None:
        """`given` matches the part's schema: every leaf (`some`: a non-empty subset of them)."""
        schema = self.schema(part, kind)
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

    def read(self, part, kind: str, out: dict | None = None) -> concurrent.futures.Future:
        """Future of {leaf: array}: the latest written (else committed) state of a part.

        `out` ({leaf: preallocated C-contiguous array}, e.g. from mtjax.hostmem.BufferPool) is filled
        in place and returned; without it fresh arrays are allocated (slower: page faults).
        """
        part = _part_name(part)
        self._check_usable()
        self.schema(part, kind)  # an unknown part or kind fails here, with the valid names
        slot = self._latest.get((part, kind))
        if slot is None:
            raise StoreError(f"store {self.root}: {part} {kind} has never been written; "
                             "fill the store with `mtjax init` or `mtjax import`")
        if out is None:
            out = {leaf: np.empty(s.shape, s.dtype) for leaf, s in self.schema(part, kind).items()}
        else:  # every leaf, or some of them (a split MoE block's sub-part)
            self._check_arrays(part, kind, out, "read buffers", some=True)
            bad = [leaf for leaf, a in out.items() if not (a.flags.c_contiguous and a.flags.writeable)]
            if bad:
                raise StoreError(f"read buffers for {part} {kind} must be writable and C-contiguous: {bad}")
        handles = self._handles(part, kind, slot, create=False)  # checks each zarr.json once per session

        def on_error(leaf, e):
            return StoreError(f"store {self.root}: {part} {kind} tensor {leaf} (slot {slot}) is corrupt or "
                              f"unreadable ({_ts_message(e)}); restore the store from a backup")

        def start():
            base = layout.slot_dir(self.root, part, kind, slot)
            futs = [(leaf, f) for leaf, h in handles.items() if leaf in out
                    for f in chunks.read_into(self._io, base / leaf, _rows(h), out[leaf])]
            done = arrays.gather(futs, out, on_error)
            return done if self.writable else self._unless_committed_meanwhile(done)

        return self._counted(self._chain(part, kind, start), 0, sum(a.nbytes for a in out.values()))

    def _unless_committed_meanwhile(self, read: concurrent.futures.Future) -> concurrent.futures.Future:
        """A reader's result, unless a writer committed while it read.

        After a commit the writer reuses the slots this reader reads, so the bytes may mix
        two steps: fail rather than return them.
        """
        checked = concurrent.futures.Future()

        def check(f):
            if f.exception() is not None:
                return checked.set_exception(f.exception())
            try:
                now = manifest.read(self.root).generation
            except StoreError as e:
                return checked.set_exception(e)
            if now != self._manifest.generation:
                return checked.set_exception(StoreError(
                    f"store {self.root} was committed by its writer while this read ran; "
                    "call refresh() (or reopen the store) and read again"))
            checked.set_result(f.result())

        read.add_done_callback(check)
        return checked

    def refresh(self) -> None:
        """Read-only stores: move to the latest committed step (reads see it from now on)."""
        if self.writable:
            raise StoreError("refresh() is for read-only stores; a writer's view is always current")
        self._manifest = manifest.read(self.root)
        with self._mutex:
            self._latest = {(p, k): s for p, kinds in self._manifest.slots.items() for k, s in kinds.items()}

    def write(self, part, kind: str, values: dict) -> concurrent.futures.Future:
        """Future that resolves once every chunk is written to the uncommitted slot (durable
        at the commit that names it).

        `values` must hold every leaf of `schema(part, kind)` with its exact shape and
        dtype; keep the arrays unchanged until the future resolves.
        """
        part = _part_name(part)
        self._check_usable()
        if not self.writable:
            raise StoreError(f"store {self.root} is open read-only; open it with writable=True to write")
        self._check_arrays(part, kind, values, "write")
        slot = layout.other_slot(self._manifest.slots[part][kind])
        try:
            handles = self._handles(part, kind, slot, create=True)
        except StoreError as e:
            self._broken = self._broken or f"creating {part} {kind} failed ({e})"  # no partial step may commit
            raise

        def on_error(leaf, e):
            msg = f"writing {part} {kind} tensor {leaf} failed ({_ts_message(e)})"
            self._broken = self._broken or msg  # the slot is half-written: refuse to commit it
            return StoreError(f"store {self.root}: {msg}; the committed step {self.step} is intact")

        def start():
            base = layout.slot_dir(self.root, part, kind, slot)
            futs = [(leaf, f) for leaf, h in handles.items()
                    for f in chunks.write_from(self._write_io, base / leaf, _rows(h), values[leaf], self._writeback)]
            return arrays.gather(futs, None, on_error)

        with self._mutex:
            if self._committing or self._prepared is not None:
                raise StoreError(f"store {self.root}: {part} {kind} was written while a commit ran; "
                                 "finish every write before calling commit")
            self._latest[(part, kind)] = slot
            self._dirty.add((part, kind))
        return self._counted(self._chain(part, kind, start), 1, sum(a.nbytes for a in values.values()))

    def _counted(self, fut: concurrent.futures.Future, which: int, nbytes: int) -> concurrent.futures.Future:
        def count(f):
            if not f.cancelled() and f.exception() is None:
                with self._mutex:
                    self._io_bytes[which] += nbytes

        fut.add_done_callback(count)
        return fut

    @property
    def io_bytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) of tensor data by this open store so far."""
        with self._mutex:
            return tuple(self._io_bytes)

    def _chain(self, part: str, kind: str, start) -> concurrent.futures.Future:
        """Start after the previous read or write of the same (part, kind) finished."""
        with self._mutex:
            fut = arrays.after(self._pending.get((part, kind)), start)
            self._pending[(part, kind)] = fut
        return fut

    def wait(self) -> None:
        """Block until every pending read and write has finished; raise the first failure."""
        with self._mutex:
            pending = list(self._pending.values())
        errors = [f.exception() for f in concurrent.futures.wait(pending).done if f.exception() is not None]
        with self._mutex:
            self._pending = {k: f for k, f in self._pending.items() if not f.done()}
        if errors:
            raise errors[0]

    # --- commits ------------------------------------------------------------------------

    def commit(self, step: int, train_state: dict | None = None, pending: dict | None = None,
               prepare: bool = False) -> None:
        """Make every write since the last commit, and `train_state`, the committed `step`.

        Atomic: after a crash at any moment the store opens at the previous step or at
        this one, never a mix. On error the previous commit stays current. `pending`
        (one-copy stores): {"tag", "parts", "scale"} of gradient sums, durable in
        `pending_dir`, that the committed step still has to apply to those parts.
        `prepare` (a multi-process run's shard): everything but the manifest's rename;
        the new manifest waits, durable, as layout.PREPARED until `finish_commit`, which
        the run calls once every process has prepared (mtjax.store.shards).
        """
        if prepare and self._manifest.hosts is None:
            raise StoreError("a prepared commit is for a multi-process run's shard")
        if not self.writable:
            raise StoreError(f"store {self.root} is open read-only; open it with writable=True to commit")
        if not isinstance(step, int) or step < 0:
            raise StoreError(f"commit step must be a non-negative int, got {step!r}")
        self._check_usable()
        if train_state is not None:
            train_state = dict(train_state)
            saved_state.check(train_state)  # before anything touches the disk
        if pending is not None and not pending.get("parts"):
            pending = None  # nothing left to apply: a complete step
        if pending is not None and self.copies == 2:
            raise StoreError("pending gradients are for one-copy stores (copies=1)")
        with self._mutex:
            self._committing = True
            part_commits, self._part_commits = self._part_commits, []
            waits = list(self._pending.values()) + part_commits
        try:
            self._commit(step, train_state, pending, waits, part_commits, prepare)
        finally:
            with self._mutex:
                self._committing = False

    def _commit(self, step, train_state, pending, waits, part_commits, prepare=False) -> None:
        concurrent.futures.wait(waits)  # the step's writes must all be on disk before the manifest names them
        self._check_usable()  # a failed write marked the store broken: never commit a partial step
        for f in part_commits:
            f.result()  # a failed part commit: its error, not a commit that skips it
        files, dirs = [], set()
        if pending is not None:
            pending = {"tag": str(pending["tag"]), "parts": list(pending["parts"]), "scale": float(pending["scale"])}
            # The sums the manifest will name, and their names, are durable before it does.
            files += [self.pending_dir / layout.pending_file(layout.pending_key(part, pending["tag"]), leaf)
                      for part in pending["parts"] for leaf in self.schema(part, "master")]
            dirs.add(self.pending_dir)
        self._on_phase("written")
        slots = {p: dict(kinds) for p, kinds in self._manifest.slots.items()}
        with self._mutex:
            written = sorted(self._dirty)
        for part, kind in written:
            slot = slots[part][kind] = self._latest[(part, kind)]
            files += self._slot_files(part, kind, slot)
            dirs.update(_slot_dirs(layout.slot_dir(self.root, part, kind, slot), self.schema(part, kind)))
        self._sync(files, sorted(dirs))
        self._on_phase("synced")
        generation = self._manifest.generation + 1
        ts_name = None
        if train_state is not None:
            ts_name = saved_state.save(self.root, f"g{generation:08d}-step{step:08d}.json", train_state)
        self._on_phase("train_state")
        with self._commit_mutex:
            new = dataclasses.replace(self._manifest, step=step, generation=generation, slots=slots,
                                      train_state=ts_name, pending=pending)
            if prepare:
                manifest.write(self.root, new, layout.PREPARED)
                self._prepared = new
                self._on_phase("prepared")
                return
            manifest.write(self.root, new)  # the commit point
            self._on_phase("committed")
            self._finished(new)

    def _finished(self, new: manifest.Manifest) -> None:
        """After `new` became the store's manifest: forget the committed writes, delete
        train states it does not name (and a one-copy store's old slots)."""
        self._manifest = new
        dirty, self._dirty = self._dirty, set()
        slots = new.slots
        saved_state.clean(self.root, keep=new.train_state)
        if self.copies == 1:
            for part, kind in dirty:
                self._free_slot(part, kind, layout.other_slot(slots[part][kind]))

    def finish_commit(self) -> None:
        """A shard's prepared commit becomes its manifest (every process has prepared its
        own: the run's step is committed, mtjax.store.shards)."""
        if self._prepared is None:
            raise StoreError(f"store {self.root} has no prepared commit to finish")
        with self._commit_mutex:
            try:
                os.replace(self.root / layout.PREPARED, self.root / layout.MANIFEST)
                fsync_path(self.root)
            except OSError as e:
                raise StoreError(f"could not finish the commit of store {self.root} ({e.strerror or e}); "
                                 "resume the run with all of its processes") from None
            new, self._prepared = self._prepared, None
            self._on_phase("committed")
            self._finished(new)

    def commit_part(self, part: str, after=None) -> concurrent.futures.Future:
        """One-copy stores: once the part's pending writes are on disk, commit its new state
        and drop it from the pending update, free its old slots, then call `after()`.

        Returns at once; `commit` waits for every part commit. A crash before the manifest
        names the new state leaves the part pending, so a resume applies the same update again.
        """
        if self.copies != 1:
            raise StoreError("commit_part is for one-copy stores (copies=1)")
        with self._mutex:
            writes = [self._pending[(part, k)] for k in model_parts.KINDS if (part, k) in self._pending]

        def run():
            concurrent.futures.wait(writes)
            self._check_usable()
            for w in writes:
                w.result()
            with self._mutex:
                kinds = [k for k in model_parts.KINDS if (part, k) in self._dirty]
            slots = {k: self._latest[(part, k)] for k in kinds}
            files, dirs = [], set()
            for kind, slot in slots.items():
                files += self._slot_files(part, kind, slot)
                dirs.update(_slot_dirs(layout.slot_dir(self.root, part, kind, slot), self.schema(part, kind)))
            self._sync(files, sorted(dirs))
            with self._commit_mutex:
                m = self._manifest
                table = {p: dict(ks) for p, ks in m.slots.items()}
                table[part].update(slots)
                pending = m.pending
                if pending is not None:
                    pending = dict(pending, parts=[p for p in pending["parts"] if p != part])
                new = dataclasses.replace(m, generation=m.generation + 1, slots=table, pending=pending)
                manifest.write(self.root, new)  # the part's commit point
                self._manifest = new
                with self._mutex:
                    self._dirty -= {(part, k) for k in kinds}
            for kind, slot in slots.items():
                self._free_slot(part, kind, layout.other_slot(slot))
            if after is not None:
                after()

        fut = self._committer.submit(run)
        with self._mutex:
            self._part_commits = [f for f in self._part_commits if not f.done() or f.exception()] + [fut]
        return fut

    def _slot_files(self, part: str, kind: str, slot: str) -> list[Path]:
        """Every chunk file of one (part, kind)'s slot."""
        base, schema = layout.slot_dir(self.root, part, kind, slot), self.schema(part, kind)
        return [f for leaf, h in self._handles(part, kind, slot, create=False).items()
                for f in chunks.files(base / leaf, tuple(schema[leaf].shape), np.dtype(schema[leaf].dtype).itemsize,
                                      _rows(h))]

    def _sync(self, files: list[Path], dirs: list[Path]) -> None:
        """Make what a commit is about to name durable: its files' data and their names
        (writes only started their writeback; mtjax.store.durable)."""
        try:
            durable.sync(self._io, files, dirs)
        except OSError as e:
            raise StoreError(f"could not make the writes to store {self.root} durable ({e}); "
                             f"the committed step {self.step} is intact, commit again") from None

    def load_train_state(self) -> dict | None:
        """The train state committed with the current step, or None if none was given."""
        if self._manifest.train_state is None:
            return None
        return saved_state.load(self.root, self._manifest.train_state)

    def close(self) -> None:
        """Wait for pending I/O, then release the writer lock. Uncommitted writes are dropped."""
        try:
            if getattr(self, "_pending", None):
                concurrent.futures.wait(list(self._pending.values()))
            if getattr(self, "_committer", None) is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
        finally:
            self._arrays = None
            for pool in ("_io", "_write_io"):
                if getattr(self, pool, None) is not None:
                    getattr(self, pool).shutdown(wait=True)
                    setattr(self, pool, None)
            if getattr(self, "_writeback", None) is not None:
                self._writeback.close()
                self._writeback = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        mode = "writable" if self.writable else "read-only"
        return f"Store({str(self.root)!r}, step={self.step}, {len(self.parts)} parts, {mode})"


def _slot_dirs(path: Path, leaves) -> list[Path]:
    """Directories whose entries a write into a slot changed: each array's (chunk keys
    are flat), the slot's, the part's and parts/ (new the first time a slot is used)."""
    return [path / leaf for leaf in leaves] + [path, path.parent, path.parent.parent]


def open(path, writable: bool = False, config: ModelConfig | None = None) -> Store:  # noqa: A001
    """Open an existing store. `writable` takes the single-writer lock; `config`, when
    given, must equal the store's model config."""
    root = Path(path)
    if not root.is_dir():
        raise StoreError(f"no store at {root}; create one with `mtjax init` or `mtjax import`")
    return Store(root, writable, config)


def create(path, cfg: ModelConfig, tx=None, copies: int = 2, hosts: dict | None = None) -> Store:
    """Create an empty store for `cfg` (manifest at step 0, nothing written) and open it
    for writing. `tx` (an optax transformation; default AdamW from OptimConfig()) fixes the
    optimizer-state leaves. `copies=1` keeps one copy of the state on disk instead of two
    (a trainer must then commit every step; docs/store.md). `hosts` ({"index", "count",
    "run"}): the store is that process's shard of a multi-process run (mtjax.store.shards)."""
    if copies not in (1, 2):
        raise StoreError(f"store copies must be 1 or 2, got {copies!r}")
    root = Path(path)
    if (root / layout.MANIFEST).exists() or (root.exists() and any(root.iterdir())):
        raise StoreError(f"{root} already exists and is not empty; choose a new directory "
                         "(an existing store is opened with mtjax.store.open)")
    if tx is None:
        tx = make_optimizer(OptimConfig())
    names = [p.name for p in model_parts.parts(cfg)]
    schemas = {p: {k: model_parts.schema(cfg, p, k, tx) for k in model_parts.KINDS} for p in names}
    if hosts is not None:
        if copies == 1:
            raise StoreError("a multi-process run's shard keeps two copies (store.copies=2)")
        shard = Shard(int(hosts["index"]), int(hosts["count"]))
        schemas = {p: {k: s if k == "compute" else shard.schema(s) for k, s in kinds.items()}
                   for p, kinds in schemas.items()}
    try:
        (root / layout.PARTS_DIR).mkdir(parents=True, exist_ok=True)
        (root / layout.TRAIN_STATE_DIR).mkdir(exist_ok=True)
        (root / layout.PENDING_DIR).mkdir(exist_ok=True)
        manifest.write_atomic(root / layout.SCHEMA, json.dumps(layout.schema_to_json(schemas)))
        store_id = uuid.uuid4().hex
        manifest.write_atomic(root / layout.STORE_ID, store_id + "\n")
        empty = manifest.Manifest(step=0, generation=0, config=layout.config_to_json(cfg), store_id=store_id,
                                  slots={p: {k: None for k in model_parts.KINDS} for p in names},
                                  dtypes={"compute": cfg.compute_dtype, "master": "float32",
                                          "checkpoint": cfg.param_dtype}, copies=copies, hosts=hosts)
        manifest.write(root, empty)
    except OSError as e:
        raise StoreError(f"cannot create store at {root} ({e.strerror or e})") from None
    return Store(root, writable=True)


def remove(path) -> None:
    """Delete a store directory (used to clean up after a failed import or init)."""
    shutil.rmtree(path, ignore_errors=True)
