"""No lost runs: every run, RAM tier and reference engine included, checkpoints to the
store under its run directory, so the store's lock keeps a second trainer out, a rerun
without `--run.resume` is refused before it changes a byte, a resume with other fixed
settings is refused naming them, and a killed run resumes exactly. final/ is an export.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import mtjax.store
from mtjax import checkpoint, cli, config, hf, rundir
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
        (tmp_path / "other.txt").write_text("other text " * 400)
        cache = tree(run / "data")
        other = f"--data.dataset={tmp_path / 'other.txt'}"  # would prepare the live run's cache again
        for extra in ([], ["--run.resume=true"], ["--run.resume=true", other]):
            line = refused(args(run, 100_000, "ram", "--run.checkpoint_every=0", *extra))
            assert "is already open for writing (by process" in line and str(first.pid) in line
        assert first.poll() is None  # the first trains on
        assert tree(run / "data") == cache
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
    _, stored = checkpoint.load_weights(run / "store")
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

    assert [config.load(None, [f"run.resume={v}"]).run.resume for v in ("true", "no", "auto")] == [True, False, "auto"]
    with pytest.raises(MtjaxError, match="run.resume must be true, false or auto, got 'sometimes'"):
        config.load(None, ["run.resume=sometimes"])


# --- A run owns only what it made (docs/reliability.md): nothing of the user's, nothing of
# another run, is replaced; a refused trainer writes nothing, not even its data cache. ----


def refused_here(argv: list[str], capsys) -> str:
    """`mtjax argv` in this process: exit 2 and one error line; that line."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtjax train: error: "), err
    return err[0]


