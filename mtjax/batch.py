"""One step's training input: token ids, which targets count, and where documents begin.

    Batch(tokens)                       plain text windows: every target counts, one document per row
    Batch(tokens, loss_mask, segments)  packed chat / prompt-completion data

All three arrays are [accum, batch, seq]. `loss_mask[..., t]` says whether token t counts
as a target (it is predicted from the tokens before it in its document); `segments[..., t]`
is the document that token t belongs to (1, 2, ... within a row; 0 marks padding, which
neither attends nor is attended to, and never counts). A token whose document begins at t
is never a target of the token before it, whatever the mask says: attention and positions
restart at every document boundary.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtjax.errors import MtjaxError


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # int32 [accum, batch, seq]
    loss_mask: np.ndarray | None = None  # bool [accum, batch, seq]; None: every target counts
    segments: np.ndarray | None = None  # int32 [accum, batch, seq]; None: one document per row

    def __post_init__(self):
        for name in ("loss_mask", "segments"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != np.shape(self.tokens):
                raise MtjaxError(f"batch {name} has shape {np.shape(value)}, its tokens {np.shape(self.tokens)}")

    @property
    def plain(self) -> bool:
        """True when every target counts and every row is one document (today's text windows)."""
        return self.loss_mask is None and self.segments is None


def as_batch(x) -> Batch:
    """A Batch from a Batch or from token ids [accum, batch, seq] / [batch, seq]."""
    if isinstance(x, Batch):
        batch = x
    else:
        batch = Batch(np.asarray(x, np.int32))
    if batch.tokens.ndim == 2:
        batch = Batch(*(None if a is None else a[None] for a in (batch.tokens, batch.loss_mask, batch.segments)))
    if batch.tokens.ndim != 3:
        raise MtjaxError(f"tokens must be [accum, batch, seq] or [batch, seq], got shape {batch.tokens.shape}")
    return batch


def concat(batches) -> Batch:
    """One Batch of several along the micro-batch axis (Batches or token arrays, all alike:
    every one with a loss mask and document ids, or none)."""
    batches = [as_batch(b) for b in batches]
    fields = [[getattr(b, name) for b in batches] for name in ("tokens", "loss_mask", "segments")]
    return Batch(*(None if all(a is None for a in arrays) else np.concatenate(arrays) for arrays in fields))
