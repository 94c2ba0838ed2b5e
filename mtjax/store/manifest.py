"""The manifest: the single file whose atomic replacement commits a step.

Everything a committed step consists of is named by the manifest (the slot of every
(part, kind), the train-state file), so replacing the manifest atomically is the
commit: write a temporary file, fsync it, rename it over the old one, fsync the
directory. A crash before the rename leaves the old step; after it, the new one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from mtjax.store import layout
from mtjax.store.durable import event, fsync_path
from mtjax.store.errors import StoreError


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int  # the committed training step
    generation: int  # +1 per commit; names train-state files uniquely
    config: dict  # layout.config_to_json(ModelConfig)
    slots: dict  # {part: {kind: "a" | "b" | None}}; None = never written
    train_state: str | None = None  # file under train_state/, or None
    dtypes: dict | None = None  # {"compute", "master", "checkpoint"}: for people reading the file
    layout_version: int = layout.LAYOUT_VERSION
    store_id: str | None = None  # equals the store's STORE_ID file; None in stores made before it
    copies: int = 2  # 2: A/B slots of every part; 1: one copy plus the pending gradients (docs/store.md)
    pending: dict | None = None  # copies=1: {"tag", "parts", "scale"} of gradients not yet applied
    hosts: dict | None = None  # a multi-process run's shard: {"index", "count", "run"} (docs/store.md)

    def to_json(self) -> dict:
        return {"format": layout.FORMAT, **dataclasses.asdict(self)}


def read(root: Path, name: str = layout.MANIFEST) -> Manifest:
    path = root / name
    if not path.exists():
        if name == layout.MANIFEST and layout.data_held(root):
            raise StoreError(lost(root))
        if name == layout.MANIFEST and layout.is_store(root):
            raise StoreError(f"store {root} has no {layout.MANIFEST} and holds no weights (the leftover of a store "
                             f"creation stopped before its first commit); delete {root} and create the store again")
        raise StoreError(f"{root} is not an mtjax store (no {layout.MANIFEST}); create one with `mtjax init` or `mtjax import`")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{path} is corrupt ({e}); restore the store from a backup") from None
    if not isinstance(d, dict) or d.get("format") != layout.FORMAT:
        raise StoreError(f"{path} is not an mtjax store manifest")
    version = d.get("layout_version")
    if not isinstance(version, int) or version > layout.LAYOUT_VERSION:
        raise StoreError(
            f"store {root} has layout version {version}, newer than this mtjax supports "
            f"({layout.LAYOUT_VERSION}); upgrade mtjax to open it"
        )
    try:
        return Manifest(step=int(d["step"]), generation=int(d["generation"]), config=d["config"],
                        slots=d["slots"], train_state=d.get("train_state"), dtypes=d.get("dtypes"),
                        layout_version=version, store_id=d.get("store_id"), copies=int(d.get("copies", 2)),
                        pending=d.get("pending"), hosts=d.get("hosts"))
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{path} lacks a valid {e} entry; restore the store from a backup") from None


def lost(root: Path) -> str:
    """The refusal of a store whose manifest is gone but whose data is still there."""
    held = ", ".join(f"{name}/" for name in layout.data_held(root))
    return (f"store {root} has lost its {layout.MANIFEST} (the commit point naming which of its files hold the "
            f"last step) but still holds data ({held}): it cannot be opened, and nothing in it was changed; put "
            f"back {layout.MANIFEST} from a backup of this store, or delete {root} yourself to start afresh")


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see either the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"could not write {path} ({e.strerror or e}); the previous commit is intact. "
                         "Free disk space or fix permissions, then commit again") from None
    try:
        fsync_path(path.parent)  # the rename itself is durable
    except OSError as e:
        raise StoreError(f"wrote {path} but could not fsync its directory ({e.strerror or e}); "
                         "after a power loss the store may open at the previous commit") from None


def write(root: Path, manifest: Manifest, name: str = layout.MANIFEST) -> None:
    """Commit `manifest`, recorded with this mtjax's layout version: what it names is in
    this version's format (an older store is upgraded by its first commit). `name`
    layout.PREPARED writes a shard's prepared commit instead (mtjax.store.shards)."""
    manifest = dataclasses.replace(manifest, layout_version=layout.LAYOUT_VERSION)
    event("manifest", manifest)
    write_atomic(root / name, json.dumps(manifest.to_json(), indent=1))


def read_prepared(root: Path) -> Manifest | None:
    """A shard's prepared commit (layout.PREPARED), or None when it has none."""
    if not (root / layout.PREPARED).exists():
        return None
    return read(root, layout.PREPARED)
