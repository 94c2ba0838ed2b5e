"""Experiment configs: defaults, YAML, typed dotted overrides, errors, shipped experiments."""

from __future__ import annotations

import argparse
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
    ("--run.wandb=true", "run.wandb names the Weights & Biases project to log to (--run.wandb=my-project)"),
    ("--stream.engine=warp", "stream.engine must be one of reference, stream"),
    ("--stream.adapters=host", "stream.adapters must be one of resident, streamed, got 'host'"),
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
    # 671_026_404_352 parameters (the multi-token-prediction layer left out) and the 58 MoE
    # layers' routing biases, 256 each: buffers, but leaves (counted here)
    "deepseek-v3-plan.yaml": 671_026_419_200,
    "deepseek-coder-v2-lite-plan.yaml": 15_706_484_224,
    "gpt-oss-120b-plan.yaml": 116_829_156_672,  # transformers' count from GptOssConfig (meta device)
    "gpt-oss-20b-plan.yaml": 20_914_757_184,
    # transformers' counts from the config classes' defaults (meta device), language models only
    "qwen3.5-9b-plan.yaml": 8_953_803_264,
    "qwen3.5-35b-a3b-plan.yaml": 34_660_610_688,
    # transformers' counts from the released configs' text model (meta device): vision tower and MTP left out
    "qwen3.5-27b-plan.yaml": 26_895_998_464,
    "qwen3.5-122b-a10b-plan.yaml": 122_111_526_912,
    "qwen3-next-80b-a3b-plan.yaml": 79_674_391_296,
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


def test_a_key_set_twice_in_a_yaml_file_is_refused_naming_it_and_both_lines(tmp_path):
    file = tmp_path / "exp.yaml"
    cases = {
        "optim:\n  lr: 1.0e-3\n  b1: 0.8\n  lr: 2.0e-3\n": "sets optim.lr twice (lines 2 and 4); keep one of them",
        "optim:\n  lr: 1.0e-3\nrun:\n  steps: 3\noptim:\n  b1: 0.8\n": "sets optim twice (lines 1 and 5); keep one of them",
        "model:\n  rope_scaling: {rope_type: linear, factor: 2, factor: 4}\n": "sets model.rope_scaling.factor twice (line 2); keep one of them",
    }
    for text, message in cases.items():
        file.write_text(text)
        with pytest.raises(ConfigError) as e:
            config.load(file)
        assert str(e.value) == f"{file} {message}"
    # A merge key brings defaults that the mapping's own keys override: not a key said twice.
    file.write_text("optim: {<<: {lr: 1.0e-3, b1: 0.8}, lr: 2.0e-3}\n")
    assert (config.load(file).optim.lr, config.load(file).optim.b1) == (2e-3, 0.8)
    with pytest.raises(ConfigError, match="^model.rope_scaling sets factor twice; keep one of them$"):
        config.load(None, ["--model.rope_scaling={rope_type: linear, factor: 2, factor: 4}"])


def test_a_command_line_setting_given_twice_takes_the_last(capsys):
    """As argparse (and absl flags) do: a stored command line can be extended with one
    setting that replaces its own, and the later of two values is the one used."""
    from mtjax import cli
    from mtjax.commands import train

    args, extra = cli.build_parser().parse_known_args(["train", "--optim.lr=1e-3", "--run.steps=4", "--optim.lr=2e-3"])
    exp = config.load(None, train.overrides_of(argparse_namespace(args, extra)))
    assert exp.optim.lr == 2e-3 and exp.run.steps == 4
    assert config.load(None, ["--optim.lr=1e-3", "--optim.lr=2e-3"]).optim.lr == 2e-3


def argparse_namespace(args, extra):
    args.extra_args = extra
    return args


