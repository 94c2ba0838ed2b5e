"""Flash attention as a Pallas kernel, for the GPU cases cuDNN (through jax's API) does not take.

`jax.nn.dot_product_attention` has no document (segment) ids and no logit soft-cap, so
packed rows and Gemma's capped scores (and their sliding windows) would otherwise run the
chunked XLA kernel of mtjax.attention_chunked on a GPU. This is the same computation written as
Pallas kernels (`pl.pallas_call` over a grid with BlockSpecs, the form Pallas lowers to
Triton on a GPU): one program per (query block, row, head) keeps its block's running
softmax (flash attention's online rescaling) over the key blocks it can see, and writes
the output and one log-sum-exp per query. The backward (custom_vjp) recomputes the
probabilities from that log-sum-exp: one kernel per key block sums dK and dV over the
query blocks that see it, one per query block sums dQ; dS = P * (dP - rowsum(dO * O)).

Masks are mtjax.attention_mask's (`visible`): causal, a window of W keys including the query
itself, same document where `segments` [b, t] are given. Rows are padded to whole blocks
with positions past the row (and document -1), which no real query sees; a padded query
sees at least itself, so every softmax row is finite, and its output is dropped.

Layouts as mtjax.attention_chunked: q [b, t, heads, hd], k and v [b, t, kv_heads, hd] (grouped
queries when kv_heads < heads); scores fp32. `interpret=True` runs the kernels on any
backend (the CPU tests); mtjax.attention.attend picks this kernel on a CUDA GPU only, where
a probe compiles it for the shape. It lowers to Triton for CUDA (tested on the CPU); its GPU
compile and speed are unmeasured (no GPU here).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton

BLOCK_Q = 64  # query rows per program
BLOCK_K = 64  # key rows per inner step


def _mask(qpos, kpos, window, q_seg, k_seg):
    """mtjax.attention_mask.visible's mask, [bq, bk]: causal, within the window, same document."""
    mask = kpos[None, :] <= qpos[:, None]
    if window:
        mask &= kpos[None, :] > qpos[:, None] - window
    if q_seg is not None:
        mask &= q_seg[:, None] == k_seg[None, :]
    return mask


