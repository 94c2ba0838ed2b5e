"""Files made durable when a commit names them, not when they are written.

A chunk or gradient file is written without waiting for the disk. Once its bytes are in
the page cache and it has its name, a `Writeback` asks the kernel to begin writing its
pages (Linux `sync_file_range` with SYNC_FILE_RANGE_WRITE, which does not wait for the
disk but does wait for room in the disk's request queue), on a thread of its own: the
write is done, and a read of the same file may start from the page cache, while the
disk is still busy with earlier writes. A commit then calls `sync` on every file and
directory its manifest will name before it writes the manifest: by then most pages are
on disk and the fsyncs return quickly. Waiting per file at write time (an fsync each)
kept an I/O thread blocked on the disk per chunk and wrote at 0.3-0.6 GB/s on the
2-core machine; starting the writeback inside the write held the I/O thread until the
request queue had room, so a read queued behind writes (docs/store.md has both).

`observe(fn)` is the store I/O layer's one seam for tests: fn(event, *args) is called
around every file operation a commit's durability depends on (`event` below), on the
thread doing it, so a test can follow what is durable, or hold or fail an operation.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import os
from pathlib import Path

from mtjax.observers import Observers

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait
_observers = Observers()


def observe(fn):
    """Call fn(event, *args) at each of the store's file operations:

        ("write", path)          a chunk or gradient file is about to be written
        ("written", path)        it is written and renamed into place (not yet durable)
        ("renamed", old, new)    a gradient file took a new name (its step's tag)
        ("fsync", path)          a file or directory is about to be fsynced
        ("synced", path)         it is
        ("manifest", manifest)   a manifest (mtjax.store.manifest.Manifest) is about to be written

    An exception fn raises fails the operation, as the disk's own error would. Returns
    the function that stops calling fn."""
    return _observers.add(fn)


def event(name: str, *args) -> None:
    """Tell the observers of one file operation (`observe`)."""
    _observers(name, *args)


def _sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux: the commit's fsync does all the work
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_START = _sync_file_range()


def _start_writeback(fd: int) -> None:
    """Begin writing the file's dirty pages to disk without waiting for the disk (a hint:
    a failure is ignored, the commit's fsync still makes the file durable)."""
    if _START is not None:
        _START(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


class Writeback:
    """Starts the writeback of files by name, in the order given, on one thread of its own.

    A hint, as `_start_writeback` is: a file removed or replaced meanwhile is skipped or
    has its new contents written, and `close` drops what has not started.
    """

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtjax-writeback")

    def start(self, path: Path) -> None:
        if _START is not None:
            self._pool.submit(self._start, path)

    @staticmethod
    def _start(path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # removed meanwhile (a dropped scratch file): nothing to write
            return
        try:
            _start_writeback(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name."""
    event("fsync", path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    event("synced", path)


def sync(pool: concurrent.futures.Executor, files, dirs) -> None:
    """fsync `files` (their data) and `dirs` (the names in them) in parallel: each call
    waits for the disk, not the CPU. Raises the first OSError."""
    list(pool.map(fsync_path, [*files, *dirs]))
