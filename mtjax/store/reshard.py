"""A run's store rewritten for another number of processes (`mtjax store reshard`).

    reshard(src, dst, processes)     # -> the new store root

`src`: a run's store root holding the shards of N processes (mtjax.store.shards, every
shard gathered under it) or a one-process store. `dst`: a new directory that receives the
store a one-process run uses (processes=1) or `shard-<p>-of-<M>/` for M processes. It
goes part by part, kind by kind: a part's master and optimizer rows are read from every
source shard into whole leaves, and each new shard's rows (mtjax.shard) are written, so
host memory holds about one part. The compute copy, every leaf not split, the committed
step and train state (data position, seed, fixed settings; the optimizer's step count is
a leaf) and a kept tokenizer are copied. The new store keeps the run's id, which names
the run in its records (mtjax.rundir), so it resumes with the run's run.dir. The source
is only read; every refusal comes before anything is written, and the new store is built
in a hidden sibling of `dst` and renamed into place once complete (mtjax.store.fill).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from mtjax import parts as model_parts
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.shard import Shard
from mtjax.store import fill, layout, lock, shards
from mtjax.store import store as store_mod
from mtjax.store.errors import StoreError


def reshard(src, dst, processes: int) -> Path:
    src, dst = Path(src), Path(dst)
    if processes < 1:
        raise StoreError(f"--processes must be 1 or more, got {processes}")
    fill.check_destination(dst)
    if dst.resolve().is_relative_to(src.resolve()):
        raise StoreError(f"{dst} is inside the source store {src}, which is only read; choose a directory outside it")
    sources = _open_sources(src)
    try:
        count, first = len(sources), sources[0]
        state = first.load_train_state()
        _check(src, count, processes, state)
        with fill.staged_dir(dst) as tmp:  # renamed to dst once complete: never a partial store there
            _write(sources, tmp, processes, state)
    finally:
        for s in sources:
            s.close()
    return dst


def _open_sources(src: Path) -> list:
    """The source's stores, read-only, in process order: one, or every shard of its run;
    a source whose shards do not make one settled commit of one run is refused."""
    if not src.is_dir():
        raise StoreError(f"no store at {src}; pass a run's store root (or a one-process store)")
    if (src / layout.MANIFEST).exists():
        roots = [src]
    else:
        found = shards.present(src)
        if not found:
            raise StoreError(f"{src} holds neither a store (manifest.json) nor the shards of a multi-process run "
                             "(shard-<p>-of-<N>/); pass a run's store root")
        count = found[0].count
        if any(s.count != count for s in found):
            counts = " and ".join(str(n) for n in sorted({s.count for s in found}))
            raise StoreError(f"{src} holds the shards of runs of {counts} processes; keep one run's shards there")
        missing = [Shard(i, count).name for i in range(count) if Shard(i, count) not in found]
        if missing:
            raise StoreError(f"{src} lacks {', '.join(missing)} of its run of {count} processes; gather every "
                             "process's shard under the store root (copy them from hosts that do not share it)")
        roots = [shards.shard_root(src, s) for s in found]
    for root in roots:
        if (root / layout.PREPARED).exists():
            raise StoreError(f"{root} holds a commit prepared but not finished (its run stopped inside a commit); "
                             f"resume it with {len(roots)} processes once to settle its last commit, then reshard")
        lock.check_free(root, "reshard it once that run has stopped")  # it would commit under the reads
    sources = []
    try:
        for root in roots:
            sources.append(store_mod.open(root))
        _check_agree(src, sources)
    except BaseException:
        for s in sources:
            s.close()
        raise
    return sources


def _check_agree(src: Path, sources: list) -> None:
    first = sources[0]
    if len(sources) == 1 and first.hosts is not None:
        raise StoreError(f"{src} is one shard of a run of {first.hosts['count']} processes; pass the store root "
                         f"that holds all of them ({src.parent})")
    for s in sources[1:]:
        if s.run_id != first.run_id:
            raise StoreError(f"{s.root} belongs to another run (run id {s.run_id}) than {first.root} "
                             f"({first.run_id}); put back the run's own {s.root.name}")
        if s.generation != first.generation or s.step != first.step:
            raise StoreError(f"{s.root} holds another commit (generation {s.generation}, step {s.step}) than "
                             f"{first.root} (generation {first.generation}, step {first.step}), and no commit "
                             f"waits to settle them: it is not of the run's last commit; put back the run's own "
                             f"{s.root.name}")
    if first.copies == 1:
        raise StoreError(f"store {src} keeps one copy of the state (store.copies=1), which cannot be resharded yet")
    if first.never_written:
        raise StoreError(f"store {src} holds no committed state yet; there is nothing to reshard")


def _check(src: Path, count: int, processes: int, state: dict | None) -> None:
    if processes == count:
        this = "one process" if count == 1 else f"{count} processes"
        raise StoreError(f"{src} already holds a run of {this}; there is nothing to reshard")
    rows = ((state or {}).get("fixed") or {}).get("data", {}).get("batch_size")
    if rows is not None and rows % processes:
        raise StoreError(f"the run in {src} trains data.batch_size={rows} rows a step, which {processes} processes "
                         f"cannot share equally; choose a --processes that divides {rows}")


def _tx(state: dict | None):
    """The optimizer the run trains with (its fixed settings), which fixes the optimizer
    state's leaves; a store never trained holds the default one's (mtjax import, init)."""
    optim = ((state or {}).get("fixed") or {}).get("optim")
    return make_optimizer(OptimConfig(**optim) if optim else OptimConfig())


def _write(sources: list, dst: Path, processes: int, state: dict | None) -> None:
    first = sources[0]
    cfg, run, tx = first.config, first.run_id, _tx(state)
    if processes == 1:
        targets = [store_mod.create(dst, cfg, tx, store_id=run)]
    else:
        targets = [store_mod.create(shards.shard_root(dst, Shard(p, processes)), cfg, tx,
                                    hosts={"index": p, "count": processes, "run": run}) for p in range(processes)]
    try:
        for part in first.parts:
            for kind in model_parts.KINDS:
                if first.slots.committed(part, kind) is None:
                    continue  # never written (its run never wrote this kind of this part)
                whole = _whole(sources, part, kind, model_parts.schema(cfg, part, kind, tx))
                writes = [t.write(part, kind, whole if t.shard is None or kind == "compute"
                                  else {n: t.shard.take(a) for n, a in whole.items()}) for t in targets]
                for w in writes:
                    w.result()
        kept = first.root / layout.TOKENIZER_DIR
        for t in targets:
            if kept.is_dir():
                shutil.copytree(kept, t.root / layout.TOKENIZER_DIR)
            t.commit(first.step, state)
    finally:
        for t in targets:
            t.close()


def _whole(sources: list, part: str, kind: str, schema: dict) -> dict:
    """{leaf: whole array} of a part's committed state, from every source shard's rows."""
    used = sources[:1] if kind == "compute" else sources
    pieces = [r.result() for r in [s.read(part, kind) for s in used]]
    if len(pieces) == 1:
        return pieces[0]
    shard = sources[0].shard
    return {n: np.concatenate([p[n] for p in pieces]) if shard.splits(spec.shape) else pieces[0][n]
            for n, spec in schema.items()}
