"""The researcher's workflow around a run: what it records per step and shows on its
progress line, its charts, its TensorBoard events and Weights & Biases history, and
eval/generate of a layer store as of an HF checkpoint."""

from __future__ import annotations

import fcntl
import io
import json
import os
import struct
import subprocess
import sys
import termios
import tty

import matplotlib.image
import pytest

import small_disk
from mtjax import checkpoint, cli, config, evaluate, model, wandb_log
from mtjax import run as run_lib
from mtjax.commands import plot
from mtjax.errors import MissingPackage
from mtjax.plan.cost import mfu_flops_per_token
from mtjax.progress import Progress, peak_flops

from conftest import TINY_MODEL_ARGS

TINY = [*TINY_MODEL_ARGS,
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


@pytest.mark.slow  # a streamed training run
def test_each_step_records_rss_mfu_and_stage_times(streamed):
    _, log, records = streamed
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0.01 < r["rss_gib"] < 64  # this process's resident memory, in GiB
        assert {"stage_read_s", "stage_compute_s", "stage_optimizer_s"} <= set(r)
        assert r["stage_compute_s"] > 0
    cfg = config.model_config(config.load(None, TINY))
    flops = mfu_flops_per_token(cfg, 32)
    peak, _ = peak_flops(__import__("jax").devices()[0], "float32")
    for r in steps[1:]:  # the first step pays compilation: no rate yet
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / peak, rel=1e-2, abs=1e-4)
    assert "MFU against 0.19 TFLOP/s float32 (cpu-2core, dev-machine)" in log
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
    n = model.num_params(config.model_config(config.load(None, TINY)))
    for prev, r in zip(steps, steps[1:]):
        wall = r["time_s"] - prev["time_s"]  # at least the step's own wall time
        # Each step rewrites every kind of state (fp32 compute and master, AdamW mu and nu)
        # and reads the master and AdamW state for its update.
        assert r["disk_write_gbps"] * 1e9 * wall >= 16 * n
        assert r["disk_read_gbps"] * 1e9 * wall >= 12 * n
    assert all("disk r " in line and " GB/s" in line for line in log.getvalue().splitlines()
               if line.startswith("step ") and "loss" in line)


def test_flops_per_token_is_six_per_param_plus_attention():
    cfg = config.model_config(config.load(None, TINY))
    width = cfg.num_attention_heads * cfg.head_dim
    assert mfu_flops_per_token(cfg, 16) == 6 * model.num_params(cfg) + 12 * cfg.num_hidden_layers * 16 * width


def test_peak_of_a_gpu_comes_from_its_builtin_profile():
    class H200:
        platform, device_kind = "gpu", "NVIDIA H200"

    peak, note = peak_flops(H200(), "bfloat16")
    assert peak == 989e12 and "(h200, vendor)" in note
    unknown = type("X", (), {"platform": "gpu", "device_kind": "Some GPU"})()
    assert peak_flops(unknown, "bfloat16")[0] is None


@pytest.mark.slow  # a streamed training run
def test_plot_writes_a_valid_png_of_all_panels(streamed, tmp_path, capsys):
    run_dir, _, _ = streamed
    out = tmp_path / "charts.png"
    assert cli.main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 500 and image.shape[1] > 1000  # the 3 x 2 grid at 120 dpi
    assert f"wrote {out}" in capsys.readouterr().out


def test_metrics_and_log_lines_carry_the_learning_rate_and_gradient_norm(streamed):
    _, log, records = streamed
    steps = [r for r in records if "loss" in r]
    warmup = config.load(None, TINY).optim  # 20 warmup steps to 4e-3: step s trains at 4e-3 * (s - 1) / 20
    assert [r["lr"] for r in steps] == pytest.approx([warmup.lr * (s - 1) / warmup.warmup_steps for s in (1, 2, 3, 4)])
    assert all(r["grad_norm"] > 0 for r in steps)
    lines = [line for line in log.splitlines()
             if line.startswith("step ") and "loss" in line and "val_loss" not in line]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]  # one plain line per logged step
    for line, r in zip(lines, steps[1::2]):
        assert f"  lr {r['lr']:.3g}  gnorm {r['grad_norm']:.3f}  " in line
    assert "\r" not in log
    assert "mtjax: weights: a fresh random initialisation (run.seed 0)" in log
    assert "warning: optim.warmup_steps (20) is not shorter than run.steps (4)" in log


def _clocked(times):
    """A clock for Progress that reads `times` in turn (construction first, then one per update)."""
    it = iter(times)
    return lambda: next(it)


