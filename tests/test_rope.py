"""mtjax.rope's frequencies and attention factors equal transformers' RoPE init functions
(yarn with and without truncation, mscale and explicit factors; longrope's short and long
sets with partial rotary), and partial rotary leaves the unrotated features untouched."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import mtjax
from mtjax import rope

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}
YARN_CASES = {
    "defaults": {},
    "untruncated": {"truncate": False},
    "mscale": {"mscale": 1.2, "mscale_all_dim": 0.7},
    "explicit-attention-factor-betas": {"attention_factor": 0.9, "beta_fast": 16.0, "beta_slow": 2.0},
}


def _llama(rope_parameters: dict, **kwargs):
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=4096,
                                    rope_parameters={"rope_theta": 50000.0, **rope_parameters}, **kwargs)


@pytest.mark.parametrize("extra", list(YARN_CASES.values()), ids=list(YARN_CASES))
def test_yarn_matches_transformers(extra):
    hf_cfg = _llama({**YARN, **extra})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = mtjax.from_hf_dict(hf_cfg.to_dict())
    assert cfg.rope_scaling.rope_type == "yarn"
    np.testing.assert_allclose(rope.inv_frequencies(cfg), inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    assert rope.attention_factor(cfg) != 1.0


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_matches_transformers(partial, long):
    pairs = int(64 * partial) // 2
    rng = np.random.default_rng(0)
    hf_cfg = transformers.Phi3Config(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=8192, original_max_position_embeddings=1024,
        partial_rotary_factor=partial, rope_theta=10000.0, pad_token_id=None, rope_scaling={
            "rope_type": "longrope", "short_factor": list(1 + rng.random(pairs)), "long_factor": list(1 + 8 * rng.random(pairs))})
    seq = 1025 if long else 1024  # the long factors take over past original_max_position_embeddings
    inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=seq)
    cfg = mtjax.from_hf_dict(hf_cfg.to_dict())
    assert cfg.rotary_dim == 2 * pairs
    np.testing.assert_allclose(rope.inv_frequencies(cfg, long=long), inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_factor(cfg) == pytest.approx(factor, rel=1e-12) and factor > 1
    # cos_sin picks the set by the rows' length, as transformers' forward does
    cos, _ = rope.cos_sin(cfg, jnp.arange(seq)[None], jnp.float32)
    expected = np.cos(np.float32(seq - 1) * inv_freq.numpy()) * factor
    np.testing.assert_allclose(np.asarray(cos)[0, -1, :pairs], expected, rtol=2e-4, atol=2e-5)


def test_partial_rotary_turns_only_the_first_features():
    cfg = mtjax.ModelConfig(head_dim=16, partial_rotary_factor=0.5)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 16)), jnp.float32)
    cos, sin = rope.cos_sin(cfg, jnp.arange(5)[None], jnp.float32)
    assert cos.shape == (1, 5, 8)
    out = np.asarray(rope.apply(x, cos, sin))
    np.testing.assert_array_equal(out[..., 8:], np.asarray(x)[..., 8:])
    full = np.asarray(rope.apply(x[..., :8], cos, sin))
    np.testing.assert_array_equal(out[..., :8], full)
    assert not np.allclose(out[:, 1:, :, :8], np.asarray(x)[:, 1:, :, :8])


@pytest.mark.parametrize("change, match", [
    (dict(partial_rotary_factor=0.1), "even number"),
    (dict(model_type="phi3", mlp_bias=True), "no biases"),
    (dict(rope_scaling=mtjax.model_config.RopeScaling("longrope", short_factor=(1.0,), long_factor=(1.0,))), "short_factor"),
])
def test_inconsistent_settings_are_config_errors(change, match):
    with pytest.raises(mtjax.model_config.ConfigError, match=match):
        dataclasses.replace(mtjax.ModelConfig(head_dim=16), **change)
