"""One-copy stores (store.copies=1): half the disk of A/B slots, the same guarantees.

A one-copy store commits each step as the state before its update plus the gradients
still to apply; each part's update is committed on its own, after which its old slot and
its gradient go. These tests check that training equals a two-copy run bit for bit,
that the disk holds one copy, that kill -9 at random moments then rerun ends
bit-identical, and that nothing reads half-updated weights.
"""

from __future__ import annotations

import json
import os
import random
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
from mtjax import config, model
from mtjax.config import StoreConfig
from mtjax.errors import MtjaxError
from mtjax.model_config import ConfigError
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.store.hf_export import export_hf
from mtjax.stream import StreamEngine

import fault_trials
from conftest import ONE_KV_HEAD, tiny_config

CFG = tiny_config(num_hidden_layers=3, **ONE_KV_HEAD)
OPT = OptimConfig(lr=1e-2, clip_norm=0.5, warmup_steps=0)
DISK = StoreConfig(compute="disk", master="disk", opt="disk")
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 2, 16)).astype(np.int32)  # accum 2


def _train(path: Path, copies: int, steps: int, close: bool = True):
    """`steps` committed steps (a one-copy step commits itself; two copies are committed
    after each). The last step's update is left pending, as if the process died right
    after its commit (the engine would otherwise start it at once)."""
    store = mtjax.store.create(path, CFG, make_optimizer(OPT), copies=copies)
    engine = StreamEngine(CFG, model.init_params(CFG, 0), OPT, store_config=DISK, store=store)
    start = engine.updater.start
    engine.updater.start = lambda: None if engine.step_count == steps else start()
    engine.commit(0)
    for i in range(steps):
        engine.step(TOKENS)
        if copies == 2:
            engine.commit(i + 1)
    if close:
        engine.close()
        store.close()
    return engine, store


def _parts_bytes(path: Path) -> int:
    """Bytes of tensor data in the store's chunk files (each ends with a 4-byte crc32c)."""
    chunks = [f for f in (path / "parts").rglob("c*") if f.name == "c" or f.name.startswith("c.")]
    return sum(f.stat().st_size - 4 for f in chunks)


def _params(path: Path):
    with mtjax.store.open(path) as store:
        return {p: store.read(p, "master").result() for p in store.parts}


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[p][n], b[p][n]) for p in a for n in a[p])


@pytest.mark.slow  # two stores trained side by side
def test_one_copy_trains_like_two_copies_on_half_the_disk(tmp_path):
    one, s1 = _train(tmp_path / "one", 1, 3, close=False)
    two, s2 = _train(tmp_path / "two", 2, 3, close=False)
    assert s1.pending is not None and s2.pending is None  # one copy: the last update waits, committed
    one_bytes, two_bytes = _parts_bytes(tmp_path / "one"), _parts_bytes(tmp_path / "two")
    assert one_bytes == s1.nbytes() and two_bytes == 2 * s2.nbytes()  # exactly one copy vs two
    pending = list(s1.pending_dir.iterdir())  # one chunk file per leaf: its bytes + a 4-byte crc32c
    assert len(pending) == sum(len(s1.schema(p, "master")) for p in s1.parts)
    assert sum(f.stat().st_size - 4 for f in pending) == s1.nbytes("master")  # the fp32 gradient of every part
    p1, p2 = one.params(), two.params()  # applies the last update (and commits it, one copy)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), p1, p2))
    assert s1.pending is None and not list(s1.pending_dir.iterdir())
    for e, s in ((one, s1), (two, s2)):
        e.close()
        s.close()


def test_resume_applies_the_committed_update_exactly(tmp_path):
    """A process that dies after committing step 2 (its update not applied yet): a new
    engine on the store applies it and continues exactly as an unbroken run."""
    _train(tmp_path / "clean", 1, 3)
    _train(tmp_path / "broken", 1, 2)  # closed with step 2's update pending
    with mtjax.store.open(tmp_path / "broken", writable=True) as store:
        assert sorted(store.pending["parts"]) == sorted(store.parts)
        engine = StreamEngine(CFG, optim=OPT, store_config=DISK, store=store, step=2)
        engine.step(TOKENS)  # committed as step 3 by its own last operation
        engine.flush()
        engine.close()
    clean_engine, clean_store = _train(tmp_path / "clean2", 1, 3, close=False)
    clean_engine.flush()
    clean_engine.close()
    clean_store.close()
    assert _same(_params(tmp_path / "broken"), _params(tmp_path / "clean2"))


