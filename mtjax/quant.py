"""Quantized formats of a frozen base's linear weights: int8 and NF4, in JAX.

A quantized leaf (a frozen 2-D kernel, mtjax.precision) is one uint8 array, its packed
bytes, which the store keeps as its compute copy and the step stages; the block
decodes it on the device (`decode`) into the compute dtype before using it. A kernel is
[in, out] (x @ kernel); W = kernel.T is the [out, in] weight a Hugging Face checkpoint
holds.

    int8  QLoRA's absmax quantization per output channel: c = 127 / absmax(W[j, :]),
          codes round(c * W[j, :]) in int8, decoded as code * scale, scale =
          absmax * fp32(1 / 127). Bytes: the codes, as the kernel [in, out] (in * out),
          then the scales (fp32, [out]).
    nf4   QLoRA's 4-bit NormalFloat in blocks of 64: 64 consecutive weights of one output
          channel (a column of the kernel; the input axis padded with zeros to a multiple
          of 64) share their absmax; each weight / absmax is replaced by the index of the
          nearest of the 16 NF4 levels, decoded as level * absmax. With the input size a
          multiple of 64 (every model's) these are bitsandbytes' blocks of the checkpoint's
          [out, in] tensor. Bytes: the indices, two a byte (rows 2i and 2i + 1 of a column,
          the first in the high nibble), as [blocks, 32, out], then the absmax of each
          block (fp32, [blocks, out]). No double quantization of the absmax: 4.5 bits a
          weight. Nothing is transposed, so encode and decode are elementwise work.

`encode(fmt, kernel)` and `decode(fmt, packed, shape, dtype)` are traceable; `to_host`
and `from_host` run them on the CPU backend. tests/test_quant.py checks both formats
against a numpy reference written from the QLoRA paper's definitions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("int8", "nf4")
PACKED = np.dtype(np.uint8)  # a quantized leaf's compute copy: its bytes
NF4_BLOCK = 64
# The 16 NF4 levels as bitsandbytes publishes them (QLoRA's quantiles of N(0, 1), scaled to [-1, 1]).
NF4_LEVELS = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2  # a value above k of them takes level k


def check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; one of {', '.join(FORMATS)}")


def nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of the packed copy of a kernel of `shape` ([in, out])."""
    check(fmt)
    n, out = math.prod(shape), shape[-1]
    if fmt == "int8":
        return n + 4 * out
    return -(-shape[0] // NF4_BLOCK) * out * (NF4_BLOCK // 2 + 4)


def _bytes_of(x) -> jax.Array:
    """The little-endian bytes of an fp32 array, flat (uint8)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint8).reshape(-1)


def _fp32_of(b) -> jax.Array:
    return jax.lax.bitcast_convert_type(b.reshape(-1, 4), jnp.float32)


def encode(fmt: str, kernel) -> jax.Array:
    """The packed bytes (uint8, flat) of a 2-D fp32 kernel [in, out]."""
    check(fmt)
    w = jnp.asarray(kernel, jnp.float32)
    if fmt == "int8":
        absmax = jnp.max(jnp.abs(w), axis=0)  # one per output channel
        c = jnp.where(absmax > 0, 127 / jnp.where(absmax > 0, absmax, 1), 1)  # an all-zero channel: codes 0
        codes = jnp.clip(jnp.round(c * w), -127, 127).astype(jnp.int8)
        # Decoded by a product with a stored scale: XLA may turn a division into a product by
        # a rounded reciprocal, so the only division is c's (which the bytes then hold).
        scale = absmax * jnp.float32(1 / 127)
        return jnp.concatenate([jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape(-1), _bytes_of(scale)])
    rows = -(-w.shape[0] // NF4_BLOCK) * NF4_BLOCK
    blocks = jnp.pad(w, ((0, rows - w.shape[0]), (0, 0))).reshape(-1, NF4_BLOCK, w.shape[1])  # [blocks, 64, out]
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    x = blocks / jnp.where(absmax > 0, absmax, 1)[:, None, :]
    # The level's index: how many midpoints lie below x (a chain of selects XLA fuses into
    # one loop; a binary search, jnp.searchsorted, is several times slower on the CPU).
    index = jnp.zeros(x.shape, jnp.uint8)
    for k, m in enumerate(_NF4_MIDPOINTS.tolist()):
        index = jnp.where(x > m, jnp.uint8(k + 1), index)
    packed = (index[:, 0::2] << 4) | index[:, 1::2]  # [blocks, 32, out]
    return jnp.concatenate([packed.reshape(-1), _bytes_of(absmax)])


def decode(fmt: str, packed, shape: tuple[int, ...], dtype) -> jax.Array:
    """The kernel [in, out] = `shape` that packed bytes hold, in `dtype` (each value is
    computed in fp32, then rounded once to `dtype`)."""
    check(fmt)
    n = math.prod(shape)
    if fmt == "int8":
        codes = jax.lax.bitcast_convert_type(packed[:n], jnp.int8).reshape(shape)
        return (codes.astype(jnp.float32) * _fp32_of(packed[n:])).astype(dtype)
    blocks, out = -(-shape[0] // NF4_BLOCK), shape[1]
    cut = blocks * NF4_BLOCK // 2 * out
    pairs = packed[:cut].reshape(blocks, NF4_BLOCK // 2, 1, out)
    index = jnp.concatenate([pairs >> 4, pairs & 0xF], axis=2).reshape(blocks, NF4_BLOCK, out)
    absmax = _fp32_of(packed[cut:]).reshape(blocks, 1, out)
    values = jnp.asarray(NF4_LEVELS)[index] * absmax
    return values.reshape(-1, out)[:shape[0]].astype(dtype)


@functools.lru_cache(maxsize=None)
def _encoder(fmt: str):
    return jax.jit(functools.partial(encode, fmt))


@functools.lru_cache(maxsize=None)
def _decoder(fmt: str, shape: tuple[int, ...], dtype: np.dtype):
    return jax.jit(lambda b: decode(fmt, b, shape, dtype).astype(jnp.float32))


def to_host(fmt: str, kernel: np.ndarray) -> np.ndarray:
    """`encode` on the CPU backend: host bytes of a host kernel."""
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(_encoder(fmt)(np.asarray(kernel, np.float32)))


def from_host(fmt: str, packed: np.ndarray, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """`decode` on the CPU backend, in fp32: the host kernel that host bytes hold, as the
    device computes with it in `dtype`."""
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(_decoder(fmt, tuple(shape), np.dtype(dtype))(np.asarray(packed, PACKED)))
