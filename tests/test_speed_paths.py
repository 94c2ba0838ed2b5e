"""The speed paths of the step (remat policies) change nothing numerically."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtjax
from mtjax import model
from mtjax.model_config import ConfigError
from mtjax.reference import ReferenceTrainer

from conftest import tiny_config, tokens as random_tokens

CFG = tiny_config(vocab_size=128)
SEQ = 16


def tokens(batch: int, seed: int) -> np.ndarray:
    return random_tokens(CFG.vocab_size, (batch, SEQ), seed)


@pytest.fixture(scope="module")
def params():
    # Perturbed norms: freshly initialised all-ones norms would hide a wrong recompute.
    p = mtjax.init_params(CFG, seed=0)
    return jax.tree.map(lambda x: np.asarray(x) + (0.1 * np.cos(np.arange(x.size)).reshape(x.shape)
                                                   if x.ndim == 1 else 0), p)


@pytest.mark.slow  # a gradient per remat policy
@pytest.mark.parametrize("policy", model.REMAT_POLICIES)
def test_every_remat_policy_gives_the_plain_gradient(params, policy):
    batch = jnp.asarray(tokens(2, seed=1))
    grad = lambda remat: jax.jit(jax.grad(lambda p: mtjax.loss_fn(CFG, p, batch, remat=remat)))(params)  # noqa: E731
    plain, got = grad(False), grad(policy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # a gradient per remat policy
def test_dots_policy_saves_the_projections_and_full_saves_nothing():
    """Policies differ in what the backward keeps: count the saved residuals."""
    x = jnp.ones((1, SEQ, CFG.hidden_size))
    block = mtjax.init_params(CFG, seed=0)["blocks"][0]
    fn = lambda b, x: model.block_forward(CFG, CFG.layer_specs[0], b, x)  # noqa: E731

    def n_residuals(policy):
        _, vjp = jax.vjp(model.remat_block(fn, policy), block, x)
        return sum(leaf.size for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "size"))

    full, dots, none = n_residuals("full"), n_residuals("dots"), n_residuals("none")
    d, f = CFG.hidden_size, CFG.intermediate_size
    q, kv = CFG.num_attention_heads * CFG.head_dim, CFG.num_key_value_heads * CFG.head_dim
    projections = SEQ * (q + 2 * kv + d + 2 * f)  # q, k, v, o, gate, up (the backward never needs down's)
    assert dots - full >= projections  # it keeps at least the projection outputs
    assert none > dots  # and less than no remat at all


@pytest.mark.slow  # a gradient per remat policy
def test_trainer_steps_agree_across_policies(params):
    opt = mtjax.OptimConfig(lr=1e-2, schedule="constant", clip_norm=0.5)
    full, dots = (ReferenceTrainer(CFG, params, opt, remat=p) for p in ("full", "dots"))
    for seed in (2, 3):
        a, b = full.step(tokens(2, seed)), dots.step(tokens(2, seed))
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for x, y in zip(jax.tree.leaves(dots.params), jax.tree.leaves(full.params)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(y)  # the streamed == reference spec


def test_unknown_remat_policy_is_a_config_error(params):
    with pytest.raises(ConfigError, match="remat must be one of none, full, dots"):
        ReferenceTrainer(CFG, params, remat="dot")
