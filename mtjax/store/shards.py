"""A multi-process run's store: one shard store per process, committed together.

    ROOT/shard-<p>-of-<N>/     process p's store (mtjax.store.Store): its rows of every
                               part's master weights and optimizer state, the whole compute
                               copy, its own manifest whose `hosts` entry names the shard
                               ({"index", "count", "run"}: the run id all shards share)

A step is committed only when every process has made its shard durable. Each process
prepares its commit (every write durable, the new manifest durable as
`manifest.next.json`: `Store.commit(prepare=True)`), then all processes meet at a
barrier, then each renames its prepared manifest over `manifest.json`
(`Store.finish_commit`). The first of those renames is the run's commit point: it
happens only after every shard was prepared, so from then on every shard holds the step,
either committed or prepared. At a resume the processes compare their shards'
generations (`resolve`): a shard whose prepared commit is the newest committed
generation anywhere finishes it (roll forward); a prepared commit newer than every
manifest is dropped (that step was never committed); anything else is a shard that does
not belong with the others and is refused.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mtjax.shard import Shard
from mtjax.store import layout, manifest
from mtjax.store.durable import fsync_path
from mtjax.store.errors import StoreError

_SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")


def shard_root(root, shard: Shard) -> Path:
    return Path(root) / shard.name


def present(root) -> list[Shard]:
    """The shards under a store root that hold a store (a manifest), by count, then index."""
    root = Path(root)
    found = [Shard(int(m.group(1)), int(m.group(2))) for d in (root.iterdir() if root.is_dir() else ())
             if (m := _SHARD_DIR.fullmatch(d.name)) and (d / layout.MANIFEST).exists()]
    return sorted(found, key=lambda s: (s.count, s.index))


def check_count(root, count: int) -> None:
    """Refuse a store root holding shards of a run with another number of processes."""
    root = Path(root)
    other = sorted({s.count for s in present(root)} - {count})
    if other:
        this = "one process" if count == 1 else f"{count}"
        raise StoreError(f"store {root} holds the shards of a run of {other[0]} processes; resume it with "
                         f"{other[0]} processes (this run has {this}), `mtjax store reshard` it for {count}, "
                         "or use a new run.dir")


def generations(root, shard: Shard) -> tuple[int, int]:
    """(committed generation, prepared generation) of this process's shard; -1 for none
    (no store yet, or no prepared commit)."""
    path = shard_root(root, shard)
    if not (path / layout.MANIFEST).exists():
        return -1, -1
    prepared = manifest.read_prepared(path)
    return manifest.read(path).generation, -1 if prepared is None else prepared.generation


def resolve(root, shard: Shard, table) -> int:
    """Bring this process's shard to the run's last committed generation, given every
    process's `generations` (`table[p]` = process p's pair). Returns that generation
    (-1: no process has a store; 0: none was ever committed)."""
    path = shard_root(root, shard)
    committed = max(int(row[0]) for row in table)
    mine, prepared = (int(x) for x in table[shard.index])
    if mine == committed:
        if prepared >= 0:  # a commit prepared but never reached by every process
            (path / layout.PREPARED).unlink()
            fsync_path(path)
        return committed
    if prepared == committed:
        try:
            os.replace(path / layout.PREPARED, path / layout.MANIFEST)  # finish the run's last commit
            fsync_path(path)
        except OSError as e:
            raise StoreError(f"could not finish the last commit of {path} ({e.strerror or e})") from None
        return committed
    if mine <= 0 and committed <= 0:
        return committed
    have = "no store" if mine < 0 else f"generation {mine}"
    raise StoreError(f"store shard {path} holds {have} but the run's other shards were committed at generation "
                     f"{committed}: it does not belong to this run; restore the run's own shard {shard.name}")
