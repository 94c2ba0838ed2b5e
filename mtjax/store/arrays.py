"""tensorstore I/O: one zarr3 array per leaf, read into caller buffers, asynchronously.

Every chunk carries a crc32c checksum (zarr3 `crc32c` codec), so a flipped byte fails
the read; missing chunks are errors too (`fill_missing_data_reads: false`), never
silently zeros. Arrays are opened with their full expected metadata, so a damaged or
foreign `zarr.json` is caught when the array is opened.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import tensorstore as ts

from mtjax.store import layout


def spec(path: Path, shape: tuple[int, ...], dtype: np.dtype) -> dict:
    dtype = np.dtype(dtype)
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},  # fsyncs each chunk (file_io_sync)
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,  # else all-zero chunks (fresh AdamW mu/nu) are never written
        "metadata": {
            "shape": list(shape),
            "data_type": dtype.name,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": layout.chunk_shape(shape, dtype.itemsize)}},
            "chunk_key_encoding": {"name": "default"},
            "fill_value": 0,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
    }


class ArrayCache:
    """Opened tensorstore handles by path; opening reads and checks `zarr.json` once."""

    def __init__(self):
        self._context = ts.Context()  # shared I/O and copy thread pools for the whole store
        self._open: dict[Path, ts.TensorStore] = {}
        self._lock = threading.Lock()

    def get(self, path: Path, shape, dtype, create: bool) -> ts.TensorStore:
        with self._lock:
            handle = self._open.get(path)
        if handle is None:
            handle = ts.open(spec(path, shape, dtype), open=True, create=create, context=self._context).result()
            with self._lock:
                self._open[path] = handle
        return handle


def read_into(src: ts.TensorStore, out: np.ndarray) -> ts.Future:
    """Fill the preallocated `out` from `src` without allocating a result array."""
    return ts.array(out, copy=False, write=True).write(src)


def write_from(dst: ts.TensorStore, array: np.ndarray) -> ts.Future:
    """Resolves once the bytes are durable (each chunk is fsynced)."""
    return dst.write(array).commit


def gather(futures: dict[str, ts.Future], result, on_error: Callable[[str, BaseException], BaseException]):
    """One concurrent Future for many tensorstore futures.

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
        except Exception as e:  # tensorstore reports I/O and checksum failures as ValueError
            error = on_error(leaf, e)
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

    for leaf, fut in futures.items():
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
