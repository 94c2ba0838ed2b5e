"""The chunked kernel (mtjax.attention_chunked) and the sampling path's masked_attention equal
jax.nn.dot_product_attention (outputs and gradients) in every case they serve."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import attention_chunked, documents
from mtjax.attention import masked_attention
from mtjax.attention_chunked import causal_attention, query_chunks
from mtjax.attention_mask import local_chunks

from conftest import tiny_config


def reference(q, k, v, scale, window):
    local = (window - 1, 0) if window else None
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, scale=scale)


SLOW = pytest.mark.slow  # ~5 s each here; the fast tier keeps one case


@pytest.mark.parametrize("t, heads, kv_heads, window, rows", [
    pytest.param(16, 4, 4, None, 5, marks=SLOW),    # uneven chunks, plain multi-head
    pytest.param(37, 4, 1, 7, 8, marks=SLOW),       # multi-query, sliding window shorter than a chunk
    pytest.param(64, 6, 2, 16, 16, marks=SLOW),     # grouped query, window = chunk
    (64, 4, 2, None, 128),                          # one chunk (seq shorter than CHUNK_ROWS)
    pytest.param(50, 2, 2, 40, 10, marks=SLOW),     # window spanning several chunks
])
def test_outputs_and_gradients_equal_dot_product_attention(t, heads, kv_heads, window, rows):
    kq, kk, kv, kd = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(kq, (2, t, heads, 8))
    k, v = jax.random.normal(kk, (2, t, kv_heads, 8)), jax.random.normal(kv, (2, t, kv_heads, 8))
    dout = jax.random.normal(kd, q.shape)
    def value_and_vjp(fn):  # jitted: eager dispatch of every chunk's ops is what would take time
        return jax.jit(lambda q, k, v, d: (lambda out, vjp: (out, *vjp(d)))(*jax.vjp(fn, q, k, v)))(q, k, v, dout)

    want = value_and_vjp(lambda *a: reference(*a, 0.3, window))
    got = value_and_vjp(lambda *a: causal_attention(*a, 0.3, window, rows))
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)


@pytest.mark.slow  # compiles a long attention; the fast tier keeps the fp32 checks
def test_bf16_inputs_stay_within_bf16_rounding():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, 32, 4, 8), jnp.bfloat16) for x in (kq, kk, kv))
    got = causal_attention(q, k, v, 0.35, None, 8)
    assert got.dtype == jnp.bfloat16
    want = reference(*(x.astype(jnp.float32) for x in (q, k, v)), 0.35, None)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)


def test_chunks_skip_exactly_the_invisible_keys():
    """Chunk i scores keys [first visible, end of chunk i): nothing visible is dropped."""
    assert query_chunks(512, None, 128) == [(0, 128, 0), (128, 256, 0), (256, 384, 0), (384, 512, 0)]
    assert query_chunks(10, 3, 4) == [(0, 3, 0), (3, 7, 1), (7, 10, 5)]
    for t, window, rows in [(37, 7, 8), (100, None, 30), (64, 64, 16)]:
        chunks = query_chunks(t, window, rows)
        assert chunks[0][0] == 0 and chunks[-1][1] == t
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        for r0, r1, k0 in chunks:
            assert k0 == (max(0, r0 - window + 1) if window else 0)  # row r0's first visible key


def test_the_model_uses_the_chunked_path_on_the_cpu():
    """The softmax attention module (mtjax.layers.softmax) goes through attend(), which
    picks causal_attention on this backend."""
    from mtjax import model

    cfg = tiny_config(num_hidden_layers=1)
    block = model.init_params(cfg, seed=0)["blocks"][0]
    x = jnp.ones((1, 8, 32))
    jaxpr = str(jax.make_jaxpr(lambda b, x: model.block_forward(cfg, cfg.layer_specs[0], b, x))(block, x))
    assert jax.default_backend() == "cpu" and "custom_vjp_call" in jaxpr


def _capped_reference(q, k, v, scale, window, softcap):
    """Soft-capped causal attention written out, differentiated by autodiff."""
    kv, t = k.shape[2], q.shape[1]
    k, v = (jnp.repeat(x, q.shape[2] // kv, axis=2) for x in (k, v))
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * scale
    s = jnp.tanh(s / softcap) * softcap
    qpos, kpos = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", p, v)


def test_soft_capped_scores_forward_and_backward_equal_autodiff(window=5):
    """Gemma 2's cap * tanh(s / cap): the custom backward's extra factor is exact, and the
    sampling path's masked_attention caps the same way. Scores reach ~4x the cap here; one
    windowed case (the cap is the same code with or without a window)."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(3), 4)
    t, cap = 13, 2.0
    q = 3 * jax.random.normal(kq, (2, t, 4, 8))
    k, v = 3 * jax.random.normal(kk, (2, t, 2, 8)), jax.random.normal(kv, (2, t, 2, 8))
    dout = jax.random.normal(kd, q.shape)

    def value_and_vjp(fn):
        return jax.jit(lambda q, k, v, d: (lambda out, vjp: (out, *vjp(d)))(*jax.vjp(fn, q, k, v)))(q, k, v, dout)

    want = value_and_vjp(lambda *a: _capped_reference(*a, 0.35, window, cap))
    got = value_and_vjp(lambda *a: causal_attention(*a, 0.35, window, 4, softcap=cap))
    uncapped = value_and_vjp(lambda *a: causal_attention(*a, 0.35, window, 4))
    for a, b, c in zip(got, want, uncapped):
        a, b, c = (np.asarray(x, np.float64) for x in (a, b, c))
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
        assert np.linalg.norm(c - b) > 1e-2 * np.linalg.norm(b)  # the cap is not vacuous here
    qpos, kpos = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = jnp.asarray((kpos <= qpos) & ((kpos > qpos - window) if window else True))[None, None]
    cached = masked_attention(q, k, v, mask, 0.35, cap)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(want[0]), rtol=1e-5, atol=1e-5)