def test_a_step_must_be_committed_before_its_update(tmp_path):
    """A one-copy step's last operation is its commit, of the train state the step was
    given, and only that starts its updates; an update of a step not committed is refused."""
    engine, store = _train(tmp_path / "s", 1, 1, close=False)  # step 1's update left pending
    assert [str(op) for op in engine.schedule.operations[-2:]] == ["update (clip scale known)",
                                                                  "commit (state before the update + gradients)"]
    engine.updater.start = lambda: None  # step 2's update, too, waits (as if the process died after its commit)
    engine.step(TOKENS, {"step": 2, "note": "given to the step"})
    assert store.step == 2 and store.load_train_state() == {"step": 2, "note": "given to the step"}
    assert sorted(store.pending["parts"]) == sorted(store.parts)
    engine.one_copy.step_finished()  # as if a third step's gradients were final, its commit not yet run
    with pytest.raises(MtjaxError, match="must be committed"):
        engine.flush()
    engine.close()
    store.close()


def test_half_updated_store_is_not_read_as_weights(tmp_path):
    from mtjax import checkpoint
    from mtjax.stream.sample import StreamSampler

    _train(tmp_path / "s", 1, 2)
    with pytest.raises(mtjax.store.StoreError, match="resume the run"):
        export_hf(tmp_path / "s", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(mtjax.store.StoreError, match="resume the run"):
        checkpoint.load_weights(tmp_path / "s")  # eval
    with mtjax.store.open(tmp_path / "s") as store, pytest.raises(mtjax.store.StoreError, match="resume the run"):
        StreamSampler(store)  # generate


def test_leftovers_of_a_crash_are_freed_on_open(tmp_path):
    _, store = _train(tmp_path / "s", 1, 2, close=False)
    slot = store.slots.committed("block.0", "master")
    stale = mtjax.store.layout.slot_dir(store.root, "block.0", "master", mtjax.store.layout.other_slot(slot))
    store.close()
    # What a kill between writing a part and committing it leaves: a written spare slot
    # and the next step's partial gradient sums.
    shutil.copytree(stale.with_name(f"master.{slot}"), stale, dirs_exist_ok=True)
    (store.pending_dir / "block.1.sum--x.bin").write_bytes(b"0" * 100)
    assert _parts_bytes(tmp_path / "s") > store.nbytes()
    with mtjax.store.open(tmp_path / "s", writable=True) as again:
        assert _parts_bytes(tmp_path / "s") == again.nbytes()
        assert not (again.pending_dir / "block.1.sum--x.bin").exists()
        assert again.pending is not None  # the committed gradients stay


def test_config_needs_every_kind_on_disk():
    with pytest.raises(ConfigError, match="store.copies=1 keeps every kind"):
        config.load(None, ["--store.copies=1", "--store.master=disk"])
    with pytest.raises(ConfigError, match="store.copies must be 1 or 2"):
        config.load(None, ["--store.copies=3"])


ONE_COPY = ["--store.copies=1"]


@pytest.mark.slow  # mtjax processes killed and rerun
def test_kill_minus_9_then_rerun_ends_bit_identical(tmp_path):
    """`mtjax train` on a one-copy store killed at random moments, each kill followed by
    the same command; the finished run equals an uninterrupted two-copy run."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path  # a kill is not a power loss
    work = base / f"mtjax-test-one-copy-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        steps, rng = 5, random.Random(3)
        r = fault_trials.mtjax(fault_trials.train_args(work / "clean", steps))  # two copies
        assert r.returncode == 0, r.stderr
        args = fault_trials.train_args(work / "killed", steps) + ONE_COPY
        kills = 0
        for i in range(6):
            if i % 2:
                killed = fault_trials.run_killed_after_commit(args, work / "killed", rng.randrange(steps),
                                                             rng.uniform(0.0, 0.4))
            else:
                killed = fault_trials.run_killed(args, rng.uniform(3.0, 12.0))
            kills += killed
            if not killed:
                shutil.rmtree(work / "killed")
        assert kills >= 3
        r = fault_trials.mtjax(args)
        assert r.returncode == 0, r.stderr
        assert fault_trials.same_files(work / "clean" / "final", work / "killed" / "final", ["model.safetensors"])
        with mtjax.store.open(work / "killed" / "store") as store:
            assert store.copies == 1 and store.pending is None
            assert _parts_bytes(work / "killed" / "store") == store.nbytes()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.slow  # three mtjax processes
def test_a_run_killed_right_after_committing_its_last_step_applies_its_update_on_rerun(tmp_path):
    """A one-copy run killed just after committing its last step leaves that step's update
    to apply; its rerun has no step left to train, and still applies it, commits and
    exports the same weights as an uninterrupted two-copy run."""
    steps = 2
    r = fault_trials.mtjax(fault_trials.train_args(tmp_path / "clean", steps))
    assert r.returncode == 0, r.stderr
    args = fault_trials.train_args(tmp_path / "killed", steps) + ONE_COPY
    # Commits (generations): step 0 is 1, step 1 is 2, its 4 parts' updates 3-6, step 2 is 7.
    killed = subprocess.run([sys.executable, str(Path(__file__).parent / "hosts_train.py"), *args[1:]],
                            env={**fault_trials.env(), "MTJAX_TEST_KILL": "committed:7"}, cwd=fault_trials.ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with mtjax.store.open(tmp_path / "killed" / "store") as store:
        assert store.step == steps and store.pending is not None
    r = fault_trials.mtjax(args)
    assert r.returncode == 0, r.stderr
    assert fault_trials.same_files(tmp_path / "clean" / "final", tmp_path / "killed" / "final", ["model.safetensors"])
    with mtjax.store.open(tmp_path / "killed" / "store") as store:
        assert store.step == steps and store.pending is None


def test_final_commit_right_after_a_step_commit(tmp_path):
    """A run's last step is committed (its update starts on the update threads at once),
    then committed again with `flush`: the second commit waits for those updates rather
    than racing their writes, and the store ends complete and equal to a two-copy run."""
    for copies in (1, 2):
        store = mtjax.store.create(tmp_path / f"s{copies}", CFG, make_optimizer(OPT), copies=copies)
        engine = StreamEngine(CFG, model.init_params(CFG, 0), OPT, store_config=DISK, store=store)
        engine.commit(0)
        for i in range(3):
            engine.step(TOKENS)  # one copy: committed by the step itself
            if copies == 2:
                engine.commit(i + 1)
        engine.commit(3, flush=True)
        assert store.pending is None
        engine.close()
        store.close()
    assert _same(_params(tmp_path / "s1"), _params(tmp_path / "s2"))


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a store and its bytes (LOCK holds the pid of its last writer)."""
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file() and f.name != "LOCK"}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip, lambda f: f.write_bytes(f.read_bytes()[:-9]), Path.unlink],
                         ids=["flipped", "truncated", "missing"])
