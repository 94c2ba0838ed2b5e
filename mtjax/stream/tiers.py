"""Where state lives between uses: host RAM, or the layer store on disk.

Each kind of state (compute weights, master weights, optimizer state) is placed in one
tier. Both tiers answer the store's calls (`read(part, kind, out)` and
`write(part, kind, arrays)`, each returning a Future), so the engine never asks where a
kind lives. RAM-tier arrays are numpy arrays on huge pages that the fused optimizer
updates in place (`mtjax.hostmem.huge_empty`), or, with the optax program, jax arrays
on the CPU backend that it donates.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping

import jax
import numpy as np

from mtjax.errors import MtjaxError
from mtjax.parts import KINDS
from mtjax.store.layout import pending_file

TIER_NAMES = ("ram", "disk")


def host_device() -> jax.Device:
    """The CPU device that holds host-resident state and runs the optimizer."""
    return jax.devices("cpu")[0]


def _done(value) -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_result(value)
    return fut


def _fill(out: dict | None, arrays: Mapping) -> dict:
    """`arrays`, copied into the caller's buffers when it gave some."""
    if out is None:
        return dict(arrays)
    for name, buf in out.items():
        np.copyto(buf, np.asarray(arrays[name]), casting="no")
    return out


class RamTier:
    """State held in host RAM; reads and writes complete at once."""

    name = "ram"

    def __init__(self):
        self._data: dict[tuple[str, str], dict] = {}

    def read(self, part: str, kind: str, out: dict | None = None) -> cf.Future:
        try:
            return _done(_fill(out, self._data[part, kind]))
        except KeyError:
            raise MtjaxError(f"no {kind} state for part {part} in the RAM tier") from None

    def write(self, part: str, kind: str, arrays: Mapping) -> cf.Future:
        self._data[part, kind] = dict(arrays)
        return _done(None)

    def close(self) -> None:
        self._data.clear()


class DiskTier:
    """State read from and written to the layer store (mtjax.store).

    Writes become durable at the store's next `commit`; until then the store serves
    reads of the latest written arrays.
    """

    name = "disk"

    def __init__(self, store):
        self.store = store

    def read(self, part: str, kind: str, out: dict | None = None) -> cf.Future:
        return self.store.read(part, kind, out=out)

    def write(self, part: str, kind: str, arrays: Mapping) -> cf.Future:
        # np.asarray waits for the jitted update that produced the arrays (host sync,
        # on the prefetch worker thread): the store needs their bytes.
        return self.store.write(part, kind, {n: np.asarray(a) for n, a in arrays.items()})

    def close(self) -> None:
        pass


def derives_compute(fused_update: bool, master_tier: str, compute_tier: str) -> bool:
    """Whether no compute copy is kept: with the fused update and both master and compute
    weights in RAM, the prefetcher rounds master straight into the staging slot
    (docs/pipeline.md, "The compute copy"). The engine and the planner both ask here."""
    return fused_update and master_tier == "ram" and compute_tier == "ram"


class Tiers:
    """The tier of each kind of state: {"compute": tier, "master": tier, "opt": tier}."""

    def __init__(self, placement: Mapping[str, str], store=None):
        unknown = sorted(set(placement) - set(KINDS))
        if unknown:
            raise MtjaxError(f"store.tiers has unknown state kind(s) {unknown}; use {list(KINDS)}")
        bad = {k: v for k, v in placement.items() if v not in TIER_NAMES}
        if bad:
            raise MtjaxError(f"store.tiers values must be 'ram' or 'disk', got {bad}")
        self.placement = {kind: placement.get(kind, "ram") for kind in KINDS}
        if "disk" in self.placement.values() and store is None:
            raise MtjaxError("a 'disk' tier needs a layer store: pass store=mtjax.store.create(...)")
        ram, disk = RamTier(), DiskTier(store) if store is not None else None
        self.by_kind = {kind: ram if where == "ram" else disk for kind, where in self.placement.items()}

    def read(self, part: str, kind: str, out: dict | None = None) -> cf.Future:
        return self.by_kind[kind].read(part, kind, out)

    def write(self, part: str, kind: str, arrays: Mapping) -> cf.Future:
        return self.by_kind[kind].write(part, kind, arrays)

    def kinds_in(self, tier_name: str) -> list[str]:
        return [k for k, v in self.placement.items() if v == tier_name]

    def close(self) -> None:
        for tier in set(self.by_kind.values()):
            tier.close()


