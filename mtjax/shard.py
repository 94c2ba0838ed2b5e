"""One process's share of the host state in a multi-process run (ZeRO-style over hosts).

Process `index` of `count` owns a contiguous range of rows of every leaf of the master
weights and the optimizer state: rows [index * R // count, (index + 1) * R // count) of a
leaf with R rows, so the ranges differ by at most one row and cover the leaf. A leaf with
fewer rows than processes (and a scalar, such as AdamW's step count) is not split: every
process holds all of it and updates it identically from the same summed gradient. The
compute copy is never split: every process streams the whole of it to its devices.

For the collectives, each process's range is padded to `block(R)` rows (the largest
range), so that the processes' pieces are equal: piece p of a padded leaf holds process
p's rows at its start.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @property
    def name(self) -> str:
        """The shard's directory name inside a multi-process run's store root."""
        return f"shard-{self.index}-of-{self.count}"

    def splits(self, shape) -> bool:
        """Whether a leaf of this shape is split by rows (else every process holds it all)."""
        return len(shape) >= 1 and shape[0] >= self.count

    def rows(self, n: int, index: int | None = None) -> tuple[int, int]:
        """[start, stop) of the rows process `index` (default: this one) owns of n rows."""
        i = self.index if index is None else index
        return i * n // self.count, (i + 1) * n // self.count

    def block(self, n: int) -> int:
        """Rows of each process's padded piece of an n-row leaf."""
        return -(-n // self.count)

    def shape(self, shape) -> tuple:
        """The shape of this process's part of a leaf."""
        if not self.splits(shape):
            return tuple(shape)
        start, stop = self.rows(shape[0])
        return (stop - start, *shape[1:])

    def take(self, a: np.ndarray) -> np.ndarray:
        """This process's rows of a whole leaf (the leaf itself when not split)."""
        if not self.splits(a.shape):
            return a
        start, stop = self.rows(a.shape[0])
        return a[start:stop]

    def schema(self, schema: dict) -> dict:
        """{leaf: ShapeDtypeStruct} of this process's part of master or optimizer state."""
        return {n: jax.ShapeDtypeStruct(self.shape(s.shape), s.dtype) for n, s in schema.items()}

    def pad_whole(self, a: np.ndarray) -> np.ndarray:
        """A whole split leaf laid out as count padded pieces [count * block, ...]."""
        n, b = a.shape[0], self.block(a.shape[0])
        out = np.zeros((self.count * b, *a.shape[1:]), a.dtype)
        for p in range(self.count):
            start, stop = self.rows(n, p)
            out[p * b: p * b + stop - start] = a[start:stop]
        return out

    def pad_own(self, part: np.ndarray, n: int) -> np.ndarray:
        """This process's rows of an n-row leaf, padded to one piece [block, ...]."""
        out = np.zeros((self.block(n), *part.shape[1:]), part.dtype)
        out[: part.shape[0]] = part
        return out

    def unpad_whole(self, padded: np.ndarray, n: int) -> np.ndarray:
        """The whole n-row leaf from its count padded pieces."""
        b = self.block(n)
        return np.concatenate([padded[p * b: p * b + stop - start]
                               for p, (start, stop) in ((p, self.rows(n, p)) for p in range(self.count))])
