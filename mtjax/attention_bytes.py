"""What attention holds on a device beyond the residuals its vjp keeps, priced for the
planner (the attention layers' `working`, mtjax.layers.softmax and mtjax.layers.latent):
`working_bytes` for the kernel `attend` picks (mtjax.attention.kernel; the chunked kernel's
geometry is mtjax.attention_chunked's), `gathered_bytes` for the keys and values that one
device of a row split over devices gathers.
"""

from __future__ import annotations

import jax.numpy as jnp

from mtjax import attention
from mtjax.attention_chunked import CHUNK_ROWS, UNROLLED_CHUNKS, query_chunks


# The CUDA capability assumed for a GPU when none is here: the GPUs of the planner's
# hardware profiles (mtjax.plan.hardware) are Hopper.
PLANNED_CAPABILITY = 9.0


def working_bytes(platform: str, dtype, batch: int, heads: int, seq: int, head_dim: int, window: int | None = None,
                  softcap: float | None = None, sinks: bool = False, devices: int = 1,
                  kv_heads: int | None = None) -> int:
    """Bytes `attend`'s recompute and backward on `platform` ("cpu", "gpu", ...) hold at
    once beyond what its vjp keeps (q, k, v, the output, a log-sum-exp per query: the
    residuals the planner traces): fp32 probabilities and their gradient over the
    scores' tiles, per row and query head. The chunked kernel's unrolled chunks (up to
    UNROLLED_CHUNKS of CHUNK_ROWS queries) hold every chunk's tiles over its visible keys
    at once, O(t^2), and each chunk's own slices of the keys and of the values over those
    keys (`kv_heads` of each; default `heads`), in the compute dtype: XLA shares the
    recompute's slices with the backward's, so all of them are live when the backward
    starts (a slice that is the whole row is the array itself, a residual: not counted).
    Its loop (longer rows, and a row split over `devices`, `seq` being one device's share)
    holds one [rows, rows] block's tiles, and on the CPU below fp32 also fp32 copies of the
    queries, keys and values that its forward and backward loops carry from the recompute
    to the backward; the fused GPU kernels (`kernel`: cuDNN, Pallas) keep their tiles on
    chip: none counted."""
    backend = "cuda" if platform == "gpu" else platform
    capability = (attention.cuda_capability() or PLANNED_CAPABILITY) if backend == "cuda" else None
    which = attention.kernel(backend, dtype, head_dim, window, softcap, capability=capability, sinks=sinks)
    if devices == 1 and which != "chunked":
        return 0
    kv = kv_heads or heads
    if devices > 1 or -(-seq // CHUNK_ROWS) > UNROLLED_CHUNKS:
        tiles = CHUNK_ROWS * CHUNK_ROWS
        copies = 4 * batch * seq * head_dim * (heads + 2 * kv)
        held = copies if platform == "cpu" and jnp.dtype(dtype).itemsize < 4 else 0  # widened q, k, v
    else:
        chunks = query_chunks(seq, window, CHUNK_ROWS)
        tiles = sum((r1 - r0) * (r1 - k0) for r0, r1, k0 in chunks)
        sliced = sum(r1 - k0 for _, r1, k0 in chunks if r1 - k0 < seq)  # keys in chunks' own slices
        held = 2 * jnp.dtype(dtype).itemsize * batch * kv * head_dim * sliced  # of the keys and the values
    return 2 * 4 * batch * heads * tiles + held


def gathered_bytes(platform: str, dtype, batch: int, kv_heads: int, seq: int, head_dim: int, devices: int = 1) -> int:
    """Bytes one device of `split_attention` on `platform` holds beyond an unsplit kernel
    over its share of `seq` tokens (its residuals and `working_bytes` price that share):
    the keys and values gathered from the other `devices - 1` shares, in `dtype` (in fp32
    on the CPU, whose XLA backend converts them before the all-gather: its loop runs in
    fp32), and their fp32 cotangents over those positions (`_flash_bwd` sums dk, dv of the
    whole row in fp32 before the gather's transpose reduce-scatters them). None on one
    device. The document ids gathered with them (int32, one a token) are left out."""
    others = batch * seq * (devices - 1) * kv_heads * head_dim
    return 2 * others * ((4 if platform == "cpu" else jnp.dtype(dtype).itemsize) + 4)
