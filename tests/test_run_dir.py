"""No lost runs: every run, RAM tier and reference engine included, checkpoints to the
store under its run directory, so the store's lock keeps a second trainer out, a rerun
without `--run.resume` is refused before it changes a byte, a resume with other fixed
settings is refused naming them, and a killed run resumes exactly. final/ is an export.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import mtjax.store
from mtjax import checkpoint, cli, hf
from mtjax import run as run_lib
from mtjax.errors import MtjaxError
from mtjax.store import hf_export

import fault_trials  # noqa: E402  (tests/ is on sys.path: tests/conftest.py)
import small_disk  # noqa: E402

STATE = {"ram": fault_trials.STATE["ram"], "reference": fault_trials.STATE["reference"]}


def args(run_dir: Path, steps: int, state: str = "ram", *extra: str) -> list[str]:
    return ["train", *fault_trials.TINY, *STATE[state], "--run.checkpoint_every=2", f"--run.steps={steps}",
            f"--run.dir={run_dir}", *extra]


def launch(argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mtjax", *argv], text=True, cwd=fault_trials.ROOT,
                            env=fault_trials.env(), **kwargs)


def refused(argv: list[str]) -> str:
    """Run `mtjax argv` as a user would; it must exit 2 with one error line; that line."""
    p = launch(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtjax train: error: "), err
    return lines[0]


def files(run_dir: Path) -> dict[Path, bytes]:
    return {f: f.read_bytes() for f in sorted(run_dir.rglob("*")) if f.is_file()}


def per_step_loss(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line the kill cut short
        if "loss" in r:
            out[r["step"]] = r["loss"]  # a step run again after the resume replaces the killed run's
    return out


@pytest.mark.parametrize("state", ["ram", "reference"])
def test_rerun_without_resume_on_a_finished_run_is_refused_and_changes_nothing(tmp_path, state):
    run = tmp_path / "run"
    assert cli.main(args(run, 4, state)) == 0
    assert (run / "final" / "model.safetensors").exists() and (run / "store" / "manifest.json").exists()
    before = files(run)
    line = refused(args(run, 4, state))
    assert "holds a run trained to step 4" in line and "--run.resume=true" in line
    assert files(run) == before  # final/, the store and metrics.jsonl byte-identical


def test_a_second_trainer_on_a_ram_tier_run_dir_is_refused(tmp_path):
    run = tmp_path / "run"
    first = launch(args(run, 100_000, "ram", "--run.checkpoint_every=0"), stdout=subprocess.DEVNULL,
                  stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() or not per_step_loss(run):
            assert first.poll() is None and time.monotonic() < deadline, "the first trainer did not start"
            time.sleep(0.1)
        for extra in ([], ["--run.resume=true"]):
            line = refused(args(run, 100_000, "ram", "--run.checkpoint_every=0", *extra))
            assert "is already open for writing (by process" in line and str(first.pid) in line
        assert first.poll() is None  # the first trains on
    finally:
        first.kill()
        first.wait()
    with mtjax.store.open(run / "store") as store:
        assert store.step == 0 and store.load_train_state()["step"] == 0  # its commit of step 0 is intact


def test_a_resume_with_other_settings_is_refused_naming_them(tmp_path):
    run = tmp_path / "run"
    assert cli.main(args(run, 2)) == 0
    (tmp_path / "other.txt").write_text("other text " * 400)
    before = files(run / "store")
    for flag, named in [("--optim.lr=0.02", "optim.lr 0.01 (now 0.02)"),
                        ("--data.seq_len=16", "data.seq_len 32 (now 16)"),
                        (f"--data.dataset={tmp_path / 'other.txt'}", "data.dataset 'builtin:shakespeare' (now '")]:
        line = refused(args(run, 4, "ram", "--run.resume=true", flag))
        assert named in line and "resume with the same ones" in line, (flag, line)
        assert files(run / "store") == before
    assert cli.main(args(run, 3, "ram", "--run.resume=true")) == 0  # the same settings resume


def test_a_killed_ram_tier_run_resumes_with_the_same_per_step_losses(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    clean = launch(args(straight, 6), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    p = launch(args(killed, 6), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while p.poll() is None and time.monotonic() < deadline:
            if (killed / "metrics.jsonl").exists() and max(per_step_loss(killed), default=0) >= 3:
                break  # step 3 ran, so the commit of step 2 is done
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait()
    assert p.returncode == -signal.SIGKILL and 3 <= max(per_step_loss(killed)) < 6
    resumed = launch(args(killed, 6, "ram", "--run.resume=true"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-3000:]
    assert clean.wait(timeout=300) == 0, clean.stderr.read()[-3000:]
    got, want = per_step_loss(killed), per_step_loss(straight)
    assert sorted(got) == list(range(1, 7)) and got == want  # bit-identical per-step losses
    weights = [(d / "final" / "model.safetensors").read_bytes() for d in (killed, straight)]
    assert weights[0] == weights[1]


def test_eval_and_generate_work_on_the_run_outputs(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(args(run, 2, "reference")) == 0
    capsys.readouterr()
    outs = []
    for where in (run / "final", run / "store"):
        assert cli.main(["generate", str(where), "--prompt", "To", "--tokens", "5", "--temperature", "0"]) == 0
        assert cli.main(["eval", str(where), str(run / "data"), "--seq-len", "32", "--batch-size", "2",
                         "--batches", "1"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]  # the export holds the store's weights
    _, exported = hf.load_params(run / "final")
    _, stored = run_lib.load_weights(run / "store")
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(stored)):
        np.testing.assert_array_equal(a, b)
    assert json.loads((run / "final" / checkpoint.EXPORT_NOTE).read_text())["tokenizer"] == "bytes"


def test_a_full_disk_while_writing_final_leaves_no_litter(tmp_path, monkeypatch, capsys):
    with small_disk.mounted(tmp_path / "disk", "8m") as disk:
        run = disk / "run"
        real = hf_export.export_hf
        ballast = []

        def export_on_a_full_disk(*a, **kw):
            ballast.append(small_disk.fill(disk))
            return real(*a, **kw)

        monkeypatch.setattr(hf_export, "export_hf", export_on_a_full_disk)
        assert cli.main(args(run, 2)) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # beside the progress lines
        assert len(err) == 1 and "No space left" in err[0] and "mtjax export" in err[0], err
        assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temporary litter
        assert not (run / "final").exists()
        with mtjax.store.open(run / "store") as store:
            assert store.step == 2  # the run's last commit is there to export
        ballast[0].unlink()
        monkeypatch.setattr(hf_export, "export_hf", real)
        assert cli.main(["export", str(run / "store"), str(disk / "out")]) == 0


def test_run_resume_is_true_false_or_auto():
    from mtjax import config

    assert [config.load(None, [f"run.resume={v}"]).run.resume for v in ("true", "no", "auto")] == [True, False, "auto"]
    with pytest.raises(MtjaxError, match="run.resume must be true, false or auto, got 'sometimes'"):
        config.load(None, ["run.resume=sometimes"])
