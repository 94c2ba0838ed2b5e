"""Platform tunings chosen by the platform a program is traced for (mtjax.target), not the
process's default backend: lowered for the CPU a program has the CPU's flat dots and
chunked attention, lowered for CUDA (without a GPU: an abstract mesh of CUDA devices)
it has neither (attention: cuDNN's kernel where a CUDA capability is known, else the
chunked one); and a cuDNN refusal falls back to the chunked kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from mtjax import attention, moe, target
from mtjax.attention_chunked import causal_attention
from mtjax.layers.basic import _dot

BF16 = jnp.bfloat16
CUDA = AbstractMesh((1,), ("data",), abstract_device=AbstractDevice("NVIDIA H200", None, "cuda"))


def _lowered(fn, *shapes, platform: str) -> str:
    args = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
    if platform == "cpu":
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    with jax.sharding.use_abstract_mesh(CUDA):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_platform_traced_for_is_the_meshs_else_the_default_backends():
    assert target.platform() == jax.default_backend() == "cpu"
    with jax.sharding.use_abstract_mesh(CUDA):
        assert target.platform() == "cuda"
        assert attention._platform() == ("cuda", None)  # no GPU here: no capability, so no cuDNN


def test_dot_flattens_tokens_for_the_cpu_only():
    def loss(x, w):
        return jnp.sum(_dot(x, w).astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1))
    cpu, cuda = (_lowered(grad, (2, 8, 16), (16, 4), platform=p) for p in ("cpu", "cuda"))
    assert "tensor<16x16xbf16>" in cpu and "tensor<16x16xbf16>" not in cuda  # x as [tokens, d]
    assert "dot_general" in cuda and "tensor<2x8x16xbf16>" in cuda


def test_attention_is_chosen_by_the_platform_traced_for(monkeypatch):
    """The CPU and a CUDA platform without a known capability: the chunked kernel (no full
    [t, t] scores, lowered for either); CUDA with a capability: cuDNN's (its probe, which
    compiles on a GPU only, stood in for here by an acceptance)."""
    def attend(q, k, v):
        return attention.attend(q, k, v, 0.25)

    shapes = (1, 256, 4, 16), (1, 256, 2, 16), (1, 256, 2, 16)
    args = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
    assert "custom_vjp_call" in str(jax.make_jaxpr(attend)(*args))
    with jax.sharding.use_abstract_mesh(CUDA):
        assert "custom_vjp_call" in str(jax.make_jaxpr(attend)(*args))
    cpu, cuda = (_lowered(attend, *shapes, platform=p) for p in ("cpu", "cuda"))
    assert "256x256" not in cpu and "256x256" not in cuda  # chunked: no full [t, t] score matrix

    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, implementation=None, **kw: (
        calls.append(implementation), jnp.zeros(a[0].shape, a[0].dtype))[1])
    monkeypatch.setattr(attention, "cuda_capability", lambda: 9.0)
    monkeypatch.setattr(attention, "cudnn_refusal", lambda *a: None)
    fresh = lambda q, k, v: attention.attend(q, k, v, 0.25)  # noqa: E731  not the traces above, which jax caches
    jax.make_jaxpr(fresh)(*args)
    assert calls == []  # the CPU: chunked whatever a GPU would do
    with jax.sharding.use_abstract_mesh(CUDA):
        assert "custom_vjp_call" not in str(jax.make_jaxpr(fresh)(*args))
    assert calls == ["cudnn"]


def test_experts_take_the_cpus_blocked_matmul_and_cudas_ragged_dot():
    def experts(x, weights, chosen, gate, up, down):
        return moe.experts_forward(x, weights, chosen, gate, up, down)

    t, k, e, d, f = 8, 2, 4, 16, 24
    args = [jax.ShapeDtypeStruct((t, d), BF16), jax.ShapeDtypeStruct((t, k), jnp.float32),
            jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((e, d, f), BF16),
            jax.ShapeDtypeStruct((e, d, f), BF16), jax.ShapeDtypeStruct((e, f, d), BF16)]
    assert "ragged_dot" not in str(jax.make_jaxpr(experts)(*args))
    with jax.sharding.use_abstract_mesh(CUDA):
        assert "ragged_dot" in str(jax.make_jaxpr(experts)(*args))


@pytest.mark.slow  # two attention compiles
def test_a_cudnn_refusal_falls_back_to_the_chunked_kernel(monkeypatch):
    real = jax.nn.dot_product_attention
    calls = []

    def refusing(*a, implementation=None, **kw):
        calls.append(implementation)
        if implementation == "cudnn":
            raise NotImplementedError("cuDNN flash attention does not take this")
        return real(*a, implementation=implementation, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", refusing)
    attention.cudnn_refusal.cache_clear()
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, 12, 4, 8), BF16)
    k, v = jax.random.normal(kk, (1, 12, 2, 8), BF16), jax.random.normal(kv, (1, 12, 2, 8), BF16)
    with pytest.warns(UserWarning, match="cuDNN flash attention refused .* attention runs the chunked kernel"):
        got = jax.jit(lambda q, k, v: attention.attend(q, k, v, 0.4, platform=("cuda", 9.0)))(q, k, v)
    assert calls == ["cudnn"]  # the probe asked once; the step never called the refusing kernel
    want = jax.jit(lambda q, k, v: causal_attention(q, k, v, 0.4))(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
