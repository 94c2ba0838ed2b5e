"""Experiment configs: defaults, YAML, typed dotted overrides, errors, shipped experiments."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from mtjax import config, model
from mtjax.config import ConfigError, ExperimentConfig
from mtjax.errors import MtjaxError

EXPERIMENTS = sorted((Path(__file__).parent.parent / "experiments").glob("*.yaml"))


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, MtjaxError)


def test_default_yaml_equals_the_typed_defaults():
    assert config.load(EXPERIMENTS[0].parent / "default.yaml") == ExperimentConfig()


def test_overrides_are_parsed_to_the_field_type_and_keep_other_defaults():
    exp = config.load(None, ["--optim.lr=3e-4", "run.steps=7", "--run.tensorboard=false",
                             "--stream.engine=reference", "--stream.device_budget_bytes=8e9",
                             "--optim.clip_norm=null", "--model.hidden_size=64",
                             "--model.layer_types=full_attention,full_attention,full_attention,full_attention"])
    assert exp.optim.lr == 3e-4 and isinstance(exp.optim.lr, float)
    assert exp.optim.warmup_steps == ExperimentConfig().optim.warmup_steps  # group default kept
    assert exp.run.steps == 7 and exp.run.tensorboard is False
    assert exp.stream.device_budget_bytes == 8_000_000_000
    assert exp.optim.clip_norm is None
    cfg = config.model_config(exp)
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 4  # preset + override


def test_command_line_overrides_win_over_yaml(tmp_path):
    file = tmp_path / "exp.yaml"
    file.write_text("optim:\n  lr: 1.0e-2\nrun:\n  steps: 3\n")
    exp = config.load(file, ["--optim.lr=5e-3"])
    assert exp.optim.lr == 5e-3 and exp.run.steps == 3


def test_nested_dataclass_override():
    exp = config.load(None, ["--model.rope_scaling={rope_type: linear, factor: 2}"])
    assert config.model_config(exp).rope_scaling.factor == 2.0


@pytest.mark.parametrize("override, message", [
    ("--optim.lrr=1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    ("--optimm.lr=1", "unknown config group 'optimm'; did you mean 'optim'?"),
    ("--model.hiden_size=3", "did you mean 'model.hidden_size'?"),
    ("--run.stesp=3", "did you mean 'run.steps'?"),
    ("--lr=1", "unknown config key 'lr'"),
])
def test_unknown_key_names_the_closest_valid_key(override, message):
    with pytest.raises(ConfigError) as e:
        config.load(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("--optim.lr=fast", "optim.lr must be a number, got 'fast'"),
    ("--run.steps=1.5", "run.steps must be an integer"),
    ("--run.tensorboard=maybe", "run.tensorboard must be true or false"),
    ("--stream.engine=warp", "stream.engine must be one of reference, stream"),
    ("--store.opt=tape", "store.opt must be one of ram, disk"),
    ("--optim.schedule=sawtooth", "optim.schedule must be constant, cosine or linear"),
    ("--model.preset=tinny", "did you mean 'tiny'?"),
    ("--optim.lr", "needs a value"),
])
def test_bad_values_are_config_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        config.model_config(config.load(None, [override]))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_yaml_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        config.load(bad)
    bad.write_text("optim: 3\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        config.load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.yaml")


def test_model_sources(tmp_path):
    only_ckpt = config.load(None, ["--model.checkpoint=ckpt"]).model
    assert only_ckpt.hf_config == "ckpt" and only_ckpt.preset is None  # the checkpoint names the architecture
    inline = config.load(None, ["--model.checkpoint=ckpt", "--model.preset=null", "--model.vocab_size=300"])
    assert inline.model.hf_config is None and config.model_config(inline).vocab_size == 300
    with pytest.raises(ConfigError, match="both name an architecture"):
        config.load(None, ["--model.preset=tiny", "--model.hf_config=x"])
    with pytest.raises(ConfigError, match="no config.json"):
        config.model_config(config.load(None, [f"--model.hf_config={tmp_path}"]))


def test_dump_and_load_round_trip(tmp_path):
    exp = config.load(None, ["--model.rope_scaling={rope_type: linear, factor: 2}", "--optim.lr=1e-3",
                             "--run.sample_prompt=A: b\n", "--store.master=disk"])
    config.dump(exp, tmp_path / "x.yaml")
    assert config.load(tmp_path / "x.yaml") == exp


def test_every_key_has_help_text():
    missing = [k for k, (_, _, text) in config.valid_keys().items() if not text]
    assert not missing, f"fields without a comment: {missing}"


KNOWN_SIZES = {  # parameters of the real models the shipped shapes copy
    "llama-3.2-1b-finetune.yaml": 1_235_814_400,
    "qwen2.5-7b-1gpu.yaml": 7_615_616_512,
    "qwen2-chat-finetune.yaml": 494_032_768,  # Qwen2.5-0.5B-Instruct
    "llama-70b-plan.yaml": 70_553_706_496,
    "phi-4-plan.yaml": 14_659_507_200,
    "gemma-2-27b-plan.yaml": 27_227_128_320,
    "gemma-3-27b-plan.yaml": 27_009_346_304,  # the language model; the vision tower is left out
    "gemma-3-1b-finetune.yaml": 999_885_952,
    "mixtral-8x7b-plan.yaml": 46_702_792_704,
    "qwen3-30b-a3b-plan.yaml": 30_532_122_624,
    "qwen3-235b-a22b-plan.yaml": 235_093_634_560,
}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_shipped_experiment_parses_and_shape_checks(path):
    exp = config.load(path)
    cfg = config.model_config(exp)
    params = model.abstract_params(cfg)  # ShapeDtypeStructs only: nothing is allocated
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    if path.name in KNOWN_SIZES:
        assert n == KNOWN_SIZES[path.name]
    assert params["embed"]["embedding"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert len(params["blocks"]) == cfg.num_hidden_layers
    x = jax.ShapeDtypeStruct((1, 16, cfg.hidden_size), jnp.dtype(cfg.compute_dtype))
    out = jax.eval_shape(lambda b, h: model.block_forward(cfg, cfg.layer_specs[0], b, h), params["blocks"][0], x)
    assert out.shape == x.shape and out.dtype == x.dtype
    logits = jax.eval_shape(lambda h, e, t: model.head_forward(cfg, h, e, t), params["head"], params["embed"], x)
    assert logits.shape == (1, 16, cfg.vocab_size)
    assert exp.data.seq_len <= cfg.max_position_embeddings
