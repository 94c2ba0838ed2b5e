"""A store's slot table: which slot ("a" or "b") of each (part, kind) the committed
manifest names, which one the latest write went to, and what was written since the last
commit.

Writes go to the slot the committed manifest does not name (`claim`); reads see the
latest write. A one-copy store frees a slot's chunks once a commit names the other one
(`free`), and at open whatever no commit names (`free_stale`, the leftovers of a crash).
"""

from __future__ import annotations

import threading
from pathlib import Path

from mtjax.store import layout
from mtjax.store.errors import StoreError
from mtjax.store.manifest import Manifest


def slot_dirs(path: Path, leaves) -> list[Path]:
    """Directories whose entries a write into a slot changed: each array's (chunk keys
    are flat), the slot's, the part's and parts/ (new the first time a slot is used)."""
    return [path / leaf for leaf in leaves] + [path, path.parent, path.parent.parent]


class Slots:
    """The slot table of one open store (`store`: its root and schemas)."""

    def __init__(self, store, committed: Manifest):
        self.store = store
        self.manifest = committed  # the committed manifest (a commit replaces it)
        self.committing = False  # a write issued during a commit could land in a slot it frees
        self.prepared: Manifest | None = None  # a shard's commit waiting for the other processes
        self._latest = self._table(committed)
        self._dirty: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @staticmethod
    def _table(m: Manifest) -> dict:
        return {(p, k): s for p, kinds in m.slots.items() for k, s in kinds.items()}

    def committed(self, part: str, kind: str) -> str | None:
        """The slot the committed manifest names (None: never committed)."""
        return self.manifest.slots[part][kind]

    def latest(self, part: str, kind: str) -> str | None:
        """The slot the latest write went to, else the committed one."""
        with self._lock:
            return self._latest.get((part, kind))

    def claim(self, part: str, kind: str, slot: str) -> None:
        """A write of (part, kind) to `slot` is about to be queued."""
        with self._lock:
            if self.committing or self.prepared is not None:
                raise StoreError(f"store {self.store.root}: {part} {kind} was written while a commit ran; "
                                 "finish every write before calling commit")
            self._latest[(part, kind)] = slot
            self._dirty.add((part, kind))

    def hold(self, committing: bool) -> None:
        """A commit starts (True: writes are refused) or ends (False)."""
        with self._lock:
            self.committing = committing

    def written(self, part: str | None = None) -> list[tuple[str, str]]:
        """The (part, kind)s written since the last commit: all, or `part`'s."""
        with self._lock:
            return sorted(pk for pk in self._dirty if part is None or pk[0] == part)

    def named(self, part: str, kind: str, slot: str) -> tuple[list[Path], list[Path]]:
        """(chunk files, directories) a commit naming this slot makes durable first."""
        path = layout.slot_dir(self.store.root, part, kind, slot)
        return self.store.io.files(part, kind, slot), slot_dirs(path, self.store.schema(part, kind))

    def adopt(self, new: Manifest, done: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
        """`new` became the store's manifest; it names the writes in `done` (None: every
        write so far). Returns the (part, kind)s it names newly written."""
        with self._lock:
            self.manifest = new
            done = sorted(self._dirty) if done is None else done
            self._dirty -= set(done)
        return done

    def refresh(self, m: Manifest) -> None:
        """A reader moves to the committed manifest `m`."""
        with self._lock:
            self.manifest, self._latest = m, self._table(m)

    def free(self, part: str, kind: str, slot: str) -> None:
        base = layout.slot_dir(self.store.root, part, kind, slot)
        for leaf in self.store.schema(part, kind):
            for f in (base / leaf).glob("c*") if (base / leaf).is_dir() else ():
                f.unlink(missing_ok=True)  # chunk keys: "c" (a scalar) or "c.<i>...", and their temp files

    def free_stale(self) -> None:
        """One-copy stores: delete what no commit names (a crash can leave both behind):
        chunks of the slots the manifest does not name, and gradients of no pending update."""
        for part, kinds in self.manifest.slots.items():
            for kind, slot in kinds.items():
                if slot is not None:
                    self.free(part, kind, layout.other_slot(slot))
        p = self.manifest.pending
        keep = {layout.pending_file(layout.pending_key(part, p["tag"]), leaf)
                for part in (p["parts"] if p else ()) for leaf in self.store.schema(part, "master")}
        pending_dir = self.store.root / layout.PENDING_DIR
        for f in pending_dir.iterdir() if pending_dir.is_dir() else ():
            if f.name not in keep:
                f.unlink(missing_ok=True)
