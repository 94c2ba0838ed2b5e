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


def _dot(x, w, split: bool = False):
    """x [..., d] @ w [d, f], accumulated in fp32 (bf16 matmuls are only fast that way on CPU).

    For the CPU the token axes are flattened into one first (`rows`). On [b, t, d], XLA's
    CPU backend wrote the backward's activation gradients transposed for the weight-gradient
    dots, and reduced 3-D norms slowly: flat, one block's forward + backward ran ~9%
    faster (width 1024). Below fp32 the CPU's dot has its backward written out
    (`_low_dot`). Other platforms get the dot as it is (mtjax.target: the platform traced
    for). `split`: x's tokens are split over devices (see `rows`).
    """
    if target.platform() != "cpu":
        return jnp.einsum("...d,df->...f", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    flat, back = rows(x, split)
    if x.dtype == jnp.float32:
        y = jnp.einsum("td,df->tf", flat, w.astype(x.dtype), preferred_element_type=jnp.float32)
    else:  # named: remat policy "dots" (mtjax.model) keeps it, as it keeps the dots themselves
        y = checkpoint_name(_low_dot(flat, w.astype(x.dtype)), LOW_DOT)
    return back(y.astype(x.dtype))


def rows(x, split: bool = False):
    """(x [..., d] as rows [n, d], the function putting rows [n, f] back as [..., f]).

    `split`: each row's tokens are split over devices (stream.split: sequence, x [b, t, ...]
    sharded along t). Flattening b * t would lose that sharding (a merged axis keeps only
    its major axis's): XLA gathered every row onto every device, each ran the dense layers
    over all of them (an fp32 block at batch 2 x 4096 tokens held 1.69x its planned
    temporaries at 2 devices, 4.75x at 8; at 2 x 2048 over 2 devices, width 512, it ran
    2.6 s of CPU time, 1.6 s token-major, AMD Zen 4). So the rows go token-major, [t, b, ...] flattened, whose major
    axis keeps each device's share (one row: the same as b * t)."""
    shape = x.shape
    if not split or x.ndim < 3 or shape[0] == 1:
        return x.reshape(-1, shape[-1]), lambda y: y.reshape(*shape[:-1], y.shape[-1])
    moved = jnp.swapaxes(x, 0, 1)
    return (moved.reshape(-1, shape[-1]),
            lambda y: jnp.swapaxes(y.reshape(*moved.shape[:-1], y.shape[-1]), 0, 1))


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
        self.split = cfg.splits_rows  # see `rows`

    def add_adapter(self, rank: int, scale: float, rngs: nnx.Rngs, dropout: float = 0.0) -> None:
        """A fresh LoRA adapter of `rank` (A as PEFT draws it, B zero: the output unchanged)."""
        d_in, d_out = self.kernel.shape
        # nnx.data: the attributes held None (static) until now
        self.lora_a = nnx.data(nnx.Param(lora.init_a(rngs.params(), d_in, rank)))
        self.lora_b = nnx.data(nnx.Param(jnp.zeros((rank, d_out), jnp.float32)))
        self.lora_scale, self.lora_dropout = scale, dropout

    def __call__(self, x):
        y = _dot(x, self.kernel[...], self.split)
        y = y + self.bias[...].astype(y.dtype) if self.bias is not None else y
        if self.lora_a is None:
            return y
        with jax.named_scope("lora"):
            h = _dot(lora.dropped(x, self.lora_dropout), self.lora_a[...], self.split)  # [..., r]
            return y + (self.lora_scale * _dot(h, self.lora_b[...], self.split)).astype(y.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with fp32 statistics, as transformers computes it (see `rms_norm`); `eps`:
    where not the config's rms_norm_eps."""

    def __init__(self, dim: int, cfg: ModelConfig, eps: float | None = None):
        # Gemma's (1 + w) norms start at w = 0, the others' w at 1: both the identity scale.
        self.weight = nnx.Param(jnp.full((dim,), 0.0 if cfg.rms_norm_offset else 1.0, jnp.float32))
        self.eps, self.offset = cfg.rms_norm_eps if eps is None else eps, cfg.rms_norm_offset
        self.split = cfg.splits_rows  # see `rows`

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps, self.offset, self.split)


def rms_norm(x, weight, eps: float, offset: bool = False, split: bool = False):
    """Over the last axis; computed on flat rows (`rows`, `split` as there; see `_dot`: 10x
    faster backward).

    Llama's scales by w after casting back to x's dtype; with `offset` (Gemma's) it scales
    by (1 + w) in fp32 and casts afterwards; with no weight (None: Llama 4's L2 q/k norm)
    it only normalises."""
    flat, back = rows(x, split)
    x32 = flat.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return back(normed.astype(x.dtype))
    if offset:
        return back((normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype))
    return back(weight.astype(x.dtype) * normed.astype(x.dtype))
