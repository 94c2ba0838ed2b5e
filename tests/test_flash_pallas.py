"""mtjax.flash_pallas, the GPU's kernel for the cases cuDNN does not take, run on the CPU by
Pallas's interpreter: outputs and gradients equal the chunked kernel's (fp32, 1e-5), rows
not a multiple of the blocks (padding), windows, soft-caps, packed documents, grouped queries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.attention_chunked import causal_attention
from mtjax.flash_pallas import flash_attention

DOCS = np.array([[1] * 10 + [2] * 20 + [0] * 7, [3] * 37], np.int32)  # two documents and padding; one document


@pytest.mark.parametrize("window, softcap, documents, blocks", [
    (None, None, False, (16, 8)),   # causal only, query blocks twice the key blocks
    (5, None, False, (8, 16)),      # a window shorter than a block, key blocks twice the query blocks
    (None, 30.0, False, (16, 16)),  # soft-capped scores
    (7, 20.0, True, (16, 8)),       # packed documents with a window and a soft-cap
    (None, None, True, (32, 32)),   # one block holds the whole row
])
def test_outputs_and_gradients_equal_the_chunked_kernel(window, softcap, documents, blocks):
    b, t, heads, kv_heads, hd = 2, 37, 4, 2, 16
    kq, kk, kv, kd = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(kq, (b, t, heads, hd))
    k, v = jax.random.normal(kk, (b, t, kv_heads, hd)), jax.random.normal(kv, (b, t, kv_heads, hd))
    dout = jax.random.normal(kd, q.shape)
    segments = jnp.asarray(DOCS) if documents else None
    block_q, block_k = blocks

    def pallas(q, k, v):
        return flash_attention(q, k, v, 0.3, window, softcap, segments, block_q=block_q, block_k=block_k,
                               interpret=True)

    def chunked(q, k, v):
        return causal_attention(q, k, v, 0.3, window, rows=16, softcap=softcap, segments=segments)

    got, want = (jax.jit(lambda q, k, v, f=f: (lambda o, vjp: (o, *vjp(dout)))(*jax.vjp(f, q, k, v)))(q, k, v)
                 for f in (pallas, chunked))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=name)


def test_bf16_inputs_stay_within_bf16_rounding_of_the_fp32_result():
    """bf16 q, k, v (what a GPU step streams): fp32 scores and sums inside, bf16 out and
    gradients, within bf16 rounding of the chunked kernel's fp32 result."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(9), 4)
    q = jax.random.normal(kq, (2, 37, 4, 16))
    k, v = jax.random.normal(kk, (2, 37, 2, 16)), jax.random.normal(kv, (2, 37, 2, 16))
    dout, docs = jax.random.normal(kd, q.shape), jnp.asarray(DOCS)

    def run(f, *args):
        out, vjp = jax.vjp(f, *args)
        return out, *vjp(dout.astype(out.dtype))

    got = jax.jit(lambda *a: run(lambda q, k, v: flash_attention(q, k, v, 0.3, 9, 20.0, docs, block_q=16, block_k=16,
                                                                  interpret=True), *a))(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    want = jax.jit(lambda *a: run(lambda q, k, v: causal_attention(q, k, v, 0.3, 9, softcap=20.0, segments=docs), *a))(
        q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=5e-2, rtol=5e-2, err_msg=name)


def test_forward_and_backward_lower_to_triton_for_a_cuda_gpu_on_this_cpu():
    """Without a GPU, the step short of compiling: the three kernels (forward, dK and dV, dQ)
    lower to Triton calls for the CUDA platform, at a padded row that is not a power of two."""
    q = jax.ShapeDtypeStruct((2, 130, 4, 64), jnp.bfloat16)
    k, docs = jax.ShapeDtypeStruct((2, 130, 2, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, 130), jnp.int32)

    def loss(q, k, v, docs):
        return jnp.sum(flash_attention(q, k, v, 0.125, 32, 30.0, docs).astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, docs).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 3
