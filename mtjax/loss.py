"""Next-token cross-entropy, averaged over the counted targets in fp32 (as transformers does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jnp.ndarray, tokens: jnp.ndarray, targets=None) -> jnp.ndarray:
    """Mean loss of predicting tokens[:, 1:] from logits[:, :-1] ([b, t, v], [b, t]).

    `targets` (bool [b, t], mtjax.documents.targets: the loss mask with padding and document
    boundaries folded in) keeps only the tokens it marks; the mean is over those (0 when
    there are none). None: every target counts.

    Written for the CPU's fusions: logits stay one [b * t, v] matrix (no sliced copy; the
    last position of each row gets weight 0) and the target logit is picked by comparing
    against the vocabulary index, so the backward is one elementwise pass, not a scatter.
    """
    b, t, v = logits.shape
    logits = logits.reshape(b * t, v).astype(jnp.float32)
    next_ids = jnp.roll(tokens, -1, axis=1).reshape(b * t, 1)
    counted = jnp.broadcast_to(jnp.arange(t) < t - 1, (b, t))
    if targets is not None:
        counted = counted & jnp.roll(targets, -1, axis=1)  # row i predicts token i + 1
    counted = counted.reshape(b * t)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.sum(jnp.where(jnp.arange(v)[None, :] == next_ids, logits, 0.0), axis=-1)
    count = b * (t - 1) if targets is None else jnp.maximum(jnp.sum(counted), 1)
    return jnp.sum(jnp.where(counted, logz - picked, 0.0)) / count
