"""What a store must be before it is opened: its own manifest, a schema matching its
model config, a well-formed slot table and pending update, a train state it holds.

Each check raises a one-line StoreError naming what is wrong and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtjax import model_config, precision, roles
from mtjax import parts as model_parts
from mtjax.model_config import ModelConfig
from mtjax.shard import Shard
from mtjax.store import layout
from mtjax.store.errors import StoreError
from mtjax.store.manifest import Manifest


def identity(root: Path, m: Manifest) -> None:
    """A manifest copied from another store (even one at the same step) is refused."""
    id_file = root / layout.STORE_ID
    ours = id_file.read_text().strip() if id_file.exists() else None
    if ours is None and m.store_id is not None:  # stores made before STORE_ID have neither
        raise StoreError(f"store {root} has lost its {layout.STORE_ID} file, which identifies it; if "
                         f"{layout.MANIFEST} is this store's own, write its store_id back: "
                         f"echo {m.store_id} > {id_file}")
    if ours is not None and m.store_id != ours:
        raise StoreError(f"{root / layout.MANIFEST} comes from another store (id {m.store_id}, "
                         f"this store is {ours}); put back this store's own manifest.json")


def not_prepared(root: Path) -> None:
    """A writer may not open a shard whose commit waits for the other processes."""
    if (root / layout.PREPARED).exists():
        raise StoreError(f"store {root} is a shard of a multi-process run stopped inside a commit; "
                         "resume the run with all of its processes")


def same_config(root: Path, stored: ModelConfig, given: ModelConfig | None) -> None:
    if given is not None:
        quantized_stay_frozen(root, stored, given)
    if given is not None and (diff := model_config.differences(stored, given)):
        raise StoreError(f"store {root} was written for another model config ({', '.join(diff)}: "
                         "the store's -> yours); use the store's settings or another store")


def quantized_stay_frozen(root: Path, stored: ModelConfig, given: ModelConfig) -> None:
    """A quantized leaf (mtjax.precision) has only its quantized bytes: asked to train
    by `given`'s freeze patterns, it is refused by name."""
    for part in model_parts.parts(stored):
        for name, leaf in model_parts.leaves(stored, part.name).items():
            if isinstance(leaf.compute, precision.Quantized) and roles.role(given, part.name, name) != roles.FROZEN:
                raise StoreError(f"store {root} keeps {part.name}/{name} quantized ({stored.base_format}), which "
                                 f"cannot be trained; keep the store's model.freeze ({','.join(stored.freeze)}) "
                                 f"and base_format")


def schema(root: Path, config: ModelConfig, shard: Shard | None) -> dict:
    """{part: {kind: {leaf: ShapeDtypeStruct}}} from schema.json, checked against `config`."""
    path = root / layout.SCHEMA
    if not path.exists():
        raise StoreError(f"store {root} has lost its {layout.SCHEMA} file (the shape and dtype of every "
                         f"array it holds): it cannot be opened; put back {layout.SCHEMA} from a backup of this "
                         "store")
    try:
        schemas = layout.schema_from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{path} is missing or corrupt ({e}); restore the store from a backup") from None
    for part in model_parts.parts(config):
        for kind in ("compute", "master"):
            derived = model_parts.schema(config, part.name, kind)
            if kind == "master" and shard is not None:
                derived = shard.schema(derived)
            if schemas.get(part.name, {}).get(kind) != derived:
                raise StoreError(f"{path} does not match the store's model config at {part.name} {kind}; "
                                 "the store was assembled from different models")
    return schemas


def slot_table(root: Path, m: Manifest, parts: list[str]) -> None:
    slots = m.slots
    if (not isinstance(slots, dict) or list(slots) != parts
            or any(not isinstance(slots[p], dict) or set(slots[p]) != set(model_parts.KINDS)
                   or set(slots[p].values()) - {*layout.SLOTS, None} for p in parts)):
        raise StoreError(f"{root / layout.MANIFEST} has a malformed slot table; restore the store from a backup")


def copies(root: Path, m: Manifest, parts: list[str]) -> None:
    pending = m.pending
    ok = m.copies in (1, 2) and (pending is None or (
        m.copies == 1 and isinstance(pending, dict) and isinstance(pending.get("tag"), str)
        and isinstance(pending.get("parts"), list) and set(pending["parts"]) <= set(parts)
        and isinstance(pending.get("scale"), (int, float))))
    if not ok:
        raise StoreError(f"{root / layout.MANIFEST} has a malformed copies/pending entry; "
                         "restore the store from a backup")


def pending_format(root: Path, m: Manifest) -> None:
    """Pending gradients written before they carried a checksum cannot be checked."""
    if m.pending and m.pending["parts"] and m.layout_version < layout.PENDING_CRC_VERSION:
        raise StoreError(f"store {root} (layout {m.layout_version}) stopped mid-update with pending gradient files "
                         "in a format without checksums; finish the update with the mtjax that wrote it "
                         "(resume the run there), then continue with this one")


def train_state(root: Path, m: Manifest) -> None:
    """The train state the manifest names is this store's (checked before a writer
    cleans up train states, which would otherwise delete this store's real one)."""
    named = m.train_state
    if named is not None and not (root / layout.TRAIN_STATE_DIR / named).exists():
        raise StoreError(f"{root / layout.MANIFEST} names train state {named}, which this store does "
                         "not hold: the manifest comes from another store (or was damaged); put back this "
                         "store's own manifest.json")
