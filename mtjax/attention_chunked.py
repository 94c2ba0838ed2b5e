"""The chunked causal attention kernel (`kernel`'s "chunked" in mtjax.attention): causal
self-attention that skips the masked half of the score matrix, with its own backward;
unrolled over query chunks (`causal_attention`), looped over blocks for long rows
(`looped_attention`), and over a row split over devices (`split_attention`).

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

Layouts: q [b, t, heads, hd], k and v [b, t, kv_heads, hd] (grouped-query attention when
kv_heads < heads); scores are [b, kv_heads, group, t_q, t_k], fp32.

Masks are mtjax.attention_mask's (`visible`): causal, a sliding window, and packed
documents (`segments` [b, t]).

Soft-capping (Gemma 2) replaces the scaled scores s by cap * tanh(s / cap) before the mask
and softmax; the backward multiplies dS by its derivative, 1 - tanh^2.

Sinks (gpt-oss): a learned logit per query head that joins every row's softmax
denominator and weighs no value: p_j = exp(s_j) / (sum_j' exp(s_j') + exp(sink)). The
row's log-sum-exp includes it, so the backward's probabilities and dS keep their form,
and d sink = -sum over rows of p_sink * rowsum(dO * O). Both kernels (unrolled and
looped) take them; a row split over devices does not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtjax.attention_mask import visible

CHUNK_ROWS = 128  # query rows per chunk: 4 chunks at seq 512 measured fastest here
UNROLLED_CHUNKS = 16  # more chunks than this take the loop: XLA holds an unrolled program's chunks at once


def query_chunks(t: int, window: int | None, rows: int) -> list[tuple[int, int, int]]:
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


def heads_major(x, kv_heads: int):
    """[b, t, n, h] -> [b, kv, n / kv, t, h]: each head's rows contiguous for the batched matmuls."""
    b, t, n, h = x.shape
    return x.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def token_major(x):
    """[b, kv, g, t, h] -> [b, t, kv * g, h]."""
    b, kv, g, t, h = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, h)


def sink_logits(sinks, kv: int):
    """Per-head sinks [heads] -> fp32 [1, kv, g, 1, 1], beside the scores' [b, kv, g, tq, tk]."""
    return sinks.astype(jnp.float32).reshape(1, kv, -1, 1, 1)


def _sinks_grad(sinks, kv: int, lse, delta):
    """d sinks [heads] = -sum over rows of p_sink * rowsum(dO * O), p_sink = exp(sink - lse)
    (lse and delta [b, kv, g, t, 1]); None without sinks."""
    if sinks is None:
        return None
    p_sink = jnp.exp(sink_logits(sinks, kv) - lse)
    return -jnp.sum(p_sink * delta, axis=(0, 3, 4)).reshape(sinks.shape).astype(sinks.dtype)


def _forward(q, k, v, segments, scale, window, softcap, rows, sinks=None):
    kv = k.shape[2]
    qh, kh, vh = heads_major(q, kv), heads_major(k, kv)[:, :, 0], heads_major(v, kv)[:, :, 0]
    sink = None if sinks is None else sink_logits(sinks, kv)
    outs, lses = [], []
    for r0, r1, k0 in query_chunks(q.shape[1], window, rows):
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
    return token_major(_forward(q, k, v, segments, scale, window, softcap, rows, sinks)[0])


def _fwd(q, k, v, scale, window, rows, softcap, segments, sinks):
    out, lses = _forward(q, k, v, segments, scale, window, softcap, rows, sinks)
    return token_major(out), (q, k, v, segments, sinks, out, lses)


def _bwd(scale, window, rows, softcap, res, dout):
    q, k, v, segments, sinks, out, lses = res
    kv = k.shape[2]
    qh, kh, vh, doh = heads_major(q, kv), heads_major(k, kv)[:, :, 0], heads_major(v, kv)[:, :, 0], \
        heads_major(dout, kv)
    # rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's correction term, [b, kv, g, t, 1]
    delta = jnp.sum(doh.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    dq, dk, dv = [], jnp.zeros(kh.shape, jnp.float32), jnp.zeros(vh.shape, jnp.float32)
    for (r0, r1, k0), lse in zip(query_chunks(q.shape[1], window, rows), lses):
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
    dq = token_major(jnp.concatenate(dq, axis=3))
    dk, dv = (token_major(d[:, :, None]) for d in (dk, dv))
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
    qh = heads_major(_padded(q, n), kv)
    kh, vh = (heads_major(_padded(x, m), kv)[:, :, 0] for x in (k, v))
    if q_seg is None:
        return qh, kh, vh, None, None
    return qh, kh, vh, _padded(q_seg, n, -1), _padded(k_seg, m, -1)


def _loop_forward(q, k, v, q_seg, k_seg, q0, scale, window, softcap, rows, sinks=None):
    """(output [b, kv, g, n, h], log-sum-exp [b, kv, g, n, 1]) over padded blocks; the
    `sinks` join each row's denominator after its last key block."""
    qh, kh, vh, q_seg, k_seg = _loop_inputs(q, k, v, q_seg, k_seg, rows)
    sink = None if sinks is None else sink_logits(sinks, k.shape[2])

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
    return token_major(out)[:, :q.shape[1]]


def _flash_fwd(q, k, v, q_seg, k_seg, q0, scale, window, rows, softcap, sinks):
    out, lse = _loop_forward(q, k, v, q_seg, k_seg, q0, scale, window, softcap, rows, sinks)
    return token_major(out)[:, :q.shape[1]], (q, k, v, q_seg, k_seg, q0, sinks, out, lse)


def _flash_bwd(scale, window, rows, softcap, res, dout):
    q, k, v, q_seg0, k_seg0, q0, sinks, out, lse = res
    kv = k.shape[2]
    qh, kh, vh, q_seg, k_seg = _loop_inputs(q, k, v, q_seg0, k_seg0, rows)
    doh = heads_major(_padded(dout, qh.shape[3]), kv)  # padded queries: zero cotangent, so no gradient
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
    dq = token_major(jnp.moveaxis(dq, 0, 3).reshape(qh.shape))[:, :q.shape[1]]
    dk, dv = (token_major(d[:, :, None])[:, :k.shape[1]] for d in (dk, dv))
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
