"""The pieces every layer kind builds from: a dense projection and RMSNorm.

Kernels are stored [in, out] (y = x @ kernel), initialised normal(initializer_range).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtjax import target
from mtjax.model_config import ModelConfig


def _dot(x, w):
    """x [..., d] @ w [d, f], accumulated in fp32 (bf16 matmuls are only fast that way on CPU).

    For the CPU the token axes are flattened into one first. On [b, t, d], XLA's CPU
    backend wrote the backward's activation gradients transposed for the weight-gradient
    dots, and reduced 3-D norms slowly: flat, one block's forward + backward ran ~9%
    faster (width 1024). Other platforms get the dot as it is (mtjax.target: the platform
    traced for).
    """
    if target.platform() != "cpu":
        return jnp.einsum("...d,df->...f", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    y = jnp.einsum("td,df->tf", x.reshape(-1, x.shape[-1]), w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32)) if bias else None

    def __call__(self, x):
        y = _dot(x, self.kernel[...])
        return y + self.bias[...].astype(y.dtype) if self.bias is not None else y


class RMSNorm(nnx.Module):
    """RMSNorm with fp32 statistics, as transformers computes it (see `rms_norm`)."""

    def __init__(self, dim: int, cfg: ModelConfig):
        # Gemma's (1 + w) norms start at w = 0, the others' w at 1: both the identity scale.
        self.weight = nnx.Param(jnp.full((dim,), 0.0 if cfg.rms_norm_offset else 1.0, jnp.float32))
        self.eps, self.offset = cfg.rms_norm_eps, cfg.rms_norm_offset

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps, self.offset)


def rms_norm(x, weight, eps: float, offset: bool = False):
    """Over the last axis; computed on a flat [rows, d] matrix (see `_dot`: 10x faster backward).

    Llama's scales by w after casting back to x's dtype; with `offset` (Gemma's) it scales
    by (1 + w) in fp32 and casts afterwards; with no weight (None: Llama 4's L2 q/k norm)
    it only normalises."""
    x32 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return normed.astype(x.dtype).reshape(x.shape)
    if offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype).reshape(x.shape)
    return (weight.astype(x.dtype) * normed.astype(x.dtype)).reshape(x.shape)
