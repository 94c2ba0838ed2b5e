"""Several processes, one per host (here: two on 127.0.0.1, CPU collectives through gloo).

Each run of processes is bounded in time (a process still running at its deadline is
killed and the test fails), and each takes a free port. One spawned run of
tests/hosts_worker.py (two processes of two CPU devices each) trains every case (RAM and
disk tiers, accum 1 and 4), so the processes' start-up and compilation are paid once:
5 AdamW steps with clipping on two processes equal the in-memory reference on the same
global batches, tensor by tensor, and each process holds half of the master and
optimizer state, in its tier's bytes and in its resident memory. Bad start-ups, and
kill -9 of one process mid-step and mid-commit, run the real `mtjax train`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import multidevice
import numpy as np
import pytest
from hosts_case import BIG, CFG, FROZEN, FROZEN_ACCUM, OPT, batches

import mtjax.store
from mtjax import model, parts, treepath
from mtjax.optim import make_optimizer
from mtjax.plan.hosts import collective_bytes
from mtjax.reference import ReferenceTrainer
from mtjax.shard import Shard
from mtjax.store import shards
from mtjax.store.errors import StoreError

HERE = Path(__file__).parent
WORKER_CASES = [("ram", 1), ("ram", 4), ("disk", 1), ("disk", 4)]  # as tests/hosts_worker.py trains them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None, devices: int = 1) -> dict:
    return multidevice.env(devices, **(extra or {}))


def launch(commands: list[list[str]], cwd: Path, timeout: float, envs: list[dict] | None = None, meanwhile=None,
           devices: int = 1):
    """Run the processes together, each with `devices` CPU devices; [(returncode, stdout,
    stderr)] once all ended. A process still running after `timeout` seconds fails the
    test (all are killed first). `meanwhile()` runs here while they do."""
    procs = [subprocess.Popen(c, cwd=cwd, env=_env(e, devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for c, e in zip(commands, envs or [None] * len(commands))]
    deadline = time.monotonic() + timeout
    try:
        if meanwhile is not None:
            meanwhile()
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"processes still running after {timeout} s: {commands}")
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


# --- the engine: two processes equal one ---------------------------------------------------


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hosts")
    port = free_port()
    results = launch([[sys.executable, str(HERE / "hosts_worker.py"), str(port), "2", str(i), str(out)]
                      for i in range(2)], out, timeout=420, devices=2,
                     meanwhile=lambda: [_reference(accum) for accum in sorted({a for _, a in WORKER_CASES})])
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    return out


@functools.cache
def _reference(accum: int):
    trainer = ReferenceTrainer(CFG, model.init_params(CFG, seed=1), OPT)
    losses = [trainer.step(b)["loss"] for b in batches(accum)]
    flat = {f"params/{k}": np.asarray(v) for k, v in treepath.flatten(trainer.params).items()}
    flat.update({f"opt/{k}": np.asarray(v) for k, v in treepath.flatten(trainer.opt_state).items()})
    return flat, losses


@pytest.mark.parametrize("tier,accum", WORKER_CASES)
def test_two_processes_train_as_one(worker_run, tier, accum):
    ref, ref_losses = _reference(accum)
    got = np.load(worker_run / f"{tier}-{accum}.npz")
    assert sorted(got.files) == sorted(ref)
    for name, want in ref.items():
        a, b = np.asarray(got[name], np.float64), np.asarray(want, np.float64)
        assert a.shape == b.shape, name
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    for i in range(2):
        losses = json.loads((worker_run / f"{tier}-{accum}-{i}.json").read_text())["losses"]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.slow
def test_two_processes_train_frozen_leaves_and_lora_as_one(tmp_path):
    """Freeze patterns (every kind of state on disk) and LoRA adapters (RAM), 5 steps of
    2 micro-batches on two processes: the one-process reference's losses and weights,
    the frozen leaves bit for bit."""
    port = free_port()
    results = launch([[sys.executable, str(HERE / "hosts_worker.py"), str(port), "2", str(i), str(tmp_path), "frozen"]
                      for i in range(2)], tmp_path, timeout=420, devices=2)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    for name, (cfg, _) in FROZEN.items():
        start = model.init_params(cfg, seed=1)
        trainer = ReferenceTrainer(cfg, start, OPT)
        ref_losses = [trainer.step(b)["loss"] for b in batches(FROZEN_ACCUM)]
        got, want, first = np.load(tmp_path / f"{name}.npz"), treepath.flatten(trainer.params), treepath.flatten(start)
        frozen = {f"{'blocks.' + p.name[6:] if p.name.is_block else p.name}.{n}"
                  for p in parts.parts(cfg) for n, leaf in parts.leaves(cfg, p.name).items() if leaf.role == "frozen"}
        assert sorted(got.files) == sorted(want) and frozen
        for leaf, b in want.items():
            if leaf in frozen:
                np.testing.assert_array_equal(got[leaf], np.asarray(first[leaf]), err_msg=f"{name} {leaf}")
                continue
            a, b = np.asarray(got[leaf], np.float64), np.asarray(b, np.float64)
            assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-30), f"{name} {leaf}"
        for i in range(2):
            losses = json.loads((tmp_path / f"{name}-{i}.json").read_text())["losses"]
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)


def _whole_bytes(kind: str, cfg=CFG) -> int:
    return sum(parts.nbytes(parts.schema(cfg, p.name, kind, make_optimizer(OPT))) for p in parts.parts(cfg))


@pytest.mark.parametrize("where", ["ram", "stored"])
def test_each_process_holds_its_half_of_the_state(worker_run, where):
    name = "ram-4" if where == "ram" else "disk-4"
    held = [json.loads((worker_run / f"{name}-{i}.json").read_text())[where] for i in range(2)]
    for kind in ("master", "opt"):
        whole = _whole_bytes(kind)
        # Each process's rows: half of every leaf, within a row (odd row counts), and
        # the two halves are the whole (the scalar step counts are held by both).
        counts = 2 * 4 * len(parts.parts(CFG)) if kind == "opt" else 0
        assert held[0][kind] + held[1][kind] == whole + counts, kind
        for h in held:
            assert 0.45 * whole < h[kind] < 0.55 * whole, (kind, h[kind], whole)
    for h in held:  # the compute copy is whole on every process: each streams all of it
        assert h["compute"] == _whole_bytes("compute")


def test_each_process_schedule_keeps_the_compute_copy_its_engine_keeps(worker_run):
    """A process holds only its rows of master: its engine keeps a compute copy, and so does
    the schedule it runs (mtjax.stream.schedule.derives_compute), which stages nothing as master."""
    for tier, accum in WORKER_CASES:
        for i in range(2):
            kept = json.loads((worker_run / f"{tier}-{accum}-{i}.json").read_text())["compute_kept"]
            assert kept == {"engine": True, "schedule": True, "in_place": 0}, (tier, accum, i)


def test_each_process_resident_memory_holds_half_of_the_state(worker_run):
    """VmRSS each process keeps for an engine (tests/hosts_worker.py) of a model whose
    master and optimizer state (193 MiB whole: what one process holds) dominates its
    compute copy (bfloat16, 32 MiB, whole on every process by design: each streams all of
    it). Measured 133-136 MiB a process here, against 129 MiB of half the state and the
    compute copy; before its rows were copied out of the whole leaves, 165."""
    state, compute = _whole_bytes("master", BIG) + _whole_bytes("opt", BIG), _whole_bytes("compute", BIG)
    assert state > 150 * 2**20 and compute < state / 5  # the state is what the measurement sees
    for i in range(2):
        rss = json.loads((worker_run / f"rss-{i}.json").read_text())
        assert rss["held"]["compute"] == compute
        grown = rss["after"] - rss["before"]
        # Half the state and the whole compute copy, within a tenth of the state: a process
        # keeping all of it would be 0.4 x state above the bound; one keeping less than its
        # half (the pages of its state not really there), 0.1 x state below the floor.
        assert 0.4 * state + compute <= grown <= 0.6 * state + compute, \
            f"process {i}: {grown / 2**20:.1f} MiB resident for {state / 2**20:.1f} MiB of state, " \
            f"{compute / 2**20:.1f} MiB of compute copy"


def test_collective_bytes_per_step_are_the_described_ones(worker_run):
    for tier, accum in WORKER_CASES:
        sent = json.loads((worker_run / f"{tier}-{accum}-0.json").read_text())["sent"]
        want = collective_bytes(CFG, 2)
        assert sent["reduce_scatter"] == 5 * want.reduce_scatter, (tier, accum)
        assert sent["all_gather"] == 5 * want.all_gather, (tier, accum)


# --- mtjax train: bad start-ups ----------------------------------------------------------

TRAIN = [sys.executable, "-m", "mtjax", "train", "--model.preset=null", "--model.model_type=llama",
         "--model.vocab_size=257", "--model.hidden_size=32", "--model.intermediate_size=33",
         "--model.num_hidden_layers=2", "--model.num_attention_heads=4", "--model.num_key_value_heads=2",
         "--model.head_dim=8", "--data.seq_len=16", "--data.batch_size=2", "--run.log_every=1",
         "--run.eval_every=0", "--run.sample_tokens=0", "--run.checkpoint_every=1", "--run.resume=auto",
         "--optim.clip_norm=0.05", "--optim.warmup_steps=1", "--optim.decay_steps=4"]


def _process(i: int, count: int, port: int, *extra: str, timeout_s: float = 60) -> list[str]:
    return [*TRAIN, f"--distributed.coordinator=127.0.0.1:{port}", f"--distributed.num_processes={count}",
            f"--distributed.process_id={i}", f"--distributed.timeout_s={timeout_s}", *extra]


def _one_error_line(rc: int, err: str) -> str:
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err and "Check failure" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("mtjax train: error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def test_unreachable_coordinator_is_one_line_within_the_timeout(tmp_path):
    start = time.monotonic()
    [(rc, _, err)] = launch([_process(1, 2, free_port(), "--run.dir=run", timeout_s=2)], tmp_path, timeout=60)
    line = _one_error_line(rc, err)
    assert "could not join the run at the coordinator 127.0.0.1:" in line and "within 2 s" in line
    assert time.monotonic() - start < 45
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_processes_started_for_different_counts_each_say_so(tmp_path):
    port = free_port()
    results = launch([_process(0, 2, port, "--run.dir=run", timeout_s=20),
                      _process(1, 3, port, "--run.dir=run", timeout_s=20)], tmp_path, timeout=90)
    for rc, _, err in results:
        assert "another distributed.num_processes than process 0" in _one_error_line(rc, err)
    assert not (tmp_path / "run").exists()


def test_resident_parts_in_a_multi_process_run_are_refused_in_one_line(tmp_path):
    port = free_port()
    results = launch([_process(i, 2, port, "--run.dir=run", "--stream.resident=all", timeout_s=30) for i in range(2)],
                     tmp_path, timeout=120)
    for rc, _, err in results:
        assert "stream.resident='all' keeps whole parts on the device" in _one_error_line(rc, err)
    assert not (tmp_path / "run").exists()


def test_a_resume_with_another_process_count_is_refused_in_one_line(tmp_path):
    for store in _filled_shards(tmp_path / "store"):
        store.commit(0, prepare=True)
        store.finish_commit()
        store.close()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    [(rc, _, err)] = launch([[*TRAIN, "--run.dir=run", "--store.path=store", "--run.resume=true"]], tmp_path, 120)
    line = _one_error_line(rc, err)
    assert "holds the shards of a run of 2 processes; resume it with 2 processes (this run has one process)" in line
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


# --- mtjax train: global commits under kill -9 -------------------------------------------


def _train(tmp_path: Path, run: str, steps: int, kills=(None, None), extra=(), timeout: float = 240):
    """Both processes of a run of `steps` steps; kills[i]: MTJAX_TEST_KILL of process i
    (tests/hosts_train.py). A process killed makes the other stop too (it is killed once
    its peer is gone)."""
    port = free_port()
    cmds = []
    for i in range(2):
        cmd = _process(i, 2, port, f"--run.dir={run}", f"--run.steps={steps}", *extra)
        cmds.append([sys.executable, str(HERE / "hosts_train.py"), *cmd[4:]] if kills[i] else cmd)
    envs = [{"MTJAX_TEST_KILL": k} if k else None for k in kills]
    procs = [subprocess.Popen(c, cwd=tmp_path, env=_env(e), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c, e in zip(cmds, envs)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    if any(p.poll() is not None and p.returncode != 0 for p in procs):
        time.sleep(1.0)  # the survivor may be finishing its own rename; then it would wait forever
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{run}: processes still running after {timeout} s")
    return [(p.returncode, p.stdout.read(), p.stderr.read()) for p in procs]


def _shard_state(root: Path) -> dict:
    out = {}
    for shard in sorted(root.glob("shard-*")):
        with mtjax.store.open(shard) as store:
            for p in store.parts:
                for kind in ("compute", "master", "opt"):
                    for leaf, a in store.read(p, kind).result().items():
                        out[shard.name, p, kind, leaf] = a
            out[shard.name, "step"] = store.step
    return out


@pytest.mark.slow
def test_kill_of_one_process_mid_commit_and_mid_step_then_rerun_is_bit_identical(tmp_path):
    steps = 4
    for rc, _, err in _train(tmp_path, "clean", steps):
        assert rc == 0, err[-3000:]
    # Generation 1 is step 0's commit, g + 1 step g's. Process 1 dies after the barrier of
    # step 2's commit (process 0 has committed it: process 1 rolls forward on the rerun),
    # then before the barrier of step 3's (nobody committed it: dropped, redone).
    for kills in [(None, "finish:3"), ("prepared:4", None)]:
        results = _train(tmp_path, "killed", steps, kills)
        assert any(rc == -signal.SIGKILL for rc, _, _ in results), [r[2][-2000:] for r in results]
    # Mid-step: process 0 is killed from outside while the processes train step 4.
    assert _train_until(tmp_path, "killed", steps, "step      3/")
    for rc, _, err in _train(tmp_path, "killed", steps):
        assert rc == 0, err[-3000:]
    clean, killed = _shard_state(tmp_path / "clean" / "store"), _shard_state(tmp_path / "killed" / "store")
    assert clean.keys() == killed.keys()
    for key, a in clean.items():
        np.testing.assert_array_equal(np.asarray(killed[key]), np.asarray(a), err_msg=str(key))

    # The final exports (process 0's, of the gathered weights) are the same bytes too.
    assert (tmp_path / "clean" / "final" / "model.safetensors").read_bytes() == \
        (tmp_path / "killed" / "final" / "model.safetensors").read_bytes()

    # A shard from another run (at the same step) in its place: every process stops, one line each.
    mine = tmp_path / "killed" / "store" / "shard-1-of-2"
    shutil.rmtree(mine)
    shutil.copytree(tmp_path / "clean" / "store" / "shard-1-of-2", mine)
    (mine / "LOCK").unlink(missing_ok=True)
    first, second = _train(tmp_path, "killed", steps + 1)
    assert "process 1 of 2 refused to start" in _one_error_line(first[0], first[2])
    assert "belongs to another run" in _one_error_line(second[0], second[2])


def _train_until(tmp_path: Path, run: str, steps: int, marker: str, timeout: float = 240) -> bool:
    """Run both processes and SIGKILL process 0 as soon as process 1 has logged `marker`
    (the step after it is then under way); then the other. True if the kill happened."""
    port = free_port()
    procs = [subprocess.Popen(_process(i, 2, port, f"--run.dir={run}", f"--run.steps={steps}"), cwd=tmp_path,
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i in range(2)]
    fd = procs[1].stderr.fileno()
    os.set_blocking(fd, False)
    seen, deadline, killed = b"", time.monotonic() + timeout, False
    while time.monotonic() < deadline and procs[1].poll() is None:
        try:
            seen += os.read(fd, 1 << 16)
        except BlockingIOError:
            pass
        if marker.encode() in seen:
            procs[0].send_signal(signal.SIGKILL)
            killed = True
            break
        time.sleep(0.05)
    time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    return killed


# --- the pieces, in one process ----------------------------------------------------------


@pytest.mark.parametrize("rows,count", [(97, 2), (33, 3), (2, 2), (1, 2), (5, 4)])
def test_shards_cover_every_row_once_and_pad_back(rows, count):
    whole = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    shards = [Shard(i, count) for i in range(count)]
    if rows < count:  # not split: every process holds all of it
        assert all(not s.splits(whole.shape) and s.take(whole) is whole for s in shards)
        return
    pieces = [s.take(whole) for s in shards]
    assert max(len(p) for p in pieces) - min(len(p) for p in pieces) <= 1
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    padded = np.concatenate([s.pad_own(p, rows) for s, p in zip(shards, pieces)])
    np.testing.assert_array_equal(padded, shards[0].pad_whole(whole))
    np.testing.assert_array_equal(shards[0].unpad_whole(padded, rows), whole)


def _filled_shards(root: Path, count: int = 2) -> list:
    stores = []
    for i in range(count):
        store = mtjax.store.create(root / Shard(i, count).name, CFG, make_optimizer(OPT),
                                   hosts={"index": i, "count": count, "run": "r"})
        for p in store.parts:
            for kind in ("compute", "master", "opt"):
                store.write(p, kind, {n: np.full(s.shape, i, s.dtype) for n, s in store.schema(p, kind).items()})
        stores.append(store)
    return stores


def test_a_commit_every_shard_prepared_is_finished_on_resume_and_one_not_prepared_everywhere_is_dropped(tmp_path):
    a, b = _filled_shards(tmp_path)
    for s in (a, b):
        s.commit(0, prepare=True)
    with pytest.raises(StoreError, match="written while a commit ran"):
        a.write("embed", "compute", a.read("embed", "compute").result())
    a.finish_commit()  # b is killed here: after the barrier, before its own rename
    a.close(), b.close()
    table = [shards.generations(tmp_path, Shard(i, 2)) for i in range(2)]
    assert table == [(1, -1), (0, 1)]
    with pytest.raises(StoreError, match="stopped inside a commit"):
        mtjax.store.open(tmp_path / Shard(1, 2).name, writable=True)
    assert [shards.resolve(tmp_path, Shard(i, 2), table) for i in range(2)] == [1, 1]
    assert [shards.generations(tmp_path, Shard(i, 2)) for i in range(2)] == [(1, -1), (1, -1)]

    # The next commit prepared by one shard only (the other killed before the barrier): dropped.
    a = mtjax.store.open(tmp_path / Shard(0, 2).name, writable=True)
    a.write("embed", "compute", {n: np.full(s.shape, 7, s.dtype) for n, s in a.schema("embed", "compute").items()})
    a.commit(1, prepare=True)
    a.close()
    table = [shards.generations(tmp_path, Shard(i, 2)) for i in range(2)]
    assert table == [(1, 2), (1, -1)]
    assert shards.resolve(tmp_path, Shard(0, 2), table) == 1
    with mtjax.store.open(tmp_path / Shard(0, 2).name) as s:
        assert s.step == 0 and all((a == 0).all() for a in s.read("embed", "compute").result().values())

    # A shard of another generation (another run's, or an old copy) is refused.
    with pytest.raises(StoreError, match="does not belong to this run"):
        shards.resolve(tmp_path, Shard(1, 2), [(5, -1), (1, -1)])
    with pytest.raises(StoreError, match="shards of a run of 2 processes"):
        shards.check_count(tmp_path, 3)


@pytest.mark.parametrize("settings,message", [
    (["distributed.coordinator=nohost"], "must be host:port"),
    (["distributed.coordinator=10.0.0.1:7777"], "needs distributed.num_processes >= 1"),
    (["distributed.coordinator=10.0.0.1:7777", "distributed.num_processes=2", "distributed.process_id=2"],
     "0 <= distributed.process_id < num_processes"),
    (["distributed.num_processes=2"], "need distributed.coordinator"),
    (["distributed.timeout_s=0"], "timeout_s must be > 0"),
])
def test_distributed_settings_are_checked_in_one_line(settings, message):
    from mtjax import config

    with pytest.raises(config.ConfigError, match=message):
        config.load(None, settings)


def test_settings_come_from_the_config_the_environment_or_slurm():
    from mtjax import distributed
    from mtjax.config import DistributedConfig

    given = DistributedConfig("h:1", 2, 1)
    assert distributed.settings(given, {"MTJAX_COORDINATOR": "other:2"}) is given
    env = {"MTJAX_COORDINATOR": "h:9", "MTJAX_NUM_PROCESSES": "4", "MTJAX_PROCESS_ID": "3"}
    assert distributed.settings(DistributedConfig(), env) == DistributedConfig("h:9", 4, 3)
    assert distributed.settings(DistributedConfig(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}) == "cluster"
    assert distributed.settings(DistributedConfig(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    with pytest.raises(distributed.ConfigError, match="MTJAX_NUM_PROCESSES"):
        distributed.settings(DistributedConfig(), {"MTJAX_COORDINATOR": "h:9"})
