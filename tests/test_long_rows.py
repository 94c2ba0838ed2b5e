"""Long rows: the streaming engine equals the in-memory reference at several thousand
tokens a row with the chunked feed-forward (model.ffn_chunk_tokens) and the chunked head
(mtjax.loss) both cutting the row into chunks; and the chunked feed-forward is the whole
one, value, router statistics and gradients, dense or MoE."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config, tiny_moe_config, token_batches

from mtjax import loss, model, moe
from mtjax.config import StreamConfig
from mtjax.model_config import ConfigError
from mtjax.optim import OptimConfig
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

OPT = OptimConfig(lr=1e-3, clip_norm=0.05, weight_decay=0.1)
SEQ = 3000  # neither chunk below divides it


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("cfg", [tiny_config(ffn_chunk_tokens=128),
                                 pytest.param(tiny_moe_config(ffn_chunk_tokens=7), marks=pytest.mark.slow)],  # ~30 s
                         ids=["dense", "moe"])
def test_the_chunked_feed_forward_is_the_whole_one(cfg):
    """Value, router statistics, the load-balancing loss and gradients: chunks (a MoE
    layer's routing and dispatch too) with a remainder after the whole ones == the whole row."""
    whole = dataclasses.replace(cfg, ffn_chunk_tokens=0)
    params = model.init_params(cfg, seed=1)
    tokens = jnp.asarray(token_batches(cfg.vocab_size, (2, 20 if cfg.num_experts else 300), 1)[0])
    assert tokens.size % cfg.ffn_chunk_tokens and tokens.size > cfg.ffn_chunk_tokens

    def grads(c):
        def objective(p):
            logits, stats = model.forward_stats(c, p, tokens)
            aux = moe.aux_loss(stats, tokens.size) if stats else 0.0
            return jnp.sum(jnp.sin(logits)) + 10 * aux, stats
        return jax.jit(jax.value_and_grad(objective, has_aux=True))(params)  # jitted: op by op is slower

    ((a, sa), ga), ((b, sb), gb) = grads(whole), grads(cfg)
    assert float(b) == pytest.approx(float(a), rel=1e-6)
    assert len(sa) == len(sb) == (len(cfg.moe_layers) if cfg.num_experts else 0)
    for x, y in zip(jax.tree.leaves(sb), jax.tree.leaves(sa), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert max(_rel(x, y) for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(ga), strict=True)) <= 1e-5


def test_a_negative_chunk_is_refused():
    with pytest.raises(ConfigError, match="ffn_chunk_tokens"):
        tiny_config(ffn_chunk_tokens=-1)


@pytest.mark.slow
def test_streamed_equals_reference_on_long_rows_with_chunked_feed_forward_and_head():
    # Chunks of 256 rows at the head (vocab 97), of 1024 tokens in the feed-forward.
    cfg = tiny_config(vocab_size=97, ffn_chunk_tokens=1024, head_chunk_tokens=256, max_position_embeddings=4096)
    assert loss.head_rows(cfg, SEQ) == 256
    batches = token_batches(cfg.vocab_size, (1, 1, SEQ), 2, seed=3)
    reference = ReferenceTrainer(cfg, model.init_params(cfg, seed=1), OPT)
    whole = ReferenceTrainer(dataclasses.replace(cfg, ffn_chunk_tokens=0), model.init_params(cfg, seed=1), OPT)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=1), OPT, StreamConfig(keep_every=1))
    for b in batches:
        ref, streamed, unchunked = reference.step(b), engine.step(b), whole.step(b)
        np.testing.assert_allclose(streamed["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(unchunked["loss"], ref["loss"], rtol=1e-5)
    streamed_params = engine.params()
    errors = jax.tree.leaves(jax.tree.map(_rel, streamed_params, reference.params))
    assert max(errors) <= 1e-5
    assert max(jax.tree.leaves(jax.tree.map(_rel, whole.params, reference.params))) <= 1e-5
    engine.close()
