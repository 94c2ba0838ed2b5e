"""A bf16 projection on the CPU (mtjax.layers.basic `_low_dot`): its written-out backward
computes what JAX's autodiff of the same forward computes, and remat policy "dots" still
keeps its outputs."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from mtjax import model
from mtjax.layers.basic import _dot

from conftest import tiny_config


def _autodiff_dot(x, w):
    """The forward `_dot` computes below fp32, left to JAX's autodiff."""
    flat = x.reshape(-1, x.shape[-1])
    y = jnp.einsum("td,df->tf", flat, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


def test_the_bf16_backward_equals_autodiff():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 24, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.1, size=(32, 48)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(2, 24, 48)), jnp.float32)

    def loss(dot, x, w):
        return jnp.sum(jnp.tanh(dot(x, w).astype(jnp.float32)) * probe)

    ours = jax.jit(jax.value_and_grad(functools.partial(loss, _dot), argnums=(0, 1)))(x, w)
    theirs = jax.jit(jax.value_and_grad(functools.partial(loss, _autodiff_dot), argnums=(0, 1)))(x, w)
    assert ours[0] == theirs[0]  # the same forward
    for a, b in zip(ours[1], theirs[1]):
        assert a.dtype == b.dtype and a.shape == b.shape
        # Equal up to fp32 summation order, then one bf16 rounding: at most a bf16 ulp apart.
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=1e-6)


def _saved(cfg, policy: str) -> list[str]:
    block = model.init_params(cfg, 0)["blocks"][0]
    x = jnp.ones((1, 8, cfg.hidden_size), cfg.compute_dtype)
    fn = model.remat_block(functools.partial(model.block_forward, cfg, cfg.layer_specs[0]), policy)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda b, x: fn(b, x).astype(jnp.float32).sum(), block, x)
    return out.getvalue().strip().splitlines()


def test_remat_dots_keeps_the_bf16_projections_as_it_keeps_the_fp32_ones():
    fp32, bf16 = tiny_config(), tiny_config(compute_dtype="bfloat16")
    assert len(_saved(bf16, "dots")) == len(_saved(fp32, "dots")) > len(_saved(bf16, "full"))
