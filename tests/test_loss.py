"""The chunked head and loss (mtjax.loss.head_loss) equals the head's logits and the full
cross-entropy, value and gradients, and its compiled memory is flat in the sequence length."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from mtjax import model
from mtjax.loss import chunk_rows, cross_entropy, head_loss

# vocab 61 and 37 tokens a row: neither divides by the chunks below.
CASES = {
    "untied": {},
    "tied": dict(tie_word_embeddings=True),
    "soft-capped": dict(final_logit_softcapping=2.5),
    "tied soft-capped": dict(tie_word_embeddings=True, final_logit_softcapping=2.5),
}


def _inputs(cfg, batch=2, seq=37):
    params = model.init_params(cfg, seed=1)
    params["head"]["norm"]["weight"] = params["head"]["norm"]["weight"] * 1.5  # not the identity
    x = 3.0 * jax.random.normal(jax.random.key(0), (batch, seq, cfg.hidden_size))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)
    return params, x, tokens


def _both(cfg, params, x, tokens, targets, chunk):
    def full(head, embed, x):
        return cross_entropy(model.head_forward(cfg, head, embed, x), tokens, targets)

    def chunked(head, embed, x):
        return head_loss(cfg, head, embed, x, tokens, targets, chunk=chunk)

    args = (params["head"], params["embed"], x)
    return (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*args) for f in (full, chunked))


def _check_equal(case, chunk, masked):
    cfg = tiny_config(vocab_size=61, **CASES[case])
    params, x, tokens = _inputs(cfg)
    targets = jax.random.bernoulli(jax.random.key(2), 0.6, tokens.shape) if masked else None
    (loss, grads), (loss_c, grads_c) = _both(cfg, params, x, tokens, targets, chunk)
    assert float(loss_c) == pytest.approx(float(loss), rel=1e-6, abs=1e-6)
    for g, g_c in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c), strict=True):
        np.testing.assert_allclose(np.asarray(g_c), np.asarray(g), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True], ids=["all targets", "masked"])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_and_gradients_equal_the_full_cross_entropy(case, masked):
    _check_equal(case, 16, masked)  # 74 tokens: 5 chunks, the last padded


@pytest.mark.parametrize("chunk", [1, 74, 500])
def test_any_chunk_size_gives_the_full_cross_entropy(chunk):
    _check_equal("tied soft-capped", chunk, True)  # one token a chunk, all in one, fewer than a chunk


def test_no_counted_target_gives_zero_loss_and_zero_gradients():
    cfg = tiny_config(vocab_size=61)
    params, x, tokens = _inputs(cfg)
    targets = jnp.zeros(tokens.shape, bool)
    loss, grads = jax.value_and_grad(lambda x: head_loss(cfg, params["head"], None, x, tokens, targets, chunk=8))(x)
    assert float(loss) == 0.0 and not np.any(np.asarray(grads))


def test_bf16_chunked_loss_is_close_to_the_full_loss():
    """In the compute dtype both run the same bf16 matmul with fp32 results."""
    cfg = tiny_config(vocab_size=61, compute_dtype="bfloat16")
    params, x, tokens = _inputs(cfg)
    x = x.astype(jnp.bfloat16)
    (loss, grads), (loss_c, grads_c) = _both(cfg, params, x, tokens, None, 16)
    assert float(loss_c) == pytest.approx(float(loss), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grads_c[2], np.float32), np.asarray(grads[2], np.float32), atol=2e-3)


def _dot_operand_types(hlo: str) -> list[tuple[str, ...]]:
    """The element types of each dot's operands in compiled HLO text (names are unique in a module)."""
    types = dict(re.findall(r"%([\w.-]+) = (\w+)\[", hlo))
    return [tuple(types[n] for n in re.findall(r"%([\w.-]+)", args))
            for args in re.findall(r" dot\(([^)]*)\)", hlo)]


