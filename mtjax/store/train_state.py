"""The train state committed with each step: counters, RNG, data cursor, run config.

Saved with orbax-checkpoint under STORE/train_state/<name>/ before the manifest that
names it is written, so it commits with the step. Arrays (RNG keys, ...) go through
orbax's array handler; everything else must be JSON (ints, floats, strings, lists,
dicts) and is saved as one JSON document. Directories no manifest names are leftovers
of an interrupted commit and are deleted when a writer opens the store.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from mtjax.store import layout, manifest
from mtjax.store.errors import StoreError


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) or type(x).__module__.startswith("jax")


def split(state: dict, where: str = "train_state") -> tuple[dict, dict]:
    """(arrays, json) trees with the same dict nesting: array leaves vs everything else."""
    arrays, plain = {}, {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise StoreError(f"{where} keys must be strings, got {key!r}")
        if isinstance(value, dict):
            a, p = split(value, f"{where}.{key}")
            if a:
                arrays[key] = a
            if p or not a:
                plain[key] = p
        elif _is_array(value):
            arrays[key] = np.asarray(value)
        else:
            plain[key] = value
    return arrays, plain


def _merge(arrays: dict, plain: dict) -> dict:
    out = dict(plain)
    for key, value in arrays.items():
        out[key] = _merge(value, plain.get(key, {})) if isinstance(value, dict) else value
    return out


def check(state: dict) -> None:
    """Raise StoreError unless `state` can be saved (before any byte is written)."""
    if not isinstance(state, dict):
        raise StoreError(f"train_state must be a dict, got {type(state).__name__}")
    _, plain = split(state)
    try:
        json.dumps(plain, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise StoreError(f"train_state holds a value that is neither an array nor JSON ({e})") from None


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save(root: Path, name: str, state: dict) -> str:
    """Write train_state/<name> durably; returns the name for the manifest."""
    target = root / layout.TRAIN_STATE_DIR / name
    shutil.rmtree(target, ignore_errors=True)  # a leftover of an interrupted commit
    arrays, plain = split(state)
    args = {"json": ocp.args.JsonSave(plain)}
    if arrays:
        args["arrays"] = ocp.args.StandardSave(arrays)
    try:
        _checkpointer().save(target, ocp.args.Composite(**args))
        manifest.fsync_tree(target)  # durable before the manifest names it
        manifest.fsync_dir(target.parent)
    except (OSError, ValueError) as e:
        shutil.rmtree(target, ignore_errors=True)
        raise StoreError(f"could not save the train state under {target} ({e}); "
                         "the previous commit is intact. Free disk space, then commit again") from None
    return name


def load(root: Path, name: str) -> dict:
    target = root / layout.TRAIN_STATE_DIR / name
    args = {"json": ocp.args.JsonRestore()}
    if (target / "arrays").is_dir():
        args["arrays"] = ocp.args.StandardRestore()
    try:
        restored = _checkpointer().restore(target, ocp.args.Composite(**args))
    except (OSError, ValueError, KeyError) as e:
        raise StoreError(f"the committed train state {target} is unreadable ({e}); restore the store from a backup") from None
    arrays = restored["arrays"] if "arrays" in args else {}
    return _merge(arrays, restored["json"])


def clean(root: Path, keep: str | None) -> None:
    """Delete train-state directories the manifest does not name (interrupted commits)."""
    base = root / layout.TRAIN_STATE_DIR
    if not base.is_dir():
        return
    for entry in base.iterdir():
        if entry.name != keep:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
