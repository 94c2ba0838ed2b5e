"""Causal self-attention that skips the masked half of the score matrix, with its own backward.

`jax.nn.dot_product_attention` (XLA implementation, which the CPU gets) computes every
head's full [t, t] scores and is differentiated op by op. Here the queries are cut into
row chunks; chunk i scores only the keys it can see, [lo_i, end of chunk i), so with c
chunks about (c - 1) / 2c of the score, softmax and probability work is never done. The
backward is written out with the flash-attention identities (probabilities recomputed
from the saved log-sum-exp; dS = P * (dP - rowsum(dO * O))), which needs fewer passes
over the [t, t] tiles than the autodiff of softmax. Each row's softmax still sees all its
keys at once (no online rescaling), so results match the XLA path to fp32 rounding.

Those chunks are unrolled in one XLA program, which schedules them side by side and holds
their scores at once (O(t^2) temporaries: 1 GiB at 8k tokens for 2 heads). Past
UNROLLED_CHUNKS chunks the same function loops over [rows, rows] blocks instead
(`looped_attention`, flash attention's online softmax, invisible key blocks skipped),
forward and backward; its memory is O(t): the inputs, the output, one log-sum-exp per
query and one block's scores. The same loop attends a row split over devices (context
parallel, `split_attention`): each device's queries against the gathered row.

Where it runs (`attend`, `kernel`): cuDNN's fused flash attention on an NVIDIA GPU where
its API takes the case and a probe compiles it for the shape (`cudnn_refusal`); on such a
GPU the cases it does not take (documents, soft-caps, fp32) by the Pallas kernel of
mtjax.flash_pallas where a probe compiles that (`pallas_refusal`); this kernel everywhere else.

Layouts: q [b, t, heads, hd], k and v [b, t, kv_heads, hd] (grouped-query attention when
kv_heads < heads); scores are [b, kv_heads, group, t_q, t_k], fp32.

Soft-capping (Gemma 2) replaces the scaled scores s by cap * tanh(s / cap) before the mask
and softmax; the backward multiplies dS by its derivative, 1 - tanh^2.

Sinks (gpt-oss): a learned logit per query head that joins every row's softmax
denominator and weighs no value: p_j = exp(s_j) / (sum_j' exp(s_j') + exp(sink)). The
row's log-sum-exp includes it, so the backward's probabilities and dS keep their form,
and d sink = -sum over rows of p_sink * rowsum(dO * O). Both kernels (unrolled and
looped) take them; a row split over devices does not.

Packed documents: `segments` [b, t] (int document ids, mtjax.batch) confines each query to
the keys of its own document, on top of the causal (and window) mask; a padding token
(segment 0) sees only padding, so every query still sees itself and each softmax row
stays finite. None (plain windows) adds nothing to the traced program. Chunked local
attention (Llama 4) is that same mask over chunk ids (`local_chunks`).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from mtjax import flash_pallas, target

CHUNK_ROWS = 128  # query rows per chunk: 4 chunks at seq 512 measured fastest here
UNROLLED_CHUNKS = 16  # more chunks than this take the loop: XLA holds an unrolled program's chunks at once


def _chunks(t: int, window: int | None, rows: int) -> list[tuple[int, int, int]]:
    """(first query, end query, first visible key) of each query chunk."""
    n = max(1, -(-t // rows))
    bounds = [round(i * t / n) for i in range(n + 1)]
    return [(a, b, max(0, a - window + 1) if window else 0) for a, b in zip(bounds, bounds[1:])]


def _scores(q, k, r0: int, k0: int, scale: float, window: int | None, softcap: float | None, segments):
    """Scaled (and capped) fp32 scores [b, kv, g, tq, tk] and the visibility mask of query
    rows r0.. on keys k0.."""
    s = jnp.einsum("bkgth,bksh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    tq, tk = q.shape[3], k.shape[2]
    if segments is None:
        return s, visible(r0 + jnp.arange(tq), k0 + jnp.arange(tk), window)
    mask = visible(r0 + jnp.arange(tq), k0 + jnp.arange(tk), window, segments[:, r0:r0 + tq], segments[:, k0:k0 + tk])
    return s, mask[:, None, None]  # [b, tq, tk] -> [b, 1, 1, tq, tk]


def visible(query_pos, key_pos, window: int | None = None, query_segments=None, key_segments=None):
    """Which keys each query sees, bool [tq, tk] (or [b, tq, tk] with segments): keys at or
    before the query's position `query_pos` [tq] (`key_pos` [tk]), within its `window` of
    W keys where set (the query's own included), and of its own document where
    `query_segments` [b, tq] and `key_segments` [b, tk] are given. Every attention path
    (training's chunks, sampling's cache) masks by this."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if window:
        mask &= key_pos[None, :] > query_pos[:, None] - window  # W keys including the query itself
    if query_segments is not None:
        mask = mask & (query_segments[:, :, None] == key_segments[:, None, :])
    return mask


def _heads_major(x, kv_heads: int):
    """[b, t, n, h] -> [b, kv, n / kv, t, h]: each head's rows contiguous for the batched matmuls."""
    b, t, n, h = x.shape
    return x.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def _token_major(x):
    """[b, kv, g, t, h] -> [b, t, kv * g, h]."""
    b, kv, g, t, h = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, h)


