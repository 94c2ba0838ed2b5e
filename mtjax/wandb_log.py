"""Weights & Biases logging of a run's records (`run.wandb: PROJECT`), beside metrics.jsonl.

    logger = wandb_log.start(exp, run_dir)   # the W&B run of run.wandb's project
    logger.log(record)                      # each metrics.jsonl record, as it is written
    logger.close()

Every record of metrics.jsonl is logged as it is written, with its own "step" (the
run's optimizer step) declared as the step of every other key, so the W&B history has
the rows metrics.jsonl has, steps that a resumed run repeats included. The W&B run's id
is kept in <run.dir>/wandb.json: a resumed run continues the same W&B run, a fresh one
(which starts a fresh metrics.jsonl too) forgets it and starts a new one. W&B keeps its
local files under <run.dir>/wandb/, or under WANDB_DIR when that is set; the other
WANDB_* variables (WANDB_MODE=offline, WANDB_ENTITY, ...) work as wandb documents them.
W&B's service completes an offline run's .wandb file when it closes the run, which may be
just after close() returns; wandb.teardown(), or wandb's exit hook, waits for it.
wandb is optional (`pip install 'mtjax[wandb]'`) and imported only when run.wandb is
set. Only process 0 of a multi-process run logs (mtjax.run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mtjax.config import ConfigError, ExperimentConfig
from mtjax.errors import MissingPackage

ID_FILE = "wandb.json"  # {"id", "project"} of the run's W&B run


class Logger:
    """An open W&B run that takes metrics.jsonl records."""

    def __init__(self, run):
        self._run = run

    def log(self, record: dict) -> None:
        self._run.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def close(self) -> None:
        self._run.finish()


def forget(run_dir: Path) -> None:
    """A fresh run's: the next start makes a new W&B run rather than continuing the last one."""
    (Path(run_dir) / ID_FILE).unlink(missing_ok=True)


def require():
    """The wandb module, or one line saying how to install it (a run checks before it starts)."""
    try:
        import wandb
    except ImportError:
        raise MissingPackage("run.wandb", "wandb", "wandb") from None
    return wandb


def start(exp: ExperimentConfig, run_dir: Path) -> Logger:
    """The W&B run of `exp.run.wandb`'s project: the one named in run_dir/wandb.json, else a new one."""
    wandb = require()
    run_dir = Path(run_dir)
    id_file = run_dir / ID_FILE
    try:
        known = json.loads(id_file.read_text()).get("id") if id_file.exists() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        known = None  # unreadable: a new W&B run rather than none
    files = None if os.environ.get("WANDB_DIR") else str(run_dir)  # <run.dir>/wandb/ unless WANDB_DIR says
    try:
        run = wandb.init(project=exp.run.wandb, id=known, resume="allow" if known else None,
                         name=run_dir.resolve().name, config=exp.to_dict(), dir=files)
    except Exception as e:  # a missing login, no network, a bad WANDB_* setting: wandb's own exception types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"run.wandb={exp.run.wandb}: W&B could not start its run ({first}); run `wandb login`, "
                          "set WANDB_MODE=offline to log locally, or leave run.wandb unset") from None
    run.define_metric("step")
    run.define_metric("*", step_metric="step")  # metrics.jsonl's step is the x axis, repeated steps too
    id_file.write_text(json.dumps({"id": run.id, "project": exp.run.wandb}) + "\n")
    return Logger(run)
