"""Documents in a step's batch: which targets count and how much each micro-batch weighs
(on the host), and where each document's positions begin (on the device).

The step's loss is the mean over every counted target of the step, across micro-batches
(not a mean of per-micro-batch means): micro-batch i's mean loss is weighted by
count_i / total, its share of the step's counted targets, which is known on the host
before the step runs. A plain batch (every target counts, one document per row) keeps
its equal weights 1 / accum and runs the same programs as it always did: its device
inputs carry no segments and no targets (None, decided when the program is traced).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.batch import Batch, as_batch
from mtjax.errors import MtjaxError


class NothingToTrain(MtjaxError):
    """Every target of a step (or of an evaluation) is masked out."""


class Inputs(NamedTuple):
    """What the device gets of a batch: a pytree, put on the device in one call.

    Arrays are [..., batch, seq]: the whole step's [accum, batch, seq], or one micro-batch.
    """

    tokens: np.ndarray  # int32
    segments: np.ndarray | None  # int32 document ids (0: padding); None: one document per row
    targets: np.ndarray | None  # bool: token t is a counted target; None: every target counts

    def micro(self, i: int) -> Inputs:
        """Micro-batch i of the step's inputs."""
        return Inputs(*(None if a is None else a[i] for a in self))


def targets(batch: Batch) -> np.ndarray | None:
    """bool [accum, batch, seq]: whether token t counts as a target (None for a plain batch).

    A target is a token that the loss mask keeps, outside padding (segment 0), in the same
    document as the token before it (so never the first token of a row or of a document).
    """
    if batch.plain:
        return None
    out = np.ones(batch.tokens.shape, bool) if batch.loss_mask is None else np.array(batch.loss_mask, bool)
    out[..., 0] = False
    if batch.segments is not None:
        seg = np.asarray(batch.segments)
        out &= seg != 0
        out[..., 1:] &= seg[..., 1:] == seg[..., :-1]
    return out


def step_inputs(batch, what: str = "step") -> tuple[Inputs, np.ndarray]:
    """(device inputs [accum, batch, seq], float64 weight of each micro-batch, summing to 1).

    Raises NothingToTrain when no target of the whole `what` counts.
    """
    batch = as_batch(batch)
    counted = targets(batch)
    segments = None if batch.segments is None else np.asarray(batch.segments, np.int32)
    tokens, accum = np.asarray(batch.tokens, np.int32), batch.tokens.shape[0]
    if counted is None:
        return Inputs(tokens, None, None), np.full(accum, 1.0 / accum)
    counts = counted.sum(axis=(1, 2), dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        raise NothingToTrain(f"every token of this {what}'s batch is masked out of the loss (no answer tokens, "
                             f"or documents of one token): nothing to learn from; check the data's loss masks, "
                             "or prepare it to train on every token")
    return Inputs(tokens, segments, counted), counts / total


def trained_tokens(batch) -> int:
    """The tokens a step learns from, as tokens/s and MFU count them: its counted targets;
    every token of a plain batch (as throughput has always been counted for text windows)."""
    batch = as_batch(batch)
    counted = targets(batch)
    return int(batch.tokens.size if counted is None else counted.sum())


def positions(segments: jnp.ndarray) -> jnp.ndarray:
    """int32 [..., seq]: each token's position in its document, restarting at 0 where a
    document begins (where the segment id changes)."""
    t = segments.shape[-1]
    index = jnp.arange(t, dtype=jnp.int32)
    begins = jnp.concatenate([jnp.ones_like(segments[..., :1], bool), segments[..., 1:] != segments[..., :-1]],
                             axis=-1)
    first = jax.lax.cummax(jnp.where(begins, index, 0), axis=segments.ndim - 1)
    return index - first
