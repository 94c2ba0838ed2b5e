"""Crash safety: a writer killed (SIGKILL) at any moment leaves the store at one whole step.

A writer process commits step after step, alternating between two known states
(state(step) = values(seed = step % 2)). It is killed after a random delay, or at a
chosen point of the commit protocol. The reopened store must be at the last step the
writer reported committed or the one after, and equal that step's state bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mtjax.store
from mtjax.store import commit
from test_store import CFG, read_all, same, values, write_all

pytestmark = pytest.mark.slow  # processes killed mid-commit

TINY = dataclasses.replace(CFG, num_hidden_layers=1, layer_types=())

HERE = Path(__file__).parent


def writer(root: str, crash_phase: str | None) -> None:
    store = mtjax.store.open(root, writable=True)
    if crash_phase:
        def on_phase(committing, phase, generation):
            if phase == crash_phase and store.step >= 2:
                os.kill(os.getpid(), signal.SIGKILL)
        commit.observe(on_phase)  # this process ends killed, or with the writer's error
    states = [values(store, 0), values(store, 1)]
    print("ready", os.getpid(), flush=True)
    step = store.step
    while True:
        step += 1
        write_all(store, states[step % 2])
        store.commit(step, {"step": step})
        print(step, flush=True)


def zygote() -> None:
    """Import once, then fork one writer per line read from stdin: "STORE [CRASH_PHASE]"."""
    for line in sys.stdin:
        root, *phase = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                writer(root, phase[0] if phase else None)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print("exit", status, flush=True)


class Writers:
    """Start writer processes (forked from one zygote, to pay Python imports once) and kill them."""

    def __init__(self):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=HERE, env=env)

    def start(self, root: Path, phase: str = "") -> int:
        self.proc.stdin.write(f"{root} {phase}\n")
        self.proc.stdin.flush()
        word, pid = self.proc.stdout.readline().split()
        assert word == "ready"
        return int(pid)

    def lines(self) -> list[str]:
        """The writer's output up to its end: the steps it reported committed."""
        out = []
        while not (line := self.proc.stdout.readline()).startswith("exit"):
            assert line, "the zygote died"
            out.append(line.strip())
        return out

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _check(root: Path, last_reported: int) -> int:
    store = mtjax.store.open(root, writable=True)  # a writer open also cleans the interrupted commit
    try:
        assert store.step in (last_reported, last_reported + 1), (store.step, last_reported)
        assert same(read_all(store), values(store, store.step % 2)), f"mixed state at step {store.step}"
        assert store.load_train_state() == {"step": store.step}
        return store.step
    finally:
        store.close()


def _new_store(root: Path) -> Path:
    """A store at step 1 holding state(1)."""
    store = mtjax.store.create(root, TINY)
    write_all(store, values(store, 1))
    store.commit(1, {"step": 1})
    store.close()
    return root


@pytest.fixture(scope="module")
def writers():
    w = Writers()
    yield w
    w.close()


def test_random_kills(writers, tmp_path):
    root = _new_store(tmp_path / "s")
    rng = random.Random(1234)
    last_committed = 1
    for trial in range(24):
        pid = writers.start(root)
        seen = [writers.proc.stdout.readline().strip() for _ in range(rng.randint(0, 2))]  # committed steps
        time.sleep(rng.uniform(0.0, 0.4))  # about one write-and-commit cycle: kill anywhere in it
        os.kill(pid, signal.SIGKILL)  # no cleanup, no flush
        reported = [int(s) for s in seen + writers.lines()]
        expected = reported[-1] if reported else last_committed
        last_committed = _check(root, expected)
    assert last_committed >= 20  # the writers made progress: the kills fell in many different cycles


@pytest.mark.parametrize("phase", ["written", "synced", "train_state", "committed"])
def test_kill_at_each_commit_phase(writers, tmp_path, phase):
    root = _new_store(tmp_path / "s")
    writers.start(root, phase)
    assert writers.lines() == ["2"]  # killed during the commit of step 3
    # before the manifest's rename the store is at step 2, after it at step 3
    assert _check(root, 2) == (3 if phase == "committed" else 2)


if __name__ == "__main__":
    zygote()
