"""The pieces every layer kind builds from: a dense projection and RMSNorm.

Kernels are stored [in, out] (y = x @ kernel), initialised normal(initializer_range).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mtjax import lora, target
from mtjax.model_config import ModelConfig


LOW_DOT = "low_precision_dot"  # the checkpoint name of `_low_dot`'s outputs


def _dot(x, w):
    """x [..., d] @ w [d, f], accumulated in fp32 (bf16 matmuls are only fast that way on CPU).

    For the CPU the token axes are flattened into one first. On [b, t, d], XLA's CPU
    backend wrote the backward's activation gradients transposed for the weight-gradient
    dots, and reduced 3-D norms slowly: flat, one block's forward + backward ran ~9%
    faster (width 1024). Below fp32 the CPU's dot has its backward written out
    (`_low_dot`). Other platforms get the dot as it is (mtjax.target: the platform traced
    for).
    """
    if target.platform() != "cpu":
        return jnp.einsum("...d,df->...f", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    flat = x.reshape(-1, x.shape[-1])
    if x.dtype == jnp.float32:
        y = jnp.einsum("td,df->tf", flat, w.astype(x.dtype), preferred_element_type=jnp.float32)
    else:  # named: remat policy "dots" (mtjax.model) keeps it, as it keeps the dots themselves
        y = checkpoint_name(_low_dot(flat, w.astype(x.dtype)), LOW_DOT)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


@jax.custom_vjp
def _low_dot(x, w):
    """x [t, d] @ w [d, f] in a low-precision dtype (bf16), accumulated in fp32, rounded to x's dtype.

    Differentiated by JAX, the fp32 cotangent of the rounding made both backward dots fp32
    (JAX upcasts the other operand to match): on the CPU that ran them without the bf16
    (AMX) kernels. Here the cotangent is rounded first, as the forward's output was, and
    each backward dot takes bf16 operands and accumulates in fp32, so they compute what
    the autodiff did up to summation order. One bf16 block forward + backward (width 1024,
    seq 512, Sapphire Rapids): 307-313 -> 243-252 ms of CPU time; with the weight gradient's
    dot on bf16 too (`transposed`) -> 154-168 ms. (The same backward for fp32 measured no
    faster than XLA's own: fp32 keeps JAX's derivative.)"""
    return jnp.einsum("td,df->tf", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _low_dot_fwd(x, w):
    return _low_dot(x, w), (x, w)


def _low_dot_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("tf,df->td", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("dt,tf->df", transposed(x), g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


def transposed(x):
    """x [t, d] transposed into an array of its own, [d, t]. XLA's CPU backend upcasts a
    bf16 dot whose left operand contracts over its major axis (the weight gradient's, over
    the tokens) to fp32, and folds a transpose written before the dot back into it (an
    optimization barrier or an elementwise op in between does not stop it). Through a pad
    and a slice it does not: one [512 x 1024] x [512 x 2816] weight gradient 22.4 -> 6.2 ms
    of CPU time (Sapphire Rapids, AMX), the transpose's copy included."""
    return jnp.pad(x.T, ((0, 0), (0, 1)))[:, :x.shape[0]]


_low_dot.defvjp(_low_dot_fwd, _low_dot_bwd)


class Dense(nnx.Module):
    """y = x @ kernel (+ bias), plus a LoRA adapter's scale * (x @ lora_a) @ lora_b where
    one is added (`add_adapter`, mtjax.lora)."""

    def __init__(self, d_in: int, d_out: int, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32)) if bias else None
        self.lora_a = self.lora_b = None
        self.lora_scale = self.lora_dropout = 0.0

    def add_adapter(self, rank: int, scale: float, rngs: nnx.Rngs, dropout: float = 0.0) -> None:
        """A fresh LoRA adapter of `rank` (A as PEFT draws it, B zero: the output unchanged)."""
        d_in, d_out = self.kernel.shape
        # nnx.data: the attributes held None (static) until now
        self.lora_a = nnx.data(nnx.Param(lora.init_a(rngs.params(), d_in, rank)))
        self.lora_b = nnx.data(nnx.Param(jnp.zeros((rank, d_out), jnp.float32)))
        self.lora_scale, self.lora_dropout = scale, dropout

    def __call__(self, x):
        y = _dot(x, self.kernel[...])
        y = y + self.bias[...].astype(y.dtype) if self.bias is not None else y
        if self.lora_a is None:
            return y
        with jax.named_scope("lora"):
            h = _dot(lora.dropped(x, self.lora_dropout), self.lora_a[...])  # [..., r]
            return y + (self.lora_scale * _dot(h, self.lora_b[...])).astype(y.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with fp32 statistics, as transformers computes it (see `rms_norm`); `eps`:
    where not the config's rms_norm_eps."""

    def __init__(self, dim: int, cfg: ModelConfig, eps: float | None = None):
        # Gemma's (1 + w) norms start at w = 0, the others' w at 1: both the identity scale.
        self.weight = nnx.Param(jnp.full((dim,), 0.0 if cfg.rms_norm_offset else 1.0, jnp.float32))
        self.eps, self.offset = cfg.rms_norm_eps if eps is None else eps, cfg.rms_norm_offset

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
