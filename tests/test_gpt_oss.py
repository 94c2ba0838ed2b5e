"""gpt-oss (mtjax.families.gpt_oss) beyond the transformers parity of tests/test_hf_moe.py:
five streamed AdamW steps equal the in-memory reference, in RAM and on disk with the MoE
blocks split into expert groups (whose programs take the experts' biases beside their
kernels); the streamed sampler's cached greedy tokens equal transformers' `generate`
(sinks and the sliding window over the cache); MXFP4 experts (the hub's layout, built
here) dequantize as transformers dequantizes them, on import, and export unquantized."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_models
import mtjax
import parity
from mtjax import hf, model, mxfp4, treepath
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig

# Two layers (a window of 3 in rows of 12, then full), 8 experts of which 2 per token,
# a limit that clamps the SwiGLU here.
TINY = ModelConfig(model_type="gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True, o_proj_bias=True,
                   sliding_window=3, layer_types=("sliding_attention", "full_attention"), num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=16, moe_layers=(0, 1), router_aux_loss_coef=0.05,
                   swiglu_limit=0.5, swiglu_alpha=1.3)
OPT = OptimConfig(lr=1e-3, clip_norm=0.05, weight_decay=0.1)


def _params():
    """Random weights with every 1-D leaf (norms, biases, sinks) drawn too."""
    params = model.init_params(TINY, seed=1)
    rng = np.random.default_rng(2)
    flat = treepath.flatten(params)
    flat.update({n: jnp.asarray(np.asarray(a) + rng.normal(0, 0.3, a.shape), jnp.float32)
                 for n, a in flat.items() if a.ndim == 1})
    return treepath.unflatten(params, flat)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_five_streamed_steps_equal_the_reference(make_store, tier):
    """On the disk tier the MoE blocks are split into expert groups of 3 (forced)."""
    run = parity.streamed_and_reference(make_store, TINY, _params(), OPT, tier, metrics=("loss", "aux_loss"))
    if tier == "disk":
        assert run.split == {0: ((0, 1, 2), (3, 4, 5), (6, 7)), 1: ((0, 1, 2), (3, 4, 5), (6, 7))}
    assert any(n.endswith("sinks") for n in run.streamed) and any(n.endswith("gate_proj.bias") for n in run.streamed)
    changed = {n for n, w in run.streamed.items() if not np.array_equal(np.asarray(w), np.asarray(run.initial[n]))}
    for name, w in run.streamed.items():
        assert parity.rel(w, run.expected[name]) <= 1e-5, name
        # Every leaf trains but the 1-D ones of an expert no token reached (no decay on them).
        assert name in changed or (".experts." in name and name.endswith(".bias")), name


@pytest.mark.slow  # a transformers checkpoint and its store
def test_cached_greedy_decoding_equals_transformers_generate(tmp_path):
    ckpt, torch_model = hf_models.checkpoint(tmp_path, "gpt_oss", num_local_experts=8, initializer_range=0.2,
                                             swiglu_limit=0.5)
    # The nine-token prompt is longer than the window of 3.
    parity.assert_greedy_decoding_equals_generate(ckpt, torch_model, tmp_path)


def _mxfp4(rng, experts: int, rows: int, cols: int):
    """Random MXFP4 blocks [E, rows, cols / 32, 16] and scales [E, rows, cols / 32] (uint8),
    every code drawn and exponents around 2 ** -6."""
    blocks = rng.integers(0, 256, (experts, rows, cols // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(118, 126, (experts, rows, cols // 32), dtype=np.uint8)


def _transformers_dequantized(blocks, scales) -> np.ndarray:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return out.numpy()


def test_mxfp4_dequantization_equals_transformers():
    blocks, scales = _mxfp4(np.random.default_rng(0), 3, 10, 64)
    ours = mxfp4.dequantize(blocks, scales)
    assert ours.shape == (3, 64, 10)
    np.testing.assert_array_equal(ours, _transformers_dequantized(blocks, scales))
    assert np.any(ours < 0) and np.any(ours > 0) and np.any(ours == 0)


@pytest.mark.slow  # a transformers checkpoint, quantized, imported and exported
def test_an_mxfp4_checkpoint_imports_dequantized_and_exports_unquantized(tmp_path):
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM

    ckpt, _ = hf_models.checkpoint(tmp_path, "gpt_oss", num_local_experts=4, intermediate_size=32)
    tensors, rng, want = load_file(str(ckpt / hf.SINGLE_FILE)), np.random.default_rng(1), {}
    for i in range(2):  # the hub's layout: each layer's two expert kernels as blocks and scales
        for proj, rows, cols in (("gate_up_proj", 64, 32), ("down_proj", 32, 32)):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = _mxfp4(rng, 4, rows, cols)
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            want[name] = _transformers_dequantized(blocks, scales)
    save_file(tensors, str(ckpt / hf.SINGLE_FILE), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (ckpt / "config.json").write_text(json.dumps(config))

    cfg, params = mtjax.load_params(ckpt)
    specs = {s.hf_name: s for s in hf.layout(cfg)}
    for name, w in want.items():
        np.testing.assert_array_equal(hf.from_tree(specs[name], params), w, err_msg=name)
    mtjax.save_params(cfg, params, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    exported = load_file(str(tmp_path / "out" / hf.SINGLE_FILE))
    assert not any(n.endswith(("_blocks", "_scales")) for n in exported)
    reloaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).named_parameters())
    for name, w in want.items():
        np.testing.assert_array_equal(exported[name], w, err_msg=name)
        np.testing.assert_array_equal(reloaded[name].detach().numpy(), w, err_msg=name)