def test_tokens_per_s_is_the_rate_over_the_last_steps(tmp_path):
    """Steps 2-5 take 1 s, steps 6-15 take 0.5 s: at step 15 the rate over the last 10
    steps is 2 steps/s (the mean since step 1 would be 14 steps in 9 s)."""
    ends = [10.0, 11, 12, 13, 14] + [14 + 0.5 * i for i in range(1, 11)]
    clock = _clocked([0.0, *ends])
    out = io.StringIO()
    with Progress(tmp_path, 15, tokens_per_step=100, log_every=5, stream=out, clock=clock) as p:
        for step in range(1, 16):
            p.update(step, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[-1].startswith("step     15/15  loss 2.0000  lr 0.001  gnorm 0.500  200 tok/s over 10 steps  ")
    assert "100 tok/s over 4 steps" in lines[0]  # step 5: steps 2-5 at 1 step/s, the compiling step 1 left out
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tokens_per_s"] == 200.0 and last["rate_steps"] == 10


def test_tokens_per_s_counts_only_the_tokens_trained_on(tmp_path):
    """Chat steps train on their counted targets only: the rate is of those, not of
    tokens_per_step (which would give 100 tok/s here)."""
    clock = _clocked([0.0, 1, 2, 3, 4, 5])
    with Progress(tmp_path, 5, tokens_per_step=100, stream=io.StringIO(), flops_per_token=10.0,
                  peak_flops=1e3, clock=clock) as p:
        for step, trained in enumerate([999, 10, 20, 30, 40], start=1):
            p.update(step, {"loss": 2.0}, trained)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tokens_per_s"] == 25.0 and last["mfu"] == 0.25  # steps 2-5: 100 tokens in 4 s


def _on_pty(tmp_path, columns: int) -> bytes:
    """What Progress writes for 4 steps to a raw pseudo-terminal `columns` wide."""
    master, slave = os.openpty()
    tty.setraw(slave)  # no newline translation: the bytes as written
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    with os.fdopen(slave, "w") as stream, Progress(tmp_path, 4, 10, log_every=2, stream=stream) as p:
        for step in range(1, 5):
            p.update(step, {"loss": 1.0, "lr": 1e-3, "grad_norm": 0.5})
    written = os.read(master, 1 << 16)
    os.close(master)
    return written


def test_a_terminal_of_zero_columns_gets_plain_lines(tmp_path):
    zero = _on_pty(tmp_path / "a", 0)
    assert b"\r" not in zero and [line[:11] for line in zero.splitlines()] == [b"step      2", b"step      4"]
    assert b"gnorm 0.500" in zero
    assert b"\r" in _on_pty(tmp_path / "b", 80)  # a real width gets the live bar


def wandb_history(path) -> list[dict]:
    """The rows an offline W&B run logged, read from its run-ID.wandb file: a LevelDB-style
    log (a 7-byte header, 32 KiB blocks of records with a 7-byte header each: crc, length,
    kind 1 whole / 2 first / 3 middle / 4 last) of wandb's Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    raw, block = path.read_bytes(), 32768
    assert raw[:4] == b":W&B"
    pos, pending, rows = 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record, pending = wandb_internal_pb2.Record.FromString(pending), b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.slow  # two training runs and wandb's service process
def test_wandb_logs_the_records_of_metrics_jsonl_and_a_resumed_run_continues_its_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path / "wandb-files")),
                        ("WANDB_CONSOLE", "off"), ("WANDB_SILENT", "true")):
        monkeypatch.setenv(name, value)
    (tmp_path / "wandb-files").mkdir()
    run_dir = tmp_path / "run"
    args = [*TINY, "--stream.engine=reference", "--run.wandb=mtjax-test", f"--run.dir={run_dir}"]
    run_lib.train(config.load(None, [*args, "--run.steps=2"]), io.StringIO())
    first = json.loads((run_dir / wandb_log.ID_FILE).read_text())
    run_lib.train(config.load(None, [*args, "--run.steps=4", "--run.resume=true"]), io.StringIO())
    # run.finish() returns before W&B's service has closed the run and written its .wandb file
    # (a loaded machine once read the second one before it had); teardown waits for the service.
    wandb.teardown()
    assert json.loads((run_dir / wandb_log.ID_FILE).read_text()) == first == {"id": first["id"],
                                                                               "project": "mtjax-test"}
    # W&B names a run's directory offline-run-<second it started>-<id>, adding -1 if that one exists
    runs = sorted((tmp_path / "wandb-files" / "wandb").glob(f"offline-run-*-{first['id']}*/run-{first['id']}.wandb"))
    assert len(runs) == 2  # the resumed run logged into a W&B run of the same id
    logged = [{k: v for k, v in row.items() if not k.startswith("_")} for file in runs for row in wandb_history(file)]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 2, 3, 4, 4]  # steps, and the validation losses at 2 and 4
    assert logged == records


def test_a_run_without_the_wandb_package_stops_in_one_line_before_anything_is_made(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    exp = config.load(None, ["--run.wandb=mtjax-test", f"--run.dir={tmp_path}"])
    with pytest.raises(MissingPackage, match=r"run.wandb needs the wandb package, which is not installed: pip install wandb \(or install mtjax with the \[wandb\] extra\)"):
        run_lib.train(exp, io.StringIO())
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


def test_import_progress_is_plain_lines_off_a_terminal(tmp_path, capsys):
    import hf_models

    ckpt, _ = hf_models.checkpoint(tmp_path, "llama", vocab_size=64)
    assert cli.main(["import", str(ckpt), str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert "\r" not in out
    assert [line.split()[0] for line in out.splitlines()[:-1]] == ["1/4", "2/4", "3/4", "4/4"]  # 2 blocks + embed, head


def test_plot_goes_into_the_run_directory_with_memory_from_zero(streamed, capsys):
    run_dir, _, records = streamed
    capsys.readouterr()
    assert cli.main(["plot", str(run_dir)]) == 0
    assert capsys.readouterr().out == f"wrote {run_dir / plot.DEFAULT_NAME}\n"
    assert (run_dir / plot.DEFAULT_NAME).read_bytes()[:4] == b"\x89PNG"
    fig = plot.figure({run_dir: records})
    fig.draw_without_rendering()  # lays out the legends
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert axes["memory"].get_ylim()[0] == 0 and axes["throughput"].get_ylim()[0] == 0
    for title, key in (("learning rate", "lr"), ("gradient norm", "grad_norm")):
        (line,) = axes[title].lines
        assert list(line.get_ydata()) == [r[key] for r in records if key in r]
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:  # beside the data, never over it
            assert not legend.get_window_extent().overlaps(ax.get_window_extent()), ax.get_title()


@pytest.mark.slow  # a training run, ~6 s
def test_plot_to_an_unwritable_place_is_one_line_and_leaves_nothing(streamed, tmp_path, capsys):
    run_dir, _, _ = streamed
    a_file = tmp_path / "file"
    a_file.write_text("kept")
    cases = [(a_file / "x.png", "is a file, not a directory"), (a_file / "deeper" / "x.png", "Not a directory"),
             (tmp_path / "x.bmp", "matplotlib writes no .bmp images"), (tmp_path / "x", "no extension")]
    for out, message in cases:
        capsys.readouterr()
        assert cli.main(["plot", str(run_dir), "--out", str(out)]) == 2, out
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "--out" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and a_file.read_text() == "kept"
    with small_disk.mounted(tmp_path / "ro", "1M") as mnt:
        (mnt / "charts.png").write_bytes(b"an older chart")
        small_disk.make_readonly(mnt)
        result = subprocess.run([sys.executable, "-m", "mtjax", "plot", str(run_dir), "--out", str(mnt / "charts.png")],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [
            f"mtjax plot: error: cannot write {mnt / 'charts.png'} (Read-only file system); choose another --out"]
        assert os.listdir(mnt) == ["charts.png"] and (mnt / "charts.png").read_bytes() == b"an older chart"
    with small_disk.mounted(tmp_path / "full", "1M") as mnt:
        (mnt / "charts.png").write_bytes(b"an older chart")
        small_disk.fill(mnt)
        capsys.readouterr()
        assert cli.main(["plot", str(run_dir), "--out", str(mnt / "charts.png")]) == 2
        assert "(No space left on device); choose another --out" in capsys.readouterr().err
        assert sorted(os.listdir(mnt)) == ["ballast", "charts.png"]  # no partial image left
        assert (mnt / "charts.png").read_bytes() == b"an older chart"


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


@pytest.mark.slow  # compiles the streamed and the whole-model eval of two models
def test_streamed_eval_equals_the_in_memory_eval(imported):
    """`mtjax eval` streams the model part by part (evaluate.eval_engine): its loss over a batch
    of micro-batches is the whole-model reference's, for a store and for a checkpoint."""
    import numpy as np

    from mtjax import reference

    ckpt, store, _ = imported
    tokens = np.random.default_rng(0).integers(0, 300, (3, 2, 16), dtype=np.int32)
    for path in (ckpt, store):
        cfg, params = checkpoint.load_weights(path)
        want = reference.eval_loss(cfg, params, tokens)["loss"]
        engine = evaluate.eval_engine(path)
        try:
            got = engine.eval_loss(tokens)["loss"]
        finally:
            engine.close()
        assert got == pytest.approx(want, rel=1e-6), path


def test_eval_of_a_store_on_a_read_only_disk(imported, tmp_path, capsys):
    """Streamed eval only reads the store: one on a read-only disk evaluates as before."""
    import shutil

    _, store, text = imported
    flags = [str(text), "--split", "train", "--tokenizer", "bytes", "--seq-len", "16", "--batch-size", "2", "--batches", "1"]
    want = _output(capsys, ["eval", str(store), *flags])
    with small_disk.mounted(tmp_path / "ro", "32m") as mnt:
        shutil.copytree(store, mnt / "store")
        small_disk.make_readonly(mnt)
        assert _output(capsys, ["eval", str(mnt / "store"), *flags]) == want


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
    store_cfg, got = checkpoint.load_weights(store)
    assert store_cfg.num_hidden_layers == cfg.num_hidden_layers
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
