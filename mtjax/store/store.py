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
import json
import shutil
import uuid
from pathlib import Path

from mtjax import parts as model_parts
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.shard import Shard
from mtjax.store import checks, layout, manifest
from mtjax.store import train_state as saved_state
from mtjax.store.commit import Commits
from mtjax.store.errors import StoreError
from mtjax.store.io import StoreIO
from mtjax.store.lock import WriterLock
from mtjax.store.slots import Slots


def _part_name(part) -> str:
    return part.name if isinstance(part, model_parts.Part) else str(part)


def _shard(m: manifest.Manifest) -> Shard | None:
    h = m.hosts
    return None if h is None else Shard(int(h["index"]), int(h["count"]))


class Store:
    """An open store. Use `create` or `open`, not this constructor.

    Its pieces: `slots` (the slot table, mtjax.store.slots), `io` (chunk reads and
    writes, mtjax.store.io) and `commits` (the commit protocols, mtjax.store.commit).
    """

    def __init__(self, root: Path, writable: bool, config: ModelConfig | None = None, chunk_bytes: int | None = None):
        self.root = Path(root)
        self.writable = writable
        self.chunk_bytes = chunk_bytes or layout.CHUNK_BYTES  # of the arrays it creates; a reader takes theirs
        self._lock = WriterLock(self.root) if writable else None
        self.io = self.commits = None
        try:
            committed = manifest.read(self.root)
            checks.identity(self.root, committed)
            if writable:
                checks.not_prepared(self.root)
            self.config = layout.config_from_json(committed.config)
            self._schemas = checks.schema(self.root, self.config, _shard(committed))
            checks.same_config(self.root, self.config, config)
            self.parts = [p.name for p in model_parts.parts(self.config)]
            checks.slot_table(self.root, committed, self.parts)
            self.slots = Slots(self, committed)
            self.io = StoreIO(self)
            self.commits = Commits(self)
            checks.copies(self.root, committed, self.parts)
            checks.train_state(self.root, committed)
            if writable:
                saved_state.clean(self.root, keep=committed.train_state)
                if self.copies == 1:
                    checks.pending_format(self.root, committed)
                    self.slots.free_stale()
        except BaseException:
            self.close()
            raise

    # --- what is stored ----------------------------------------------------------------

    @property
    def shard(self) -> Shard | None:
        """The rows of master and optimizer state this store holds (a multi-process run's
        shard, mtjax.store.shards); None: all of them."""
        return _shard(self.slots.manifest)

    @property
    def hosts(self) -> dict | None:
        """A shard's {"index", "count", "run"} (the run id every shard of a run shares)."""
        h = self.slots.manifest.hosts
        return None if h is None else dict(h)

    @property
    def run_id(self) -> str:
        """The id that names the store's run in its records (mtjax.rundir): the store's own
        (STORE_ID), or the run id every shard of a multi-process run records."""
        if self.hosts:
            return self.hosts["run"]
        id_file = self.root / layout.STORE_ID
        return id_file.read_text().strip() if id_file.exists() else str(self.root.resolve())  # made before ids

    @property
    def generation(self) -> int:
        """+1 per commit (a shard's commits are named by it across the processes)."""
        return self.slots.manifest.generation

    @property
    def copies(self) -> int:
        """2: every part has two slots (any commit interval); 1: one copy, committed every step."""
        return self.slots.manifest.copies

    @property
    def pending(self) -> dict | None:
        """One-copy stores: {"tag", "parts", "scale"} of the committed gradients whose update
        has not been applied to `parts` yet (None or no parts: the state is complete)."""
        p = self.slots.manifest.pending
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
        return self.slots.manifest.step

    @property
    def never_written(self) -> bool:
        """No state was ever committed: a store created and left before its first commit."""
        return all(slot is None for kinds in self.slots.manifest.slots.values() for slot in kinds.values())

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

    def read(self, part, kind: str, out: dict | None = None) -> concurrent.futures.Future:
        """Future of {leaf: array}: the latest written (else committed) state of a part.

        `out` ({leaf: preallocated C-contiguous array}, e.g. from mtjax.hostmem.BufferPool) is filled
        in place and returned; without it fresh arrays are allocated (slower: page faults).
        A reader's read fails when the writer commits while it runs (`refresh`).
        """
        part = _part_name(part)
        self.io.check_usable()
        self.schema(part, kind)  # an unknown part or kind fails here, with the valid names
        slot = self.slots.latest(part, kind)
        if slot is None:
            raise StoreError(f"store {self.root}: {part} {kind} has never been written; "
                             "fill the store with `mtjax init` or `mtjax import`")
        return self.io.read(part, kind, slot, out)

    def refresh(self) -> None:
        """Read-only stores: move to the latest committed step (reads see it from now on)."""
        if self.writable:
            raise StoreError("refresh() is for read-only stores; a writer's view is always current")
        self.slots.refresh(manifest.read(self.root))

    def write(self, part, kind: str, values: dict, carry: bool = False) -> concurrent.futures.Future:
        """Future that resolves once every chunk is written to the uncommitted slot (durable
        at the commit that names it).

        `values` must hold every leaf of `schema(part, kind)` with its exact shape and
        dtype; keep the arrays unchanged until the future resolves. `carry`: `values` may
        hold some leaves only; the others keep their latest values (hard links of its
        chunk files, no byte written: a frozen leaf's compute copy, mtjax.roles).
        """
        part = _part_name(part)
        self.io.check_usable()
        if not self.writable:
            raise StoreError(f"store {self.root} is open read-only; open it with writable=True to write")
        slot = layout.other_slot(self.slots.committed(part, kind))
        carried, latest = carry and set(values) < set(self.schema(part, kind)), self.slots.latest(part, kind)
        if carried and latest is None:
            raise StoreError(f"store {self.root}: {part} {kind} was never written, so no leaf can keep its value; "
                             "write every leaf once")
        self.io.check_arrays(part, kind, values, "write", some=carried)
        # The carried leaves are already in `slot` when the latest write went there.
        return self.io.write(part, kind, slot, values, claim=lambda: self.slots.claim(part, kind, slot),
                             carry_from=latest if carried and latest != slot else None)

    @property
    def io_bytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) of tensor data by this open store so far."""
        return self.io.io_bytes

    def wait(self) -> None:
        """Block until every pending read and write has finished; raise the first failure."""
        self.io.wait()

    # --- commits (mtjax.store.commit) ---------------------------------------------------

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
        if prepare and self.hosts is None:
            raise StoreError("a prepared commit is for a multi-process run's shard")
        if not self.writable:
            raise StoreError(f"store {self.root} is open read-only; open it with writable=True to commit")
        if not isinstance(step, int) or step < 0:
            raise StoreError(f"commit step must be a non-negative int, got {step!r}")
        self.io.check_usable()
        if train_state is not None:
            train_state = dict(train_state)
            saved_state.check(train_state)  # before anything touches the disk
        self.commits.commit(step, train_state, pending, prepare)

    def finish_commit(self) -> None:
        """A shard's prepared commit becomes its manifest (every process has prepared its
        own: the run's step is committed, mtjax.store.shards)."""
        self.commits.finish()

    def commit_part(self, part: str, after=None) -> concurrent.futures.Future:
        """One-copy stores: once the part's pending writes are on disk, commit its new state
        and drop it from the pending update, free its old slots, then call `after()`.

        Returns at once; `commit` waits for every part commit. A crash before the manifest
        names the new state leaves the part pending, so a resume applies the same update again.
        """
        if self.copies != 1:
            raise StoreError("commit_part is for one-copy stores (copies=1)")
        return self.commits.part(part, after)

    def load_train_state(self) -> dict | None:
        """The train state committed with the current step, or None if none was given."""
        named = self.slots.manifest.train_state
        return None if named is None else saved_state.load(self.root, named)

    def close(self) -> None:
        """Wait for pending I/O, then release the writer lock. Uncommitted writes are dropped."""
        try:
            if self.io is not None:
                concurrent.futures.wait(self.io.pending())
            if self.commits is not None:
                self.commits.close()
                self.commits = None
        finally:
            if self.io is not None:
                self.io.close()
                self.io = None
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


