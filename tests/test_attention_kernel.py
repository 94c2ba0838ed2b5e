"""The one place attention picks its implementation: `mtjax.attention.kernel`, tested without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import attention, attention_chunked, attention_mask
from mtjax.attention import kernel
from mtjax.attention_chunked import causal_attention

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize("args, kw, want", [
    (("cpu", BF16, 64), {}, "chunked"),                                   # the CPU: always the chunked path
    (("cpu", F32, 128), {"window": 16}, "chunked"),
    (("cuda", BF16, 128), {"capability": 8.0}, "cudnn"),                  # A100, bf16
    (("cuda", F16, 64), {"window": 4096, "capability": 9.0}, "cudnn"),    # a causal sliding window fits
    (("cuda", BF16, 256), {"capability": 9.0}, "cudnn"),                  # head dim 256 from Hopper on
    (("cuda", BF16, 256), {"capability": 8.6}, "pallas"),                 # ... not before: Pallas then
    (("cuda", BF16, 288), {"capability": 9.0}, "chunked"),                # beyond any cuDNN head dim
    (("cuda", BF16, 100), {"capability": 9.0}, "chunked"),                # not a multiple of 8
    (("cuda", F32, 128), {"capability": 9.0}, "pallas"),                  # fp32: no cuDNN kernel, Pallas
    (("cuda", BF16, 128), {"softcap": 50.0, "capability": 9.0}, "pallas"),    # soft-cap: not in jax.nn
    (("cuda", BF16, 128), {"segments": True, "capability": 9.0}, "pallas"),   # document ids: not in jax.nn
    (("cuda", BF16, 64), {"segments": True, "window": 8, "softcap": 30.0, "capability": 8.0}, "pallas"),
    (("cuda", BF16, 128), {"segments": True, "capability": 7.5}, "chunked"),  # Pallas's Triton: Ampere on
    (("cuda", BF16, 96), {"segments": True, "capability": 9.0}, "chunked"),   # head dim not a power of two
    (("cpu", BF16, 128), {"segments": True, "softcap": 30.0}, "chunked"),     # the CPU: never Pallas
    (("cuda", BF16, 128), {"sinks": True, "capability": 9.0}, "chunked"),     # sinks (gpt-oss): in no fused kernel
    (("cuda", BF16, 128), {"capability": None}, "chunked"),               # capability unknown
    (("gpu", BF16, 128), {}, "chunked"),                                  # a GPU without cuDNN
    (("tpu", BF16, 128), {}, "chunked"),                                  # O(t) memory wherever cuDNN is not
])
def test_kernel_choice(args, kw, want):
    assert kernel(*args, **kw) == want


def test_attend_passes_the_window_and_scale_to_the_kernel_it_picks(monkeypatch):
    """With the choice forced to cuDNN, `attend` calls jax.nn.dot_product_attention with
    implementation="cudnn" and arguments that compute what the chunked path does (run
    here by the XLA implementation of the same call)."""
    calls = []
    real = jax.nn.dot_product_attention

    def recording(*a, implementation=None, **kw):
        calls.append(implementation)
        return real(*a, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    attention.cudnn_refusal.cache_clear()  # probed afresh, through the recording stand-in
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (1, 12, 4, 8), BF16)
    k, v = jax.random.normal(kk, (1, 12, 2, 8), BF16), jax.random.normal(kv, (1, 12, 2, 8), BF16)
    hopper = ("cuda", 9.0)
    got = jax.jit(lambda q, k, v: attention.attend(q, k, v, 0.4, 5, platform=hopper))(q, k, v)  # one compile
    assert calls == ["cudnn", "cudnn"]  # the probe's compile (it takes the shape), then the step's call
    want = jax.jit(lambda q, k, v: causal_attention(q, k, v, 0.4, 5))(*(x.astype(F32) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)


def test_platform_on_this_machine_is_named_as_kernel_expects():
    backend, capability = attention._platform()
    assert backend == jax.default_backend() or backend == "cuda"
    assert (capability is None) == (backend != "cuda")


def test_cuDNN_refuses_on_this_cpu_in_one_line_and_attend_falls_back(recwarn):
    """The probe for real (no stand-in): cuDNN's kernel does not compile on the CPU, so with
    the choice forced to a Hopper GPU `attend` says why in one warning line and computes
    with the chunked kernel, exactly."""
    attention.cudnn_refusal.cache_clear()
    attention._told.clear()
    q = jax.ShapeDtypeStruct((1, 16, 2, 8), BF16)
    why = attention.cudnn_refusal(q, q, 0.5, None)
    assert why and "\n" not in why
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(x, (1, 16, 2, 8), BF16) for x in (kq, kk, kv))
    got = jax.jit(lambda q, k, v: attention.attend(q, k, v, 0.5, platform=("cuda", 9.0)))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jax.jit(lambda q, k, v: causal_attention(q, k, v, 0.5))(q, k, v), np.float32))
    said = [str(w.message) for w in recwarn if "cuDNN" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0] and "attention runs the chunked kernel" in said[0], said


def _with_sinks_by_definition(q, k, v, sinks, scale, window, segments):
    """Attention with sinks written out: one more logit per row, the sink's, in the softmax,
    dropped after it (as transformers' gpt-oss computes it)."""
    kv, t = k.shape[2], q.shape[1]
    k, v = jnp.repeat(k, q.shape[2] // kv, axis=2), jnp.repeat(v, q.shape[2] // kv, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    pos = jnp.arange(t)
    mask = attention_mask.visible(pos, pos, window, segments, segments)[:, None]  # [b, 1, t, t]
    s = jnp.where(mask, s, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:-1], 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhts,bshd->bthd", p, v)


@pytest.mark.parametrize("which", ["unrolled", "looped"])
def test_sinks_in_the_chunked_kernel_forward_and_backward(which):
    """Chunks (or loop blocks) of 4 rows over 11 tokens, a window of 5, two documents,
    grouped heads: the output and the gradients of q, k, v and the sinks equal the
    definition's."""
    keys = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(keys[0], (2, 11, 4, 8), F32)
    k, v = jax.random.normal(keys[1], (2, 11, 2, 8), F32), jax.random.normal(keys[2], (2, 11, 2, 8), F32)
    sinks = 2.0 * jax.random.normal(keys[3], (4,), F32)
    dout = jax.random.normal(keys[4], q.shape, F32)
    segments = jnp.asarray([[1] * 11, [1] * 6 + [2] * 5], jnp.int32)

    def loss(fn):
        return lambda q, k, v, sinks: jnp.sum(fn(q, k, v, sinks) * dout)

    kernel_fn = causal_attention if which == "unrolled" else attention_chunked.looped_attention
    ours = loss(lambda q, k, v, sinks: kernel_fn(q, k, v, 0.3, 5, 4, None, segments, sinks))
    theirs = loss(lambda q, k, v, sinks: _with_sinks_by_definition(q, k, v, sinks, 0.3, 5, segments))
    np.testing.assert_allclose(ours(q, k, v, sinks), theirs(q, k, v, sinks), rtol=1e-5)
    for got, want in zip(jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, sinks),
                         jax.grad(theirs, argnums=(0, 1, 2, 3))(q, k, v, sinks)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(jax.grad(ours, argnums=3)(q, k, v, sinks)).min()) > 0  # the sinks do get a gradient


def test_attend_runs_the_pallas_kernel_for_documents_and_soft_caps_on_a_cuda_gpu(monkeypatch):
    """With the choice made for a Hopper GPU, packed documents with a soft-cap go to
    mtjax.flash_pallas (here through Pallas's interpreter, a stand-in for its GPU compile):
    probed once, then called with the window, cap and document ids; equal to the chunked path."""
    calls = []
    real = attention.flash_pallas.flash_attention

    def interpreted(*a, **kw):
        calls.append(a[3:])  # scale, window, softcap, segments
        return real(*a, **kw, interpret=True)

    monkeypatch.setattr(attention.flash_pallas, "flash_attention", interpreted)
    attention.pallas_refusal.cache_clear()  # probed afresh, through the stand-in
    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (1, 20, 4, 16))
    k, v = jax.random.normal(kk, (1, 20, 2, 16)), jax.random.normal(kv, (1, 20, 2, 16))
    docs = jnp.asarray([[1] * 7 + [2] * 13])
    got = jax.jit(lambda q, k, v, d: attention.attend(q, k, v, 0.4, 6, 25.0, d, platform=("cuda", 9.0)))(q, k, v, docs)
    assert len(calls) == 2 and all(c[:3] == (0.4, 6, 25.0) for c in calls)  # the probe's compile, then the step
    want = causal_attention(q, k, v, 0.4, 6, softcap=25.0, segments=docs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_pallas_refuses_on_this_cpu_in_one_line_and_attend_falls_back(recwarn):
    """The Pallas probe for real: its kernel compiles only interpreted on the CPU, so with
    the choice made for a Hopper GPU, packed documents run the chunked kernel exactly, and
    one warning line says why."""
    attention.pallas_refusal.cache_clear()
    attention._told.clear()
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(x, (1, 16, 2, 16), BF16) for x in (kq, kk, kv))
    docs = jnp.asarray([[1] * 5 + [2] * 11])
    got = jax.jit(lambda q, k, v, d: attention.attend(q, k, v, 0.5, segments=d, platform=("cuda", 9.0)))(q, k, v, docs)
    want = jax.jit(lambda q, k, v, d: causal_attention(q, k, v, 0.5, segments=d))(q, k, v, docs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    said = [str(w.message) for w in recwarn if "Pallas" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0] and "attention runs the chunked kernel" in said[0], said
