"""The optimizer stage as the optax program: the donated, in-place update equals the program undonated."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtjax import precision, treepath
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream.update import PartUpdate, _update

from conftest import tiny_config, token_batches

CFG = tiny_config(num_hidden_layers=1, num_attention_heads=2, head_dim=16)
# Odd shapes, remainders, a 3-D leaf, 1-D norms (no weight decay) and a scalar.
SHAPES = {"a.kernel": (300, 7), "b.kernel": (37, 13), "c.kernel": (9, 4, 5), "norm.weight": (5,),
          "big.bias": (1000,), "gain": ()}
TX = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=10, weight_decay=0.1))
S = jax.ShapeDtypeStruct


def _random(shapes, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in shapes.items()}


def _reference(tx, dtype, master, opt, grads, scale):
    """The update program, nothing donated: what the engine's update must reproduce."""
    template = jax.eval_shape(tx.init, {n: S(np.shape(a), np.float32) for n, a in master.items()})
    fn = jax.jit(functools.partial(_update, tx, precision.Policy(dtype)))
    m, o, c = fn(master, treepath.unflatten(template, opt), None, grads, jnp.float32(scale))
    return {n: np.asarray(a) for n, a in m.items()}, treepath.flatten(jax.tree.map(np.asarray, o)), \
        {n: np.asarray(a) for n, a in c.items()}


def _host(tree: dict) -> dict:
    return {n: np.array(a) for n, a in tree.items()}


def _check_equal(got: dict, want: dict):
    assert set(got) == set(want)
    for n in want:
        g, w = np.asarray(got[n]), want[n]
        assert g.shape == w.shape and g.dtype == w.dtype, n
        # Within fp32 rounding of the leaf's values: a program compiled differently (another
        # fusion, the fused loop) may contract other multiply-adds (FMA).
        if g.dtype == np.float32:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(w))), err_msg=n)
        elif g.dtype == jnp.bfloat16:  # rounded from fp32 masters a few ulp apart: one bf16 ulp
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=2 ** -7, atol=0, err_msg=n)
        else:
            np.testing.assert_array_equal(g, w, err_msg=n)


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_whole_part_update_equals_undonated_program(compute_dtype, tier):
    """The engine's update (donated inputs, RAM-tier XLA buffers or disk-tier numpy)
    equals the same program run without donation, over steps with a clip scale."""
    cfg = dataclasses.replace(CFG, compute_dtype=compute_dtype)
    update = PartUpdate(cfg, TX)
    master = {n: jax.device_put(a) for n, a in _random(SHAPES, 0).items()}
    state = (master, update.init_state(master), update.compute_copy(master))
    for step in range(3):
        grads = _random(SHAPES, 10 + step, 1e-2)
        scale = 0.5 if step == 1 else 1.0
        # One step from the same inputs, so that rounding differences do not compound.
        want_m, want_o, want_c = _reference(TX, compute_dtype, _host(state[0]), _host(state[1]), grads, scale)
        if tier == "disk":  # the disk tier hands in numpy buffers and no compute copy
            state = (_host(state[0]), _host(state[1]), None)
        inputs, original = state, [_host(d) for d in state[:2]]
        state = update("block.0", *state, grads, scale)
        _check_equal(state[0], want_m)
        _check_equal(state[1], want_o)
        _check_equal(state[2], want_c)
        if tier == "disk":  # numpy buffers the engine reuses are read, never written
            for given, kept in zip(inputs[:2], original):
                _check_equal(given, kept)
        else:  # RAM-tier XLA buffers are donated: consumed, their memory reused for the results
            assert all(a.is_deleted() for d in inputs for n, a in d.items() if not n.endswith("count"))


def test_ram_tier_update_runs_in_place():
    update = PartUpdate(CFG, TX)
    master = {n: jax.device_put(a) for n, a in _random(SHAPES, 0).items()}
    state = update("block.0", master, update.init_state(master), update.compute_copy(master), _random(SHAPES, 1), 1.0)

    def pointers(tree):
        return {a.unsafe_buffer_pointer() for n, a in tree.items() if not n.endswith("count")}

    before = set().union(*map(pointers, state))
    state = update("block.0", *state, _random(SHAPES, 2), 1.0)
    # Master, moments and compute copy land in the buffers they came in (donated); XLA
    # may swap buffers between arrays of one shape, so compare the sets.
    assert set().union(*map(pointers, state)) == before


def test_whole_part_fallback_equals_reference():
    tx = optax.chain(optax.clip_by_global_norm(1e-3), TX)
    update = PartUpdate(CFG, tx)
    master = _random(SHAPES, 0)
    opt = _host(update.init_state(master))
    grads = _random(SHAPES, 1)
    want = _reference(tx, CFG.compute_dtype, master, opt, grads, 1.0)
    got = update("block.0", {n: jax.device_put(a) for n, a in master.items()}, opt, None, grads, 1.0)
    for g, w in zip(got, want):
        _check_equal(g, w)


@pytest.mark.slow  # engine steps against the reference
def test_engine_with_the_optax_program_commits_its_state_whole(make_store):
    """Streamed steps with the optax program's RAM-tier state (XLA buffers it updates in
    place) equal the in-memory trainer, and a commit writes that state to the store whole."""
    from mtjax import model, parts
    from mtjax.reference import ReferenceTrainer
    from mtjax.stream import StreamEngine

    cfg = tiny_config(vocab_size=97)
    opt = OptimConfig(lr=1e-3, warmup_steps=1, decay_steps=10, clip_norm=0.05, weight_decay=0.1)
    batches = token_batches(cfg.vocab_size, (1, 2, 16), 3)
    ref = ReferenceTrainer(cfg, model.init_params(cfg, seed=1), opt)
    # The optax transformation as `tx`, not only its OptimConfig: the update is XLA's program.
    engine = StreamEngine(cfg, model.init_params(cfg, seed=1), opt, batch_shape=(2, 16), tx=make_optimizer(opt),
                          store=make_store(cfg, make_optimizer(opt)))
    assert engine.update.fused is None
    for b in batches:
        ref.step(b)
        engine.step(b)
    params, opt_state = engine.params(), engine.opt_state()
    kept = engine.tiers.read("block.0", "master").result()["mlp.up_proj.kernel"]
    assert isinstance(kept, jax.Array)  # the program's own (donated) result, not a copy
    for got, want in [(params, ref.params), (opt_state, ref.opt_state)]:
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            assert np.linalg.norm(g - w) <= 1e-5 * max(np.linalg.norm(w), 1e-30)
    engine.commit()
    stored = engine.store.read("block.0", "master").result()
    want = treepath.flatten(parts.part_params(params, "block.0"))
    for n, a in stored.items():
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want[n]))
    engine.close()
