"""`mtjax store reshard`: a run's store rewritten for another number of processes.

A one-process store after 2 steps, resharded to 3 processes (rows not divisible by 3)
and back to one, is the source bit for bit; each refusal is one line and writes nothing,
as does a reshard that fails midway; and (slow) a run resharded from one process to two
and back, resumed each time with its own run.dir, trains on as one process would have.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_MODEL_ARGS

import mtjax.store
from mtjax import cli
from mtjax.shard import Shard
from mtjax.store import layout, lock
from mtjax.store import store as store_mod

# Widths 32 and 64 and a vocabulary of 256: none divides by 3, so the shards' rows differ.
# data.batch_size 6: 1, 2, 3 and 6 processes can share it.
TRAIN = ["train", *TINY_MODEL_ARGS, "--data.seq_len=16", "--data.batch_size=6", "--run.steps=2",
         "--run.checkpoint_every=1", "--run.eval_every=0", "--run.sample_tokens=0", "--run.log_every=1"]


def reshard(src, dst, processes) -> int:
    """`mtjax store reshard`'s exit status (an argument refused: argparse's exit)."""
    try:
        return cli.main(["store", "reshard", str(src), str(dst), "--processes", str(processes)])
    except SystemExit as e:
        return e.code


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(a one-process run's store after 2 steps, that store resharded for 3 processes)."""
    root = tmp_path_factory.mktemp("reshard")
    assert cli.main([*TRAIN, f"--run.dir={root / 'run'}"]) == 0
    assert reshard(root / "run" / "store", root / "three", 3) == 0
    return root / "run" / "store", root / "three"


def _state(root: Path) -> dict:
    """Every leaf of every part and kind, the step and the train state of a store."""
    with mtjax.store.open(root) as store:
        out = {(p, kind, leaf): a for p in store.parts for kind in ("compute", "master", "opt")
               for leaf, a in store.read(p, kind).result().items()}
        out["step"], out["train_state"], out["run"] = store.step, store.load_train_state(), store.run_id
    return out


def test_three_processes_and_back_to_one_is_the_source_bit_for_bit(trained, tmp_path):
    src, three = trained
    source = _state(src)
    assert source["step"] == 2 and source["train_state"]["loader"]
    shard_dirs = sorted(d.name for d in three.iterdir())
    assert shard_dirs == [Shard(i, 3).name for i in range(3)]
    for i, name in enumerate(shard_dirs):
        shard = _state(three / name)
        assert shard["step"] == 2 and shard["train_state"] == source["train_state"]
        assert shard["run"] == source["run"]  # the run's id: its records stay its own
        uneven = 0
        for key, whole in source.items():
            if isinstance(key, tuple):
                want = whole if key[1] == "compute" else Shard(i, 3).take(whole)
                uneven += want.shape != whole.shape and whole.shape[0] % 3 != 0
                np.testing.assert_array_equal(shard[key], want, err_msg=f"{name} {key}")
        assert uneven  # some leaves' rows did not divide evenly
    assert reshard(three, tmp_path / "one", 1) == 0
    back = _state(tmp_path / "one")
    assert back.keys() == source.keys()
    for key, want in source.items():
        if isinstance(key, tuple):
            assert back[key].dtype == want.dtype, key
            np.testing.assert_array_equal(back[key], want, err_msg=str(key))
        else:
            assert back[key] == want, key
    assert (three / "shard-0-of-3").exists()  # the source was left as it was


def _listing(root: Path) -> list:
    return sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file())


def _shard_copy(three: Path, where: Path, change=None) -> Path:
    out = where / "copy"
    shutil.copytree(three, out)
    if change is not None:
        change(out)
    return out


def _other_run(root: Path) -> None:
    path = root / "shard-1-of-3" / layout.MANIFEST
    m = json.loads(path.read_text())
    m["hosts"]["run"] = "0123456789abcdef"
    path.write_text(json.dumps(m))


def _committed_again(root: Path) -> None:
    with mtjax.store.open(root / "shard-2-of-3", writable=True) as store:
        store.commit(store.step, store.load_train_state())


def _one_copy(root: Path) -> None:
    with mtjax.store.open(root / "shard-0-of-3") as store:
        cfg = store.config
    shutil.rmtree(root)
    mtjax.store.create(root, cfg, copies=1).close()


@pytest.mark.parametrize("case,message", [
    ("processes=0", "argument --processes: must be >= 1, got 0"),
    ("processes=3", "already holds a run of 3 processes; there is nothing to reshard"),
    ("processes=4", "trains data.batch_size=6 rows a step, which 4 processes cannot share equally"),
    ("not empty", "already exists and is not empty; choose a new store directory"),
    ("inside", "is inside the source store"),
    ("missing", "lacks shard-1-of-3 of its run of 3 processes; gather every process's shard"),
    ("prepared", "holds a commit prepared but not finished (its run stopped inside a commit); resume it with 3 "
                 "processes once to settle its last commit"),
    ("generation", "holds another commit (generation 2, step 2) than"),
    ("other run", "belongs to another run (run id 0123456789abcdef)"),
    ("one shard", "is one shard of a run of 3 processes; pass the store root that holds all of them"),
    ("one copy", "keeps one copy of the state (store.copies=1), which cannot be resharded yet"),
    ("trained now", "is already open for writing (by process "),
    ("no store", "holds neither a store (manifest.json) nor the shards of a multi-process run"),
])
def test_refusals_are_one_line_and_write_nothing(trained, tmp_path, capsys, case, message):
    _, three = trained
    changes = {"missing": lambda r: shutil.rmtree(r / "shard-1-of-3"),
               "prepared": lambda r: shutil.copy(r / "shard-1-of-3" / layout.MANIFEST,
                                                 r / "shard-1-of-3" / layout.PREPARED),
               "generation": _committed_again, "other run": _other_run, "one copy": _one_copy,
               "no store": lambda r: [shutil.rmtree(d) for d in list(r.iterdir())],
               "trained now": None}
    src = _shard_copy(three, tmp_path, changes.get(case)) if case in changes else three
    if case == "one shard":
        src = three / "shard-0-of-3"
    dst, processes = tmp_path / "out", 2
    if case.startswith("processes="):
        processes = int(case.split("=")[1])
    elif case == "not empty":
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
    elif case == "inside":
        dst = src / "new"
    held = lock.WriterLock(src / "shard-1-of-3") if case == "trained now" else None  # a trainer's
    before_src, before_dst = _listing(src), _listing(dst) if dst.exists() else None
    capsys.readouterr()
    try:
        assert reshard(src, dst, processes) == 2
    finally:
        if held is not None:
            held.release()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("mtjax store reshard: error:"), err
    assert message in err, err
    assert "Traceback" not in err
    assert _listing(src) == before_src
    assert (_listing(dst) if dst.exists() else None) == before_dst



