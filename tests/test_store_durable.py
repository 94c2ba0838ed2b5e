"""Writes wait for no fsync; every commit makes durable exactly what its manifest names first.

A recorder follows every chunk and gradient file written (dirty until fsynced) and the
directory entry each write (or a gradient sum's rename to its step's tag) made (volatile until the directory is fsynced); at
each manifest write it checks that every file the new manifest names, in the slots and
the pending update, was fsynced after its last write, and its directory after its entry
was made. Two-copy stores with several steps per commit and a
one-copy engine (its step commits and its per-part commits) are followed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import mtjax.store
from mtjax import model
from mtjax.config import StoreConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.store import chunks, durable, layout
from mtjax.stream import StreamEngine

from conftest import ONE_KV_HEAD, tiny_config

CFG = tiny_config(intermediate_size=48, **ONE_KV_HEAD)
OPT = OptimConfig(lr=1e-2, clip_norm=0.5, warmup_steps=0)


class Recorder:
    """A file is durable once fsynced after its last write; its name, once its directory
    was fsynced after the write (re)named it there. A later entry in the same directory
    does not make the names fsynced before it volatile again. It follows the store's file
    operations through their public seam (mtjax.store.durable.observe) until `stop`."""

    def __init__(self, root: Path):
        self.root, self.lock, self.checked = root, threading.Lock(), 0
        self.dirty: set[Path] = set()  # files written since their last fsync
        self.unnamed: dict[Path, set[Path]] = {}  # directory -> entries made since its last fsync
        self.syncing: dict[tuple[Path, int], set[Path]] = {}  # (directory, thread) -> entries its fsync covers
        self.stop = durable.observe(self.on)

    def on(self, event: str, *args) -> None:
        if event == "written":
            path = Path(args[0])
            with self.lock:
                self.dirty.add(path)
                self.unnamed.setdefault(path.parent, set()).add(path)
        elif event == "renamed":  # a step's sums take their tag: new entries, the same data
            old, path = Path(args[0]), Path(args[1])
            with self.lock:
                if old in self.dirty:
                    self.dirty.add(path)
                self.unnamed.setdefault(path.parent, set()).add(path)
        elif event == "fsync":
            path = Path(args[0])
            with self.lock:  # before: a write racing the fsync stays dirty
                self.dirty.discard(path)
                self.syncing[path, threading.get_ident()] = set(self.unnamed.get(path, ()))
        elif event == "synced":
            path = Path(args[0])
            with self.lock:
                entries = self.syncing.pop((path, threading.get_ident()))
                self.unnamed.get(path, set()).difference_update(entries)
        elif event == "manifest":
            self.check(args[0])

    def check(self, m) -> None:
        named = []
        for part, kinds in m.slots.items():
            for kind, slot in kinds.items():
                if slot is not None:
                    base = layout.slot_dir(self.root, part, kind, slot)
                    named += [f for f in base.rglob("c*") if chunks.TMP_SUFFIX not in f.name]
        if m.pending and m.pending["parts"]:
            tag = m.pending["tag"]
            named += [f for f in (self.root / layout.PENDING_DIR).iterdir() if f"{tag}--" in f.name
                      and any(f.name.startswith(layout.pending_key(p, tag)) for p in m.pending["parts"])]
            assert named, "the manifest names pending gradients that are not there"
        with self.lock:
            missing = [str(f.relative_to(self.root)) for f in named
                       if f in self.dirty or f in self.unnamed.get(f.parent, ())]
        assert not missing, f"the manifest names files (or directories) not fsynced since their last write: {missing[:4]}"
        self.checked += 1


@pytest.fixture
def recorder():
    made = []
    yield lambda root: made.append(Recorder(root)) or made[-1]
    for rec in made:
        rec.stop()


def test_two_copy_commits_sync_what_they_name(tmp_path, recorder):
    root = tmp_path / "s"
    rec = recorder(root)
    store = mtjax.store.create(root, CFG, make_optimizer(OPT))
    rng = np.random.default_rng(0)
    for commit in range(3):
        for _ in range(2):  # two writes of every part between commits: the last one is named
            futs = [store.write(p, k, {leaf: rng.standard_normal(s.shape).astype(s.dtype)
                                       for leaf, s in store.schema(p, k).items()})
                    for p in store.parts for k in ("compute", "master", "opt")]
            [f.result() for f in futs]
        assert rec.dirty  # writes returned without fsyncing
        store.commit(commit + 1)
    assert rec.checked == 3 + 1  # create's empty manifest, then each commit
    store.close()


@pytest.mark.parametrize("copies", [1, 2])
def test_engine_commits_sync_what_they_name(tmp_path, recorder, copies):
    root = tmp_path / "s"
    rec = recorder(root)
    store = mtjax.store.create(root, CFG, make_optimizer(OPT), copies=copies)
    engine = StreamEngine(CFG, model.init_params(CFG, 0), OPT,
                          store_config=StoreConfig(compute="disk", master="disk", opt="disk"), store=store)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (1, 2, 8)).astype(np.int32)
    engine.commit(0)
    for i in range(2):
        engine.step(tokens)  # one copy: the step's last operation commits it
        if copies == 2:
            engine.commit(i + 1)
    engine.close()
    store.close()
    # one-copy: each step's commit plus one commit per updated part
    assert rec.checked >= (3 if copies == 2 else 3 + len(store.parts))
