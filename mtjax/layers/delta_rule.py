"""The gated delta rule (Qwen3-Next's and Qwen3.5's linear attention), in chunks.

Per value head, a state S [dk, dv] is carried through the tokens; token t first decays
it by a_t = exp(g_t), then writes its value v_t at its key k_t with strength beta_t, and
reads it with its query q_t (scaled by dk ** -0.5):

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (a_t S_{t-1})^T k_t),   o_t = S_t^T q_t.

`recurrent` computes that token by token (the definition, for tests and nothing else);
`chunked` computes the same in chunks of C tokens (WY / UT form): within a chunk the
u of all its tokens solve one unit lower-triangular system and the outputs are matmuls,
and a scan over chunks carries S, so the cost is linear in the sequence length. The
state and every product are fp32 whatever the inputs' dtype.

Packed rows: where a document starts (`starts`), the state restarts from zero, as if
a_t were 0 there: the products of decays across a document start are masked to zero, so
a packed row equals its documents run one by one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64  # tokens per chunk, transformers' default


def _resets(starts, shape):
    """Document starts [b, t] (bool; None: none) -> ids [b, t] that change at each start."""
    if starts is None:
        return jnp.zeros(shape, jnp.int32)
    return jnp.cumsum(starts.astype(jnp.int32), axis=-1)


def unit_lower_inverse(a):
    """The inverse of unit lower-triangular matrices a [..., c, c], by blocks: the inverses
    of the diagonal blocks of s rows give those of 2s rows, [[A, 0], [C, D]]^-1 =
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]], from s = 1 up (c padded to a power of two). Matmuls
    only: XLA's CPU triangular solve inside this layer's program hung its async dispatch."""
    c = a.shape[-1]
    size = 1 << (c - 1).bit_length()
    lead = a.shape[:-2]
    full = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), (*lead, size, size))
    full = full.at[..., :c, :c].set(a)
    inverse = jnp.ones((*lead, size, 1, 1), a.dtype)  # the 1 x 1 diagonal blocks' inverses
    s = 1
    while s < size:
        n = size // (2 * s)
        blocks = full.reshape(*lead, n, 2 * s, n, 2 * s)
        diagonal = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., n, 2s, 2s]
        below = diagonal[..., s:, :s]  # C
        upper, lower = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]  # A^-1, D^-1: [..., n, s, s]
        corner = -(lower @ below @ upper)
        top = jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([corner, lower], axis=-1)], axis=-2)
        s *= 2
    return inverse[..., 0, :c, :c]


def recurrent(q, k, v, g, beta, starts=None, state=None):
    """Token by token. q, k [b, t, h, dk], v [b, t, h, dv], g and beta [b, t, h] (g <= 0,
    the log decay), `starts` [b, t] bool where a document starts, `state` [b, h, dk, dv]
    before the first token (None: zeros). Returns (o [b, t, h, dv], the final state)."""
    b, t, h, dk = k.shape
    dtype = jnp.promote_types(v.dtype, jnp.float32)  # fp32, or fp64 where given (tests)
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    q = q * dk ** -0.5
    reset = jnp.zeros((b, t), bool) if starts is None else starts
    s0 = jnp.zeros((b, h, dk, v.shape[-1]), dtype) if state is None else state.astype(dtype)

    def step(s, xs):
        qt, kt, vt, gt, bt, rt = xs  # [b, h, .], rt [b]
        decay = jnp.where(rt[:, None], 0.0, jnp.exp(gt))
        s = s * decay[..., None, None]
        u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", s, kt))
        s = s + jnp.einsum("bhk,bhv->bhkv", kt, u)
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset)]
    s, o = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1), s


def chunked(q, k, v, g, beta, starts=None, state=None, chunk: int = CHUNK):
    """`recurrent` in chunks of `chunk` tokens (the rows zero-padded to a multiple: a
    padded token has beta = 0 and g = 0, so it leaves the state as it was).

    Returns (o [b, t, h, dv] in v's dtype, the final state [b, h, dk, dv] fp32)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    chunk = min(chunk, t)
    pad = -t % chunk
    n = (t + pad) // chunk
    ids = _resets(starts, (b, t))

    def prep(x):  # [b, t, h, ...] fp32 -> [n, b, h, c, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, chunk, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v, g, beta = (prep(x) for x in (q * dk ** -0.5, k, v, g, beta))  # [n, b, h, c, .]
    # Padded tokens share the last token's document (they come after it and change nothing).
    ids = jnp.pad(ids, [(0, 0), (0, pad)], mode="edge").reshape(b, n, chunk)
    ids = jnp.moveaxis(ids, 1, 0)[:, :, None]  # [n, b, 1, c]
    # The document before each chunk (0 before the row: a start at token 0 drops `state`).
    previous = jnp.concatenate([jnp.zeros_like(ids[:1, ..., :1]), ids[:-1, ..., -1:]], axis=0)

    cum = jnp.cumsum(g, axis=-1)  # [n, b, h, c]: log of the decay from the chunk's start
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = (ids[..., :, None] == ids[..., None, :]) & causal  # [n, b, 1, c, c]: j <= i in i's document
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(same, jnp.exp(jnp.where(same, diff, 0.0)), 0.0)  # a_{j+1} ... a_i, [n, b, h, c, c]
    # a_1 ... a_i from the chunk's start, zero where a document started at or before i.
    carried = jnp.where(ids == previous, jnp.exp(cum), 0.0)  # [n, b, h, c]

    kb = k * beta[..., None]
    strict = decay * (1.0 - jnp.eye(chunk))
    system = jnp.einsum("nbhic,nbhjc->nbhij", kb, k) * strict  # L, strictly lower
    inverse = unit_lower_inverse(system + jnp.eye(chunk, dtype=jnp.float32))
    # u = W - K' S with W = (I + L)^-1 (beta v), K' = (I + L)^-1 (beta a k)
    values = inverse @ (v * beta[..., None])  # [n, b, h, c, dv]
    keys = inverse @ (kb * carried[..., None])  # [n, b, h, c, dk]
    scores = jnp.einsum("nbhic,nbhjc->nbhij", q, k) * decay  # [n, b, h, c, c]
    q_carried = q * carried[..., None]
    last = decay[..., -1, :]  # [n, b, h, c]: decay from each token to the chunk's end
    k_last = k * last[..., None]
    s_last = carried[..., -1]  # [n, b, h]

    def step(s, xs):
        values, keys, scores, q_carried, k_last, s_last = xs
        u = values - jnp.einsum("bhck,bhkv->bhcv", keys, s)
        o = jnp.einsum("bhck,bhkv->bhcv", q_carried, s) + jnp.einsum("bhij,bhjv->bhiv", scores, u)
        s = s * s_last[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_last, u)
        return s, o

    s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    s, o = jax.lax.scan(step, s0, (values, keys, scores, q_carried, k_last, s_last))
    o = jnp.moveaxis(o, 0, 1)  # [b, n, h, c, dv]
    o = jnp.moveaxis(o, 2, 3).reshape(b, n * chunk, h, dv)[:, :t]
    return o.astype(out_dtype), s