def test_the_bf16_head_gradient_runs_every_dot_in_bf16_on_the_cpu():
    """The head's three dots (logits, dh, dkernel) take bf16 operands: XLA's CPU backend
    upcast the kernel gradient's to fp32 while its tokens-major operand was a plain
    transpose (mtjax.layers.basic.transposed). Its gradients stay those of the full loss."""
    cfg = tiny_config(vocab_size=256, hidden_size=64, compute_dtype="bfloat16")
    params, x, tokens = _inputs(cfg, batch=1, seq=128)
    x = x.astype(jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda h, x: head_loss(cfg, h, None, x, tokens, chunk=64), argnums=(0, 1)))
    dots = _dot_operand_types(grad.lower(params["head"], x).compile().as_text())
    assert len(dots) >= 3 and all(t == ("bf16", "bf16") for t in dots), dots
    (_, grads), (_, grads_c) = _both(cfg, params, x, tokens, None, 64)
    for g, g_c in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c), strict=True):
        scale = float(jnp.max(jnp.abs(g.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(g_c, np.float32), np.asarray(g, np.float32), atol=2e-2 * scale)


def test_chunk_rows_take_a_fixed_share_of_logits():
    assert chunk_rows(128 * 1024) * 128 * 1024 * 4 <= 256 * 2**20
    assert chunk_rows(128 * 1024) % 128 == 0 and chunk_rows(10**7) == 128  # at least one tile of rows
    assert chunk_rows(64, tokens=37) == 37


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_the_compiled_head_gradient_is_flat_in_sequence_length():
    """2k -> 16k tokens: the chunked head's temporaries grow by a few [tokens, hidden]
    arrays (its input, the norm's output, their gradients), never by [tokens, vocab]
    logits, which the full cross-entropy's do."""
    cfg = tiny_config(vocab_size=4096, hidden_size=64)
    head = model.abstract_part(cfg, "head")
    temps = {}
    for seq in (2048, 16384):
        x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.float32)
        tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        temps[seq] = {
            "chunked": _temp_bytes(jax.grad(lambda h, x, t: head_loss(cfg, h, None, x, t, chunk=512), (0, 1)),
                                   head, x, tokens),
            "full": _temp_bytes(jax.grad(lambda h, x, t: cross_entropy(model.head_forward(cfg, h, None, x), t), (0, 1)),
                                head, x, tokens),
        }
    added = 16384 - 2048
    per_token = {k: (temps[16384][k] - temps[2048][k]) / added for k in ("chunked", "full")}
    assert per_token["full"] >= 4 * cfg.vocab_size  # the test can fail: the full loss grows by fp32 logits
    assert per_token["chunked"] <= 4 * 4 * cfg.hidden_size, per_token


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_device_plans_head_is_flat_in_sequence_and_holds_the_compiled_head(tied):
    """The device plan's head term (mtjax.loss.head_bytes) from 2k to 16k tokens grows by
    the same per-token bytes whatever the vocabulary (no [tokens, vocab] term), and covers
    the temporaries of the engine's compiled head program at both lengths: a plan for this
    CPU (cpu-2core), the device the program is compiled for (an H200 plan prices the GPU's
    head)."""
    from mtjax import parts
    from mtjax.config import StoreConfig, StreamConfig
    from mtjax.optim import OptimConfig, make_optimizer
    from mtjax.plan import BUILTIN, StepShape, estimate
    from mtjax.stream.blockfns import _head

    tx = make_optimizer(OptimConfig())
    growth = {}
    cpu = BUILTIN["cpu-2core"]
    for vocab in (65536, 131072):
        cfg = tiny_config(vocab_size=vocab, hidden_size=64, tie_word_embeddings=tied)
        heads = {seq: estimate(cfg, StreamConfig(), StoreConfig(), StepShape(1, seq), cpu, tx=tx).device.head
                 for seq in (2048, 16384)}
        growth[vocab] = heads[16384] - heads[2048]
        assert heads[2048] < 3 * 2048 * vocab * 4  # below what whole logits would take already at 2k
        weights = parts.schema(cfg, "head", "compute")
        embed = parts.schema(cfg, "embed", "compute") if tied else None
        for seq in (2048, 16384):
            x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.float32)
            tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
            program = jax.jit(lambda w, e, x, t, cfg=cfg: _head(cfg, w, e, x, t, 1.0))
            assert _temp_bytes(program, weights, embed, x, tokens) <= heads[seq]
    assert growth[65536] == growth[131072] <= (16384 - 2048) * (2 * 4 * 64 + 16)
