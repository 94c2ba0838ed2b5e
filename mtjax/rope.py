"""Rotary position embeddings in the Hugging Face rotate-half layout, or interleaved.

The first half of each head's rotated features pairs with the second half; with
`cfg.rope_interleaved` (Llama 4, whose transformers code multiplies complex numbers)
features 2i and 2i + 1 pair instead, the tables then holding each frequency twice in a
row. With a `partial_rotary_factor` below 1 only the first `rotary_dim`
features of each head turn; the rest pass through. Frequencies follow transformers' fp32
computation, including the `linear`, `llama3`, `longrope` and `yarn` rescalings; longrope
and yarn also multiply cos and sin by an attention factor.

Longrope picks its short or long factors by the length of the rows being computed, as
transformers 5 does: the long ones when the largest position + 1 exceeds
original_max_position_embeddings (not by max_position_embeddings), for all positions of
the call. A KV-cached sampler that grows past that length keeps the keys it rotated with
the short factors (transformers recomputes its cache there).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig


def for_layer(cfg: ModelConfig, spec: LayerSpec) -> ModelConfig:
    """The config whose rope_theta and rope_scaling rotate a layer of `spec`: its own rope's
    (Gemma 3's sliding layers have a base of their own); `cfg` for a layer without RoPE."""
    r = spec.rope
    if r is None or (r.theta, r.scaling) == (cfg.rope_theta, cfg.rope_scaling):
        return cfg
    return dataclasses.replace(cfg, rope_theta=r.theta, rope_scaling=r.scaling)


def _exponents(cfg: ModelConfig) -> np.ndarray:
    dim = cfg.rotary_dim
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def inv_frequencies(cfg: ModelConfig, long: bool = False) -> np.ndarray:
    """Per-pair rotation frequencies, float32 [rotary_dim // 2]; `long`: longrope's long factors."""
    base = (np.float32(cfg.rope_theta) ** _exponents(cfg)).astype(np.float32)
    inv_freq = (1.0 / base).astype(np.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type == "longrope":
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float32)
        return (1.0 / (factors * base)).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn(cfg, base)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    # Equal factors (Llama 4 Scout's) leave no band between: the 0/0 it would divide is never picked.
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(cfg: ModelConfig, base: np.ndarray) -> np.ndarray:
    """YaRN: pairs turning fewer than beta_slow times over the pre-training context are
    slowed by `factor`, those turning more than beta_fast times kept, a linear ramp between."""
    s, dim = cfg.rope_scaling, cfg.rotary_dim

    def pair_index(rotations):  # the (fractional) pair that turns `rotations` times over the context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = pair_index(s.beta_fast), pair_index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = (1 - ramp).astype(np.float32)  # 1: the pair keeps its frequency; 0: slowed by `factor`
    slowed = (1.0 / (np.float32(s.factor) * base)).astype(np.float32)
    return (slowed * (1 - kept) + (1.0 / base).astype(np.float32) * kept).astype(np.float32)


def attention_factor(cfg: ModelConfig) -> float:
    """The multiplier of cos and sin: 1 but for longrope and yarn (theirs unless the config sets one)."""
    s = cfg.rope_scaling
    if s is None or s.rope_type not in ("longrope", "yarn"):
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.rope_type == "longrope":
        if s.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def cos_sin(cfg: ModelConfig, positions: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables [..., seq, rotary_dim] for integer `positions` [..., seq]."""
    inv_freq = jnp.asarray(inv_frequencies(cfg))
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "longrope":
        long = jnp.max(positions) + 1 > s.original_max_position_embeddings
        inv_freq = jnp.where(long, jnp.asarray(inv_frequencies(cfg, long=True)), inv_freq)
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [..., t, rd/2]
    # Interleaved: [f0, f0, f1, f1, ...]; rotate-half: [f0, f1, ..., f0, f1, ...].
    emb = jnp.repeat(freqs, 2, axis=-1) if cfg.rope_interleaved else jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    scale = attention_factor(cfg)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def apply(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, interleaved: bool = False) -> jnp.ndarray:
    """Rotate the first rotary_dim features of x [batch, seq, heads, head_dim] by the
    tables [batch|1, seq, rotary_dim]; the others pass unchanged. `interleaved`: the
    tables are `cos_sin`'s of a config with rope_interleaved."""
    rd = cos.shape[-1]
    turned, kept = x[..., :rd], x[..., rd:]
    if interleaved:  # (a, b) -> (-b, a) per pair: a + ib times cos + i sin
        pairs = turned.reshape(*turned.shape[:-1], rd // 2, 2)
        rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(turned.shape)
    else:
        half = rd // 2
        rotated = jnp.concatenate([-turned[..., half:], turned[..., :half]], axis=-1)
    out = turned * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([out, kept], axis=-1) if kept.shape[-1] else out
