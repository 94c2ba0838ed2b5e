"""The command line as a user meets it, and one end-to-end training run through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import mtjax.store as store_lib
from mtjax import checkpoint, cli, config, data, hf, model
from mtjax import run as run_lib
from mtjax.reference import ReferenceTrainer
from mtjax.store import hf_export

from conftest import TINY_MODEL_ARGS

TINY = [*TINY_MODEL_ARGS,
        "--data.seq_len=32", "--data.batch_size=4", "--data.grad_accum=2", "--optim.lr=1e-2",
        "--optim.warmup_steps=0", "--optim.decay_steps=8", "--run.steps=8", "--run.log_every=2",
        "--run.eval_every=4", "--run.eval_batches=2", "--run.checkpoint_every=4", "--run.sample_tokens=12"]


def mtjax(*args, cwd=None) -> subprocess.CompletedProcess:
    """The real entry point in a fresh interpreter, as a user runs it."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "mtjax", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["train", "--optim.lrr=3e-4"], "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    (["train", "--optim.lr=fast"], "optim.lr must be a number, got 'fast'"),
])
def test_bad_override_is_one_line_and_a_nonzero_exit(args, message):
    result = mtjax(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"mtjax train: error: {message}"]
    assert "Traceback" not in result.stderr + result.stdout


def test_errors_of_other_commands_are_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = [
        (["data", "prepare", str(empty), "--out", str(tmp_path / "ds")], "the input is empty"),
        (["generate", str(tmp_path / "nowhere")], "no store or checkpoint at"),
        (["generate", str(tmp_path), "--tokenizer", "bytes"], "has no manifest.json or config.json"),
        (["plot", str(tmp_path)], "has no metrics.jsonl"),
        (["train", str(tmp_path / "missing.yaml")], "does not exist"),
    ]
    for args, message in cases:
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, (args, err)


@pytest.mark.parametrize("command", [["train"], ["data"], ["data", "prepare"], ["data", "info"], ["generate"],
                                     ["eval"], ["plot"], ["plan"], ["probe"], ["import"], ["export"], ["init"],
                                     ["store"], ["store", "reshard"]])
def test_help_of_each_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mtjax {' '.join(command)}")
    description = out.split("\n\n")[1]  # the paragraph between the usage and the arguments
    assert len(description.split()) >= 8 and not description.lstrip().startswith(("positional", "options")), out
    if command == ["train"]:
        assert "--optim.lr FLOAT" in out and "peak learning rate" in out and "--stream.engine" in out
        # A setting taking a word or a number is shown as neither (it was INT for stream.devices=all)
        for key in ("stream.resident", "stream.devices", "run.resume"):
            assert f"--{key} VALUE" in out, key
        assert "--lora.rank INT" in out and "--store.path STR" in out  # None is no second kind