def weights(store: Store, part: str) -> dict:
    """A part's committed fp32 weights, {leaf: array}: its master, and where a leaf has
    none (frozen, mtjax.roles) its compute copy in fp32, which is all it has."""
    return model_parts.fp32_weights(store.config, part, store.read(part, "master").result(),
                                    lambda: store.read(part, "compute").result())


def open(path, writable: bool = False, config: ModelConfig | None = None) -> Store:  # noqa: A001
    """Open an existing store. `writable` takes the single-writer lock; `config`, when
    given, must equal the store's model config."""
    root = Path(path)
    if not root.is_dir():
        raise StoreError(f"no store at {root}; create one with `mtjax init` or `mtjax import`")
    return Store(root, writable, config)


def create(path, cfg: ModelConfig, tx=None, copies: int = 2, hosts: dict | None = None,
           chunk_bytes: int | None = None, store_id: str | None = None) -> Store:
    """Create an empty store for `cfg` (manifest at step 0, nothing written) and open it
    for writing. `tx` (an optax transformation; default AdamW from OptimConfig()) fixes the
    optimizer-state leaves. `copies=1` keeps one copy of the state on disk instead of two
    (a trainer must then commit every step; docs/store.md). `hosts` ({"index", "count",
    "run"}): the store is that process's shard of a multi-process run (mtjax.store.shards).
    `chunk_bytes`: about how many bytes each chunk of the arrays this open store creates
    holds (default layout.CHUNK_BYTES); a reader takes the chunking stored with an array.
    `store_id`: the store's id (default a new random one); `mtjax store reshard` keeps a
    run's id, which names it in its records (mtjax.rundir)."""
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
        store_id = store_id or uuid.uuid4().hex
        manifest.write_atomic(root / layout.STORE_ID, store_id + "\n")
        empty = manifest.Manifest(step=0, generation=0, config=layout.config_to_json(cfg), store_id=store_id,
                                  slots={p: {k: None for k in model_parts.KINDS} for p in names},
                                  dtypes={"compute": cfg.compute_dtype, "master": "float32",
                                          "checkpoint": cfg.param_dtype}, copies=copies, hosts=hosts)
        manifest.write(root, empty)
    except OSError as e:
        raise StoreError(f"cannot create store at {root} ({e.strerror or e})") from None
    return Store(root, writable=True, chunk_bytes=chunk_bytes)


def remove(path) -> None:
    """Delete a store directory (used to clean up after a failed import or init)."""
    shutil.rmtree(path, ignore_errors=True)
