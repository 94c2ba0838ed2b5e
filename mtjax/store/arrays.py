"""tensorstore arrays: one zarr3 array per leaf, created and checked; futures combined.

Every chunk carries a crc32c checksum (zarr3 `crc32c` codec). Arrays are opened against
their expected shape, dtype, codecs and key encoding, so a damaged or foreign
`zarr.json` is caught when the array is opened. Chunk data moves through `chunks`
(straight between the caller's arrays and the files); `gather` and `after` combine
and order the futures of that I/O.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import tensorstore as ts

from mtjax.store import layout


CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
KEYS = {"name": "default", "configuration": {"separator": "."}}  # flat: all chunks in the array's directory


def spec(path: Path, shape: tuple[int, ...], dtype: np.dtype, chunks: list[int] | None = None) -> dict:
    """The array at `path`: created with `chunks`, or opened (any chunking) when None."""
    dtype = np.dtype(dtype)
    metadata = {"shape": list(shape), "data_type": dtype.name, "codecs": CODECS, "chunk_key_encoding": KEYS}
    if chunks is not None:
        metadata.update(chunk_grid={"name": "regular", "configuration": {"chunk_shape": chunks}}, fill_value=0)
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,  # else all-zero chunks (fresh AdamW mu/nu) are never written
        "metadata": metadata,
    }


class ArrayCache:
    """Opened tensorstore handles by path; opening reads and checks `zarr.json` once. An
    array created here is chunked in about `chunk_bytes` (layout.chunk_shape)."""

    def __init__(self, chunk_bytes: int | None = None):
        self.chunk_bytes = chunk_bytes
        self._context = ts.Context()  # shared I/O and copy thread pools for the whole store
        self._open: dict[Path, ts.TensorStore] = {}
        self._lock = threading.Lock()

    def get(self, path: Path, shape, dtype, create: bool) -> ts.TensorStore:
        """Open the array (its stored chunking is kept); with `create`, make it if missing."""
        with self._lock:
            handle = self._open.get(path)
        if handle is None:
            if create and not (path / "zarr.json").exists():
                chunks = layout.chunk_shape(tuple(shape), np.dtype(dtype).itemsize, self.chunk_bytes)
                handle = ts.open(spec(path, shape, dtype, chunks), create=True, open=True, context=self._context)
            else:
                handle = ts.open(spec(path, shape, dtype), open=True, context=self._context)
            handle = handle.result()
            if list(handle.chunk_layout.read_chunk.shape or ())[1:] != list(shape)[1:]:
                raise ValueError(f"{path} is not chunked in whole rows, which mtjax reads in place")
            with self._lock:
                self._open[path] = handle
        return handle


def gather(futures: list[tuple[str, object]], result, on_error: Callable[[str, BaseException], BaseException]):
    """One concurrent Future for many (leaf, future) pairs (tensorstore or concurrent futures).

    It resolves to `result` once all succeeded, or fails with `on_error(leaf, exc)` for the
    first leaf that failed (after all have finished, so no I/O outlives the future).
    """
    done = concurrent.futures.Future()
    if not futures:
        done.set_result(result)
        return done
    lock = threading.Lock()
    state = {"left": len(futures), "error": None}

    def finished(leaf: str, fut: ts.Future) -> None:
        try:
            fut.result()
            error = None
        except Exception as e:  # I/O, checksum and disk-full failures of one leaf
            error = on_error(leaf, e)
            error.__cause__ = error.__cause__ or e  # the OSError stays reachable (e.g. mtjax.store.fill words it)
        with lock:
            if error is not None and state["error"] is None:
                state["error"] = error
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            if state["error"] is not None:
                done.set_exception(state["error"])
            else:
                done.set_result(result)

    for leaf, fut in futures:
        fut.add_done_callback(lambda f, leaf=leaf: finished(leaf, f))
    return done


def after(previous: concurrent.futures.Future | None, start: Callable[[], concurrent.futures.Future]):
    """Run `start` (which returns a Future) once `previous` has finished, success or not.

    Orders reads and writes of the same (part, kind) without blocking the caller.
    """
    if previous is None or previous.done():
        return start()
    chained = concurrent.futures.Future()

    def go(_):
        try:
            inner = start()
        except BaseException as e:
            chained.set_exception(e)
            return
        inner.add_done_callback(lambda f: _copy(f, chained))

    previous.add_done_callback(go)
    return chained


def _copy(src: concurrent.futures.Future, dst: concurrent.futures.Future) -> None:
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())
