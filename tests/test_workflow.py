"""The researcher's workflow around a run: what it records per step, its charts, its
TensorBoard events, and eval/generate of a layer store as of an HF checkpoint."""

from __future__ import annotations

import io
import json

import matplotlib.image
import pytest

from mtjax import cli, config
from mtjax import run as run_lib
from mtjax.progress import model_flops_per_token, peak_flops

TINY = ["--model.hidden_size=32", "--model.intermediate_size=64", "--model.num_hidden_layers=2",
        "--model.num_attention_heads=2", "--model.num_key_value_heads=1", "--model.head_dim=16",
        "--data.seq_len=32", "--data.batch_size=2", "--run.steps=4", "--run.log_every=2",
        "--run.eval_every=2", "--run.eval_batches=1", "--run.sample_tokens=0", "--stream.engine=stream"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """A tiny streamed run; its log lines and metrics.jsonl records."""
    run_dir = tmp_path_factory.mktemp("wf") / "run"
    log = io.StringIO()
    run_lib.train(config.load(None, [*TINY, f"--run.dir={run_dir}"]), log)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, log.getvalue(), records


def test_each_step_records_rss_mfu_and_stage_times(streamed):
    _, log, records = streamed
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0.01 < r["rss_gib"] < 64  # this process's resident memory, in GiB
        assert {"stage_read_s", "stage_compute_s", "stage_optimizer_s"} <= set(r)
        assert r["stage_compute_s"] > 0
    cfg = config.model_config(config.load(None, TINY))
    flops = model_flops_per_token(cfg.num_params(), 2, 32, 32)
    peak, _ = peak_flops(__import__("jax").devices()[0], "float32")
    for r in steps[1:]:  # the first step pays compilation: no rate yet
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / peak, rel=1e-2, abs=1e-4)
    assert "MFU against 0.19 TFLOP/s float32 (cpu-2core, facts)" in log
    step_lines = [line for line in log.splitlines() if line.startswith("step ") and "loss" in line
                  and "val_loss" not in line]
    assert len(step_lines) == 2 and all("mfu " in line and "rss " in line for line in step_lines)
    assert "device_mem_gib" not in steps[0]  # the CPU backend reports no device memory


def test_disk_tier_reports_the_bandwidth_it_moved(tmp_path):
    """Store I/O per step: the bytes of state and gradients read and written over the
    step's wall time, in metrics.jsonl and on the progress line."""
    run_dir, log = tmp_path / "run", io.StringIO()
    disk = ["--store.compute=disk", "--store.master=disk", "--store.opt=disk", "--run.eval_every=0"]
    run_lib.train(config.load(None, [*TINY, *disk, f"--run.dir={run_dir}", "--run.steps=3", "--run.log_every=1"]), log)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    n = config.model_config(config.load(None, TINY)).num_params()
    for prev, r in zip(steps, steps[1:]):
        wall = r["time_s"] - prev["time_s"]  # at least the step's own wall time
        # Each step rewrites every kind of state (fp32 compute and master, AdamW mu and nu)
        # and reads the master and AdamW state for its update.
        assert r["disk_write_gbps"] * 1e9 * wall >= 16 * n
        assert r["disk_read_gbps"] * 1e9 * wall >= 12 * n
    assert all("disk r " in line and " GB/s" in line for line in log.getvalue().splitlines()
               if line.startswith("step ") and "loss" in line)


def test_flops_per_token_is_six_per_param_plus_attention():
    assert model_flops_per_token(1000, 2, 16, 8) == 6 * 1000 + 12 * 2 * 16 * 8


def test_peak_of_a_gpu_comes_from_its_builtin_profile():
    class H200:
        platform, device_kind = "gpu", "NVIDIA H200"

    peak, note = peak_flops(H200(), "bfloat16")
    assert peak == 989e12 and "(h200, vendor)" in note
    unknown = type("X", (), {"platform": "gpu", "device_kind": "Some GPU"})()
    assert peak_flops(unknown, "bfloat16")[0] is None


def test_plot_writes_a_valid_png_of_all_panels(streamed, tmp_path, capsys):
    run_dir, _, _ = streamed
    out = tmp_path / "charts.png"
    assert cli.main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 500 and image.shape[1] > 1000  # the 2 x 2 grid at 120 dpi
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny HF checkpoint and the layer store `mtjax import` makes of it (fp32 compute,
    so that both evaluate in the same dtype)."""
    import hf_models

    root = tmp_path_factory.mktemp("imp")
    ckpt, _ = hf_models.checkpoint(root, "qwen2", vocab_size=300)
    store = root / "store"
    assert cli.main(["import", str(ckpt), str(store), "--compute-dtype", "float32"]) == 0
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    return ckpt, store, text


def _output(capsys, args) -> str:
    capsys.readouterr()
    assert cli.main(args) == 0
    return capsys.readouterr().out


def test_eval_of_a_store_equals_eval_of_its_checkpoint(imported, capsys):
    ckpt, store, text = imported
    flags = [str(text), "--split", "train", "--tokenizer", "bytes", "--seq-len", "16", "--batch-size", "2", "--batches", "2"]
    from_ckpt = _output(capsys, ["eval", str(ckpt), *flags])
    from_store = _output(capsys, ["eval", str(store), *flags])
    assert from_ckpt.startswith("train loss ") and from_store == from_ckpt


def test_generate_from_a_store_equals_generate_from_its_checkpoint(imported, capsys):
    ckpt, store, _ = imported
    flags = ["--tokenizer", "bytes", "--prompt", "the ", "--tokens", "8", "--temperature", "0"]
    from_ckpt = _output(capsys, ["generate", str(ckpt), *flags])
    assert _output(capsys, ["generate", str(store), *flags]) == from_ckpt


def test_store_weights_are_the_checkpoint_weights(imported):
    import jax
    import numpy as np

    from mtjax import hf

    ckpt, store, _ = imported
    cfg, want = hf.load_params(ckpt)
    store_cfg, got = run_lib.load_weights(store)
    assert store_cfg.num_hidden_layers == cfg.num_hidden_layers
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
