"""mtjax's model equals Hugging Face transformers on the same weights.

For each case a tiny random transformers model (every 1-D parameter perturbed, see
hf_models.py) is saved with `save_pretrained`, loaded with `mtjax.load_params`, and
compared in fp32 with matmul precision "highest" (conftest.py): logits, the mean
next-token loss, and the gradient of every tensor of the checkpoint.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
import mtjax
import parity
from mtjax import hf
from mtjax.model_config import FULL, SLIDING

pytestmark = pytest.mark.slow  # transformers + torch models side by side

SEQ = 12  # longer than every sliding window below
BATCH = 2

LLAMA3_ROPE = {
    # With head_dim 8 and theta 5e5 the wavelengths are ~6, ~167, ~4.4e3 and ~1.2e5:
    # original_max_position_embeddings 256 puts them in all three llama3 regimes
    # (kept: < 64, interpolated: 64..256, slowed by `factor`: > 256).
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def longrope(original: int, pairs: int = 4) -> dict:
    """Phi-3.5-style longrope: rows of SEQ tokens take the short factors when SEQ <= `original`,
    the long ones beyond; max_position_embeddings / original sets the attention factor."""
    return dict(original_max_position_embeddings=original, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6][:pairs], "long_factor": [1.2, 2.5, 5.0, 9.0][:pairs]})


# YaRN over a pre-training context of 32: one pair kept, the others ramped or slowed by `factor`.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


# Gemma 3's global layers: their own base and linear scaling; the sliding ones another base.
GEMMA3_ROPE = {FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 2000.0},
               SLIDING: {"rope_type": "default", "rope_theta": 50.0}}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    family: str
    overrides: dict
    sharded: bool = False


CASES = [
    Case("llama2", "llama", {}),
    Case("llama3-rope-tied", "llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    Case("llama-linear-rope", "llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    Case("llama-biases-gqa4", "llama", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
    Case("llama-sharded", "llama", {}, sharded=True),
    Case("qwen2-qkv-bias-tied", "qwen2", dict(tie_word_embeddings=True)),
    Case("qwen2-mixed-sliding", "qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    Case("qwen3-qk-norm", "qwen3", {}),
    Case("mistral-window5", "mistral", dict(sliding_window=5)),
    Case("llama-yarn-untruncated", "llama", dict(rope_scaling={**YARN, "truncate": False})),
    # Phi-3 variants, few to keep compiles few: default RoPE untied with a window; longrope in
    # the short regime, tied; Phi-4-mini's partial rotary with longrope in the long regime.
    Case("phi3-window5", "phi3", dict(sliding_window=5)),
    Case("phi3-longrope-short-tied", "phi3", dict(longrope(16), tie_word_embeddings=True)),
    Case("phi4-mini-partial-rotary-longrope-long", "phi3", dict(longrope(8, pairs=3), partial_rotary_factor=0.75)),
    # Larger weights so that both caps bite (scores and logits beyond cap / 2).
    Case("gemma2-softcap-tied", "gemma2", dict(num_hidden_layers=3, initializer_range=0.2, attn_logit_softcapping=1.0,
                                               final_logit_softcapping=3.0, tie_word_embeddings=True)),
    Case("gemma3-local-global-rope", "gemma3_text", dict(num_hidden_layers=3, layer_types=[SLIDING, SLIDING, FULL],
                                                         rope_parameters=GEMMA3_ROPE)),
    Case("gemma3-multimodal-tied", "gemma3", dict(layer_types=[SLIDING, FULL], tie_word_embeddings=True)),
]


_RUNS: dict[str, parity.HfRun] = {}  # one build per case, shared by every test of the case


@pytest.fixture(params=CASES, ids=[c.id for c in CASES])
def case(request, tmp_path_factory) -> tuple[Case, parity.HfRun]:
    c: Case = request.param
    if c.id not in _RUNS:
        _RUNS[c.id] = parity.hf_run(tmp_path_factory.mktemp(c.id), c.family, c.overrides, (BATCH, SEQ),
                                    sharded=c.sharded)
    return c, _RUNS[c.id]


def test_checkpoint_is_the_case_asked_for(case):
    """Guards the other tests: the features each case claims are really in the config."""
    c, r = case
    cfg = r.cfg
    assert cfg.model_type == hf_models.MODEL_TYPE[c.family]
    if c.sharded:
        assert (r.ckpt / hf.INDEX_FILE).exists() and len(list(r.ckpt.glob("*.safetensors"))) > 1
    if "tie_word_embeddings" in c.overrides:
        assert cfg.tie_word_embeddings and "lm_head" not in r.params["head"]
        assert "lm_head.weight" not in hf.SafetensorsReader(r.ckpt).names()
    if c.family in ("mistral", "gemma2", "gemma3_text", "gemma3") or c.overrides.get("use_sliding_window") \
            or "sliding_window" in c.overrides:
        assert SLIDING in cfg.layer_types and cfg.sliding_window < SEQ
    if c.id == "qwen2-mixed-sliding":
        assert cfg.layer_types[0] != SLIDING and cfg.layer_types[1:] == (SLIDING, SLIDING)
    if "rope_scaling" in c.overrides:
        assert cfg.rope_scaling.rope_type == c.overrides["rope_scaling"]["rope_type"]
    if c.family == "qwen2":
        assert cfg.attention_bias
    if c.family == "qwen3":
        assert cfg.qk_norm
    if c.family == "phi3":
        names = hf.SafetensorsReader(r.ckpt).names()
        assert cfg.fused_projections and "model.layers.0.self_attn.qkv_proj.weight" in names
        assert "model.layers.0.mlp.gate_up_proj.weight" in names and not any("q_proj" in n for n in names)
        assert (cfg.sliding_window is not None) == ("sliding_window" in c.overrides)
    if "longrope" in c.id:
        assert (SEQ > cfg.rope_scaling.original_max_position_embeddings) == ("long" in c.id.replace("longrope", ""))
    if "partial_rotary_factor" in c.overrides:
        assert cfg.rotary_dim < cfg.head_dim
    if c.family.startswith("gemma"):
        assert cfg.rms_norm_offset and cfg.sandwich_norms and cfg.embed_scale and cfg.hidden_act == "gelu_pytorch_tanh"
        assert cfg.attn_scale != cfg.head_dim**-0.5 and SLIDING in cfg.layer_types and FULL in cfg.layer_types
        assert cfg.qk_norm == (c.family != "gemma2")
    if c.family == "gemma2":
        caps = (cfg.attn_logit_softcapping, cfg.final_logit_softcapping)
        assert caps == (c.overrides["attn_logit_softcapping"], c.overrides["final_logit_softcapping"])
    if c.family == "gemma3":
        assert hf.SafetensorsReader(r.ckpt).left_out  # a vision tower was there and was set aside
    if "rope_parameters" in c.overrides:
        assert cfg.rope_scaling.rope_type == "linear" and (cfg.rope_theta, cfg.local_rope_theta) == (2000.0, 50.0)
    assert cfg.num_attention_heads // cfg.num_key_value_heads > 1


def test_logits_match(case):
    _, r = case
    logits = np.asarray(mtjax.forward(r.cfg, r.params, jnp.asarray(r.tokens)))
    scale = np.abs(r.hf_logits).max()
    err = np.abs(logits - r.hf_logits).max()
    assert err <= 1e-5 * scale, f"max |logit error| {err:.3g} vs max |logit| {scale:.3g}"


def test_loss_matches(case):
    _, r = case
    loss = float(mtjax.loss_fn(r.cfg, r.params, jnp.asarray(r.tokens), remat=False))
    assert abs(loss - r.hf_loss) <= 1e-6 * abs(r.hf_loss), (loss, r.hf_loss)


def _without_feature(cfg: mtjax.ModelConfig, feature: str) -> mtjax.ModelConfig:
    if feature == "sliding":
        return dataclasses.replace(cfg, layer_types=(), sliding_window=None)
    if feature in ("attn_logit_softcapping", "final_logit_softcapping"):
        return dataclasses.replace(cfg, **{feature: None})
    if feature == "local_rope":
        return dataclasses.replace(cfg, local_rope_theta=None)
    if feature == "partial_rotary":  # longrope factors shortened to the rotated pairs
        return dataclasses.replace(cfg, partial_rotary_factor=1.0, rope_scaling=None)
    return dataclasses.replace(cfg, rope_scaling=None)


def _features(c: Case) -> list[str]:
    if "partial_rotary_factor" in c.overrides:
        return ["partial_rotary"]
    if "rope_scaling" in c.overrides:
        return ["rope_scaling"]
    if c.family.startswith("gemma"):
        caps = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if c.overrides.get(k)]
        rope = ["local_rope", "rope_scaling"] if "rope_parameters" in c.overrides else []
        return ["sliding", *caps, *rope]
    if "sliding_window" in c.overrides:
        return ["sliding"]
    return []


FEATURE_CASES = [c for c in CASES if _features(c)]


LONG_REGIME = [c for c in CASES if c.id == "phi4-mini-partial-rotary-longrope-long"]


@pytest.mark.parametrize("case", LONG_REGIME, ids=[c.id for c in LONG_REGIME], indirect=True)
def test_long_rows_take_the_long_factors(case):
    """The regime choice is exercised: the long-regime case computed with its short factors
    (the choice a by-max_position_embeddings rule would make) misses Hugging Face's logits."""
    _, r = case
    s = r.cfg.rope_scaling
    short_only = dataclasses.replace(r.cfg, rope_scaling=dataclasses.replace(s, long_factor=s.short_factor))
    logits = np.asarray(mtjax.forward(short_only, r.params, jnp.asarray(r.tokens)))
    assert np.abs(logits - r.hf_logits).max() > 1e-4 * np.abs(r.hf_logits).max()


@pytest.mark.parametrize("case", FEATURE_CASES, ids=[c.id for c in FEATURE_CASES], indirect=True)
def test_the_feature_under_test_changes_the_logits(case):
    """Sliding windows, rope scaling, local RoPE bases and soft-capping are not vacuous
    here: without each, the logits miss Hugging Face's by at least 10x the parity tolerance."""
    c, r = case
    for feature in _features(c):
        logits = np.asarray(mtjax.forward(_without_feature(r.cfg, feature), r.params, jnp.asarray(r.tokens)))
        assert np.abs(logits - r.hf_logits).max() > 1e-4 * np.abs(r.hf_logits).max(), feature


def test_every_gradient_matches(case):
    _, r = case
    parity.assert_gradients_match(r.cfg, r.params, r.tokens, r.hf_grads)
