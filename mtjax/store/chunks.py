"""Chunk files in and out at disk speed: straight between the caller's arrays and the disk.

tensorstore decodes each chunk into a buffer of its own (fresh memory: page faults) and
copies it out, and stages a copy of every written array: reads ran at about half the
speed of a plain `readinto` and an import held several copies of a part. The stored
format is simple enough to move directly. Our zarr3 arrays are chunked in whole rows
with flat chunk keys, so chunk i is the file `c.i.0...` holding rows [i*r, (i+1)*r) as
raw little-endian bytes followed by their crc32c (zarr v3 `bytes` + `crc32c` codecs;
the last chunk is padded to full size). `preadv`/`pwritev` move those bytes between the
file and their rows of the array, and the checksum is computed in place
(mtjax.store.checksum). tensorstore
creates and checks each array's zarr.json, and can read every array we write. Gradient
sums waiting for their update are single chunk files of the same format
(mtjax.store.pending).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np

from mtjax.store.checksum import crc32c
from mtjax.store.durable import Writeback, event

assert sys.byteorder == "little", "stored arrays are little-endian; moving them in place needs a little-endian host"

TMP_SUFFIX = ".__mtjax_writing"  # a chunk being written; renamed over the chunk when complete


class ChunkError(Exception):
    """A chunk file that is missing, of the wrong size or fails its checksum."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"chunk file {path} {reason}")


def plan(array_dir: Path, shape: tuple[int, ...], itemsize: int, rows: int) -> list[tuple[Path, int, int, int]]:
    """(chunk file, first byte, end byte in the array, padding bytes) for every chunk of
    `rows` rows (the stored chunk shape)."""
    if not shape:
        return [(array_dir / "c", 0, itemsize, 0)]
    row_bytes = math.prod(shape[1:]) * itemsize
    zeros = ".0" * (len(shape) - 1)
    out = []
    for i in range(-(-shape[0] // rows)):
        start, stop = i * rows, min(shape[0], (i + 1) * rows)
        out.append((array_dir / f"c.{i}{zeros}", start * row_bytes, stop * row_bytes,
                    (rows - (stop - start)) * row_bytes))
    return out


def _vectored(op, fd: int, buffers: list[memoryview]) -> int:
    """Move all of `buffers` from offset 0 with preadv/pwritev, however the kernel splits it."""
    total, offset = sum(len(b) for b in buffers), 0
    while offset < total:
        skip, pending = offset, []
        for b in buffers:
            if skip >= len(b):
                skip -= len(b)
                continue
            pending.append(b[skip:])
            skip = 0
        n = op(fd, pending, offset)
        if n == 0:
            break
        offset += n
    return offset


def _open_sized(path: Path, size: int) -> int:
    """A read-only descriptor of the chunk file, which must hold exactly `size` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ChunkError(path, "is missing") from None
    if (actual := os.fstat(fd).st_size) != size:
        os.close(fd)
        raise ChunkError(path, f"has {actual} bytes, expected {size}")
    return fd


def read_chunk(path: Path, dest: memoryview, padding: int) -> None:
    size = len(dest) + padding + 4
    fd = _open_sized(path, size)
    try:
        pad, stored = bytearray(padding), bytearray(4)
        if _vectored(os.preadv, fd, [dest, memoryview(pad), memoryview(stored)]) != size:
            raise ChunkError(path, "was truncated while reading")
    finally:
        os.close(fd)
    crc = crc32c(pad, crc32c(dest)) if padding else crc32c(dest)
    if crc != struct.unpack("<I", stored)[0]:
        raise ChunkError(path, "has a checksum mismatch")


def check_chunk(path: Path, nbytes: int, block: int = 16 << 20) -> None:
    """Check a chunk file of `nbytes` data bytes (no padding) against its crc32c, reading
    it a block at a time: its bytes are not kept."""
    fd = _open_sized(path, nbytes + 4)
    try:
        view, crc, offset = memoryview(bytearray(max(1, min(block, nbytes)))), 0, 0
        while offset < nbytes:
            n = os.preadv(fd, [view[:min(len(view), nbytes - offset)]], offset)
            if n == 0:
                raise ChunkError(path, "was truncated while reading")
            crc, offset = crc32c(view[:n], crc), offset + n
        stored = os.pread(fd, 4, nbytes)
    finally:
        os.close(fd)
    if len(stored) != 4 or crc != struct.unpack("<I", stored)[0]:
        raise ChunkError(path, "has a checksum mismatch")


def write_chunk(path: Path, src: memoryview, padding: int, writeback: Writeback | None = None) -> None:
    """Write a temporary file, rename it over the chunk, then hand it to `writeback` to
    start writing its pages (None: a scratch file that may never need the disk).

    Nothing waits for the disk here: the commit that names the chunk fsyncs it and the
    array's directory first (mtjax.store.durable), which makes both durable.
    """
    event("write", path)
    pad = bytes(padding)
    crc = crc32c(pad, crc32c(src)) if padding else crc32c(src)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            _vectored(os.pwritev, fd, [src, memoryview(pad), memoryview(struct.pack("<I", crc))])
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    event("written", path)
    if writeback is not None:
        writeback.start(path)


def flat(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array (a copy of any other), as one flat view."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def read_into(pool: concurrent.futures.Executor, array_dir: Path, rows: int,
              out: np.ndarray) -> list[concurrent.futures.Future]:
    """Start reading every chunk of the array at `array_dir` into `out` (C-contiguous)."""
    view = flat(out)
    return [pool.submit(read_chunk, path, view[start:stop], pad)
            for path, start, stop, pad in plan(array_dir, out.shape, out.dtype.itemsize, rows)]


def files(array_dir: Path, shape: tuple[int, ...], itemsize: int, rows: int) -> list[Path]:
    """The chunk files of an array (what a commit must make durable)."""
    return [path for path, *_ in plan(array_dir, shape, itemsize, rows)]


def write_from(pool: concurrent.futures.Executor, array_dir: Path, rows: int, array: np.ndarray,
               writeback: Writeback) -> list[concurrent.futures.Future]:
    """Start writing every chunk of `array` to the array at `array_dir`, without copying it."""
    view = flat(array)
    return [pool.submit(write_chunk, path, view[start:stop], pad, writeback)
            for path, start, stop, pad in plan(array_dir, array.shape, array.dtype.itemsize, rows)]