@pytest.mark.parametrize("override, message", [
    ("--run.checkpoint_every=-1", "run.checkpoint_every must be in [0, 2147483647] (the optimizer counts steps in "
                                  "int32), got -1"),
    ("--run.eval_every=-5", "run.eval_every must be in [0, 2147483647]"),
    ("--run.log_every=0", "run.log_every must be in [1, 2147483647]"),
    ("--run.steps=-1", "run.steps must be in [0, 2147483647]"),
    ("--run.steps=1e12", "run.steps must be in [0, 2147483647] (the optimizer counts steps in int32), "
                         "got 1000000000000"),
    ("--run.sample_tokens=-2", "run.sample_tokens must be >= 0, got -2"),
    ("--run.seed=-1", "run.seed must be in [0, 4294967295] (JAX keeps a seed's low 32 bits), got -1"),
    ("--run.seed=4294967296", "run.seed must be in [0, 4294967295]"),  # would seed as 0
    ("--optim.warmup_steps=3e9", "optim.warmup_steps must be in [0, 2147483647]"),
    ("--optim.decay_steps=-1", "optim.decay_steps must be in [0, 2147483647]"),
    ("--optim.lr=-1e-3", "optim.lr must be positive, got -0.001"),
    ("--optim.lr=0", "optim.lr must be positive, got 0.0"),
    ("--optim.weight_decay=-0.1", "optim.weight_decay must be >= 0, got -0.1"),
    ("--optim.b1=1", "optim.b1 must be in [0, 1), got 1.0"),
    ("--optim.b2=-0.5", "optim.b2 must be in [0, 1), got -0.5"),
    ("--optim.eps=0", "optim.eps must be positive, got 0.0"),
    ("--optim.min_lr_ratio=2", "optim.min_lr_ratio must be in [0, 1], got 2.0"),
    ("--optim.clip_norm=-1", "optim.clip_norm must be positive or null (no clipping), got -1.0"),
    ("--optim.lr=nan", "optim.lr must be a finite number, got 'nan'"),
    ("--data.batch_size=0", "data.batch_size must be >= 1, got 0"),
    ("--data.seq_len=0", "data.seq_len must be >= 2, got 0"),
    ("--data.seq_len=-8", "data.seq_len must be >= 2, got -8"),
    ("--data.grad_accum=0", "data.grad_accum must be >= 1, got 0"),
    ("--data.val_fraction=1", "data.val_fraction must be in [0, 1), got 1.0"),
    ("--data.seed=-1", "data.seed must be >= 0, got -1"),
    ("--stream.keep_every=-1", "stream.keep_every must be >= 0, got -1"),
    ("--stream.prefetch_depth=0", "stream.prefetch_depth must be >= 1, got 0"),
    ("--stream.device_budget_bytes=0", "stream.device_budget_bytes must be positive, got 0"),
    ("--model.rope_theta=-10000", "model.rope_theta must be positive, got -10000.0"),
    ("--model.rope_theta=0", "model.rope_theta must be positive, got 0.0"),
    ("--model.max_position_embeddings=0", "model.max_position_embeddings must be >= 1, got 0"),
    ("--model.rms_norm_eps=0", "model.rms_norm_eps must be positive, got 0.0"),
    ("--model.sliding_window=-3", "model.sliding_window must be >= 1, got -3"),
    ("--model.router_aux_loss_coef=-1", "model.router_aux_loss_coef must be >= 0, got -1.0"),
])
def test_numbers_that_cannot_be_meant_name_the_field_the_value_and_the_range(override, message):
    with pytest.raises(ConfigError) as e:
        config.model_config(config.load(None, [override]))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_ranges_read_as_they_check():
    from mtjax.bounds import FRACTION, POSITIVE, STEPS, Range

    assert [v in FRACTION for v in (0, 0.5, 1, -0.1, math.nan)] == [True, True, False, False, False]
    assert [v in POSITIVE for v in (1e-30, 0, -1, math.inf)] == [True, False, False, True]
    assert [v in STEPS for v in (0, 2**31 - 1, 2**31)] == [True, True, False]
    assert (str(FRACTION), str(POSITIVE), str(Range(2)), str(Range(0, 1, low_open=True))) == \
        ("in [0, 1)", "positive", ">= 2", "in (0, 1]")


def test_a_flag_refuses_what_its_range_refuses_in_the_same_words():
    """bounds.flag, the argparse type= of a command's numeric flag: argparse prints its
    ArgumentTypeError as "argument --FLAG: MESSAGE", and a ValueError as "invalid int value"."""
    from mtjax.bounds import AT_LEAST_1, FRACTION, SEED, flag

    assert (flag(int, AT_LEAST_1)("3"), flag(float, FRACTION)("0.25"), flag(int, SEED)(str(2**32 - 1))) == \
        (3, 0.25, 2**32 - 1)
    for kind, allowed, text, message in ((int, AT_LEAST_1, "0", "must be >= 1, got 0"),
                                         (float, FRACTION, "1", "must be in [0, 1), got 1.0"),
                                         (float, FRACTION, "nan", "must be a finite number, got 'nan'"),
                                         (float, AT_LEAST_1, "inf", "must be a finite number, got 'inf'"),
                                         (int, SEED, str(2**64), f"must be {SEED}, got {2**64}")):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            flag(kind, allowed)(text)
        assert str(e.value) == message
    with pytest.raises(ValueError):
        flag(int, AT_LEAST_1)("1.5")
    assert flag(int, AT_LEAST_1).__name__ == "int"


SEVENTY_B = str(EXPERIMENTS[0].parent / "hf_configs" / "llama-3-70b.json")


def test_architecture_fields_beside_an_hf_config_are_refused_naming_them(tmp_path):
    with pytest.raises(ConfigError) as e:
        config.model_config(config.load(None, [f"--model.hf_config={SEVENTY_B}", "--model.num_hidden_layers=4",
                                               "--model.hidden_size=4096"]))
    assert str(e.value) == (
        f"the architecture comes from model.hf_config {SEVENTY_B}, and the experiment also sets hidden_size 8192 -> "
        "4096, num_hidden_layers 80 -> 4 (its -> yours); drop those model.* settings, or give the whole "
        "architecture inline (model.preset=null, no model.hf_config, every architecture field)")
    file = tmp_path / "exp.yaml"  # a YAML that has both says the same, and a checkpoint names itself
    file.write_text(f"model:\n  checkpoint: {SEVENTY_B}\n  vocab_size: 1000\n")
    with pytest.raises(ConfigError, match=r"^the architecture comes from model.checkpoint .*vocab_size 128256 -> 1000 "):
        config.model_config(config.load(file))
    # What is not the architecture, and a value the HF config has, may be given beside it.
    exp = config.load(None, [f"--model.hf_config={SEVENTY_B}", "--model.compute_dtype=bfloat16",
                             "--model.num_hidden_layers=80", "--model.max_position_embeddings=32768",
                             "--model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 8192}"])
    cfg = config.model_config(exp)
    assert (cfg.compute_dtype, cfg.num_hidden_layers, cfg.max_position_embeddings, cfg.rope_scaling.rope_type) == \
        ("bfloat16", 80, 32768, "yarn")
