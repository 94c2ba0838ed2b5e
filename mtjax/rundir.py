"""Whose the records in a run directory are: a run replaces only records it can prove its own.

A run writes, in <run.dir> (process p > 0 of a multi-process run: <run.dir>/process-<p>/),
RUN_FILE, config.yaml, metrics.jsonl, summary.json, final/, tensorboard/ and wandb.json (its store and
its data cache prove themselves: the store's lock and id, the cache's stamp,
mtjax.data.check_cache). RUN_FILE names the run the records belong to: the id of its store
(a multi-process run's shared run id), written before any other record once every refusal
passed. So when a run opens its store (mtjax.checkpoint.open_run_store), `check` refuses,
before anything is written, records that name another store, or any record at all beside a
store that is made now (they are a run's whose store is gone: its final/, metrics.jsonl
would be replaced). A run directory from before RUN_FILE, beside its trained store, is that
store's run's.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mtjax.config import ConfigError

RUN_FILE = "run.json"
RECORDS = (RUN_FILE, "config.yaml", "metrics.jsonl", "summary.json", "final", "tensorboard", "wandb.json")
_PROCESS_DIR = re.compile(r"process-\d+")


def records_dir(run_dir: str | Path, index: int = 0) -> Path:
    """Where process `index` of a run writes its records."""
    return Path(run_dir) if not index else Path(run_dir) / f"process-{index}"


def present(where: Path) -> list[str]:
    """The names of run records in `where` (the lead's directory holds the other processes')."""
    if not where.is_dir():
        return []
    names = [n for n in RECORDS if (where / n).exists() or (where / n).is_symlink()]
    return names + sorted(n for n in os.listdir(where) if _PROCESS_DIR.fullmatch(n))


def owner(where: Path) -> str | None:
    """The run id RUN_FILE in `where` names, or None (no RUN_FILE, or not one a run wrote)."""
    try:
        record = json.loads((where / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record.get("run") if isinstance(record, dict) and isinstance(record.get("run"), str) else None


def check(where: Path, run: str | None, store: Path, trained: bool = False) -> None:
    """Refuse records in `where` that are not of run `run` (None: its store is made now, so
    none are); `trained`: the store holds a trained run (a resume)."""
    names = present(where)
    if not names:
        return
    mine = owner(where)
    if run is not None and (mine == run or (mine is None and trained and RUN_FILE not in names)):
        return  # this run's records (the second case: a run directory from before RUN_FILE)
    listed = ", ".join(f"{n}/" if (where / n).is_dir() else n for n in names)
    whose = (f"of a run whose store {store} is gone" if run is None else f"of another run than the one in {store}")
    hint = (f" (final/ is an export: --model.checkpoint={where / 'final'} trains on from it)"
            if "final" in names and run is None else "")
    raise ConfigError(f"{where} holds {listed} {whose}, and a run would replace them{hint}; choose another run.dir, "
                      "or move them away to start a new run there")


def claim(where: Path, run: str) -> None:
    """Name run `run` in RUN_FILE as the owner of the records in `where` (atomically)."""
    where.mkdir(parents=True, exist_ok=True)
    if owner(where) == run:
        return
    tmp = where / f".{RUN_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"run": run, "what": "the store (run id) whose run wrote this directory's records"})
                   + "\n")
    os.replace(tmp, where / RUN_FILE)
