"""Every commit protocol of the layer store, in one place (docs/store.md has why each is safe).

    commit_step(store, step, train_state, updater, ...)   a trainer's one entry: the
                                        protocol its store and run need, run in order
    Commits(store)                      a store's atomic steps (Store.commit,
                                        Store.finish_commit, Store.commit_part delegate here)
    OneCopy(store, tiers)               when a one-copy store's steps happen
    observe(fn)                         fn(store, phase, generation) at each phase of
                                        every commit: the seam crash tests kill at

The three protocols:
- two copies (`store.copies=2`): the step's writes went to the slots the manifest does
  not name; the commit makes them and the train state durable, then replaces the
  manifest (the commit point) and forgets what it named.
- one copy (`store.copies=1`): the store holds a single copy, so an update may not
  overwrite it until the state it replaces can be rebuilt: each step is committed as "the
  state before its update + the step's gradients" (`pending`), and each part's new state
  is committed on its own once written (`commit_part`), after which its old slot and its
  gradient files go.
- several processes (a shard per process): each prepares its commit (everything but the
  manifest's rename, the new manifest durable as layout.PREPARED), all meet at a
  barrier, then each finishes (renames it over the manifest; mtjax.store.shards).

This module drives the store's I/O and slot table; it imports nothing that computes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading

from mtjax.errors import MtjaxError
from mtjax.observers import Observers
from mtjax.store import durable, layout, manifest
from mtjax.store import train_state as saved_state
from mtjax.store.errors import StoreError
from mtjax.store.pending import PendingFiles

PHASES = ("written", "synced", "train_state", "prepared", "finish", "committed")
_observers = Observers()


def observe(fn):
    """Call `fn(store, phase, generation)` at each phase of every commit of a step in this
    process (PHASES, in order; `generation`: the one being committed): a test's way to
    act (write, crash) at a chosen point of the protocol. Returns the function that stops it."""
    return _observers.add(fn)


def _phase(store, phase: str, generation: int) -> None:
    _observers(store, phase, generation)


class Commits:
    """The commits of one open store: `commit` (a step, or a shard's prepared step),
    `finish` (a shard's prepared step), `part` (a one-copy store's part)."""

    def __init__(self, store):
        self.store = store
        self._mutex = threading.Lock()  # one manifest change at a time
        self._lock = threading.Lock()  # guards `_parts`
        # One-copy stores: part commits run in order, on their own thread, after the part's writes.
        self._committer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtjax-store-commit")
        self._parts: list[concurrent.futures.Future] = []

    def commit(self, step: int, train_state: dict | None, pending: dict | None, prepare: bool) -> None:
        """Store.commit's protocol, once its arguments are checked."""
        store, slots = self.store, self.store.slots
        if pending is not None and not pending.get("parts"):
            pending = None  # nothing left to apply: a complete step
        if pending is not None and store.copies == 2:
            raise StoreError("pending gradients are for one-copy stores (copies=1)")
        slots.hold(True)  # from here until the commit is done a write is refused
        with self._lock:
            part_commits, self._parts = self._parts, []
        try:
            self._commit(step, train_state, pending, store.io.pending() + part_commits, part_commits, prepare)
        finally:
            slots.hold(False)

    def _commit(self, step, train_state, pending, waits, part_commits, prepare) -> None:
        store, slots, io = self.store, self.store.slots, self.store.io
        concurrent.futures.wait(waits)  # the step's writes must all be on disk before the manifest names them
        io.check_usable()  # a failed write marked the store broken: never commit a partial step
        for f in part_commits:
            f.result()  # a failed part commit: its error, not a commit that skips it
        generation = slots.manifest.generation + 1  # (the part commits waited for each made one)
        files, dirs = [], set()
        if pending is not None:
            pending = {"tag": str(pending["tag"]), "parts": list(pending["parts"]), "scale": float(pending["scale"])}
            # The sums the manifest will name, and their names, are durable before it does.
            files += [store.pending_dir / layout.pending_file(layout.pending_key(part, pending["tag"]), leaf)
                      for part in pending["parts"] for leaf in store.schema(part, "master")]
            dirs.add(store.pending_dir)
        _phase(store, "written", generation)
        table = {p: dict(kinds) for p, kinds in slots.manifest.slots.items()}
        for part, kind in slots.written():
            slot = table[part][kind] = slots.latest(part, kind)
            named_files, named_dirs = slots.named(part, kind, slot)
            files += named_files
            dirs.update(named_dirs)
        io.sync(files, sorted(dirs))
        _phase(store, "synced", generation)
        ts_name = None
        if train_state is not None:
            ts_name = saved_state.save(store.root, f"g{generation:08d}-step{step:08d}.json", train_state)
        _phase(store, "train_state", generation)
        with self._mutex:
            new = dataclasses.replace(slots.manifest, step=step, generation=generation, slots=table,
                                      train_state=ts_name, pending=pending)
            if prepare:
                manifest.write(store.root, new, layout.PREPARED)
                slots.prepared = new
                _phase(store, "prepared", generation)
                return
            manifest.write(store.root, new)  # the commit point
            _phase(store, "committed", generation)
            self._finished(new)

    def _finished(self, new: manifest.Manifest) -> None:
        """After `new` became the store's manifest: forget the committed writes, delete
        train states it does not name (and a one-copy store's old slots)."""
        slots = self.store.slots
        done = slots.adopt(new)
        saved_state.clean(self.store.root, keep=new.train_state)
        if self.store.copies == 1:
            for part, kind in done:
                slots.free(part, kind, layout.other_slot(new.slots[part][kind]))

    def finish(self) -> None:
        """A shard's prepared commit becomes its manifest."""
        store, slots = self.store, self.store.slots
        if slots.prepared is None:
            raise StoreError(f"store {store.root} has no prepared commit to finish")
        _phase(store, "finish", slots.prepared.generation)
        with self._mutex:
            try:
                os.replace(store.root / layout.PREPARED, store.root / layout.MANIFEST)
                durable.fsync_path(store.root)
            except OSError as e:
                raise StoreError(f"could not finish the commit of store {store.root} ({e.strerror or e}); "
                                 "resume the run with all of its processes") from None
            new, slots.prepared = slots.prepared, None
            _phase(store, "committed", new.generation)
            self._finished(new)

    def part(self, part: str, after=None) -> concurrent.futures.Future:
        """Store.commit_part's protocol: on the committer thread, once the part's writes
        are done, make them durable, name them in a new manifest that drops the part from
        the pending update, free the part's old slots, then call `after()`."""
        store, slots, io = self.store, self.store.slots, self.store.io
        writes = io.pending(part)

        def run():
            concurrent.futures.wait(writes)
            io.check_usable()
            for w in writes:
                w.result()
            kinds = slots.written(part)
            table = {k: slots.latest(part, k) for _, k in kinds}
            files, dirs = [], set()
            for kind, slot in table.items():
                named_files, named_dirs = slots.named(part, kind, slot)
                files += named_files
                dirs.update(named_dirs)
            io.sync(files, sorted(dirs))
            with self._mutex:
                m = slots.manifest
                new_slots = {p: dict(ks) for p, ks in m.slots.items()}
                new_slots[part].update(table)
                pending = m.pending
                if pending is not None:
                    pending = dict(pending, parts=[p for p in pending["parts"] if p != part])
                new = dataclasses.replace(m, generation=m.generation + 1, slots=new_slots, pending=pending)
                manifest.write(store.root, new)  # the part's commit point
                slots.adopt(new, kinds)
            for kind, slot in table.items():
                slots.free(part, kind, layout.other_slot(slot))
            if after is not None:
                after()

        fut = self._committer.submit(run)
        with self._lock:
            self._parts = [f for f in self._parts if not f.done() or f.exception()] + [fut]
        return fut

    def close(self) -> None:
        self._committer.shutdown(wait=True)


class OneCopy:
    """The trainer's side of a one-copy store's protocol: when each atomic step happens.

        one_copy = OneCopy(store, tiers)       # the durable gradient files: one_copy.spill
        scale = one_copy.adopt(grads)          # resume: the committed gradients are pending again
        one_copy.step_finished()               # a step's gradients are final; its updates must wait
        one_copy.commit(step, state, grads, scale)   # durable: state + gradients; updates may run
        one_copy.part_updated(part)            # a part's new state committed; its gradient files go

    `grads` is the trainer's gradient sink (mtjax.stream.grads.GradSink).
    """

    def __init__(self, store, tiers):
        if tiers.kinds_in("ram"):
            raise MtjaxError("a one-copy store (store.copies=1) holds every kind of state: set store.compute, "
                             "store.master and store.opt to 'disk', or use store.copies=2")
        self.store = store
        # Gradient sums wait for their update in the store's pending directory, fsynced,
        # and stay until the part's new state is committed.
        self.spill = PendingFiles(directory=store.pending_dir)
        self._uncommitted = False  # this step's gradients are not yet in a commit
        self._tag = None  # the tag of the committed pending gradients (their file names)

    def adopt(self, grads) -> float | None:
        """Resume mid-update: the gradients the store's last commit names become `grads`'
        pending sums; returns their clip scale (None: nothing was pending)."""
        pending = self.store.pending
        if not pending:
            return None
        for part in pending["parts"]:  # fp32 sums, shaped like the master weights
            self.spill.adopt(layout.pending_key(part, pending["tag"]), self.store.schema(part, "master"))
        grads.adopt(pending["parts"], pending["tag"])
        self._tag = pending["tag"]
        return float(pending["scale"])

    def step_finished(self) -> None:
        """A step's gradients are final: no update of it may run before its commit."""
        self._uncommitted = True

    def check_may_update(self, part: str, grads) -> None:
        if self._uncommitted and part in grads.pending():
            raise MtjaxError("with a one-copy store a step must be committed (engine.commit(step, train_state)) "
                             "before its update may overwrite the only copy of the state")

    def commit(self, step: int, train_state: dict | None, grads, scale) -> None:
        """Commit `step` as the state before its update plus its pending gradients (the
        caller has let every update in flight and every write finish)."""
        parts, tag = grads.pending(), grads.ready_tag()
        pending = None if not parts else {"tag": tag, "parts": parts, "scale": float(scale)}
        self.store.commit(step, train_state, pending=pending)
        self._uncommitted, self._tag = False, tag

    def part_updated(self, part: str) -> concurrent.futures.Future:
        """Once the part's new state is written, commit it, then delete its gradient files
        (`grads.take` left them: until this commit a crash needs them)."""
        key = layout.pending_key(part, self._tag)
        return self.store.commit_part(part, after=lambda: self.spill.forget(key))


def commit_step(store, step: int, train_state: dict | None, updater, *, collect, one_copy: OneCopy | None = None,
                barrier=None, flush: bool | None = None) -> None:
    """Make a trainer's current state the store's committed `step`, by the protocol the
    store and run need. `updater` is the trainer's state and update queue
    (mtjax.stream.updater.Updater); `collect()` brings state held elsewhere (resident
    parts, on the device) into its tiers; `barrier(name)` meets every process of a
    multi-process run (None: one process).

    Pending updates are applied first, except with a one-copy store, which commits them as
    gradients still to apply (a resume applies them) and starts them only once committed:
    no pause (`flush`: apply them and commit again, the end of a run).
    """
    if one_copy is not None:
        # Updates already started (by an earlier commit of this step) must finish first:
        # a commit changes which slot each part's next write goes to.
        updater.settle()
        collect()  # resident parts' updated state, named by this commit
        one_copy.commit(step, train_state, updater.grads, updater.scale)
        if not flush:
            updater.start()  # only now may they overwrite the one copy
            return
    updater.flush()
    if one_copy is None:  # (a one-copy commit has just written them)
        collect()
    updater.write_kept(store)
    updater.wait_writes()
    if barrier is None:
        store.commit(step, train_state)
        return
    # A multi-process run's step is committed once every process's shard is durable:
    # prepare, meet, then finish (mtjax.store.shards; docs/store.md).
    store.commit(step, train_state, prepare=True)
    barrier(f"mtjax commit {store.generation + 1}")
    store.finish_commit()
