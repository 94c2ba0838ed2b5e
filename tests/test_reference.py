"""The in-memory reference trainer: the baseline every streamed step must equal."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mtjax
from mtjax.optim import make_optimizer
from mtjax.reference import ReferenceTrainer

from conftest import tiny_config, tokens as random_tokens

CFG = tiny_config(vocab_size=128)
SEQ = 16


def tokens(batch: int, seed: int = 0, accum: int | None = None) -> np.ndarray:
    shape = (batch, SEQ) if accum is None else (accum, batch, SEQ)
    return random_tokens(CFG.vocab_size, shape, seed)


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, mtjax.init_params(CFG, seed=0))


_value_and_grad = jax.jit(jax.value_and_grad(mtjax.loss_fn, argnums=1), static_argnums=0)
_forward = jax.jit(mtjax.forward, static_argnums=0)


def grads_at(cfg, params, batch):
    loss, g = _value_and_grad(cfg, params, jnp.asarray(batch))
    return float(loss), g


def global_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))


def rel_errors(a, b) -> dict[str, float]:
    """Per tensor ||a - b|| / ||b||, keyed by path."""
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    return {jax.tree_util.keystr(p): float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                                           / np.linalg.norm(np.asarray(y, np.float64)))
            for (p, x), y in zip(flat_a, flat_b)}


@pytest.mark.slow  # several trainer steps, compiled per case
def test_loss_falls_on_a_fixed_batch(params):
    batch = tokens(4)
    fresh = mtjax.init_params(CFG, seed=0)  # jax arrays, which jnp.asarray would not copy
    opt = mtjax.OptimConfig(lr=1e-2, schedule="constant", weight_decay=0.0)
    trainer = ReferenceTrainer(CFG, fresh, opt)
    losses = [trainer.step(batch)["loss"] for _ in range(10)]
    assert abs(losses[0] - np.log(CFG.vocab_size)) < 0.1  # a fresh model is near-uniform
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 8, losses
    # The step donates its buffers, but never the caller's arrays: they are intact.
    jax.tree.map(np.testing.assert_array_equal, fresh, params)


@pytest.mark.slow  # several trainer steps, compiled per case
def test_resuming_from_params_and_opt_state_continues_exactly(params):
    """A second trainer built from the first one's state takes the identical next step,
    and building it leaves the first trainer's arrays usable."""
    opt = mtjax.OptimConfig(lr=1e-2, warmup_steps=2, decay_steps=5)  # the step count matters
    first = ReferenceTrainer(CFG, params, opt)
    for seed in (30, 31):
        first.step(tokens(2, seed=seed))
    second = ReferenceTrainer(CFG, first.params, opt, opt_state=first.opt_state)
    a, b = second.step(tokens(2, seed=32)), first.step(tokens(2, seed=32))
    assert a == b
    jax.tree.map(np.testing.assert_array_equal, second.params, first.params)
    jax.tree.map(np.testing.assert_array_equal, second.opt_state, first.opt_state)
    assert int(second.opt_state[0].count) == 3  # the AdamW step count carried over


def test_remat_does_not_change_the_gradient(params):
    """The trainer differentiates with every block under jax.checkpoint."""
    batch = jnp.asarray(tokens(2, seed=40))
    plain = jax.jit(jax.grad(lambda p: mtjax.loss_fn(CFG, p, batch, remat=False)))(params)
    _, remat = grads_at(CFG, params, batch)
    errors = rel_errors(remat, plain)
    assert max(errors.values()) <= 1e-6, errors


@pytest.mark.slow  # several trainer steps, compiled per case
def test_gradient_accumulation_equals_one_big_batch(params):
    micro = tokens(2, seed=3, accum=4)  # [accum 4, batch 2, seq]
    big = micro.reshape(8, SEQ)
    opt = mtjax.OptimConfig(lr=1e-2, schedule="constant", clip_norm=0.5)
    accumulated, whole = ReferenceTrainer(CFG, params, opt), ReferenceTrainer(CFG, params, opt)
    for step in range(2):
        a, b = accumulated.step(micro), whole.step(big)
        assert a["grad_norm"] > opt.clip_norm  # clipping is active on both steps
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    errors = rel_errors(accumulated.params, whole.params)
    # fp32 sums in another order, through two AdamW steps (whose normalisation magnifies the
    # smallest gradient entries): 1.04e-5 on one kernel with jax 0.10.2, optax 0.2.8, numpy
    # 2.4.6, also on the commit before the one-design change. A wrong accumulation (a sum
    # instead of a mean, a dropped micro-batch) is off by far more than 1e-3.
    assert max(errors.values()) <= 2e-5, errors
    # ... and the two steps really moved every tensor far more than that.
    moved = rel_errors(whole.params, params)
    assert min(moved.values()) > 1e-3, moved