def _losses(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_a_run_resharded_from_one_process_to_two_and_back_trains_on_as_one_process(tmp_path):
    """A run of one process to step 2, resharded for two and resumed by two processes with
    its own run.dir to step 4, then resharded for one and resumed to step 5, equals one
    process's 5 steps (within the tolerance of two processes == one, tests/test_hosts.py):
    its losses and final export."""
    from safetensors.numpy import load_file
    from test_hosts import TRAIN as ONE, _process, free_port, launch

    for rc, _, err in launch([[*ONE, "--run.dir=ref", "--run.steps=5"], [*ONE, "--run.dir=run", "--run.steps=2"]],
                             tmp_path, 300):
        assert rc == 0, err[-3000:]
    assert reshard(tmp_path / "run" / "store", tmp_path / "two", 2) == 0
    port = free_port()
    for rc, _, err in launch([_process(i, 2, port, "--run.dir=run", "--store.path=two", "--run.steps=4",
                                       "--run.resume=true") for i in range(2)], tmp_path, 300):
        assert rc == 0, err[-3000:]
    assert reshard(tmp_path / "two", tmp_path / "one", 1) == 0
    [(rc, _, err)] = launch([[*ONE, "--run.dir=run", "--store.path=one", "--run.steps=5", "--run.resume=true"]],
                            tmp_path, 300)
    assert rc == 0, err[-3000:]
    ref, got = _losses(tmp_path / "ref"), _losses(tmp_path / "run")
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([got[s] for s in (3, 4, 5)], [ref[s] for s in (3, 4, 5)], rtol=1e-5)
    want, have = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("ref", "run"))
    assert sorted(have) == sorted(want)
    for name, b in want.items():
        a, b = np.asarray(have[name], np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    with mtjax.store.open(tmp_path / "one") as store:
        assert store.step == 5

def test_a_reshard_that_fails_midway_leaves_nothing_at_the_destination(trained, tmp_path, monkeypatch, capsys):
    """A full disk at the second new shard's commit: one line, and neither the destination
    nor the hidden directory it was built in is left (mtjax.store.fill.staged_dir)."""
    _, three = trained
    commit = store_mod.Store.commit

    def full_at_shard_one(self, step, *args, **kwargs):
        if self.hosts and self.hosts["index"] == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root / layout.MANIFEST))
        return commit(self, step, *args, **kwargs)

    monkeypatch.setattr(store_mod.Store, "commit", full_at_shard_one)
    capsys.readouterr()
    assert reshard(three, tmp_path / "out", 2) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "No space left on device" in err, err
    assert f"cannot write the store at {tmp_path / 'out'}" in err and "nothing was created there" in err, err
    assert list(tmp_path.iterdir()) == []


def test_host_memory_holds_about_one_part(tmp_path):
    """Resharding 8 blocks holds one kind of one part at a time (twice while its rows are
    joined), not the whole state: numpy's allocations (tracemalloc) peak below three times
    the largest kind of a part, a ninth of the state here."""
    import tracemalloc

    from conftest import tiny_config

    from mtjax import parts
    from mtjax.store import fresh
    from mtjax.store import reshard as reshard_mod

    cfg = tiny_config(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, vocab_size=64)
    fresh.init_store(cfg, tmp_path / "src")
    with mtjax.store.open(tmp_path / "src") as store:
        largest = max(parts.nbytes(store.schema(p, k)) for p in store.parts for k in parts.KINDS)
        total = store.nbytes()
    assert total > 9 * largest
    for processes, src, dst in [(2, "src", "two"), (1, "two", "one")]:
        tracemalloc.start()
        try:
            reshard_mod.reshard(tmp_path / src, tmp_path / dst, processes)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 3 * largest, (processes, peak, largest, total)


@pytest.mark.parametrize("case", ["freeze-disk", "lora-ram"])
def test_frozen_leaves_and_lora_adapters_go_to_three_processes_and_back(tmp_path, case):
    """Parts whose master and optimizer state hold only some leaves (frozen ones have a
    compute copy only; LoRA adapters beside a frozen base, mtjax.roles) come back bit for bit."""
    from hosts_case import FROZEN

    from mtjax.store import fresh
    from mtjax.store import reshard as reshard_mod

    fresh.init_store(FROZEN[case][0], tmp_path / "src")
    reshard_mod.reshard(tmp_path / "src", tmp_path / "three", 3)
    reshard_mod.reshard(tmp_path / "three", tmp_path / "one", 1)
    source, back = _state(tmp_path / "src"), _state(tmp_path / "one")
    assert back.keys() == source.keys()
    for key, want in source.items():
        if isinstance(key, tuple):
            np.testing.assert_array_equal(back[key], want, err_msg=str(key))
