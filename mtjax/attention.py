"""Causal self-attention that skips the masked half of the score matrix, with its own backward.

`jax.nn.dot_product_attention` (XLA implementation, which the CPU gets) computes every
head's full [t, t] scores and is differentiated op by op. Here the queries are cut into
row chunks; chunk i scores only the keys it can see, [lo_i, end of chunk i), so with c
chunks about (c - 1) / 2c of the score, softmax and probability work is never done. The
backward is written out with the flash-attention identities (probabilities recomputed
from the saved log-sum-exp; dS = P * (dP - rowsum(dO * O))), which needs fewer passes
over the [t, t] tiles than the autodiff of softmax. Each row's softmax still sees all its
keys at once (no online rescaling), so results match the XLA path to fp32 rounding.

Layouts: q [b, t, heads, hd], k and v [b, t, kv_heads, hd] (grouped-query attention when
kv_heads < heads); scores are [b, kv_heads, group, t_q, t_k], fp32.

Soft-capping (Gemma 2) replaces the scaled scores s by cap * tanh(s / cap) before the mask
and softmax; the backward multiplies dS by its derivative, 1 - tanh^2.

Sinks (gpt-oss): a learned logit per query head that joins every row's softmax
denominator and weighs no value: p_j = exp(s_j) / (sum_j' exp(s_j') + exp(sink)). The
row's log-sum-exp includes it, so the backward's probabilities and dS are unchanged in
form, and d sink = -sum over rows of p_sink * rowsum(dO * O).

Packed documents: `segments` [b, t] (int document ids, mtjax.batch) confines each query to
the keys of its own document, on top of the causal (and window) mask; a padding token
(segment 0) sees only padding, so every query still sees itself and each softmax row
stays finite. None (plain windows) adds nothing to the traced program. Chunked local
attention (Llama 4) is that same mask over chunk ids (`local_chunks`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtjax import target

CHUNK_ROWS = 128  # query rows per chunk: 4 chunks at seq 512 measured fastest here


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def causal_attention(q, k, v, scale: float, window: int | None = None, rows: int = CHUNK_ROWS,
                     softcap: float | None = None, segments=None, sinks=None):
    """softmax(cap(q k^T * scale), causal [and sliding-window] [and same-document] mask
    [and per-head `sinks` [heads] in the denominator]) v: [b, t, heads, hd]."""
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
    dsinks = None
    if sinks is not None:  # -sum over rows of p_sink * rowsum(dO * O), p_sink = exp(sink - lse)
        p_sink = jnp.exp(_sink_logits(sinks, kv) - jnp.concatenate(lses, axis=3))  # [b, kv, g, t, 1]
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 3, 4)).reshape(sinks.shape).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks  # no cotangent for document ids


causal_attention.defvjp(_fwd, _bwd)


FUSED_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash attention takes (fp8 aside)


def kernel(backend: str, dtype, head_dim: int, window: int | None = None, softcap: float | None = None,
           segments: bool = False, capability: float | None = None, sinks: bool = False) -> str:
    """Which implementation `attend` uses: "chunked" (`causal_attention`), "cudnn"
    (`jax.nn.dot_product_attention`'s fused flash-attention kernel) or "xla" (the same
    function's XLA implementation). A pure function of what is traced and where, so that
    the choice is tested without a GPU.

    `backend` is "cpu", "cuda" (an NVIDIA GPU, `capability` its compute capability, e.g.
    9.0) or any other platform. cuDNN takes fp16/bf16 with a head dim that is a multiple
    of 8, at most 256 from Hopper (9.0) on and 128 before, and a causal sliding window;
    `jax.nn.dot_product_attention` has no logit soft-cap, no document (segment) ids and
    no sinks, so those stay on the chunked path, which computes them exactly (Llama 4's
    chunked layers too: their chunks are document ids, `local_chunks`).
    """
    if backend == "cpu" or softcap or segments or sinks:
        return "chunked"
    fits = (backend == "cuda" and capability is not None and jnp.dtype(dtype).name in FUSED_DTYPES
            and head_dim % 8 == 0 and head_dim <= (256 if capability >= 9.0 else 128))
    return "cudnn" if fits else "xla"


def _platform() -> tuple[str, float | None]:
    """(platform as `kernel` names it, CUDA compute capability or None) of the program being
    traced (mtjax.target): "cuda" with the first GPU's capability where one is here."""
    platform = target.platform()
    if platform not in ("gpu", "cuda"):
        return platform, None
    try:  # CUDA devices report e.g. "9.0"; other GPUs report none or an architecture name
        return "cuda", float(jax.devices("gpu")[0].compute_capability)
    except (RuntimeError, IndexError, AttributeError, TypeError, ValueError):  # no GPU here, or not CUDA
        return platform, None


def attend(q, k, v, scale: float, window: int | None = None, softcap: float | None = None, segments=None,
           sinks=None, *, platform: tuple[str, float | None] | None = None):
    """Causal attention by the fastest exact path of the platform being traced for (`kernel`);
    `softcap`: soft-capped scores (Gemma 2); `segments` [b, t]: document ids of packed rows,
    which confine attention to each document; `sinks` [heads]: per-head sink logits
    (gpt-oss). All three take the chunked path on every platform.
    Where cuDNN refuses what `kernel` expected it to take, XLA's implementation computes it.
    `platform`: (backend, CUDA capability) to choose for instead of the one being traced
    for (how the GPU's choice is checked without a GPU)."""
    backend, capability = _platform() if platform is None else platform
    which = kernel(backend, q.dtype, q.shape[-1], window, softcap, segments=segments is not None,
                   capability=capability, sinks=sinks is not None)
    if which == "chunked":
        return causal_attention(q, k, v, scale, window, CHUNK_ROWS, softcap, segments, sinks)
    local = (window - 1, 0) if window else None  # W keys including the query itself
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, scale=scale,
                                            implementation=which)
    except (NotImplementedError, ValueError, RuntimeError):  # cuDNN's refusal, at trace time
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, scale=scale,
                                            implementation="xla")


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