@pytest.mark.slow  # several trainer steps, compiled per case
def test_accumulated_gradient_is_the_mean_of_micro_batch_gradients(params):
    """One SGD step exposes the accumulated gradient: (params - new params) / lr."""
    micro = tokens(2, seed=5, accum=3)
    lr = 1e4  # the update dwarfs the params, so p - (p - lr g) loses no digits of g in fp32
    trainer = ReferenceTrainer(CFG, params, optax.sgd(lr))
    trainer.step(micro)
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *[grads_at(CFG, params, m)[1] for m in micro])
    got = jax.tree.map(lambda p0, p1: (p0 - p1) / lr, params, trainer.params)
    errors = rel_errors(got, mean)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.slow  # several trainer steps, compiled per case
def test_bf16_compute_keeps_fp32_master_and_matches_fp32_loss(params):
    batch = tokens(4, seed=7)
    bf16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
    opt = mtjax.OptimConfig(lr=1e-2, schedule="constant")
    t16, t32 = ReferenceTrainer(bf16, params, opt), ReferenceTrainer(CFG, params, opt)
    m16, m32 = t16.step(batch), t32.step(batch)
    assert m16["loss"] == pytest.approx(m32["loss"], rel=1e-2)
    assert m16["loss"] != m32["loss"]  # bf16 really ran: bitwise equality would mean fp32
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=5e-2)
    for _ in range(3):
        m16 = t16.step(batch)
    assert np.isfinite(m16["loss"]) and m16["loss"] < m32["loss"]
    assert {x.dtype for x in jax.tree.leaves(t16.params)} == {jnp.dtype(jnp.float32)}
    floats = [x for x in jax.tree.leaves(t16.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}


def test_bf16_loss_is_computed_in_bf16():
    """The logits of a bf16 model equal those of bf16-rounded weights run in bf16, not fp32."""
    p = mtjax.init_params(CFG, seed=1)
    batch = jnp.asarray(tokens(2, seed=8))
    bf16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
    low = np.asarray(_forward(bf16, p, batch))
    high = np.asarray(_forward(CFG, p, batch))
    assert low.dtype == np.float32  # logits come back in fp32 either way
    assert 0 < np.abs(low - high).max() < 0.05 * np.abs(high).max()


@pytest.mark.slow  # several trainer steps, compiled per case
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_global_norm_clipping_clips(params, optimizer):
    """The step equals the optimizer applied to the gradient pre-scaled to norm clip."""
    batch = tokens(4, seed=11)
    loss, g = grads_at(CFG, params, batch)
    norm = global_norm(g)
    clip = norm / 4
    if optimizer == "sgd":
        tx = optax.sgd(1e4)  # a step that dwarfs the params keeps all digits of it in fp32
        trainer = ReferenceTrainer(CFG, params, tx, clip_norm=clip)
    else:
        # eps comparable to the gradient entries makes Adam's first step depend on scale.
        opt = mtjax.OptimConfig(lr=1e-2, eps=1e-3, clip_norm=clip)
        tx, trainer = make_optimizer(opt), ReferenceTrainer(CFG, params, opt)
    metrics = trainer.step(batch)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5) and metrics["grad_norm"] > clip
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)

    def one_step(grads):
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    clipped = one_step(jax.tree.map(lambda x: x * (clip / norm), g))
    errors = rel_errors(jax.tree.map(lambda a, b: a - b, trainer.params, params),
                        jax.tree.map(lambda a, b: a - b, clipped, params))
    assert max(errors.values()) <= 1e-4, errors
    # Unclipped, the step would be measurably different: the test can tell them apart.
    unclipped = one_step(g)
    diff = rel_errors(jax.tree.map(lambda a, b: a - b, unclipped, params),
                      jax.tree.map(lambda a, b: a - b, clipped, params))
    assert max(diff.values()) > 1e-2


@pytest.mark.slow  # several trainer steps, compiled per case
def test_train_reference_with_a_plain_optax_transformation(params):
    batches = [tokens(4, seed=s) for s in (20, 21, 20, 21, 20, 21)]
    lr = 0.5
    final, opt_state, losses = mtjax.train_reference(CFG, params, batches, optax.sgd(lr))
    assert len(losses) == len(batches) and all(np.isfinite(losses))
    assert losses[4] < losses[2] < losses[0] and losses[5] < losses[3] < losses[1], losses  # per batch
    # The first step is plain SGD on the unclipped gradient.
    first, _, [loss0] = mtjax.train_reference(CFG, params, batches[:1], optax.sgd(lr))
    loss, g = grads_at(CFG, params, batches[0])
    assert loss0 == pytest.approx(loss, rel=1e-6)
    expected = jax.tree.map(lambda p, d: p - lr * d, params, g)
    moved = rel_errors(expected, params)
    assert min(moved.values()) > 3e-5, moved  # the tolerance below is far under the step
    errors = rel_errors(first, expected)
    assert max(errors.values()) <= 1e-6, errors


@pytest.mark.parametrize("field, value", [
    ("lr", 0.0), ("schedule", "step"), ("warmup_steps", -1), ("b1", 1.0), ("b2", -0.1),
    ("eps", 0.0), ("weight_decay", -1e-3), ("min_lr_ratio", 1.5), ("clip_norm", 0.0),
])
def test_bad_optimizer_settings_are_config_errors_naming_the_field(field, value):
    with pytest.raises(mtjax.ConfigError, match=f"optim.{field}"):
        mtjax.OptimConfig(**{field: value})
