"""Checks that run before step 1 of `mtjax train`, so a run that cannot finish says so
at once, in one line naming what is missing and by how much, instead of dying hours in
(host-RAM OOM, full disk) or corrupting what it was given.

    preflight.check(exp, cfg, dataset)   # raises PreflightError, or returns the plan

What each check covers (the others live where the thing is opened):
  host RAM and disk   the planner's estimate of this run (mtjax.plan) against what the
                      machine has now, with RAM_MARGIN and DISK_MARGIN left over
  device budget       the step's device plan (mtjax.stream.memory_plan, the one the engine's
                      ledger enforces) against stream.device_budget_bytes
  data                windows of data.seq_len are the rows of a chat dataset, and the
                      train split holds at least one step of them (mtjax.data also
                      checks format, emptiness and token ids against the vocabulary)
  store and config    mtjax.store.open(config=...) refuses a store of another model, and
                      mtjax.checkpoint.open_run_store one trained with other settings
"""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil

from mtjax import checkpoint
from mtjax.errors import MtjaxError
from mtjax.plan import estimate, fit, hosts, inputs
from mtjax.plan.hardware import BUILTIN
from mtjax.stream import DeviceBudgetError, memory_plan, mesh

RAM_MARGIN = fit.RAM_HEADROOM  # share of available RAM a run may plan to use
DISK_MARGIN = 0.95  # share of free disk a run may plan to fill


class PreflightError(MtjaxError):
    """The run cannot start on this machine or with this input."""


def _existing_bytes(path: Path) -> int:
    """Bytes a store already occupies (a resumed run reuses them)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _disk_root(path: Path) -> Path:
    """The nearest existing directory at or above `path` (whose filesystem the run fills)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check(exp, cfg, dataset, available_ram: int | None = None, free_disk: int | None = None, processes: int = 1):
    """Raise PreflightError if the run does not fit; returns the plan it was checked against.
    `available_ram` and `free_disk` default to what the machine has now. `processes`: one
    host of a multi-process run is checked for its share of the batch and of the state
    (mtjax.plan.hosts)."""
    dataset.check_seq_len(exp.data.seq_len)
    start, stop = dataset.split("train")
    windows = (stop - start) // exp.data.seq_len
    need = exp.data.batch_size  # one micro-batch of whole windows (the loader wraps around after)
    if windows < need:
        raise PreflightError(f"the train split of {exp.data.dataset} holds {windows} windows of {exp.data.seq_len} "
                             f"tokens but one micro-batch needs {need} (short by {need - windows}); "
                             "use more data or lower data.seq_len / data.batch_size")
    hardware = BUILTIN["cpu-2core"]  # only the bytes of the plan are used here, not its times
    run = inputs.from_experiment(exp)
    # The devices the engine will run on (more than this process has: one line, here).
    devices = len(mesh.local_devices(exp.stream.devices)) if exp.stream.engine == "stream" else 1
    plan = hosts.host_plan(estimate(cfg, run.stream, run.store, run.shape, hardware, tx=run.tx, devices=devices),
                           processes, run.tx)
    if exp.stream.engine == "stream":
        try:  # what StreamEngine.check_budget will refuse, before anything is built
            memory_plan.check_budget(plan.device, exp.stream.device_budget_bytes)
        except DeviceBudgetError as e:
            raise PreflightError(str(e)) from None
    store = checkpoint.store_path(exp)
    ram = psutil.virtual_memory().available if available_ram is None else available_ram
    if free_disk is None:
        free_disk = shutil.disk_usage(_disk_root(store)).free
    # Every run commits its state into its store (RAM-tier kinds at each checkpoint); a
    # resumed store's own bytes are reused, so they count as free.
    disk = free_disk + _existing_bytes(store)
    problem = fit.check(plan, int(ram * RAM_MARGIN), int(disk * DISK_MARGIN), tx=run.tx)
    if problem:
        raise PreflightError(f"this run does not fit the machine: {problem}")
    return plan
