"""A family registered from here, through the public registry (mtjax.families), with no
file in mtjax/ naming it: its config.json goes in and out, and its checkpoints go in and
out (directly and through a store) under the names its rules give."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

import mtjax
from mtjax import families, hf, model
from mtjax.families import hf_config
from mtjax.layers.spec import Norms
from mtjax.model_config import SWITCHES, ConfigError, ModelConfig
from mtjax.store import layout

from conftest import assert_store_round_trip, checkpoint_tensors

TOY = "toy_llama"
# Its own config.json key: q, k and v in one tensor and gate and up in another.
FUSED_KEY = "toy_fused"
HF = {"architectures": ["ToyLlamaForCausalLM"], "model_type": TOY, "vocab_size": 61, "hidden_size": 32,
      "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 500.0, "max_position_embeddings": 64,
      "tie_word_embeddings": False, "initializer_range": 0.02, "dtype": "float32", "torch_dtype": "float32",
      "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "mlp_bias": True, FUSED_KEY: True,
      "bos_token_id": 1}
_NAMES = {"self_attn": "attn", "mlp": "ffn", "pre_feedforward_layernorm": "ffn_in_norm",
          "post_feedforward_layernorm": "ffn_out_norm"}


def _from_hf(hf_dict: dict) -> dict:
    layers = int(hf_dict["num_hidden_layers"])
    fields = hf_config.read_common(hf_dict, (hf_config.FULL,) * layers, known={FUSED_KEY})
    return dict(fields, fused_projections=bool(hf_dict.get(FUSED_KEY, False)))


def _to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), mlp_bias=cfg.mlp_bias, **{FUSED_KEY: cfg.fused_projections})


def _layer_specs(cfg) -> tuple:
    """Llama's layers with sandwich norms, which no ModelConfig field asks for."""
    return tuple(dataclasses.replace(s, norms=Norms(sandwich=True)) for s in cfg.derived_layer_specs())


TOY_FAMILY = families.Family(TOY, "ToyLlamaForCausalLM", _from_hf, _to_hf, defaults={"rope_interleaved": True},
                             layer_specs=_layer_specs, checkpoint_names=lambda m: [_NAMES.get(p, p) for p in m])


@pytest.fixture
def toy():
    families.register(TOY_FAMILY)
    try:
        yield TOY_FAMILY
    finally:
        families.unregister(TOY)


def test_config_json_round_trips_through_the_registered_family(toy):
    cfg = mtjax.from_hf_dict(HF)
    assert cfg.model_type == TOY and cfg.family is toy
    assert cfg.fused_projections and cfg.mlp_bias and cfg.rope_interleaved  # its key, Llama's, its default
    assert all(s.norms.sandwich for s in cfg.layer_specs)
    assert cfg.extra_hf == (("bos_token_id", 1),)
    assert mtjax.to_hf_dict(cfg) == HF
    assert mtjax.from_hf_dict(mtjax.to_hf_dict(cfg)) == cfg
    off = mtjax.from_hf_dict({**HF, FUSED_KEY: False, "rope_parameters": None})
    assert not off.fused_projections and dataclasses.replace(cfg, fused_projections=False) == off


def test_checkpoint_round_trips_under_its_names_directly_and_through_a_store(toy, tmp_path):
    cfg = mtjax.from_hf_dict(HF)
    params = model.init_params(cfg, seed=3)
    hf.save_params(cfg, params, tmp_path / "ckpt")
    saved = checkpoint_tensors(tmp_path / "ckpt")
    assert {"model.layers.0.attn.qkv_proj.weight", "model.layers.1.ffn.gate_up_proj.bias",
            "model.layers.0.ffn_in_norm.weight", "model.layers.1.ffn_out_norm.weight"} <= set(saved)
    assert not [n for n in saved if "self_attn" in n or ".mlp." in n]
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == HF
    loaded_cfg, loaded = hf.load_params(tmp_path / "ckpt")
    assert loaded_cfg == cfg
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert_store_round_trip(tmp_path / "ckpt", tmp_path)  # the same tensors, names and config.json


def test_a_family_not_registered_is_one_config_error_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=f"model_type '{TOY}' is not supported; supported: llama") as err:
        mtjax.from_hf_dict(HF)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not supported"):
        ModelConfig(model_type=TOY)


def test_no_file_of_the_package_names_the_toy_family():
    package = Path(mtjax.__file__).parent
    assert not [p for p in package.rglob("*.py") if TOY in p.read_text()]


def test_a_switch_left_unset_takes_its_family_default_and_a_set_one_is_kept():
    assert ModelConfig(model_type="phi3").fused_projections and not ModelConfig().fused_projections
    assert not ModelConfig(model_type="phi3", fused_projections=False).fused_projections
    assert ModelConfig(fused_projections=True, moe_router="sigmoid_topk").moe_router == "sigmoid_topk"
    llama4 = ModelConfig(model_type="llama4_text")
    assert (llama4.rope_interleaved, llama4.moe_router) == (True, "sigmoid_topk")
    assert ModelConfig(model_type="qwen2_moe").shared_expert_gated


def test_a_store_config_written_before_the_switches_reads_as_its_family():
    for cfg in (ModelConfig(model_type="phi3"), ModelConfig(model_type="llama4_text"), ModelConfig()):
        written = {k: v for k, v in layout.config_to_json(cfg).items() if k not in SWITCHES}
        assert layout.config_from_json(written) == cfg
