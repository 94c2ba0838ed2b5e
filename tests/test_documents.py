"""Packed documents do not see each other, and the loss counts only the targets it should.

A row packs three documents (5, 4 and 6 tokens) and one padding token; one block of the
tiny model is a sliding-window block (window 3, shorter than every document). Each
document's loss and gradient in the packed row equal those of the document alone (at
the start of a plain row, positions from 0, nothing before it to see), in the reference
trainer and the streaming engine; the engine equals the reference on masked, packed
steps of 4 micro-batches whose counts differ, so the loss is normalised over the step.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import checkpoint, cli, data, documents, hf, model, parts, treepath
from mtjax.attention_chunked import causal_attention
from mtjax.batch import Batch
from mtjax.model_config import FULL, SLIDING
from mtjax.optim import OptimConfig
from mtjax.reference import ReferenceTrainer, eval_loss, loss_fn
from mtjax.stream import StreamEngine

from conftest import tiny_config

CFG = tiny_config(vocab_size=97, intermediate_size=48, sliding_window=3, layer_types=(FULL, SLIDING))
SEQ, LENGTHS = 16, (5, 4, 6)
OPT = OptimConfig(lr=1e-3, clip_norm=0.05, weight_decay=0.1)  # clipping active: the grad norm is ~1


def packed_row(vocab_size: int = CFG.vocab_size, lengths: tuple[int, ...] = LENGTHS, seq: int = SEQ):
    """(tokens [1, 1, seq], segments [1, 1, seq], the documents): random documents of
    `lengths`, then padding to `seq` (here: three documents, one padding token)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, vocab_size, n).astype(np.int32) for n in lengths]
    pad = seq - sum(lengths)
    tokens = np.concatenate([*docs, np.full(pad, 7, np.int32)])
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad)])
    return tokens[None, None], segments.astype(np.int32)[None, None], docs


def only(segments, j: int) -> np.ndarray:
    """A loss mask keeping document j only (its first token is no target anyway)."""
    return segments == j


def alone(doc, seq: int = SEQ) -> Batch:
    """The document at the start of a plain row of `seq` tokens, the rest of the row not counted."""
    tokens = np.full((1, 1, seq), 3, np.int32)
    tokens[0, 0, :len(doc)] = doc
    mask = np.zeros(tokens.shape, bool)
    mask[0, 0, :len(doc)] = True
    return Batch(tokens, mask)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.lru_cache(maxsize=None)
def params():
    return model.init_params(CFG, seed=1)


_value_and_grad = jax.jit(jax.value_and_grad(
    lambda p, i: loss_fn(CFG, p, i.tokens, False, i.segments, i.targets)))


def reference_loss_and_grads(batch: Batch):
    inputs, _ = documents.step_inputs(batch)
    return _value_and_grad(params(), inputs.micro(0))


@functools.lru_cache(maxsize=None)
def alone_results():
    return [reference_loss_and_grads(alone(doc)) for doc in packed_row()[2]]


def test_targets_fold_in_padding_and_document_starts():
    tokens, segments, _ = packed_row()
    mask = np.ones(tokens.shape, bool)
    mask[..., 7] = False  # one answer token masked out
    got = documents.targets(Batch(tokens, mask, segments))[0, 0]
    want = np.ones(SEQ, bool)
    want[[0, 5, 9, 15, 7]] = False  # row start, two document starts, padding, the masked token
    np.testing.assert_array_equal(got, want)
    assert documents.targets(Batch(tokens)) is None  # plain: nothing to send
    assert documents.trained_tokens(Batch(tokens, mask, segments)) == want.sum()
    assert documents.trained_tokens(Batch(tokens)) == SEQ


def test_plain_batches_trace_no_document_machinery():
    """Plain batches keep today's program: no same-document mask, no derived positions."""
    x, block = jnp.ones((1, SEQ, CFG.hidden_size)), params()["blocks"][1]
    plain = str(jax.make_jaxpr(lambda b, x: model.block_forward(CFG, CFG.layer_specs[1], b, x))(block, x))
    _, segments, _ = packed_row()
    packed = str(jax.make_jaxpr(lambda b, x, s: model.block_forward(CFG, CFG.layer_specs[1], b, x, s))(block, x, segments[0]))
    assert "cummax" not in plain and "cummax" in packed and "custom_vjp_call" in plain


def test_the_kernel_confines_attention_to_documents():
    """causal_attention with segments (chunked, windowed) equals dot_product_attention
    given the same-document mask, outputs and gradients (attend() takes it for packed
    rows on every backend: tests/test_attention_kernel.py)."""
    _, segments, _ = packed_row()
    seg = jnp.asarray(np.concatenate([segments[0], segments[0][:, ::-1]]))  # two rows, padding first in one
    kq, kk, kv, kd = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(kq, (2, SEQ, 4, 8))
    k, v = jax.random.normal(kk, (2, SEQ, 2, 8)), jax.random.normal(kv, (2, SEQ, 2, 8))
    dout = jax.random.normal(kd, q.shape)
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]

    def value_and_vjp(fn):
        return jax.jit(lambda q, k, v, d: (lambda out, vjp: (out, *vjp(d)))(*jax.vjp(fn, q, k, v)))(q, k, v, dout)

    want = value_and_vjp(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=(3, 0), scale=0.3))
    got = value_and_vjp(lambda q, k, v: causal_attention(q, k, v, 0.3, 4, 5, segments=seg))
    for a, b in zip(got, want):
        assert rel(a, b) <= 1e-6


