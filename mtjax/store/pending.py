"""Gradient sums waiting for their deferred update, parked in files in the store's chunk format.

Each leaf of a sum is one file, `<key>--<leaf>.bin` (layout.pending_file): one chunk of
mtjax.store.chunks, the leaf's raw little-endian bytes followed by their crc32c, written
to a temporary file and renamed into place. So a flipped byte, a truncated file or a
missing one is found before the sum is used, never applied.

Two uses. With the master weights on disk the sums wait in a temporary directory next
to the store, so that host memory does not grow with the model (the bytes sit in the page
cache). A one-copy store keeps them durable in its `pending_dir`: a step's commit names
them, and a resumed run checks every file it adopts before any update runs
(docs/store.md, "One-copy stores").
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from mtjax.errors import MtjaxError
from mtjax.store import chunks, durable
from mtjax.store.errors import StoreError
from mtjax.store.layout import pending_file


class PendingFiles:
    """Flat {leaf: array} dicts in files, by key (a part's sum: `layout.pending_key`).

    `directory` (a one-copy store's pending_dir) makes them durable: `put` starts their
    writeback (the store's commit that names them fsyncs them), `take(key, keep=True)`
    leaves the files until `forget(key)`, and `close` leaves the directory; without it
    a temporary directory next to `parent` is used, whose files need not reach the disk.
    """

    def __init__(self, parent: str | None = None, directory=None):
        self.durable = directory is not None
        self._writeback = durable.Writeback() if self.durable else None
        self._tmp = None if self.durable else tempfile.TemporaryDirectory(prefix=".mtjax-grads-", dir=parent)
        self.dir = Path(directory) if self.durable else Path(self._tmp.name)
        self._meta: dict[str, dict[str, tuple]] = {}
        self.io_bytes = [0, 0]  # bytes read, written

    def _path(self, key: str, leaf: str) -> Path:
        return self.dir / pending_file(key, leaf)

    def _damaged(self, e: chunks.ChunkError) -> StoreError:
        if self.durable:
            return StoreError(f"pending gradient file {e.path} {e.reason}: the update the store committed as pending "
                              "cannot be applied without it, and nothing was applied; restore the store from a backup")
        return StoreError(f"scratch gradient file {e.path} {e.reason} (a disk or memory fault); "
                          "rerun to resume from the last committed step")

    def put(self, key: str, arrays: Mapping) -> None:
        meta = {}
        try:
            for leaf, a in arrays.items():
                a = np.asarray(a, order="C")  # (np.ascontiguousarray would make a scalar 1-d)
                # Durable: on disk by the time a commit names the sum (Store.commit fsyncs it).
                chunks.write_chunk(self._path(key, leaf), chunks.flat(a), 0, writeback=self._writeback)
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
        """Take over files a previous process left under `key` ({leaf: ShapeDtypeStruct}),
        each checked (present, of its size, matching its checksum) before it is used."""
        meta = {leaf: (tuple(s.shape), np.dtype(s.dtype)) for leaf, s in schema.items()}
        for leaf, (shape, dtype) in meta.items():
            try:
                chunks.check_chunk(self._path(key, leaf), int(np.prod(shape)) * dtype.itemsize)
            except chunks.ChunkError as e:
                raise self._damaged(e) from None
        self._meta[key] = meta

    def take(self, key: str, keep: bool = False) -> dict:
        """The arrays stored under `key`; the files go (unless `keep`: then at `forget`)."""
        out = {}
        for leaf, (shape, dtype) in self._meta[key].items():
            path = self._path(key, leaf)
            out[leaf] = np.empty(shape, dtype)
            try:
                chunks.read_chunk(path, chunks.flat(out[leaf]), 0)
            except chunks.ChunkError as e:
                raise self._damaged(e) from None
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
            old, path = self._path(key, leaf), self._path(new, leaf)
            old.rename(path)
            durable.event("renamed", old, path)
        self._meta[new] = self._meta.pop(key)

    def __contains__(self, key: str) -> bool:
        return key in self._meta

    def close(self) -> None:
        self._meta.clear()
        if self._writeback is not None:
            self._writeback.close()
        if self._tmp is not None:
            self._tmp.cleanup()
