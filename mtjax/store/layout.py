"""Where everything lives in a store directory, and how the model config is recorded.

    STORE/
      manifest.json                        the commit point: step, config, slot of each (part, kind)
      manifest.next.json                   a multi-process run's shard: its next commit, prepared
      schema.json                          every array's name, shape and dtype (written once)
      STORE_ID                             a random id, also in every manifest: a manifest copied
                                           from another store is refused
      LOCK                                 held (fcntl) by the one writer
      parts/<part>/<kind>.<slot>/<leaf>/   one zarr3 array per leaf; slot "a" or "b"
      train_state/<name>.json              the committed step's train state (atomically written JSON)
      pending/<part>.<tag>--<leaf>.bin     one-copy stores: gradient sums whose update is pending
      tokenizer/                           the imported checkpoint's tokenizer files (mtjax.store.tokenizer)

See docs/store.md for the commit protocol.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from mtjax.model_config import ModelConfig, RopeScaling
from mtjax.store.errors import StoreError

LAYOUT_VERSION = 3  # 2: one-copy stores (manifest "copies" and "pending"); 3: pending files carry a crc32c
PENDING_CRC_VERSION = 3  # the first layout whose pending gradient files are checksummed chunks
FORMAT = "mtjax-store"
MANIFEST = "manifest.json"
PREPARED = "manifest.next.json"  # a shard's commit, written before every process is ready (mtjax.store.shards)
SCHEMA = "schema.json"
STORE_ID = "STORE_ID"
LOCK = "LOCK"
PARTS_DIR = "parts"
TRAIN_STATE_DIR = "train_state"
PENDING_DIR = "pending"
TOKENIZER_DIR = "tokenizer"
SLOTS = ("a", "b")
# The files that make a directory a store: a directory with any of them is one (perhaps
# with one missing), and is opened (and refused in one line) rather than taken for another.
IDENTITY = (MANIFEST, SCHEMA, STORE_ID)
# What holds a store's data once it has been written: not empty in a store whose manifest was
# deleted, empty in the leftover of a store creation stopped before its manifest.
DATA_DIRS = (PARTS_DIR, TRAIN_STATE_DIR, PENDING_DIR, TOKENIZER_DIR)
CHUNK_BYTES = 16 << 20  # 4-32 MiB chunks read fastest; one chunk decodes on one thread (docs/store.md)


def is_store(root) -> bool:
    """Whether `root` is a store directory (its identity files may be incomplete)."""
    return any((Path(root) / name).exists() for name in IDENTITY)


def data_held(root) -> list[str]:
    """The data directories of `root` that hold something (DATA_DIRS)."""
    return [name for name in DATA_DIRS if (Path(root) / name).is_dir() and any((Path(root) / name).iterdir())]


def pending_key(part: str, tag: str) -> str:
    """The name of a part's gradient sum for step `tag` in the pending directory."""
    return f"{part}.{tag}"


def pending_file(key: str, leaf: str) -> str:
    """The file of one leaf of the gradient sum named `key`."""
    return f"{key}--{leaf}.bin"


def other_slot(slot: str | None) -> str:
    """The slot a write goes to: never the one the committed manifest names."""
    return "b" if slot == "a" else "a"


def slot_dir(root: Path, part: str, kind: str, slot: str) -> Path:
    return root / PARTS_DIR / part / f"{kind}.{slot}"


def chunk_shape(shape: tuple[int, ...], itemsize: int, target: int | None = None) -> list[int]:
    """Split along the leading axis into chunks of about `target` bytes (whole rows).

    Used when an array is created; readers take the chunking stored in its zarr.json.
    """
    if not shape:
        return []
    target = target or CHUNK_BYTES
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, min(shape[0], target // max(row, 1)))
    return [rows, *shape[1:]]


def config_to_json(cfg: ModelConfig) -> dict:
    out = dataclasses.asdict(cfg)
    out["layer_types"] = list(cfg.layer_types)
    return json.loads(json.dumps(out))  # tuples become lists; the reader turns them back


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def config_from_json(d: dict) -> ModelConfig:
    d = dict(d)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise StoreError(f"the store's model config has fields this mtjax does not know: {unknown}; upgrade mtjax")
    for key in ("rope_scaling", "local_rope_scaling"):
        if d.get(key) is not None:
            d[key] = RopeScaling(**d[key])
    d["layer_types"] = tuple(d.get("layer_types", ()))
    d["moe_layers"] = tuple(d.get("moe_layers", ()))
    d["no_rope_layers"] = tuple(d.get("no_rope_layers", ()))
    d["delta_net_layers"] = tuple(d.get("delta_net_layers", ()))
    d["freeze"] = tuple(d.get("freeze", ()))
    d["extra_hf"] = _tuples(d.get("extra_hf", []))
    return ModelConfig(**d)


def schema_to_json(schemas: dict) -> dict:
    """{part: {kind: {leaf: ShapeDtypeStruct}}} -> JSON."""
    return {part: {kind: {leaf: {"shape": list(s.shape), "dtype": np.dtype(s.dtype).name}
                          for leaf, s in leaves.items()}
                   for kind, leaves in kinds.items()}
            for part, kinds in schemas.items()}


def dtype_from_name(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def schema_from_json(d: dict) -> dict:
    def spec(s):
        return jax.ShapeDtypeStruct(tuple(s["shape"]), dtype_from_name(s["dtype"]))

    return {part: {kind: {leaf: spec(s) for leaf, s in leaves.items()}
                   for kind, leaves in kinds.items()}
            for part, kinds in d.items()}
