"""FP8 checkpoint tensors, as the hub stores DeepSeek-V3 and R1: a weight in float8 e4m3
(`F8_E4M3` in safetensors) beside its `weight_scale_inv`, one fp32 scale per block of
128 x 128 (rows x columns; the last blocks cut short). The weight is the e4m3 value
times its block's scale.

safetensors' numpy reader has no float8 type, so an e4m3 tensor's bytes are read from
the file by its header (memory-mapped: one tensor at a time) and viewed as
ml_dtypes.float8_e4m3fn. mtjax.hf.SafetensorsReader dequantizes on read, so an import
streams shard by shard and tensor by tensor into the store's dtypes as for any checkpoint.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
BLOCK = (128, 128)  # the hub's weight_block_size


def raw(file: str | Path, key: str) -> np.ndarray:
    """The e4m3 tensor `key` of a safetensors file, float8_e4m3fn, memory-mapped."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(size))[key]
    start, end = info["data_offsets"]
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + size + start, shape=(end - start,))
    return data.view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """fp32 weight [rows, cols] from e4m3 `weight` and its per-block scales
    [ceil(rows / block[0]), ceil(cols / block[1])]."""
    rows, cols = weight.shape
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not tile a {rows} x {cols} weight in "
                         f"blocks of {block[0]} x {block[1]} (expected {expected})")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return weight.astype(np.float32) * scale
