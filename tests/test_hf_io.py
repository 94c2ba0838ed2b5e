"""Hugging Face checkpoints in and out: transformers loads what mtjax saves, bad
checkpoints give one clear CheckpointError, bf16 weights survive a round trip bit-exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import hf_models
import mtjax
from mtjax import hf
from mtjax.errors import MtjaxError

TOKENS = np.random.default_rng(1).integers(0, hf_models.BASE["vocab_size"], (2, 10))

SAVE_CASES = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2-mixed-sliding": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "phi4-mini-longrope-window": ("phi3", dict(
        partial_rotary_factor=0.75, sliding_window=5, original_max_position_embeddings=8,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 4.0, 8.0]})),
    "gemma2-softcap": ("gemma2", dict(num_hidden_layers=3, attn_logit_softcapping=1.0, final_logit_softcapping=3.0)),
    "gemma3-tied": ("gemma3_text", dict(num_hidden_layers=3, tie_word_embeddings=True,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 2000.0},
                                                         "sliding_attention": {"rope_theta": 50.0,
                                                                               "rope_type": "default"}})),
}


def _perturbed(params, seed: int = 0):
    """The params with noise added, so a saved file cannot pass by holding the originals."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (x + 0.05 * rng.standard_normal(x.shape)).astype(np.float32), params)


def _transformers_logits(ckpt: Path) -> np.ndarray:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(TOKENS)).logits.numpy()


def _assert_same_logits(cfg, params, ckpt: Path):
    ours = np.asarray(mtjax.forward(cfg, params, jnp.asarray(TOKENS)))
    theirs = _transformers_logits(ckpt)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()


@pytest.mark.parametrize("family, overrides", list(SAVE_CASES.values()), ids=list(SAVE_CASES))
def test_transformers_loads_saved_params(family, overrides, tmp_path):
    src, _ = hf_models.checkpoint(tmp_path, family, **overrides)
    cfg, params = mtjax.load_params(src)
    params = _perturbed(params)
    out = tmp_path / "saved"
    mtjax.save_params(cfg, params, out)
    assert (out / hf.SINGLE_FILE).exists() and not (out / hf.INDEX_FILE).exists()
    _assert_same_logits(cfg, params, out)
    assert mtjax.load_hf_config(out) == cfg


def test_sharded_save_has_a_transformers_index(tmp_path):
    src, _ = hf_models.checkpoint(tmp_path, "llama")
    cfg, params = mtjax.load_params(src)
    params = _perturbed(params)
    out = tmp_path / "sharded"
    mtjax.save_params(cfg, params, out, max_shard_bytes=16_000)
    index = json.loads((out / hf.INDEX_FILE).read_text())
    shard_files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shard_files) > 2 and not (out / hf.SINGLE_FILE).exists()
    assert sorted(set(index["weight_map"].values())) == shard_files
    assert set(index["weight_map"]) == {s.hf_name for s in hf.layout(cfg)}
    # total_size is the bytes of the tensors (headers excluded), as transformers writes it.
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in hf.hf_tensors(cfg, params))
    for name, file in index["weight_map"].items():
        with safe_open(out / file, framework="np") as f:
            assert name in f.keys()
    _assert_same_logits(cfg, params, out)
    _, back = mtjax.load_params(out)
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_index_total_size_agrees_with_transformers(tmp_path):
    """A sharded save of a transformers model gives the index transformers itself writes."""
    src, _ = hf_models.checkpoint(tmp_path, "llama", sharded=True)
    cfg, params = mtjax.load_params(src)
    out = tmp_path / "ours"
    mtjax.save_params(cfg, params, out, max_shard_bytes=20_000)
    ours = json.loads((out / hf.INDEX_FILE).read_text())["metadata"]["total_size"]
    theirs = json.loads((src / hf.INDEX_FILE).read_text())["metadata"]["total_size"]
    assert ours == theirs


def test_saving_over_a_checkpoint_of_the_other_layout(tmp_path):
    """No stale single file or index is left to shadow the new weights."""
    src, _ = hf_models.checkpoint(tmp_path, "llama")
    cfg, params = mtjax.load_params(src)
    out = tmp_path / "out"
    mtjax.save_params(cfg, params, out, max_shard_bytes=16_000)
    params = _perturbed(params)
    mtjax.save_params(cfg, params, out)  # now one file
    assert not (out / hf.INDEX_FILE).exists()
    _assert_same_logits(cfg, params, out)
    params = _perturbed(params, seed=1)
    mtjax.save_params(cfg, params, out, max_shard_bytes=16_000)  # sharded again
    assert not (out / hf.SINGLE_FILE).exists()
    _, back = mtjax.load_params(out)
    jax.tree.map(np.testing.assert_array_equal, back, params)


