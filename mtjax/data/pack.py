"""Documents into fixed rows: several per row (packing) or one per row, padded.

    packer = Packer(seq_len=512, pad_id=eos, one_per_row=False)
    for ids, targets in documents:
        for row in packer.add(ids, targets): write(row)
    for row in packer.finish(): write(row)

A row is (tokens, loss_mask, segments), each [seq_len]: segments numbers the row's
documents 1, 2, ... and marks padding 0 (padding tokens are `pad_id`, never targets);
positions restart at every document, so they follow from the segments (mtjax.documents).
Packing is greedy first fit: a document goes into the oldest open row with room for it,
else opens a row; at most OPEN_ROWS rows stay open, the oldest is closed beyond that. No
document is split: one longer than seq_len is refused by `add` (the caller drops it).
"""

from __future__ import annotations

import numpy as np

OPEN_ROWS = 64


def segment_dtype(seq_len: int) -> np.dtype:
    """Holds every document number of a row (at most seq_len documents)."""
    return np.dtype(np.uint16) if seq_len < 1 << 16 else np.dtype(np.uint32)


class _Row:
    def __init__(self, seq_len: int, pad_id: int):
        self.tokens = np.full(seq_len, pad_id, np.int64)
        self.mask = np.zeros(seq_len, np.uint8)
        self.segments = np.zeros(seq_len, segment_dtype(seq_len))
        self.used, self.docs = 0, 0

    def put(self, ids: np.ndarray, targets: np.ndarray) -> None:
        end = self.used + ids.size
        self.docs += 1
        self.tokens[self.used:end], self.mask[self.used:end], self.segments[self.used:end] = ids, targets, self.docs
        self.used = end

    def done(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.tokens, self.mask, self.segments


class Packer:
    def __init__(self, seq_len: int, pad_id: int, one_per_row: bool = False):
        self.seq_len, self.pad_id, self.one_per_row = seq_len, pad_id, one_per_row
        self._open: list[_Row] = []

    def add(self, ids, targets) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Place one document (ids, and which of them are targets); the rows it completes."""
        ids, targets = np.asarray(ids, np.int64), np.asarray(targets, bool)
        if ids.size > self.seq_len or ids.size != targets.size:
            raise ValueError(f"a document of {ids.size} tokens does not fit rows of {self.seq_len}")
        if self.one_per_row:
            row = _Row(self.seq_len, self.pad_id)
            row.put(ids, targets)
            return [row.done()]
        for row in self._open:
            if self.seq_len - row.used >= ids.size:
                row.put(ids, targets)
                break
        else:
            row = _Row(self.seq_len, self.pad_id)
            row.put(ids, targets)
            self._open.append(row)
        full = [r for r in self._open if r.used == self.seq_len]
        self._open = [r for r in self._open if r.used < self.seq_len]
        if len(self._open) > OPEN_ROWS:
            full.append(self._open.pop(0))
        return [r.done() for r in full]

    def finish(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The rows still open."""
        rows, self._open = [r.done() for r in self._open], []
        return rows