def tree(where: Path) -> dict[Path, bytes | None]:
    """Every file's bytes and every directory under `where` (None), but a store's LOCK file."""
    return {p: None if p.is_dir() else p.read_bytes() for p in sorted(where.rglob("*")) if p.name != "LOCK"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run (reference engine: the quickest); tests work on copies."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(args(run, 2, "reference", "--run.resume=auto")) == 0
    return run


def copy_of(run: Path, where: Path) -> Path:
    shutil.copytree(run, where)
    (where / "store" / "LOCK").unlink(missing_ok=True)
    return where


def test_run_dir_dot_leaves_the_users_data_dir_alone(tmp_path, monkeypatch, capsys):
    """`--run.dir=.` prepares raw text into ./data, where the README puts prepared datasets:
    a directory no run made is refused, byte for byte as it was; an empty run.dir too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "genesis.txt").write_text("In the beginning God created the heaven and the earth. " * 200)
    assert cli.main(["data", "prepare", "genesis.txt", "--out", "data/genesis", "--tokenizer", "bytes"]) == 0
    (tmp_path / "data" / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    line = refused_here(args(Path("."), 2, "reference"), capsys)
    assert "data is not a data cache a run made" in line and "choose another run.dir" in line, line
    assert tree(tmp_path) == before  # no store, no record, no temporary directory either
    # ./data itself a prepared dataset: the line says how to train on it.
    shutil.rmtree(tmp_path / "data")
    assert cli.main(["data", "prepare", "genesis.txt", "--out", "data", "--tokenizer", "bytes"]) == 0
    before = tree(tmp_path)
    line = refused_here(args(Path("."), 2, "reference"), capsys)
    assert "data is a prepared dataset" in line and "--data.dataset=data" in line, line
    assert tree(tmp_path) == before
    line = refused_here([*args(Path("."), 2, "reference"), "--run.dir="], capsys)
    assert "run.dir is empty" in line and tree(tmp_path) == before


@pytest.mark.slow  # a training run (the finished run, or one from an init store)
def test_a_finished_run_whose_store_was_deleted_is_not_overwritten(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path / "run")
    shutil.rmtree(run / "store")  # to free disk: final/ is the product
    before = tree(run)
    for resume in ("false", "auto", "true"):
        line = refused_here(args(run, 2, "reference", f"--run.resume={resume}"), capsys)
        assert "holds run.json, config.yaml, metrics.jsonl, summary.json, final/ of a run whose store" in line, line
        assert f"--model.checkpoint={run / 'final'}" in line and "choose another run.dir" in line, line
        assert tree(run) == before


@pytest.mark.slow  # a training run (the finished run, or one from an init store)
def test_a_resume_of_a_finished_run_writes_nothing_and_says_so(finished, tmp_path, capsys):
    """The README's command (it says --run.resume=true) again on a finished run: one line,
    exit 0, the run's own closing lines, and not a byte written (no new commit)."""
    run = copy_of(finished, tmp_path / "run")
    before = tree(run)
    capsys.readouterr()
    assert cli.main(args(run, 2, "reference", "--run.resume=true")) == 0
    out, err = capsys.readouterr()
    assert f"mtjax: {run} is already trained to step 2 (run.steps=2); nothing written" in err
    summary = json.loads((run / "summary.json").read_text())
    assert out.strip() == run_lib.describe(summary) and summary["first_loss"] is not None
    assert tree(run) == before
    # Killed after its last commit, before final/ and summary.json: the resume makes them
    # from that commit, and commits nothing again.
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    store = tree(run / "store")
    assert cli.main(args(run, 2, "reference", "--run.resume=true")) == 0
    assert tree(run / "store") == store
    assert (run / "final" / "model.safetensors").read_bytes() == (finished / "final" / "model.safetensors").read_bytes()
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 2
    # A run.steps behind the last commit would commit a step its weights are past.
    line = refused_here(args(run, 1, "reference", "--run.resume=true"), capsys)
    assert "is trained to step 2, past run.steps=1" in line


@pytest.mark.slow  # a training run (the finished run, or one from an init store)
def test_a_refused_trainer_leaves_the_data_cache_as_it_was(finished, tmp_path, capsys):
    """Other inputs would prepare the cache again: a trainer refused for a finished run
    (no run.resume) or for another model prepares nothing first."""
    run = copy_of(finished, tmp_path / "run")
    (tmp_path / "other.txt").write_text("other text " * 400)
    before = tree(run)
    other = f"--data.dataset={tmp_path / 'other.txt'}"
    line = refused_here([*args(run, 4, "reference"), other], capsys)
    assert "holds a run trained to step 2" in line
    line = refused_here([*args(run, 4, "reference", "--run.resume=true"), other, "--model.num_hidden_layers=3"],
                        capsys)
    assert "num_hidden_layers 2 -> 3" in line, line
    assert tree(run) == before


@pytest.mark.parametrize("name", [*rundir.RECORDS, "process-1"])
def test_every_record_a_run_writes_is_its_own_or_refused(tmp_path, capsys, name):
    """A run dir holding one thing a run would write (a user's, or a run's whose store is
    gone) is refused before anything is made; nothing there changes."""
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    if name in ("final", "tensorboard") or name.startswith("process-"):
        (run / name).mkdir()
        (run / name / "keep.txt").write_text("mine")
    else:
        (run / name).write_text('{"run": "another"}\n' if name == rundir.RUN_FILE else "mine\n")
    before = tree(run)
    line = refused_here(args(run, 2, "reference"), capsys)
    assert f"{run} holds {name}" in line and "choose another run.dir" in line, line
    assert tree(run) == before


@pytest.mark.slow  # a training run (the finished run, or one from an init store)
def test_records_of_another_store_are_refused_and_the_run_keeps_its_own(tmp_path, capsys):
    """Beside a store `mtjax init` made, records naming another store (one deleted and made
    again) are refused; records naming this one (a run killed before its first commit)
    are the run's own, and the run starts over from the store's weights."""
    run = tmp_path / "run"
    config.dump(config.load(None, fault_trials.TINY), tmp_path / "tiny.yaml")
    assert cli.main(["init", str(tmp_path / "tiny.yaml"), str(run / "store")]) == 0
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / rundir.RUN_FILE).write_text('{"run": "0123"}\n')
    before = tree(run)
    line = refused_here(args(run, 2, "reference"), capsys)
    assert "metrics.jsonl of another run than the one in" in line, line
    assert tree(run) == before
    with mtjax.store.open(run / "store") as store:
        mine = store.run_id
    (run / rundir.RUN_FILE).write_text(json.dumps({"run": mine}) + "\n")
    assert cli.main(args(run, 2, "reference")) == 0
    assert sorted(per_step_loss(run)) == [1, 2]  # its fresh record
