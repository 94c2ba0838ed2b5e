"""The train state committed with each step: counters, RNG, data cursor, run config.

One JSON file, STORE/train_state/<name>, written atomically (a temporary file, fsync,
rename, fsync of the directory) before the manifest that names it, so it commits with
the step. Values are JSON (numbers, NaN and Inf included, strings, lists, dicts, None)
or numpy/JAX arrays (RNG keys, ...), which are kept as their dtype, shape and the
base64 of their bytes, and come back as numpy arrays of that dtype and shape. Files no
manifest names are leftovers of an interrupted commit and are deleted when a writer
opens the store.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np

from mtjax.store import layout, manifest
from mtjax.store.errors import StoreError

ARRAY = "__ndarray__"  # the one key of the JSON object an array is stored as


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or type(x).__module__.startswith("jax")


def _encode(value, where: str):
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str) or key == ARRAY:
                raise StoreError(f"{where} keys must be strings other than {ARRAY!r}, got {key!r}")
            out[key] = _encode(v, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if _is_array(value):
        a = np.ascontiguousarray(np.asarray(value))
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        return {ARRAY: {"dtype": a.dtype.name, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise StoreError(f"train_state holds a value that is neither an array nor JSON ({where}: {type(value).__name__})")


def _decode(value):
    if isinstance(value, dict):
        if set(value) == {ARRAY}:
            a = value[ARRAY]
            raw = base64.b64decode(a["data"])
            return np.frombuffer(raw, layout.dtype_from_name(a["dtype"])).reshape(a["shape"]).copy()
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def check(state: dict) -> None:
    """Raise StoreError unless `state` can be saved (before any byte is written)."""
    if not isinstance(state, dict):
        raise StoreError(f"train_state must be a dict, got {type(state).__name__}")
    _encode(state, "train_state")


def save(root: Path, name: str, state: dict) -> str:
    """Write train_state/<name> durably; returns the name for the manifest."""
    text = json.dumps(_encode(state, "train_state"), indent=1)
    manifest.write_atomic(root / layout.TRAIN_STATE_DIR / name, text)  # StoreError: the previous commit is intact
    return name


def load(root: Path, name: str) -> dict:
    target = root / layout.TRAIN_STATE_DIR / name
    if target.is_dir():
        raise StoreError(f"the committed train state {target} was written by an older mtjax (an orbax "
                         "directory); continue that run with the mtjax that wrote it, or start a new run.dir")
    try:
        return _decode(json.loads(target.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"the committed train state {target} is unreadable ({e}); "
                         "restore the store from a backup") from None


def clean(root: Path, keep: str | None) -> None:
    """Delete train-state files the manifest does not name (interrupted commits)."""
    base = root / layout.TRAIN_STATE_DIR
    if not base.is_dir():
        return
    for entry in base.iterdir():
        if entry.name != keep:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