# --- loading errors ---------------------------------------------------------------------


@pytest.fixture
def llama(tmp_path):
    src, _ = hf_models.checkpoint(tmp_path, "llama")
    cfg, params = mtjax.load_params(src)
    return src, cfg, params


def _one_line_error(ckpt, **kwargs) -> str:
    with pytest.raises(mtjax.CheckpointError) as err:
        mtjax.load_params(ckpt, **kwargs)
    message = str(err.value)
    assert isinstance(err.value, MtjaxError) and "\n" not in message
    return message


def test_missing_extra_and_misshaped_tensors_in_one_error(llama, tmp_path):
    _, cfg, params = llama
    tensors = dict(hf.hf_tensors(cfg, params))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = q[:-1]
    bad = tmp_path / "bad"
    hf.save_checkpoint(cfg, tensors.items(), bad)
    message = _one_line_error(bad)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.self_attn.rotary_emb.inv_freq" in message
    assert "mis-shaped: model.layers.0.self_attn.q_proj.weight" in message
    assert str(tuple(q.shape)) in message  # the expected shape is named


def test_config_that_does_not_match_the_weights(llama):
    src, cfg, _ = llama
    message = _one_line_error(src, cfg=dataclasses.replace(cfg, num_hidden_layers=3, layer_types=()))
    # the setting that differs, not the tensors that follow from it (those are listed only
    # when the checkpoint's own config.json does not explain them, as in the test above)
    assert "(num_hidden_layers 2 -> 3: the checkpoint's -> this run's)" in message
    assert "model.layers" not in message and "layer_types" not in message


def test_tied_checkpoint_with_a_redundant_lm_head_loads(llama, tmp_path):
    _, cfg, params = llama
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    tensors = dict(hf.hf_tensors(cfg, params))  # untied: has lm_head.weight
    hf.save_checkpoint(tied, tensors.items(), tmp_path / "tied")
    _, loaded = mtjax.load_params(tmp_path / "tied")
    assert "lm_head" not in loaded["head"]
    np.testing.assert_array_equal(loaded["embed"]["embedding"], params["embed"]["embedding"])


@pytest.mark.parametrize("keep", [20, 0.5, -4], ids=["header-cut", "half", "last-bytes-cut"])
def test_truncated_file_is_a_checkpoint_error(llama, keep):
    src = llama[0]
    file = src / hf.SINGLE_FILE
    data = file.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    file.write_bytes(data[:n])
    assert "truncated" in _one_line_error(src)


def test_missing_shard_and_broken_index(tmp_path):
    src, _ = hf_models.checkpoint(tmp_path, "llama", sharded=True)
    index = src / hf.INDEX_FILE
    good = index.read_text()
    index.write_text("{not json")
    _one_line_error(src)
    index.write_text(json.dumps({"metadata": {}}))
    _one_line_error(src)
    index.write_text(good)
    next(src.glob("model-*.safetensors")).unlink()
    _one_line_error(src)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(mtjax.to_hf_dict(mtjax.ModelConfig())))
    assert "neither" in _one_line_error(tmp_path)


# --- bf16 -------------------------------------------------------------------------------


def _raw_tensors(ckpt: Path) -> dict[str, tuple[str, bytes]]:
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                out[name] = (f.get_slice(name).get_dtype(), f.get_tensor(name).tobytes())
    return out


@pytest.mark.parametrize("load_dtype", [ml_dtypes.bfloat16, np.float32], ids=["as-bf16", "as-fp32"])
def test_bf16_checkpoint_round_trips_bit_exactly(tmp_path, load_dtype):
    model = hf_models.build("qwen2", tie_word_embeddings=True).to(torch.bfloat16)
    src = hf_models.save(model, tmp_path / "bf16")
    cfg, params = mtjax.load_params(src, dtype=load_dtype)
    assert cfg.param_dtype == "bfloat16"
    assert all(x.dtype == np.dtype(load_dtype) for x in jax.tree.leaves(params))
    mtjax.save_params(cfg, params, tmp_path / "again")
    original, again = _raw_tensors(src), _raw_tensors(tmp_path / "again")
    assert original.keys() == again.keys()
    for name, (dtype, raw) in original.items():
        assert dtype == "BF16" and again[name] == (dtype, raw), name