class ScratchFiles:
    """Flat {leaf: array} dicts parked in files: gradients waiting for their update when
    the master weights live on disk, so host memory does not grow with the model.

    Plain file writes and reads: the bytes sit in the page cache, not in the process.
    `directory` (a one-copy store's pending_dir) makes them durable: `put(..., sync=True)`
    fsyncs, `take(key, keep=True)` leaves the files until `forget(key)`, and `close`
    leaves the directory; without it a temporary directory next to `parent` is used.
    """

    def __init__(self, parent: str | None = None, directory=None):
        import tempfile
        from pathlib import Path

        self.durable = directory is not None
        self._tmp = None if self.durable else tempfile.TemporaryDirectory(prefix=".mtjax-grads-", dir=parent)
        self.dir = Path(directory) if self.durable else Path(self._tmp.name)
        self._meta: dict[str, dict[str, tuple]] = {}
        self.io_bytes = [0, 0]  # bytes read, written

    def _path(self, key: str, leaf: str):
        return self.dir / pending_file(key, leaf)

    def put(self, key: str, arrays: Mapping, sync: bool = False) -> None:
        import os

        meta = {}
        try:
            for leaf, a in arrays.items():
                a = np.ascontiguousarray(np.asarray(a))
                with open(self._path(key, leaf), "wb") as f:
                    a.tofile(f)
                    if sync and self.durable:
                        f.flush()
                        os.fsync(f.fileno())  # the sum must survive a crash once a commit names it
                meta[leaf] = (a.shape, a.dtype)
                self.io_bytes[1] += a.nbytes
        except OSError as e:
            for leaf in arrays:
                self._path(key, leaf).unlink(missing_ok=True)
            # A user-facing error: the step fails, what was committed before it stays intact.
            raise MtjaxError(f"cannot park gradients in {self.dir} ({e}); free disk space there, then "
                             "rerun to resume from the last committed step") from None
        self._meta[key] = meta

    def adopt(self, key: str, schema: Mapping) -> None:
        """Take over files a previous process left under `key` ({leaf: ShapeDtypeStruct})."""
        missing = [leaf for leaf in schema if not self._path(key, leaf).is_file()]
        if missing:
            raise MtjaxError(f"{self.dir} lacks the pending gradient file {pending_file(key, missing[0])} that the store's "
                             "manifest names; the store is damaged: restore it from a backup")
        self._meta[key] = {leaf: (tuple(s.shape), np.dtype(s.dtype)) for leaf, s in schema.items()}

    def take(self, key: str, keep: bool = False) -> dict:
        """The arrays stored under `key`; the files go (unless `keep`: then at `forget`)."""
        out = {}
        for leaf, (shape, dtype) in self._meta[key].items():
            path = self._path(key, leaf)
            out[leaf] = np.fromfile(path, dtype).reshape(shape)
            self.io_bytes[0] += out[leaf].nbytes
            if not keep:
                path.unlink()
        if not keep:
            del self._meta[key]
        return out

    def forget(self, key: str) -> None:
        for leaf in self._meta.pop(key, {}):
            self._path(key, leaf).unlink(missing_ok=True)

    def rename(self, key: str, new: str) -> None:
        for leaf in self._meta[key]:
            self._path(key, leaf).rename(self._path(new, leaf))
        self._meta[new] = self._meta.pop(key)

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def close(self) -> None:
        self._meta.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