def test_packed_documents_equal_each_document_alone_in_the_reference():
    tokens, segments, _ = packed_row()
    for j, (want_loss, want_grads) in enumerate(alone_results(), start=1):
        loss, grads = reference_loss_and_grads(Batch(tokens, only(segments, j), segments))
        assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
        errors = [rel(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))]
        assert max(errors) <= 1e-5, (j, max(errors))


def test_packed_documents_equal_each_document_alone_in_the_engine():
    """The engine's summed gradients, as they leave the device, equal the document's alone."""
    tokens, segments, _ = packed_row()
    for j, (want_loss, want_grads) in enumerate(alone_results(), start=1):
        engine = StreamEngine(CFG, params(), OPT)
        got, add = {}, engine.grads.add
        engine.grads.add = lambda part, g, *rest: (got.__setitem__(part, jax.device_get(g)), add(part, g, *rest))[1]
        try:
            loss = engine.step(Batch(tokens, only(segments, j), segments))["loss"]
        finally:
            engine.close()
        assert abs(loss - float(want_loss)) <= 1e-6 * abs(float(want_loss))
        assert set(got) == {p.name for p in parts.parts(CFG)}
        for name, grads in got.items():
            want = treepath.flatten(parts.part_params(want_grads, name))
            assert max(rel(grads[n], g) for n, g in want.items()) <= 1e-5, (j, name)


def masked_steps(accum: int = 4, steps: int = 2):
    """Packed, masked batches whose micro-batches count different numbers of targets."""
    rng = np.random.default_rng(5)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, CFG.vocab_size, (accum, 1, SEQ), dtype=np.int32)
        cuts = np.sort(rng.integers(1, SEQ, (accum, 1, 2)), axis=-1)
        segments = 1 + (np.arange(SEQ) >= cuts[..., :1]) + (np.arange(SEQ) >= cuts[..., 1:])
        segments[..., SEQ - rng.integers(0, 4):] = 0  # trailing padding (some rows none)
        mask = rng.random(tokens.shape) < np.linspace(0.2, 0.9, accum)[:, None, None]
        out.append(Batch(tokens, mask, segments.astype(np.int32)))
    return out


def test_streamed_equals_reference_on_masked_packed_steps():
    steps = masked_steps()
    counts = documents.targets(steps[0]).sum(axis=(1, 2))
    assert len(set(counts.tolist())) > 1  # a mean of per-micro-batch means would differ
    ref = ReferenceTrainer(CFG, params(), OPT)
    engine = StreamEngine(CFG, params(), OPT)
    try:
        for batch in steps:
            a, b = ref.step(batch), engine.step(batch)
            assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"]
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
        got = engine.params()
        assert max(rel(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref.params))) <= 1e-5
        want = eval_loss(CFG, ref.params, steps[0])["loss"]
        assert abs(engine.eval_loss(steps[0])["loss"] - want) <= 1e-6 * want
    finally:
        engine.close()
    # The step's loss is the mean over all its counted targets, not the mean of the means.
    inputs, weights = documents.step_inputs(steps[0])
    np.testing.assert_allclose(weights, counts / counts.sum())


def test_a_step_with_no_counted_target_is_one_clear_error():
    tokens, segments, _ = packed_row()
    batch = Batch(np.repeat(tokens, 2, axis=0), np.zeros((2, 1, SEQ), bool), np.repeat(segments, 2, axis=0))
    trainer = ReferenceTrainer(CFG, params(), OPT)
    with pytest.raises(documents.NothingToTrain) as e:
        trainer.step(batch)
    assert "\n" not in str(e.value) and "masked" in str(e.value)
    assert trainer.steps == 0
    engine = StreamEngine(CFG, params(), OPT)
    try:
        with pytest.raises(documents.NothingToTrain):
            engine.step(batch)
        assert engine.step_count == 0
    finally:
        engine.close()


def test_eval_reports_the_masked_loss_of_chat_data(tmp_path, capsys):
    """`mtjax eval` on a prepared chat dataset: the loss over the answers only (as
    training counts it), not over every token of the rows."""
    data_dir = Path(__file__).parent / "data"
    cfg = dataclasses.replace(CFG, vocab_size=151936, hidden_size=16, intermediate_size=32,
                              num_attention_heads=2, num_key_value_heads=1, layer_types=(), sliding_window=None)
    ckpt = tmp_path / "ckpt"
    hf.save_params(cfg, model.init_params(cfg, seed=0), ckpt)
    (ckpt / "tokenizer.json").write_bytes(gzip.decompress((data_dir / "qwen2" / "tokenizer.json.gz").read_bytes()))
    shutil.copy(data_dir / "qwen2" / "tokenizer_config.json", ckpt)
    assert cli.main(["data", "prepare", str(data_dir / "kjv-chat-24.jsonl"), "--format", "chat", "--tokenizer",
                     str(ckpt), "--seq-len", "64", "--out", str(tmp_path / "chat"), "--val-fraction", "0.25"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(ckpt), str(tmp_path / "chat"), "--seq-len", "64", "--batch-size", "2",
                     "--batches", "1"]) == 0
    line = capsys.readouterr().out.strip()
    batch = data.Loader(data.Dataset(tmp_path / "chat"), "val", 64, 2, 1, shuffle=False).next()
    _, params_ = checkpoint.load_weights(ckpt)
    masked, every = eval_loss(cfg, params_, batch)["loss"], eval_loss(cfg, params_, batch.tokens)["loss"]
    assert abs(masked - every) > 1e-3  # the mask changes the number: the test can tell them apart
    assert line.startswith(f"val loss {masked:.4f}  ")
    assert line.endswith(f"over the {documents.trained_tokens(batch):,} tokens the loss mask keeps")
