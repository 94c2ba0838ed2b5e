"""Rotary position embeddings in the Hugging Face rotate-half layout.

The first half of each head's features pairs with the second half (not interleaved
pairs). Frequencies follow transformers' fp32 computation, including the `linear` and
`llama3` rescalings.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from mtjax.model_config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies, float32 [head_dim // 2]."""
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def cos_sin(cfg: ModelConfig, positions: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables [..., seq, head_dim] for integer `positions` [..., seq]."""
    inv_freq = jnp.asarray(inv_frequencies(cfg))
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [..., t, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # rotate-half layout
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate x [batch, seq, heads, head_dim] by the tables [batch|1, seq, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
