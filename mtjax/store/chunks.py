"""Reads at disk speed: chunk files read straight into the caller's buffer, checksums checked.

tensorstore decodes each chunk into a buffer of its own (fresh memory: page faults) and
then copies it out, about half the speed of a plain `readinto` (FACTS.md). The stored
format is simple enough to read directly: our zarr3 arrays are chunked in whole rows,
so chunk i holds rows [i*r, (i+1)*r) as raw little-endian bytes, followed by their
crc32c (zarr v3 `bytes` + `crc32c` codecs; the last chunk is padded to full size).
`preadv` puts those bytes where they belong in the destination array, and the
checksum is computed over them there. Writes and metadata stay with tensorstore.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import struct
import sys
from pathlib import Path

import crc32c
import numpy as np

assert sys.byteorder == "little", "stored arrays are little-endian; reading them in place needs a little-endian host"


class ChunkError(Exception):
    """A chunk file that is missing, of the wrong size or fails its checksum."""


def plan(array_dir: Path, shape: tuple[int, ...], itemsize: int, rows: int) -> list[tuple[Path, int, int, int]]:
    """(chunk file, first byte, end byte in the array, padding bytes) for every chunk of
    `rows` rows (the stored chunk shape)."""
    if not shape:
        return [(array_dir / "c", 0, itemsize, 0)]
    row_bytes = math.prod(shape[1:]) * itemsize
    zeros = ["0"] * (len(shape) - 1)
    out = []
    for i in range(-(-shape[0] // rows)):
        start, stop = i * rows, min(shape[0], (i + 1) * rows)
        out.append((array_dir.joinpath("c", str(i), *zeros), start * row_bytes, stop * row_bytes,
                    (rows - (stop - start)) * row_bytes))
    return out


def _preadv_all(fd: int, buffers: list[memoryview]) -> int:
    """Fill `buffers` from the start of the file, however the kernel splits the reads."""
    total, offset = sum(len(b) for b in buffers), 0
    while offset < total:
        skip, pending = offset, []
        for b in buffers:
            if skip >= len(b):
                skip -= len(b)
                continue
            pending.append(b[skip:])
            skip = 0
        n = os.preadv(fd, pending, offset)
        if n == 0:
            break
        offset += n
    return offset


def read_chunk(path: Path, dest: memoryview, padding: int) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ChunkError(f"chunk file {path} is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size != len(dest) + padding + 4:
            raise ChunkError(f"chunk file {path} has {size} bytes, expected {len(dest) + padding + 4}")
        pad, stored = bytearray(padding), bytearray(4)
        parts = [dest, memoryview(pad), memoryview(stored)] if padding else [dest, memoryview(stored)]
        if _preadv_all(fd, parts) != size:
            raise ChunkError(f"chunk file {path} was truncated while reading")
    finally:
        os.close(fd)
    crc = crc32c.crc32c(dest)
    if padding:
        crc = crc32c.crc32c(pad, crc)
    if crc != struct.unpack("<I", stored)[0]:
        raise ChunkError(f"checksum mismatch in chunk file {path}")


def read_into(pool: concurrent.futures.Executor, array_dir: Path, rows: int,
              out: np.ndarray) -> list[concurrent.futures.Future]:
    """Start reading every chunk of the array at `array_dir` into `out` (C-contiguous)."""
    flat = memoryview(out.reshape(-1).view(np.uint8))
    return [pool.submit(read_chunk, path, flat[start:stop], pad)
            for path, start, stop, pad in plan(array_dir, out.shape, out.dtype.itemsize, rows)]
