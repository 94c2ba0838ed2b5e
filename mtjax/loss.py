"""Next-token cross-entropy, averaged over targets in fp32 (as transformers does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jnp.ndarray, tokens: jnp.ndarray) -> jnp.ndarray:
    """Mean loss of predicting tokens[:, 1:] from logits[:, :-1] ([b, t, v], [b, t])."""
    logits = logits[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)