def test_chunked_local_attention_is_the_document_mask_over_chunk_ids():
    """Llama 4's chunks (of 5 positions, counted from each document's start) as document ids
    with a window of one chunk, through the chunked kernel (row blocks of 8, not aligned to
    the chunks) and its custom backward, equal autodiff of the mask written out: causal,
    same document, same chunk; trailing padding sees only padding."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(5), 4)
    t, size = 13, 5
    q, dout = jax.random.normal(kq, (2, t, 4, 8)), jax.random.normal(kd, (2, t, 4, 8))
    k, v = jax.random.normal(kk, (2, t, 2, 8)), jax.random.normal(kv, (2, t, 2, 8))
    segments = np.asarray([[1] * 7 + [2] * 4 + [0] * 2, [3] * 3 + [4] * 10], np.int32)
    positions = np.asarray([[7, 4, 2], [3, 10, 0]])  # each row's documents' lengths -> positions in them
    positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in positions])
    qpos, kpos = positions[:, :, None], positions[:, None, :]
    index = np.arange(t)
    same = (segments[:, :, None] == segments[:, None, :]) & (index[None, :, None] >= index[None, None, :])
    mask = jnp.asarray(same & (qpos // size == kpos // size))[:, None]

    def value_and_vjp(fn):
        return jax.jit(lambda q, k, v, d: (lambda out, vjp: (out, *vjp(d)))(*jax.vjp(fn, q, k, v)))(q, k, v, dout)

    ids = jax.jit(lambda s: local_chunks(documents.positions(s), size, s))(segments)
    got = value_and_vjp(lambda *a: causal_attention(*a, 0.3, size, 8, None, ids))
    want = value_and_vjp(lambda *a: jax.nn.dot_product_attention(*a, mask=mask, scale=0.3))
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
    assert np.asarray(ids).tolist() == [[1] * 5 + [2] * 2 + [3] * 4 + [0] * 2, [1] * 3 + [2] * 5 + [3] * 5]
    assert local_chunks(np.arange(12)[None], size).tolist() == [[1] * 5 + [2] * 5 + [3] * 2]  # no documents


@pytest.mark.parametrize("t, window, softcap, documents_, rows", [
    pytest.param(100, None, None, False, 5, marks=SLOW),    # 20 blocks, the last one padded
    (37, 7, 2.0, False, 2),         # a window of several blocks, soft-capped
    (53, 9, None, True, 3),         # packed documents and padding (segment 0) under a window
])
def test_the_loop_over_blocks_equals_one_chunk(t, window, softcap, documents_, rows):
    """Past UNROLLED_CHUNKS chunks causal_attention loops over [rows, rows] blocks (online
    softmax, the diagonal block first): outputs and its custom backward equal the unrolled
    kernel with the whole row as one chunk (itself checked against dot_product_attention
    above)."""
    assert -(-t // rows) > attention_chunked.UNROLLED_CHUNKS
    kq, kk, kv, kd = jax.random.split(jax.random.key(t), 4)
    q, dout = 2 * jax.random.normal(kq, (2, t, 4, 8)), jax.random.normal(kd, (2, t, 4, 8))
    k, v = 2 * jax.random.normal(kk, (2, t, 2, 8)), jax.random.normal(kv, (2, t, 2, 8))
    segments = None
    if documents_:
        segments = jnp.asarray(np.repeat([[1, 2, 3, 0], [4, 5, 6, 7]], [20, 11, 15, 7], axis=1), jnp.int32)

    def value_and_vjp(fn):
        return jax.jit(lambda q, k, v, d: (lambda out, vjp: (out, *vjp(d)))(*jax.vjp(fn, q, k, v)))(q, k, v, dout)

    got = value_and_vjp(lambda *a: causal_attention(*a, 0.3, window, rows, softcap, segments))
    want = value_and_vjp(lambda *a: causal_attention(*a, 0.3, window, t, softcap, segments))
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)


def test_long_rows_hold_attention_memory_linear_in_the_row():
    """The compiled gradient of causal_attention (2 heads of 64, fp32, blocks of 64 rows: the
    loop at both lengths) at 2k and 8k tokens: XLA's temporaries grow with the row (q, k, v,
    their gradients), not with its square (unrolled chunks held 73 MiB at 2k, 1 GiB at 8k)."""
    def temp_bytes(t):
        x = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.float32)
        grad = jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, 0.1, None, 64)), argnums=(0, 1, 2))
        return jax.jit(grad).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(2048), temp_bytes(8192)
    assert long < 5 * short  # linear: x4 and a constant; quadratic would be x16
    assert long < 12 * 8192 * 2 * 64 * 4  # a dozen [t, heads, hd] fp32 arrays at most