def test_bare_mtjax_prints_usage_and_starts_nothing(tmp_path):
    result = mtjax(cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("usage: mtjax") and "train" in result.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory: nothing was trained


def test_print_config_shows_the_embedded_default(tmp_path, capsys):
    assert cli.main(["train", "--print-config"]) == 0
    file = tmp_path / "printed.yaml"
    file.write_text(capsys.readouterr().out)
    assert config.load(file) == config.ExperimentConfig()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny `mtjax train` run through the real command-line entry point."""
    run_dir = tmp_path_factory.mktemp("run") / "tiny"
    args = ["train", *TINY, f"--run.dir={run_dir}"]
    result = subprocess.run([sys.executable, "-m", "mtjax", *args], capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    return run_dir, result


@pytest.mark.slow  # a training run in a subprocess
def test_train_end_to_end(trained):
    run_dir, result = trained
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(np.isfinite(r["loss"]) and "grad_norm" in r for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # it learns
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8]
    assert "step      8/8" in result.stderr and "tok/s" in result.stderr  # plain log lines off a terminal
    assert "--- sample ---" in result.stdout and "loss " in result.stdout
    with store_lib.open(run_dir / "store") as store:  # the run's checkpoint: its store's last commit
        state = store.load_train_state()
    assert store.step == state["step"] == 8 and state["loader"] == {"epoch": 0, "position": 64}
    assert json.loads((run_dir / "final" / checkpoint.EXPORT_NOTE).read_text())["step"] == 8
    assert config.load(run_dir / "config.yaml") == config.load(None, [*TINY, f"--run.dir={run_dir}"])


@pytest.mark.slow  # a training run in a subprocess
def test_a_byte_level_export_says_it_has_no_tokenizer_and_how_to_use_it(trained, tmp_path, capsys, monkeypatch):
    """transformers would load some tokenizer without a word: the export says there is none, in
    one line and in a README.md whose recipe (run here) loads and samples the model."""
    run_dir, result = trained
    assert result.returncode == 0, result.stderr
    final, out = run_dir / "final", tmp_path / "exported"
    said = [line for line in result.stderr.splitlines() if "no tokenizer" in line]
    assert said == [f"mtjax: {hf_export.byte_level_line(final)}"] and "byte-level" in said[0]
    capsys.readouterr()
    assert cli.main(["export", str(run_dir / "store"), str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [hf_export.byte_level_line(out)]
    for folder in (final, out):
        assert not (folder / "tokenizer.json").exists()
        card = (folder / hf_export.CARD_FILE).read_text()
        recipe = card.split("```python\n")[1].split("```")[0]
        monkeypatch.chdir(tmp_path)
        exec(recipe, {})  # transformers loads the model; the recipe's ids are the bytes it was trained on
        sample = capsys.readouterr().out
        assert sample.startswith("In the beginning") and len(sample) > len("In the beginning\n")


@pytest.mark.slow  # a training run in a subprocess
def test_run_equals_a_hand_written_reference_loop(trained):
    """The run's losses and final weights are exactly N reference steps on the loader's batches."""
    run_dir, result = trained
    assert result.returncode == 0, result.stderr
    exp = config.load(run_dir / "config.yaml")
    cfg = config.model_config(exp)
    dataset = data.Dataset(run_dir / "data")
    loader = data.Loader(dataset, "train", exp.data.seq_len, exp.data.batch_size, exp.data.grad_accum, exp.data.seed)
    trainer = ReferenceTrainer(cfg, model.init_params(cfg, exp.run.seed), exp.optim)
    losses = [trainer.step(loader.next())["loss"] for _ in range(exp.run.steps)]
    logged = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    np.testing.assert_allclose(logged, losses, rtol=1e-5)
    _, saved = hf.load_params(run_dir / "final")
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(trainer.params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a training run in a subprocess
def test_generate_eval_plot_and_data_commands_on_the_run(trained, tmp_path, capsys):
    run_dir, result = trained
    assert result.returncode == 0, result.stderr
    final = str(run_dir / "final")
    assert cli.main(["generate", final, "--prompt", "To be", "--tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    assert cli.main(["eval", final, str(run_dir / "data"), "--seq-len", "32", "--batch-size", "2",
                     "--batches", "1"]) == 0
    loss = float(capsys.readouterr().out.split()[2])
    assert 0 < loss < 5.6  # below the untrained loss of ln(257)
    assert cli.main(["plot", str(run_dir), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    assert cli.main(["data", "prepare", str(text), "--out", str(tmp_path / "ds")]) == 0
    assert "501 tokens" in capsys.readouterr().out
    assert cli.main(["data", "info", str(tmp_path / "ds")]) == 0
    assert json.loads(capsys.readouterr().out)["num_tokens"] == 501


@pytest.mark.slow  # a training run in a subprocess
def test_python_api_matches_the_command_line_arguments(tmp_path):
    exp = config.load(None, [*TINY, "--run.steps=2", "--run.eval_every=0", "--run.sample_prompt=",
                             f"--run.dir={tmp_path / 'api'}"])
    summary = run_lib.train(exp, stream=open(os.devnull, "w"))
    assert summary["steps"] == 2 and summary["val_loss"] is None and summary["sample"] == ""
    assert Path(summary["checkpoint"]).is_dir()


def test_resumed_run_continues_exactly(tmp_path):
    """3 steps, then --run.resume=true to 6, equals 6 uninterrupted steps (losses and weights)."""
    base = [*TINY, "--run.eval_every=0", "--run.sample_prompt=", "--run.checkpoint_every=3",
            "--optim.decay_steps=6"]
    quiet = open(os.devnull, "w")
    run_lib.train(config.load(None, [*base, "--run.steps=6", f"--run.dir={tmp_path / 'straight'}"]), quiet)
    run_lib.train(config.load(None, [*base, "--run.steps=3", f"--run.dir={tmp_path / 'split'}"]), quiet)
    run_lib.train(config.load(None, [*base, "--run.steps=6", "--run.resume=true", f"--run.dir={tmp_path / 'split'}"]),
                  quiet)

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"]) for r in map(json.loads, lines)]

    assert [s for s, _ in losses("split")] == list(range(1, 7))
    np.testing.assert_allclose([l for _, l in losses("split")], [l for _, l in losses("straight")], rtol=1e-6)
    _, a = hf.load_params(tmp_path / "straight" / "final")
    _, b = hf.load_params(tmp_path / "split" / "final")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    with pytest.raises(config.ConfigError, match="no checkpoint to resume from"):
        run_lib.train(config.load(None, [*base, "--run.resume=true", f"--run.dir={tmp_path / 'none'}"]), quiet)


def test_tensorboard_writes_events_or_names_the_missing_package(tmp_path):
    from mtjax.progress import Progress

    with Progress(tmp_path, 2, 10, tensorboard=True, stream=open(os.devnull, "w")) as progress:
        progress.update(1, {"loss": 2.0})
        progress.update(2, {"loss": 1.5})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert b"loss" in events[0].read_bytes()  # the scalar's tag is in the event records


@pytest.mark.slow  # a run: ~7 s here
def test_evaluation_asked_of_a_split_without_a_row_is_a_warning(tmp_path, capsys):
    """run.eval_every with no validation row (data.val_fraction=0) once computed no
    validation loss and said nothing; the start of the run says why none will come."""
    run_dir = tmp_path / "r"
    assert cli.main(["train", *TINY_MODEL_ARGS, "--data.seq_len=32", "--data.batch_size=2", "--run.steps=1",
                     "--run.sample_tokens=0", "--data.val_fraction=0", "--run.eval_every=1",
                     f"--run.dir={run_dir}"]) == 0
    err = capsys.readouterr().err
    assert ("mtjax: warning: run.eval_every=1 asks for validation losses, but the val split of builtin:shakespeare "
            "holds 0 tokens, less than one row of data.seq_len 32: none is computed") in err, err


def test_an_optional_package_missing_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    """matplotlib (mtjax plot) and tensorboardX (run.tensorboard) are extras: a feature
    asked for without its package says which to install, and nothing else fails."""
    from mtjax.errors import MissingPackage
    from mtjax.progress import Progress

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    for module in ("matplotlib", "matplotlib.figure", "tensorboardX"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    assert cli.main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == ("mtjax plot: error: drawing charts needs the matplotlib package, which is not installed: "
                   "pip install matplotlib (or install mtjax with the [plot] extra)\n")
    with pytest.raises(MissingPackage, match=r"run.tensorboard needs the tensorboardX package.*\[tensorboard\] extra"):
        Progress(tmp_path, 2, 10, tensorboard=True, stream=open(os.devnull, "w"))
    assert not (tmp_path / "charts.png").exists() and not (tmp_path / "tensorboard").exists()
    # A run asking for it stops before its directory is made: once the package is installed,
    # the same command starts the run (it used to find a store at step 0 and ask for run.resume).
    assert cli.main(["train", *TINY_MODEL_ARGS, "--run.tensorboard=true", f"--run.dir={tmp_path / 'r'}"]) == 2
    assert "run.tensorboard needs the tensorboardX package" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # a training run in a subprocess
def test_fine_tune_starts_from_the_checkpoint_weights(tmp_path):
    import hf_models

    from mtjax.reference import loss_fn

    ckpt, _ = hf_models.checkpoint(tmp_path, "qwen2", vocab_size=300)
    args = ["--data.seq_len=32", "--data.batch_size=2", "--run.steps=1", "--run.eval_every=0",
            "--run.sample_prompt=", f"--model.checkpoint={ckpt}", f"--run.dir={tmp_path / 'ft'}"]
    exp = config.load(None, args)
    summary = run_lib.train(exp, open(os.devnull, "w"))
    cfg, params = hf.load_params(ckpt)
    assert config.model_config(exp) == cfg  # the checkpoint named the architecture
    first = data.Loader(data.Dataset(tmp_path / "ft" / "data"), "train", 32, 2).next()[0]
    np.testing.assert_allclose(summary["first_loss"], float(loss_fn(cfg, params, first)), rtol=1e-5)
    small, _ = hf_models.checkpoint(tmp_path / "small", "llama")  # vocabulary 97 < 257 byte ids
    with pytest.raises(data.DataError, match="model's vocabulary is 97"):
        run_lib.train(config.load(None, [*args, f"--model.checkpoint={small}", f"--run.dir={tmp_path / 'small'}-run"]),
                      open(os.devnull, "w"))


@pytest.mark.slow  # a training run in a subprocess
def test_a_bad_run_leaves_the_previous_run_intact(trained, capsys):
    run_dir, result = trained
    assert result.returncode == 0, result.stderr
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    for bad, message in (("--data.seq_len=4096", "exceeds the model's context"),
                         ("--data.batch_size=40000", "data.batch_size"),  # the data is shorter than one batch
                         ("--model.num_key_value_heads=3", "must be a multiple of")):
        # --run.resume=true: past the refusal of a finished run, to the check each case is about
        assert cli.main(["train", *TINY, f"--run.dir={run_dir}", "--run.resume=true", bad]) == 2
        assert message in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


@pytest.mark.slow  # a training run in a subprocess
def test_long_work_shows_progress_on_a_terminal_only(trained, tmp_path, capsys, monkeypatch):
    """eval, generate and data prepare draw a progress bar on stderr when it is a terminal
    (here: as if it were, with the bar shown at once), nothing otherwise; the results are
    the same either way."""
    run_dir, result = trained
    assert result.returncode == 0, result.stderr
    final = str(run_dir / "final")
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    commands = {"evaluating": ["eval", final, str(run_dir / "data"), "--seq-len", "32", "--batch-size", "2",
                               "--batches", "3"],
                "sampling": ["generate", final, "--prompt", "To be", "--tokens", "40", "--temperature", "0"],
                "tokenizing": ["data", "prepare", str(text), "--out", str(tmp_path / "ds"), "--overwrite"]}
    plain = {}
    for name, args in commands.items():
        assert cli.main(args) == 0
        plain[name] = capsys.readouterr()
        assert plain[name].err == "", (name, plain[name].err)
    monkeypatch.setenv("MTJAX_PROGRESS", "always")  # a bar at once, as on a terminal after a while
    for name, args in commands.items():
        assert cli.main(args) == 0
        shown = capsys.readouterr()
        assert shown.out == plain[name].out and name in shown.err, (name, shown)


# Ten blocks whose compute weights (~10 MB) outweigh what a streamed step holds (~7 MB).
DEEP = ["--model.hidden_size=128", "--model.intermediate_size=512", "--model.num_hidden_layers=10",
        "--model.num_attention_heads=2", "--model.num_key_value_heads=1", "--model.head_dim=64",
        "--data.seq_len=16", "--data.batch_size=2", "--data.grad_accum=1", "--stream.prefetch_depth=1",
        "--stream.keep_every=1", "--run.steps=2", "--run.eval_every=0", "--run.sample_tokens=12"]


@pytest.mark.slow  # a training run, an export and two samples, compiled
def test_the_closing_sample_streams_within_a_device_budget_below_the_weights(tmp_path, capsys):
    """A fresh `mtjax train` with stream.device_budget_bytes below the model's weights starts
    from its new store filled part by part (as `mtjax init` fills one), trains and
    samples: the closing sample streams the store's last commit part by part (the text
    `mtjax generate` gives from that store), and the device ledger's peak stays in the budget."""
    from mtjax import parts

    run_dir = tmp_path / "deep"
    cfg = config.model_config(config.load(None, DEEP))
    weights = sum(parts.nbytes(parts.schema(cfg, p.name, "compute")) for p in parts.parts(cfg))
    budget = weights * 3 // 4
    assert cli.main(["train", *DEEP, f"--stream.device_budget_bytes={budget}", f"--run.dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sample"] and f"--- sample ---\n{summary['sample']}\n" in out
    assert 0 < summary["device_peak_bytes"] <= budget < weights
    assert cli.main(["generate", str(run_dir / "store"), "--prompt", "CLEOPATRA.\n", "--tokens", "12"]) == 0
    assert capsys.readouterr().out == "CLEOPATRA.\n" + summary["sample"] + "\n"


@pytest.mark.parametrize("copies, tiers", [(2, ["--store.master=ram", "--store.opt=disk"]),
                                           (1, ["--store.compute=disk", "--store.master=disk", "--store.opt=disk"])])
def test_a_fresh_streamed_run_starts_from_the_weights_mtjax_init_gives(tmp_path, copies, tiers):
    """A new stream-engine run fills its store part by part, as `mtjax init` does (whose
    weights are init_params's, test_store_hf): its step-0 commit holds, bit for bit, the
    master, compute and optimizer state `mtjax init` writes for the same config and seed."""
    from mtjax import parts

    args = [*TINY, "--stream.engine=stream", "--run.steps=0", "--run.seed=5", f"--store.copies={copies}", *tiers,
            "--run.sample_prompt=", f"--run.dir={tmp_path / 'run'}"]
    config.dump(config.load(None, args), tmp_path / "exp.yaml")
    assert cli.main(["init", str(tmp_path / "exp.yaml"), str(tmp_path / "init"), "--seed", "5",
                     "--copies", str(copies)]) == 0
    assert cli.main(["train", *args]) == 0
    with store_lib.open(tmp_path / "run" / "store") as ran, store_lib.open(tmp_path / "init") as made:
        assert ran.step == made.step == 0 and ran.load_train_state() is not None
        assert ran.config == made.config
        for part in made.parts:
            for kind in parts.KINDS:
                want, got = made.read(part, kind).result(), ran.read(part, kind).result()
                assert want.keys() == got.keys()
                for leaf in want:
                    np.testing.assert_array_equal(np.asarray(got[leaf]), np.asarray(want[leaf]), err_msg=(part, kind, leaf))


@pytest.mark.parametrize("extra, says", [
    (["--run.sample_tokens=1000", "--stream.device_budget_bytes=7000000"],
     "the closing sample (1,011 positions) may hold 7,211,008 bytes on the device (two parts' weights and the KV "
     "caches), over stream.device_budget_bytes 7,000,000; lower run.sample_tokens"),
    pytest.param(["--model.max_position_embeddings=4096", "--run.sample_tokens=4000", "--stream.resident=2",
                  "--stream.device_budget_bytes=27000000"],  # alone it would fit
                 "may hold 22,939,648 bytes on the device (two parts' weights and the KV caches), over the 19,127,472 "
                 "that stream.device_budget_bytes 27,000,000 leaves beside the resident parts; lower run.sample_tokens",
                 marks=pytest.mark.slow),  # builds the engine, whose resident parts count
])
def test_a_closing_sample_past_the_device_budget_is_refused_before_training(tmp_path, capsys, extra, says):
    """Steps that fit stream.device_budget_bytes with a closing sample whose KV caches do
    not (beside the parts kept resident): one line before anything is trained or written,
    not a failure after the run."""
    run_dir = tmp_path / "deep"
    assert cli.main(["train", *DEEP, *extra, f"--run.dir={run_dir}"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says in err, err
    assert not run_dir.exists()