def _scores(q, k, scale, softcap):
    """Scaled (and capped) fp32 scores [bq, bk] of q [bq, hd] on k [bk, hd]."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    return jnp.tanh(s / softcap) * softcap if softcap else s


def _key_range(i, bq, bk, window, blocks):
    """(first, end) key block that query block i sees."""
    first = jnp.maximum(0, i * bq - window + 1) // bk if window else 0
    return first, jnp.minimum((i * bq + bq - 1) // bk + 1, blocks)


def _query_range(j, bq, bk, window, blocks):
    """(first, end) query block that sees key block j."""
    end = jnp.minimum((j * bk + bk - 2 + window) // bq + 1, blocks) if window else blocks
    return (j * bk) // bq, end


def _segments_of(seg_refs, q_rows, k_rows):
    """(query, key) document ids of those rows of the refs, or (None, None) without documents."""
    if not seg_refs:
        return None, None
    q_seg_ref, k_seg_ref = seg_refs
    return q_seg_ref[q_rows], k_seg_ref[k_rows]


def _forward_kernel(q_ref, k_ref, v_ref, *refs, scale, window, softcap, bq, bk):
    *seg_refs, o_ref, lse_ref = refs
    i = pl.program_id(0)
    q = q_ref[...]
    qpos = i * bq + jnp.arange(bq)

    def key_block(j, carry):
        m, total, acc = carry
        rows = pl.ds(j * bk, bk)
        k, v = k_ref[rows, :], v_ref[rows, :]
        s = _scores(q, k, scale, softcap)
        mask = _mask(qpos, j * bk + jnp.arange(bk), window, *_segments_of(seg_refs, slice(None), rows))
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that has seen no key yet
        e = jnp.where(mask, jnp.exp(s - m_safe[:, None]), 0.0)
        rescale = jnp.exp(m - m_safe)
        pv = jax.lax.dot(e.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, rescale * total + jnp.sum(e, axis=1), rescale[:, None] * acc + pv

    first, end = _key_range(i, bq, bk, window, k_ref.shape[0] // bk)
    init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, total, acc = jax.lax.fori_loop(first, end, key_block, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)  # total > 0: every query sees itself
    lse_ref[...] = m + jnp.log(total)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale, window, softcap, bq, bk):
    *seg_refs, dk_ref, dv_ref = refs
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    kpos = j * bk + jnp.arange(bk)

    def query_block(i, carry):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s = _scores(q, k, scale, softcap)
        q_seg, k_seg = _segments_of(seg_refs, rows, slice(None))
        mask = _mask(i * bq + jnp.arange(bq), kpos, window, q_seg, k_seg)
        p = jnp.where(mask, jnp.exp(s - lse_ref[rows][:, None]), 0.0)
        dv = dv + jax.lax.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[rows][:, None])
        if softcap:
            ds = ds * (1.0 - jnp.square(s / softcap))  # d cap(z) / dz = 1 - tanh^2, with s = cap(z)
        ds = (ds * scale).astype(q.dtype)
        return dk + jax.lax.dot(ds.T, q, preferred_element_type=jnp.float32), dv

    first, end = _query_range(j, bq, bk, window, q_ref.shape[0] // bq)
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(first, end, query_block, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale, window, softcap, bq, bk):
    *seg_refs, dq_ref = refs
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    qpos, lse, delta = i * bq + jnp.arange(bq), lse_ref[...][:, None], delta_ref[...][:, None]

    def key_block(j, dq):
        rows = pl.ds(j * bk, bk)
        k, v = k_ref[rows, :], v_ref[rows, :]
        s = _scores(q, k, scale, softcap)
        mask = _mask(qpos, j * bk + jnp.arange(bk), window, *_segments_of(seg_refs, slice(None), rows))
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta)
        if softcap:
            ds = ds * (1.0 - jnp.square(s / softcap))
        return dq + jax.lax.dot((ds * scale).astype(k.dtype), k, preferred_element_type=jnp.float32)

    first, end = _key_range(i, bq, bk, window, k_ref.shape[0] // bk)
    dq_ref[...] = jax.lax.fori_loop(first, end, key_block, jnp.zeros(q.shape, jnp.float32)).astype(dq_ref.dtype)


# BlockSpecs over [b, n, heads, hd] tensors and [b, heads, n] per-query rows; grid (block, b, head).
def _rows(block, hd, kv_group=1):
    return pl.BlockSpec((None, block, None, hd), lambda i, b, h: (b, i, h // kv_group, 0))


def _whole(n, hd, kv_group=1):
    return pl.BlockSpec((None, n, None, hd), lambda i, b, h: (b, 0, h // kv_group, 0))


def _per_query(block):
    return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))


def _segment_specs(block, n):  # the program's own block of document ids, and the whole row's
    return [pl.BlockSpec((None, block), lambda i, b, h: (b, i)), pl.BlockSpec((None, n), lambda i, b, h: (b, 0))]


def _call(body, grid, in_specs, out_specs, out_shape, interpret, **static):
    # Triton's compiler parameters: on a GPU the call lowers to Triton (not Mosaic GPU, jax's default)
    return pl.pallas_call(functools.partial(body, **static), grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret, compiler_params=triton.CompilerParams())


def _pad(q, k, v, segments, bq, bk):
    """Rows padded to whole blocks of both sizes; padded tokens are document -1."""
    t = q.shape[1]
    n = -(-t // math.lcm(bq, bk)) * math.lcm(bq, bk)

    def pad(x, fill=0):
        return jnp.pad(x, [(0, 0), (0, n - t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)

    return pad(q), pad(k), pad(v), None if segments is None else pad(segments.astype(jnp.int32), -1)


def _forward(q, k, v, segments, scale, window, softcap, bq, bk, interpret):
    """(output [b, n, heads, hd], log-sum-exp [b, heads, n] fp32) of the padded row."""
    (b, n, heads, hd), group = q.shape, q.shape[2] // k.shape[2]
    seg = [] if segments is None else [segments, segments]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, heads, n), jnp.float32)]
    in_specs = [_rows(bq, hd), _whole(n, hd, group), _whole(n, hd, group)] + (_segment_specs(bq, n) if seg else [])
    return _call(_forward_kernel, (n // bq, b, heads), in_specs, [_rows(bq, hd), _per_query(bq)], out_shape,
                 interpret, scale=scale, window=window, softcap=softcap, bq=bq, bk=bk)(q, k, v, *seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _attention(q, k, v, segments, scale, window, softcap, bq, bk, interpret):
    return _forward(q, k, v, segments, scale, window, softcap, bq, bk, interpret)[0]


def _attention_fwd(q, k, v, segments, scale, window, softcap, bq, bk, interpret):
    out, lse = _forward(q, k, v, segments, scale, window, softcap, bq, bk, interpret)
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(scale, window, softcap, bq, bk, interpret, res, dout):
    q, k, v, segments, out, lse = res
    (b, n, heads, hd), group = q.shape, q.shape[2] // k.shape[2]
    # rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's correction term, [b, heads, n]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    static = dict(scale=scale, window=window, softcap=softcap, bq=bq, bk=bk)
    seg = [] if segments is None else [segments, segments]
    # dK and dV per query head (grid over key blocks), summed over each kv head's group below
    whole_row = pl.BlockSpec((None, None, n), lambda j, b, h: (b, h, 0))
    by_key = [_whole(n, hd), _rows(bk, hd, group), _rows(bk, hd, group), _whole(n, hd), whole_row, whole_row]
    if seg:  # the whole row's document ids for the queries, the program's block for its keys
        by_key += [pl.BlockSpec((None, n), lambda j, b, h: (b, 0)), pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
    shape = jax.ShapeDtypeStruct((b, n, heads, hd), jnp.float32)
    dk, dv = _call(_dkv_kernel, (n // bk, b, heads), by_key, [_rows(bk, hd), _rows(bk, hd)], [shape, shape],
                   interpret, **static)(q, k, v, dout, lse, delta, *seg)
    by_query = [_rows(bq, hd), _whole(n, hd, group), _whole(n, hd, group), _rows(bq, hd), _per_query(bq),
                _per_query(bq)] + (_segment_specs(bq, n) if seg else [])
    dq = _call(_dq_kernel, (n // bq, b, heads), by_query, _rows(bq, hd), jax.ShapeDtypeStruct(q.shape, q.dtype),
               interpret, **static)(q, k, v, dout, lse, delta, *seg)
    fold = lambda d, x: d.reshape(b, n, k.shape[2], group, hd).sum(3).astype(x.dtype)  # noqa: E731
    return dq, fold(dk, k), fold(dv, v), None  # no cotangent for document ids


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, scale: float, window: int | None = None, softcap: float | None = None, segments=None,
                    *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K, interpret: bool = False):
    """softmax(cap(q k^T * scale), causal [and window] [and same-document] mask) v, as
    mtjax.attention_chunked.causal_attention computes it: q [b, t, heads, hd], k and v
    [b, t, kv_heads, hd], `segments` [b, t] document ids; blocks of `block_q` queries by
    `block_k` keys (on a GPU, powers of two of at least 16). Differentiable in q, k, v."""
    t = q.shape[1]
    q, k, v, segments = _pad(q, k, v, segments, block_q, block_k)
    out = _attention(q, k, v, segments, float(scale), window or None, softcap or None, block_q, block_k, interpret)
    return out[:, :t]
