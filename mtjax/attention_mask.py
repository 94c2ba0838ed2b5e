"""Which keys each query sees (`visible`): causal, within a sliding window where one is
set, and inside its own document where rows are packed; and the document ids that make
Llama 4's chunked local attention that same mask (`local_chunks`). The chunked kernel
(mtjax.attention_chunked) and the sampling path's cache (the attention layers' masks for
mtjax.attention.masked_attention) mask by this; mtjax.flash_pallas computes the same mask
inside its kernel.

Packed documents: `segments` [b, t] (int document ids, mtjax.batch) confines each query to
the keys of its own document, on top of the causal (and window) mask; a padding token
(segment 0) sees only padding, so every query still sees itself and each softmax row
stays finite. None (plain windows) adds nothing to the traced program. Chunked local
attention (Llama 4) is that same mask over chunk ids (`local_chunks`).
"""

from __future__ import annotations

import jax.numpy as jnp


def visible(query_pos, key_pos, window: int | None = None, query_segments=None, key_segments=None):
    """Which keys each query sees, bool [tq, tk] (or [b, tq, tk] with segments): keys at or
    before the query's position `query_pos` [tq] (`key_pos` [tk]), within its `window` of
    W keys where set (the query's own included), and of its own document where
    `query_segments` [b, tq] and `key_segments` [b, tk] are given. Every attention path
    (training's chunks, sampling's cache) masks by this."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if window:
        mask &= key_pos[None, :] > query_pos[:, None] - window  # W keys including the query itself
    if query_segments is not None:
        mask = mask & (query_segments[:, :, None] == key_segments[:, None, :])
    return mask


def local_chunks(positions, size: int, segments=None):
    """Document ids [b, t] under which attention stays inside chunks of `size` positions
    (Llama 4's chunked attention): a chunk begins wherever a position (in its document,
    mtjax.documents.positions) is a multiple of `size`, and where a document begins.
    Passed as `segments` to `attend` with a window of `size` (implied by the chunks, it
    lets the chunked kernel skip every older key block), chunked attention is the
    document mask's work, forward and custom backward alike; padding (segment 0) stays
    apart from the documents, as its own chunks."""
    starts = positions % size == 0  # position 0 too: every document starts a chunk
    ids = jnp.cumsum(starts.astype(jnp.int32), axis=-1)
    return ids if segments is None else jnp.where(segments == 0, 0, ids)
