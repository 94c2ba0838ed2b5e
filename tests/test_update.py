"""The optimizer stage: the chunked, in-place update equals one whole-leaf program."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtjax import treepath
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream.update import PartUpdate, RowChunks, _update, leaf_split

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)
# Odd shapes, remainders, a 3-D leaf, 1-D norms (no weight decay) and a scalar.
SHAPES = {"a.kernel": (300, 7), "b.kernel": (37, 13), "c.kernel": (9, 4, 5), "norm.weight": (5,),
          "big.bias": (1000,), "gain": ()}
TX = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=10, weight_decay=0.1))
S = jax.ShapeDtypeStruct


def _random(shapes, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in shapes.items()}


def _reference(tx, dtype, master, opt, grads, scale):
    """One whole-leaf program, nothing donated: the result chunking must reproduce."""
    template = jax.eval_shape(tx.init, {n: S(np.shape(a), np.float32) for n, a in master.items()})
    fn = jax.jit(functools.partial(_update, tx, np.dtype(dtype)))
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
        # The same elementwise program on fewer elements: XLA's vector loop and scalar tail
        # may round an element differently (FMA): within fp32 rounding of the leaf's values.
        if g.dtype == np.float32:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(w))), err_msg=n)
        elif g.dtype == jnp.bfloat16:  # rounded from fp32 masters a few ulp apart: one bf16 ulp
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=2 ** -7, atol=0, err_msg=n)
        else:
            np.testing.assert_array_equal(g, w, err_msg=n)


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_chunked_update_equals_whole_leaf(compute_dtype, tier):
    cfg = dataclasses.replace(CFG, compute_dtype=compute_dtype)
    update = PartUpdate(cfg, TX, chunk_bytes=64 * 4)  # 64-element chunks: every large leaf splits
    master = {n: jax.device_put(a) for n, a in _random(SHAPES, 0).items()}
    state = (master, update.init_state(master), update.compute_copy(master))
    original = _host(master)
    for step in range(3):
        grads = _random(SHAPES, 10 + step, 1e-2)
        scale = 0.5 if step == 1 else 1.0
        # One step from the same inputs, so that rounding differences do not compound.
        want_m, want_o, want_c = _reference(TX, compute_dtype, _host(state[0]), _host(state[1]), grads, scale)
        if tier == "disk":  # the disk tier hands in numpy buffers and no compute copy
            state = (_host(state[0]), _host(state[1]), None)
        state = update("block.0", *state, grads, scale)
        _check_equal(state[0], want_m)
        _check_equal(state[1], want_o)
        _check_equal(state[2], want_c)
        if step == 0:  # inputs made elsewhere are read, never written
            _check_equal(master, original)
    if tier == "ram":
        assert isinstance(state[0]["a.kernel"], RowChunks) and len(state[0]["a.kernel"].chunks) > 1


def test_ram_tier_update_runs_in_place():
    update = PartUpdate(CFG, TX, chunk_bytes=64 * 4)
    master = {n: jax.device_put(a) for n, a in _random(SHAPES, 0).items()}
    state = update("block.0", master, update.init_state(master), update.compute_copy(master), _random(SHAPES, 1), 1.0)
    def pointers(tree):
        return {c.unsafe_buffer_pointer() for n, a in tree.items() if not n.endswith("count")
                for c in (a.chunks if isinstance(a, RowChunks) else [a])}

    before = set().union(*map(pointers, state))
    state = update("block.0", *state, _random(SHAPES, 2), 1.0)
    # Master, moments and compute copy land in the buffers they came in (donated); XLA
    # may swap buffers between arrays of one shape, so compare the sets.
    assert set().union(*map(pointers, state)) == before


def test_row_chunks_read_as_arrays():
    update = PartUpdate(CFG, TX, chunk_bytes=64 * 4)
    master = _random(SHAPES, 0)
    state = update("block.0", {n: jax.device_put(a) for n, a in master.items()}, update.init_state(master), None,
                   _random(SHAPES, 1), 1.0)
    leaf = state[0]["c.kernel"]
    assert isinstance(leaf, RowChunks) and leaf.shape == (9, 4, 5) and leaf.ndim == 3 and leaf.dtype == np.float32
    assert np.asarray(leaf).shape == (9, 4, 5) and jnp.asarray(leaf).shape == (9, 4, 5)
    assert jax.block_until_ready(leaf) is not None


@pytest.mark.parametrize("tx, chunkable", [
    (TX, True),
    (optax.sgd(1e-2, momentum=0.9), True),
    (optax.lion(1e-3), True),
    (optax.chain(optax.clip_by_global_norm(1.0), TX), False),  # a norm over every leaf
    (optax.adafactor(1e-3), False),  # factored moments: row and column means
    (optax.add_noise(0.1, 0.5, 0), False),  # noise depends on the element's position
])
def test_only_elementwise_transformations_are_chunked(tx, chunkable):
    shapes = {n: S(s, np.float32) for n, s in SHAPES.items()}
    assert (leaf_split(tx, np.dtype("bfloat16"), shapes) is not None) == chunkable


def test_single_leaf_part_is_chunked():  # the embedding: its moments are its own, not shared
    split = leaf_split(TX, np.dtype("bfloat16"), {"embedding": S((64, 32), np.float32)})
    assert split is not None and split.own["embedding"] == ("0.mu.embedding", "0.nu.embedding")
    assert split.shared == ("0.count", "2.count")


def test_a_scan_along_rows_is_not_chunked():
    def running(updates, state, params=None):  # each row's update depends on the rows before it
        def body(carry, row):
            return carry + row, carry + row
        return jax.tree.map(lambda u: jax.lax.scan(body, jnp.zeros(u.shape[1:], u.dtype), u)[1], updates), state

    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), running)
    assert leaf_split(tx, np.dtype("float32"), {"x": S((8, 4), np.float32)}) is None


def test_mixing_two_leaves_is_not_chunked():
    def swap(updates, state, params=None):  # the update of one leaf comes from another
        return {"x": updates["y"], "y": updates["x"]}, state

    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), swap)
    assert leaf_split(tx, np.dtype("float32"), {"x": S((4, 4), np.float32), "y": S((4, 4), np.float32)}) is None


def test_whole_part_fallback_equals_reference():
    tx = optax.chain(optax.clip_by_global_norm(1e-3), TX)
    update = PartUpdate(CFG, tx, chunk_bytes=64 * 4)
    master = _random(SHAPES, 0)
    opt = _host(update.init_state(master))
    grads = _random(SHAPES, 1)
    want = _reference(tx, CFG.compute_dtype, master, opt, grads, 1.0)
    got = update("block.0", {n: jax.device_put(a) for n, a in master.items()}, opt, None, grads, 1.0)
    for g, w in zip(got, want):
        _check_equal(g, w)


def test_engine_with_row_chunks_equals_reference(tmp_path):
    """Streamed steps on RAM-tier RowChunks (several chunks per leaf) equal the in-memory
    trainer, and a commit writes the chunked state to the store whole."""
    import mtjax.store
    from mtjax import model, parts
    from mtjax.reference import ReferenceTrainer
    from mtjax.stream import StreamEngine

    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    opt = OptimConfig(lr=1e-3, warmup_steps=1, decay_steps=10, clip_norm=0.05, weight_decay=0.1)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, (1, 2, 16), dtype=np.int32) for _ in range(3)]
    ref = ReferenceTrainer(cfg, model.init_params(cfg, seed=1), opt)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=1), opt, batch_shape=(2, 16),
                          store=mtjax.store.create(tmp_path / "store", cfg, make_optimizer(opt)))
    engine.updater.update = PartUpdate(cfg, engine.tx, chunk_bytes=64 * 4)  # chunks of 64 elements
    for b in batches:
        ref.step(b)
        engine.step(b)
    params, opt_state = engine.params(), engine.opt_state()
    chunked = engine.tiers.read("block.0", "master").result()["mlp.up_proj.kernel"]
    assert isinstance(chunked, RowChunks) and len(chunked.chunks) > 1
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