@pytest.mark.parametrize("part", ["embed", "head"])
def test_a_damaged_pending_file_is_refused_on_resume(tmp_path, damage, part):
    """A store killed mid-update whose pending gradient file was damaged: the resume
    refuses it with one line naming the file before any update runs (the head's update
    would run last), and the store keeps every byte it had."""
    _train(tmp_path / "s", 1, 2)  # closed with step 2's update pending for every part
    with mtjax.store.open(tmp_path / "s") as store:
        tag = store.pending["tag"]
        leaf = sorted(store.schema(part, "master"))[0]
        path = store.pending_dir / mtjax.store.layout.pending_file(mtjax.store.layout.pending_key(part, tag), leaf)
    damage(path)
    before = _files(tmp_path / "s")
    with mtjax.store.open(tmp_path / "s", writable=True) as store:
        with pytest.raises(mtjax.store.StoreError) as err:
            StreamEngine(CFG, None, OPT, store_config=DISK, store=store)
        assert sorted(store.pending["parts"]) == sorted(store.parts)  # nothing applied
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "pending gradient file" in message
    assert _files(tmp_path / "s") == before


def _killed_mid_update(args: list[str], run_dir: Path) -> bool:
    """Start `mtjax args`, SIGKILL it as soon as its store's manifest names a pending
    update; True if the killed store still has one."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(fault_trials.ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "mtjax", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env, cwd=fault_trials.ROOT)
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline:
        try:
            if (json.loads((run_dir / "store" / "manifest.json").read_text()).get("pending") or {}).get("parts"):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    with mtjax.store.open(run_dir / "store") as store:
        return store.pending is not None


def test_cli_refuses_a_damaged_pending_file_in_one_line(tmp_path):
    """`mtjax train --run.resume=true` on a one-copy store killed mid-update with a flipped
    byte in a pending gradient file: exit 2, one line naming the file, no traceback, and
    the store's committed state left byte for byte as it was."""
    run_dir = tmp_path / "run"
    args = fault_trials.train_args(run_dir, 4) + ONE_COPY
    for _ in range(3):
        if _killed_mid_update(args, run_dir):
            break
        shutil.rmtree(run_dir)
    else:
        pytest.fail("three runs finished their pending updates before the kill")
    with mtjax.store.open(run_dir / "store") as store:
        part, tag = store.pending["parts"][-1], store.pending["tag"]
        leaf = sorted(store.schema(part, "master"))[-1]
        path = store.pending_dir / mtjax.store.layout.pending_file(mtjax.store.layout.pending_key(part, tag), leaf)
    _flip(path)
    mtjax.store.open(run_dir / "store", writable=True).close()  # frees what the kill left uncommitted
    before = _files(run_dir / "store")
    r = fault_trials.mtjax(args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and str(path) in lines[0] and "checksum" in lines[0], r.stderr
    assert _files(run_dir / "store") == before


def test_pending_files_of_an_older_layout_are_refused(tmp_path):
    """Pending files of layout 2 were raw bytes: a store stopped mid-update by that
    version is refused (and left as it was), not read as damaged or applied unchecked."""
    _train(tmp_path / "s", 1, 2)
    manifest = tmp_path / "s" / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), layout_version=2)))
    before = _files(tmp_path / "s")
    with pytest.raises(mtjax.store.StoreError, match=r"\(layout 2\) stopped mid-update"):
        mtjax.store.open(tmp_path / "s", writable=True)
    assert _files(tmp_path / "s") == before
