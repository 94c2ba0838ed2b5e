"""What a run says about itself: where its weights come from, what its learning-rate
schedule cannot do, a closing summary whose wording fits short and resumed runs, and a
config.yaml that records what the run actually used."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest

import hf_models
import multidevice
from mtjax import cli, config, data, hf, model
from mtjax import run as run_lib
from mtjax.optim import OptimConfig, lr_at, schedule_warnings
from mtjax.reference import ReferenceTrainer, loss_fn

from conftest import TINY_MODEL_ARGS

TINY = list(TINY_MODEL_ARGS)
SHORT = ["--data.seq_len=32", "--data.batch_size=2", "--run.eval_every=0", "--run.sample_prompt=",
         "--optim.warmup_steps=0", "--optim.decay_steps=6", "--stream.engine=reference"]


def train(args) -> tuple[dict, str]:
    """(summary, log) of a run."""
    log = io.StringIO()
    summary = run_lib.train(config.load(None, args), log)
    return summary, log.getvalue()


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hf_models.checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen2", vocab_size=300)[0]


def first_batch(run_dir):
    return data.Loader(data.Dataset(run_dir / "data"), "train", 32, 2).next()[0]


@pytest.mark.slow  # training runs, 8-20 s each here
def test_a_checkpoint_start_is_named_and_starts_from_its_weights(ckpt, tmp_path):
    run_dir = tmp_path / "ft"
    summary, log = train([*SHORT, "--run.steps=1", f"--model.checkpoint={ckpt}", f"--run.dir={run_dir}"])
    assert f"mtjax: weights: the Hugging Face checkpoint {ckpt}\n" in log and "warning: model.hf_config" not in log
    cfg, params = hf.load_params(ckpt)
    np.testing.assert_allclose(summary["first_loss"], float(loss_fn(cfg, params, first_batch(run_dir))), rtol=1e-5)


@pytest.mark.slow  # training runs, 8-20 s each here
def test_an_architecture_alone_warns_that_it_starts_from_random_weights(ckpt, tmp_path):
    run_dir = tmp_path / "scratch"
    summary, log = train([*SHORT, "--run.steps=1", f"--model.hf_config={ckpt}", f"--run.dir={run_dir}"])
    assert "mtjax: weights: a fresh random initialisation (run.seed 0)\n" in log
    warning = [line for line in log.splitlines() if line.startswith("mtjax: warning: model.hf_config=")]
    assert len(warning) == 1 and f"--model.checkpoint={ckpt}" in warning[0] and "random weights" in warning[0]
    cfg = config.model_config(config.load(None, [f"--model.hf_config={ckpt}"]))
    fresh = model.init_params(cfg, 0)  # what it says is what it did: the seed-0 init, not the checkpoint
    np.testing.assert_allclose(summary["first_loss"], float(loss_fn(cfg, fresh, first_batch(run_dir))), rtol=1e-5)


@pytest.mark.slow  # training runs, 8-20 s each here
def test_an_imported_store_and_its_resumed_commit_are_named(ckpt, tmp_path):
    store = tmp_path / "store"
    assert cli.main(["import", str(ckpt), str(store), "--compute-dtype", "float32"]) == 0
    args = [*SHORT, "--stream.engine=stream", f"--model.hf_config={ckpt}", f"--store.path={store}",
            "--store.master=disk", "--store.opt=disk", f"--run.dir={tmp_path / 'run'}"]
    _, log = train([*args, "--run.steps=2"])
    assert f"mtjax: weights: the layer store {store} as imported (no training steps in it yet)\n" in log
    assert "random" not in log and "steps of" in log.splitlines()[0]
    summary, log = train([*args, "--run.steps=3", "--run.resume=true"])
    assert f"mtjax: weights: resumed from {store} at step 2\n" in log and "; step 3 of " in log.splitlines()[0]
    loss = losses(tmp_path / "run")[3]
    assert run_lib.describe(summary).startswith(f"resumed from step 2: loss {loss:.3f} at step 3 -> {loss:.3f} "
                                                "(step 3) in ")


@pytest.mark.slow  # training runs, 8-20 s each here
def test_summary_wording_fits_a_short_run_and_its_resumptions(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, *SHORT, f"--run.dir={run_dir}"]
    summary, log = train([*args, "--run.steps=6"])
    first_line, text = log.splitlines()[0], run_lib.describe(summary)
    logged = losses(run_dir)
    assert "; 6 steps of 64 tokens;" in first_line and ", reference engine on 1 cpu device; " in first_line
    assert text.splitlines()[0].startswith(f"loss {logged[1]:.3f} at step 1 -> {np.mean(list(logged.values())):.3f} "
                                           "(mean of steps 1-6) in ")
    assert "last 10" not in text and "resumed" not in text

    summary, log = train([*args, "--run.steps=8", "--run.resume=true"])
    logged = losses(run_dir)
    assert "; steps 7-8 of 64 tokens;" in log.splitlines()[0]
    assert f"mtjax: weights: resumed from {run_dir / 'store'} at step 6\n" in log
    assert "the cosine decay ends at step 6 of 8" in log  # decay_steps=6 stopped fitting at 8 steps
    assert run_lib.describe(summary).startswith(f"resumed from step 6: loss {logged[7]:.3f} at step 7 -> "
                                                f"{(logged[7] + logged[8]) / 2:.3f} (mean of steps 7-8) in ")

    done = json.loads((run_dir / "summary.json").read_text())
    again, log = train([*args, "--run.steps=8", "--run.resume=true"])  # nothing left to do: nothing written
    assert log == f"mtjax: {run_dir} is already trained to step 8 (run.steps=8); nothing written (its closing " \
        "lines follow)\n"
    assert again == done == summary  # the finished run's own closing lines


@pytest.mark.slow  # a training run in a child with two CPU devices
def test_the_start_up_line_says_how_many_devices_the_run_uses(tmp_path):
    args = ["-m", "mtjax", "train", *TINY, *SHORT, "--stream.engine=stream", "--run.steps=1",
            f"--run.dir={tmp_path / 'run'}"]
    proc = multidevice.spawn(args, devices=2)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    first = next(line for line in err.splitlines() if "M-parameter" in line)
    assert ", stream engine on 2 cpu devices; " in first  # (one device: the reference run above)


def test_warmup_longer_than_the_run_warns_with_the_lr_it_reaches():
    readme = OptimConfig(lr=3e-3, warmup_steps=20, decay_steps=6)  # the README's 6-step run before this check
    (warning,) = schedule_warnings(readme, 6)
    assert "optim.warmup_steps (20) is not shorter than run.steps (6)" in warning
    assert f"rises to {3e-3 * 5 / 20:.3g} (25% of optim.lr)" in warning  # step 6 applies count 5 of 20
    assert schedule_warnings(OptimConfig(lr=3e-3, warmup_steps=1, decay_steps=5), 6) == []
    assert schedule_warnings(config.ExperimentConfig().optim, 300) == []  # the default run fits
    assert "the last 100 steps train at the floor" in schedule_warnings(config.ExperimentConfig().optim, 400)[0]
    assert "not at the floor; optim.decay_steps=4 " in schedule_warnings(OptimConfig(warmup_steps=1), 5)[0]
    assert schedule_warnings(OptimConfig(schedule="constant", warmup_steps=2), 10) == []


@pytest.mark.slow  # training runs, 8-20 s each here
def test_lr_at_a_step_is_the_lr_its_update_applied():
    """Adam's first update moves each undecayed (1-D) weight by lr * g / (|g| + eps), i.e.
    by lr: with a one-step linear decay, step 1 trains at lr and step 2 at lr * 0.1."""
    cfg = config.model_config(config.load(None, TINY))
    opt = OptimConfig(lr=1e-2, schedule="linear", warmup_steps=0, decay_steps=1, min_lr_ratio=0.1)
    params = model.init_params(cfg, 0)
    trainer = ReferenceTrainer(cfg, params, opt)
    trainer.step(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 2, 16), dtype=np.int32))
    after = jax.device_get(trainer.params)
    moved = [np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params)) if a.ndim == 1]
    assert lr_at(opt, 1) == pytest.approx(1e-2) and lr_at(opt, 2) == pytest.approx(1e-3)
    np.testing.assert_allclose(max(moved), lr_at(opt, 1), rtol=1e-3)


@pytest.mark.slow  # training runs, 8-20 s each here
def test_config_yaml_records_the_datasets_tokenizer_and_a_prompt_from_the_data(tmp_path):
    text = tmp_path / "fox.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    ds = tmp_path / "ds"
    assert cli.main(["data", "prepare", str(text), "--out", str(ds), "--tokenizer", "bpe:300"]) == 0
    run_dir = tmp_path / "run"
    args = [*TINY, *SHORT, "--model.vocab_size=320", f"--data.dataset={ds}", "--run.steps=1",
            "--run.sample_tokens=3", f"--run.dir={run_dir}"]
    args.remove("--run.sample_prompt=")  # the default prompt, which is Shakespeare's
    train(args)
    saved = config.load(run_dir / "config.yaml")
    assert saved.data.tokenizer != "bytes"
    ids = data.Dataset(ds).tokenizer().encode(text.read_text()[:200])
    assert data.load_tokenizer(saved.data.tokenizer).encode(text.read_text()[:200]) == ids
    assert saved.run.sample_prompt == "the quick brown fox jumps over"