def _sink_logits(sinks, kv: int):
    """Per-head sinks [heads] -> fp32 [1, kv, g, 1, 1], beside the scores' [b, kv, g, tq, tk]."""
    return sinks.astype(jnp.float32).reshape(1, kv, -1, 1, 1)


def _sinks_grad(sinks, kv: int, lse, delta):
    """d sinks [heads] = -sum over rows of p_sink * rowsum(dO * O), p_sink = exp(sink - lse)
    (lse and delta [b, kv, g, t, 1]); None without sinks."""
    if sinks is None:
        return None
    p_sink = jnp.exp(_sink_logits(sinks, kv) - lse)
    return -jnp.sum(p_sink * delta, axis=(0, 3, 4)).reshape(sinks.shape).astype(sinks.dtype)


def _forward(q, k, v, segments, scale, window, softcap, rows, sinks=None):
    kv = k.shape[2]
    qh, kh, vh = _heads_major(q, kv), _heads_major(k, kv)[:, :, 0], _heads_major(v, kv)[:, :, 0]
    sink = None if sinks is None else _sink_logits(sinks, kv)
    outs, lses = [], []
    for r0, r1, k0 in _chunks(q.shape[1], window, rows):
        s, mask = _scores(qh[:, :, :, r0:r1], kh[:, :, k0:r1], r0, k0, scale, window, softcap, segments)
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)  # finite: every query sees itself
        if sink is not None:
            m = jnp.maximum(m, sink)
        e = jnp.exp(s - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        if sink is not None:  # the sink's share of the denominator
            total = total + jnp.exp(sink - m)
        p = (e / total).astype(v.dtype)
        outs.append(jnp.einsum("bkgts,bksh->bkgth", p, vh[:, :, k0:r1], preferred_element_type=jnp.float32))
        lses.append(m + jnp.log(total))
    out = jnp.concatenate(outs, axis=3).astype(q.dtype)  # [b, kv, g, t, h]
    return out, lses


def causal_attention(q, k, v, scale: float, window: int | None = None, rows: int = CHUNK_ROWS,
                     softcap: float | None = None, segments=None, sinks=None):
    """softmax(cap(q k^T * scale), causal [and sliding-window] [and same-document] mask
    [and per-head `sinks` [heads] in the denominator]) v: [b, t, heads, hd]. Up to
    UNROLLED_CHUNKS chunks of `rows` queries, each chunk's softmax in one piece
    (`_unrolled`); longer rows by the loop over blocks (`looped_attention`), whose memory
    is O(t)."""
    if -(-q.shape[1] // rows) > UNROLLED_CHUNKS:
        return looped_attention(q, k, v, scale, window, rows, softcap, segments, sinks)
    return _unrolled(q, k, v, scale, window, rows, softcap, segments, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _unrolled(q, k, v, scale, window, rows, softcap, segments, sinks):
    return _token_major(_forward(q, k, v, segments, scale, window, softcap, rows, sinks)[0])


def _fwd(q, k, v, scale, window, rows, softcap, segments, sinks):
    out, lses = _forward(q, k, v, segments, scale, window, softcap, rows, sinks)
    return _token_major(out), (q, k, v, segments, sinks, out, lses)


def _bwd(scale, window, rows, softcap, res, dout):
    q, k, v, segments, sinks, out, lses = res
    kv = k.shape[2]
    qh, kh, vh, doh = _heads_major(q, kv), _heads_major(k, kv)[:, :, 0], _heads_major(v, kv)[:, :, 0], \
        _heads_major(dout, kv)
    # rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's correction term, [b, kv, g, t, 1]
    delta = jnp.sum(doh.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    dq, dk, dv = [], jnp.zeros(kh.shape, jnp.float32), jnp.zeros(vh.shape, jnp.float32)
    for (r0, r1, k0), lse in zip(_chunks(q.shape[1], window, rows), lses):
        q_i, do_i, k_i, v_i = qh[:, :, :, r0:r1], doh[:, :, :, r0:r1], kh[:, :, k0:r1], vh[:, :, k0:r1]
        s, mask = _scores(q_i, k_i, r0, k0, scale, window, softcap, segments)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dv = dv.at[:, :, k0:r1].add(jnp.einsum("bkgts,bkgth->bksh", p.astype(v.dtype), do_i,
                                               preferred_element_type=jnp.float32))
        dp = jnp.einsum("bkgth,bksh->bkgts", do_i, v_i, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, :, :, r0:r1])
        if softcap:
            ds = ds * (1.0 - jnp.square(s / softcap))  # d cap(z) / dz = 1 - tanh^2, with s = cap(z)
        ds = (ds * scale).astype(q.dtype)
        dq.append(jnp.einsum("bkgts,bksh->bkgth", ds, k_i, preferred_element_type=jnp.float32))
        dk = dk.at[:, :, k0:r1].add(jnp.einsum("bkgts,bkgth->bksh", ds, q_i, preferred_element_type=jnp.float32))
    dq = _token_major(jnp.concatenate(dq, axis=3))
    dk, dv = (_token_major(d[:, :, None]) for d in (dk, dv))
    dsinks = _sinks_grad(sinks, kv, jnp.concatenate(lses, axis=3), delta)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks  # no cotangent for document ids


_unrolled.defvjp(_fwd, _bwd)


# Long rows: a loop over [rows, rows] blocks (flash attention's online softmax). XLA runs a
# loop's iterations one after another, so only one block's scores are alive at a time and
# what outlives the forward is q, k, v, the output and one log-sum-exp per query: O(t).
# The queries may be a later stretch of the keys' row (`q0`, their first position: a
# device's share of a row split over devices, `split_attention`); keys are then the whole
# row, and the query blocks' edges need not fall on the key blocks'.


def _padded(x, n: int, fill=0):
    """x [b, t, ...] -> [b, n, ...], rows past t set to `fill`."""
    pad = [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad, constant_values=fill)


def _block(x, j, rows: int, axis: int = 3):
    return jax.lax.dynamic_slice_in_dim(x, j * rows, rows, axis)


def _key_blocks(q0, i, window: int | None, rows: int, blocks: int):
    """(first, last) key block that query block i (positions q0 + i * rows ..) can see."""
    first = 0 if not window else jnp.maximum(0, q0 + i * rows - window + 1) // rows
    return first, jnp.minimum((q0 + i * rows + rows - 1) // rows, blocks - 1)


def _block_scores(q_i, k_j, qpos, j, rows, scale, window, softcap, q_seg, k_seg):
    """Scaled (and capped) fp32 scores [b, kv, g, rows, rows] of queries at `qpos` on key
    block j, and their visibility mask."""
    s = jnp.einsum("bkgth,bksh->bkgts", q_i, k_j, preferred_element_type=jnp.float32) * scale
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    kpos = j * rows + jnp.arange(rows)
    if q_seg is None:
        return s, visible(qpos, kpos, window)
    return s, visible(qpos, kpos, window, q_seg, _block(k_seg, j, rows, 1))[:, None, None]


def _loop_inputs(q, k, v, q_seg, k_seg, rows):
    """Heads-major q [b, kv, g, n, h], k and v [b, kv, m, h] and the segments, padded to
    whole blocks. Padded keys get segment -1 (where documents are given) and positions past
    the row: no real query sees one. A padded query's output and gradient are dropped."""
    n, m = (-(-x.shape[1] // rows) * rows for x in (q, k))
    kv = k.shape[2]
    qh = _heads_major(_padded(q, n), kv)
    kh, vh = (_heads_major(_padded(x, m), kv)[:, :, 0] for x in (k, v))
    if q_seg is None:
        return qh, kh, vh, None, None
    return qh, kh, vh, _padded(q_seg, n, -1), _padded(k_seg, m, -1)


def _loop_forward(q, k, v, q_seg, k_seg, q0, scale, window, softcap, rows, sinks=None):
    """(output [b, kv, g, n, h], log-sum-exp [b, kv, g, n, 1]) over padded blocks; the
    `sinks` join each row's denominator after its last key block."""
    qh, kh, vh, q_seg, k_seg = _loop_inputs(q, k, v, q_seg, k_seg, rows)
    sink = None if sinks is None else _sink_logits(sinks, k.shape[2])

    def query_block(_, i):
        q_i, qpos = _block(qh, i, rows), q0 + i * rows + jnp.arange(rows)
        seg_i = None if q_seg is None else _block(q_seg, i, rows, 1)
        first, last = _key_blocks(q0, i, window, rows, kh.shape[2] // rows)

        def key_block(back, carry):  # the nearest block first
            m, total, acc = carry
            j = last - back
            s, mask = _block_scores(q_i, _block(kh, j, rows, 2), qpos, j, rows, scale, window, softcap, seg_i, k_seg)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that has seen no key yet
            e = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
            pv = jnp.einsum("bkgts,bksh->bkgth", e.astype(v.dtype), _block(vh, j, rows, 2),
                            preferred_element_type=jnp.float32)
            rescale = jnp.exp(m - m_safe)
            return m_new, rescale * total + jnp.sum(e, axis=-1, keepdims=True), rescale * acc + pv

        shape = q_i.shape[:-1] + (1,)
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(q_i.shape, jnp.float32))
        m, total, acc = jax.lax.fori_loop(0, last - first + 1, key_block, init)
        if sink is not None:  # one more term of the denominator, rescaled as a key block's
            m_new = jnp.maximum(m, sink)
            rescale = jnp.exp(m - m_new)
            m, total, acc = m_new, rescale * total + jnp.exp(sink - m_new), rescale * acc
        total = jnp.where(total > 0, total, 1.0)  # padded queries that see no key: output 0
        return None, ((acc / total).astype(q.dtype), jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(total))

    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(qh.shape[3] // rows))
    # [blocks, b, kv, g, rows, .] -> [b, kv, g, n, .]
    out, lse = (jnp.moveaxis(x, 0, 3).reshape(x.shape[1:4] + (-1, x.shape[-1])) for x in (out, lse))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, q_seg, k_seg, q0, scale, window, rows, softcap, sinks=None):
    out, _ = _loop_forward(q, k, v, q_seg, k_seg, q0, scale, window, softcap, rows, sinks)
    return _token_major(out)[:, :q.shape[1]]


def _flash_fwd(q, k, v, q_seg, k_seg, q0, scale, window, rows, softcap, sinks):
    out, lse = _loop_forward(q, k, v, q_seg, k_seg, q0, scale, window, softcap, rows, sinks)
    return _token_major(out)[:, :q.shape[1]], (q, k, v, q_seg, k_seg, q0, sinks, out, lse)


def _flash_bwd(scale, window, rows, softcap, res, dout):
    q, k, v, q_seg0, k_seg0, q0, sinks, out, lse = res
    kv = k.shape[2]
    qh, kh, vh, q_seg, k_seg = _loop_inputs(q, k, v, q_seg0, k_seg0, rows)
    doh = _heads_major(_padded(dout, qh.shape[3]), kv)  # padded queries: zero cotangent, so no gradient
    delta = jnp.sum(doh.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)

    def query_block(dkv, i):
        q_i, do_i, lse_i, delta_i = (_block(x, i, rows) for x in (qh, doh, lse, delta))
        qpos = q0 + i * rows + jnp.arange(rows)
        seg_i = None if q_seg is None else _block(q_seg, i, rows, 1)
        first, last = _key_blocks(q0, i, window, rows, kh.shape[2] // rows)

        def key_block(back, carry):
            dq_i, dk, dv = carry
            j = last - back
            k_j, v_j = _block(kh, j, rows, 2), _block(vh, j, rows, 2)
            s, mask = _block_scores(q_i, k_j, qpos, j, rows, scale, window, softcap, seg_i, k_seg)
            p = jnp.where(mask, jnp.exp(s - lse_i), 0.0)
            dv_j = jnp.einsum("bkgts,bkgth->bksh", p.astype(v.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgth,bksh->bkgts", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i)
            if softcap:
                ds = ds * (1.0 - jnp.square(s / softcap))  # d cap(z) / dz = 1 - tanh^2, with s = cap(z)
            ds = (ds * scale).astype(q.dtype)
            dq_i = dq_i + jnp.einsum("bkgts,bksh->bkgth", ds, k_j, preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("bkgts,bkgth->bksh", ds, q_i, preferred_element_type=jnp.float32)
            add = lambda d, x: jax.lax.dynamic_update_slice_in_dim(d, _block(d, j, rows, 2) + x, j * rows, 2)
            return dq_i, add(dk, dk_j), add(dv, dv_j)

        dq_i, dk, dv = jax.lax.fori_loop(0, last - first + 1, key_block, (jnp.zeros(q_i.shape, jnp.float32), *dkv))
        return (dk, dv), dq_i

    zeros = jnp.zeros(kh.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), jnp.arange(qh.shape[3] // rows))
    dq = _token_major(jnp.moveaxis(dq, 0, 3).reshape(qh.shape))[:, :q.shape[1]]
    dk, dv = (_token_major(d[:, :, None])[:, :k.shape[1]] for d in (dk, dv))
    dsinks = _sinks_grad(sinks, kv, lse, delta)  # padded queries: zero delta, no share
    # no cotangents for document ids and the queries' first position
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


def looped_attention(q, k, v, scale: float, window: int | None = None, rows: int = CHUNK_ROWS,
                     softcap: float | None = None, segments=None, sinks=None):
    """`causal_attention` by a loop over [rows, rows] blocks: the scores of one block at a
    time, key blocks the queries cannot see skipped; memory O(t) forward and backward."""
    return _flash(q, k, v, segments, segments, jnp.int32(0), scale, window, rows, softcap, sinks)


SEQUENCE = "sequence"  # the mesh axis a row's tokens are split over (mtjax.stream.mesh, stream.split)


def split_attention(q, k, v, scale: float, window: int | None, softcap: float | None, segments, devices: int,
                    rows: int = CHUNK_ROWS):
    """Causal attention of rows whose tokens are split over `devices` devices (context
    parallel; q, k, v sharded along the sequence axis over a mesh axis named SEQUENCE):
    each device gathers the whole row's keys and values (and document ids) and attends its
    own queries, positions counted from its share's start, by the loop over blocks. The
    gather's transpose sums each device's key and value gradients back to the share that
    owns them. Memory per device: its queries' share, and the row's keys and values."""
    mesh = jax.sharding.AbstractMesh((devices,), (SEQUENCE,))
    split = jax.sharding.PartitionSpec(None, SEQUENCE)

    def local(q, k, v, *segments):
        whole = lambda x: jax.lax.all_gather(x, SEQUENCE, axis=1, tiled=True)  # noqa: E731
        q0 = jax.lax.axis_index(SEQUENCE) * q.shape[1]
        q_seg, k_seg = (segments[0], whole(segments[0])) if segments else (None, None)
        return _flash(q, whole(k), whole(v), q_seg, k_seg, q0, scale, window, rows, softcap, None)

    args = (q, k, v) if segments is None else (q, k, v, segments)
    # check_vma off: the kernel's loops start from constants that vary over no axis
    return jax.shard_map(local, mesh=mesh, in_specs=(split,) * len(args), out_specs=split, check_vma=False)(*args)


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


FUSED_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash attention takes (fp8 aside)
PALLAS_HEAD_DIMS = (16, 32, 64, 128, 256)  # Triton's blocks are powers of two, at least 16 wide
PALLAS_CAPABILITY = 8.0  # Pallas's Triton lowering targets Ampere and later


def kernel(backend: str, dtype, head_dim: int, window: int | None = None, softcap: float | None = None,
           segments: bool = False, capability: float | None = None, sinks: bool = False) -> str:
    """Which implementation `attend` uses: "cudnn" (`jax.nn.dot_product_attention`'s fused
    flash-attention kernel), "pallas" (mtjax.flash_pallas) or "chunked" (`causal_attention`, O(t) memory past
    UNROLLED_CHUNKS chunks; not XLA's implementation of dot_product_attention, whose
    [heads, t, t] scores a long row cannot hold). A pure function of what is traced and
    where, so that the choice is tested without a GPU; `attend` probes the cuDNN choice.

    `backend` is "cpu", "cuda" (an NVIDIA GPU, `capability` its compute capability, e.g.
    9.0) or any other platform. cuDNN takes fp16/bf16 with a head dim that is a multiple
    of 8, at most 256 from Hopper (9.0) on and 128 before, and a causal sliding window;
    `jax.nn.dot_product_attention` has no logit soft-cap and no document (segment) ids
    (Llama 4's chunked layers are document ids too, `local_chunks`): those, and what else
    cuDNN does not take, go to the Pallas kernel on a CUDA GPU from Ampere (8.0) on with a
    head dim in PALLAS_HEAD_DIMS, and to the chunked path otherwise (exact on every backend).
    Sinks (gpt-oss) are in neither fused kernel: they take the chunked path everywhere.
    """
    if backend != "cuda" or capability is None or sinks:
        return "chunked"
    if (not softcap and not segments and jnp.dtype(dtype).name in FUSED_DTYPES and head_dim % 8 == 0
            and head_dim <= (256 if capability >= 9.0 else 128)):
        return "cudnn"
    return "pallas" if capability >= PALLAS_CAPABILITY and head_dim in PALLAS_HEAD_DIMS else "chunked"


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
    capability = (_capability() or PLANNED_CAPABILITY) if backend == "cuda" else None
    which = kernel(backend, dtype, head_dim, window, softcap, capability=capability, sinks=sinks)
    if devices == 1 and which != "chunked":
        return 0
    kv = kv_heads or heads
    if devices > 1 or -(-seq // CHUNK_ROWS) > UNROLLED_CHUNKS:
        tiles = CHUNK_ROWS * CHUNK_ROWS
        copies = 4 * batch * seq * head_dim * (heads + 2 * kv)
        held = copies if platform == "cpu" and jnp.dtype(dtype).itemsize < 4 else 0  # widened q, k, v
    else:
        chunks = _chunks(seq, window, CHUNK_ROWS)
        tiles = sum((r1 - r0) * (r1 - k0) for r0, r1, k0 in chunks)
        sliced = sum(r1 - k0 for _, r1, k0 in chunks if r1 - k0 < seq)  # keys in chunks' own slices
        held = 2 * jnp.dtype(dtype).itemsize * batch * kv * head_dim * sliced  # of the keys and the values
    return 2 * 4 * batch * heads * tiles + held


@functools.lru_cache(maxsize=64)
def cudnn_refusal(q: jax.ShapeDtypeStruct, k: jax.ShapeDtypeStruct, scale: float, window: int | None) -> str | None:
    """None where cuDNN's flash attention compiles, forward and backward, for queries `q`
    and keys `k` of these shapes (and values shaped as the keys) on this process's default
    backend; else why not, in one line. Probed once a shape (a compile, not a run)."""
    local = (window - 1, 0) if window else None

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, scale=scale,
                                           implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    return _refusal(loss, q, k, k)


@functools.lru_cache(maxsize=64)
def pallas_refusal(q: jax.ShapeDtypeStruct, k: jax.ShapeDtypeStruct, scale: float, window: int | None,
                   softcap: float | None, segments: bool) -> str | None:
    """As `cudnn_refusal`, for mtjax.flash_pallas's kernel (with document ids where
    `segments`): None where it compiles, forward and backward, on the default backend."""
    def loss(q, k, v, *ids):
        out = flash_pallas.flash_attention(q, k, v, scale, window, softcap, *ids)
        return jnp.sum(out.astype(jnp.float32))

    return _refusal(loss, q, k, k, *([jax.ShapeDtypeStruct(q.shape[:2], jnp.int32)] if segments else []))


def _refusal(loss, *args) -> str | None:
    """None where the gradient of `loss` in its first three arguments compiles for `args`
    (shapes); else the first line of why not."""
    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    except Exception as e:  # noqa: BLE001  any refusal, at trace, lowering or compile time: the kernel says no
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no reason given'}"
    return None


def _refused(which: str, q, k, scale: float, window: int | None, softcap: float | None, segments: bool) -> bool:
    """Whether kernel `which` ("cudnn" or "pallas") refuses this shape (`cudnn_refusal`,
    `pallas_refusal`); says so in one line, once a shape."""
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    if which == "cudnn":
        why, name = cudnn_refusal(shape(q), shape(k), float(scale), window), "cuDNN flash attention"
    else:
        why = pallas_refusal(shape(q), shape(k), float(scale), window, softcap, segments)
        name = "Pallas flash attention"
    if why is not None and (which, shape(q), shape(k), window, softcap, segments) not in _told:
        _told.add((which, shape(q), shape(k), window, softcap, segments))
        warnings.warn(f"{name} refused q {list(q.shape)} {q.dtype} (window {window}): {why[:200]}; "
                      f"attention runs the chunked kernel", stacklevel=3)
    return why is not None


_told: set = set()  # the shapes whose refusal was said


def _platform() -> tuple[str, float | None]:
    """(platform as `kernel` names it, CUDA compute capability or None) of the program being
    traced (mtjax.target): "cuda" with the first GPU's capability where one is here."""
    platform = target.platform()
    if platform not in ("gpu", "cuda"):
        return platform, None
    capability = _capability()
    return ("cuda", capability) if capability is not None else (platform, None)


def _capability() -> float | None:
    """The first GPU's CUDA compute capability, None without a CUDA GPU here."""
    try:  # CUDA devices report e.g. "9.0"; other GPUs report none or an architecture name
        return float(jax.devices("gpu")[0].compute_capability)
    except (RuntimeError, IndexError, AttributeError, TypeError, ValueError):  # no GPU here, or not CUDA
        return None


def attend(q, k, v, scale: float, window: int | None = None, softcap: float | None = None, segments=None,
           sinks=None, *, platform: tuple[str, float | None] | None = None, devices: int = 1):
    """Causal attention by the fastest exact path of the platform being traced for (`kernel`);
    `softcap`: soft-capped scores (Gemma 2); `segments` [b, t]: document ids of packed rows,
    which confine attention to each document. On a CUDA GPU both take the Pallas kernel
    (mtjax.flash_pallas), elsewhere the chunked path. `sinks` [heads]: per-head sink
    logits (gpt-oss), on the chunked path everywhere. Where cuDNN or Pallas refuses a shape
    `kernel` expected it to take (`cudnn_refusal`, `pallas_refusal`, probed once a shape),
    the chunked kernel computes it, and a warning says so in one line.
    `platform`: (backend, CUDA capability) to choose for instead of the one being traced
    for (how the GPU's choice is checked without a GPU). `devices` > 1: the row's tokens are
    split over that many devices (`split_attention`, on every platform)."""
    if devices > 1:  # sinks are refused there by the family (mtjax.families.gpt_oss)
        return split_attention(q, k, v, scale, window, softcap, segments, devices)
    backend, capability = _platform() if platform is None else platform
    which = kernel(backend, q.dtype, q.shape[-1], window, softcap, segments=segments is not None,
                   capability=capability, sinks=sinks is not None)
    if which == "chunked" or _refused(which, q, k, scale, window, softcap, segments is not None):
        return causal_attention(q, k, v, scale, window, CHUNK_ROWS, softcap, segments, sinks)
    if which == "pallas":
        return flash_pallas.flash_attention(q, k, v, scale, window, softcap, segments)
    local = (window - 1, 0) if window else None  # W keys including the query itself
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, scale=scale,
                                        implementation=which)


def local_chunks(positions, size: int, segments=None):
    """Document ids [b, t] under which attention stays inside chunks of `size` positions
    (Llama 4's chunked attention): a chunk begins wherever a position (in its document,
    mtjax.documents.positions) is a multiple of `size`, and where a document begins.
    Passed as `segments` to `attend` with a window of `size` (implied by the chunks, it
    lets the chunked kernel skip every older key block), chunked attention is the
    document mask's work, forward and custom backward alike; padding (segment 0) stays
    apart from the documents, as its own chunks."""
    starts = positions % size == 0  # position 0 too: every document starts a chunk
    ids = jnp.cumsum(starts.astype(jnp.int32), axis=-1)
    return ids if segments is None else jnp.where(segments == 0, 0, ids)


def masked_attention(q, k, v, mask, scale: float, softcap: float | None = None, sinks=None):
    """softmax(cap(q k^T * scale) where `mask` [, sinks]) v for an explicit boolean mask
    [b|1, 1, tq, tk] (the sampling path's cache); q [b, tq, heads, hd], k and v [b, tk, kv
    heads, hd]; `sinks` [heads] as `causal_attention` takes them."""
    if not softcap and sinks is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    kv = k.shape[2]
    qh, kh, vh = _heads_major(q, kv), _heads_major(k, kv)[:, :, 0], _heads_major(v, kv)[:, :, 0]
    s = jnp.einsum("bkgth,bksh->bkgts", qh, kh, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, :, None], jnp.tanh(s / softcap) * softcap if softcap else s, -jnp.inf)
    if sinks is not None:  # one more column in each row's softmax, dropped after it
        sink = jnp.broadcast_to(_sink_logits(sinks, kv), (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    else:
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return _token_major(jnp.einsum("bkgts,bksh->bkgth", p, vh, preferred_element_type=jnp.float32).astype(q.dtype))
