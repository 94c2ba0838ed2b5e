"""MXFP4 checkpoint tensors, as the hub stores gpt-oss's experts: `<name>_blocks` (uint8
[E, rows, cols / 32, 16]: 32 FP4 e2m1 values per block, two per byte, the low nibble
first) beside `<name>_scales` (uint8 [E, rows, cols / 32]: one e8m0 exponent per block,
biased by 127). A value is its e2m1 code's number times 2 ** (scale - 127); the tensor
they make is [E, rows, cols], which the checkpoint's unquantized form holds transposed,
[E, cols, rows] (gpt-oss's `gate_up_proj` [E, d, 2f], `down_proj` [E, f, d]).

mtjax.hf.SafetensorsReader dequantizes on read, one expert at a time into the fp32
tensor, so an import streams shard by shard and tensor by tensor into the store's dtypes
as for any checkpoint; an export writes the unquantized tensors.
"""

from __future__ import annotations

import numpy as np

BLOCKS, SCALES = "_blocks", "_scales"  # "x.gate_up_proj" -> "x.gate_up_proj_blocks", "x.gate_up_proj_scales"
# The numbers of the 16 e2m1 codes (sign, 2 exponent bits, 1 mantissa bit).
VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
EXPONENT_BIAS = 127


def shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized tensor's shape, [E, cols, rows], from its blocks' [E, rows, groups, bytes]."""
    experts, rows, groups, size = blocks_shape
    return experts, groups * size * 2, rows


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 [E, cols, rows] from MXFP4 `blocks` [E, rows, cols / 32, 16] and `scales`
    [E, rows, cols / 32] (uint8 both), an expert at a time."""
    if blocks.ndim != 4 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)} "
                         "(expected blocks [E, rows, groups, bytes] and scales [E, rows, groups])")
    out = np.empty(shape(blocks.shape), np.float32)
    for e in range(blocks.shape[0]):
        codes = np.asarray(blocks[e], np.uint8)
        values = np.empty((*codes.shape[:-1], 2 * codes.shape[-1]), np.float32)  # [rows, groups, 32]
        values[..., 0::2], values[..., 1::2] = VALUES[codes & 0x0F], VALUES[codes >> 4]
        exponents = np.asarray(scales[e], np.int32)[..., None] - EXPONENT_BIAS
        out[e] = np.ldexp(values, exponents).reshape(codes.shape[0], -1).T
    return out
