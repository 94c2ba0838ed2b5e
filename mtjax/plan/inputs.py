"""What to plan: a model config and a workload, from the paths a user has at hand.

CONFIG is a Hugging Face ``config.json``, a checkpoint directory holding one, or an
experiment YAML (read by `mtjax.config`; its data, stream and store groups give the
workload and its optim group the optimizer). Command-line values override the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mtjax import config as experiment  # the one module that reads YAML
from mtjax.errors import MtjaxError
from mtjax.model_config import ModelConfig, load_hf_config
from mtjax.optim import make_optimizer
from mtjax.plan.cost import Placement, Workload


class PlanInputError(MtjaxError, ValueError):
    """A CONFIG the planner cannot read."""


def load(path: str | Path, **model_overrides) -> tuple[ModelConfig, Workload, object | None]:
    """(model config, workload, optax transformation or None for the default AdamW)."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        return _from_experiment(path, model_overrides)
    if not path.exists():
        raise PlanInputError(f"{path} does not exist: pass an HF config.json, a checkpoint dir or an experiment YAML")
    return load_hf_config(path, **model_overrides), Workload(), None


def _from_experiment(path: Path, model_overrides: dict):
    cfg, workload, tx = from_experiment(experiment.load(path))
    if model_overrides:
        cfg = dataclasses.replace(cfg, **model_overrides)
    return cfg, workload, tx


def from_experiment(exp) -> tuple[ModelConfig, Workload, object]:
    """(model config, workload, optax transformation) of a loaded `ExperimentConfig`:
    what the trainer's preflight hands to `estimate` and then `check`."""
    return experiment.model_config(exp), workload_from_experiment(exp), make_optimizer(exp.optim)


def run_steps(path: str | Path) -> int:
    """The optimizer steps of the run: an experiment YAML's run.steps, else the default's."""
    path = Path(path)
    exp = experiment.load(path) if path.suffix in (".yaml", ".yml") else experiment.ExperimentConfig()
    return exp.run.steps


def workload_from_experiment(exp) -> Workload:
    """The planner's view of an `ExperimentConfig`: data shapes, stream knobs, store tiers."""
    return Workload(
        batch_size=exp.data.batch_size, seq_len=exp.data.seq_len, grad_accum=exp.data.grad_accum,
        keep_every=exp.stream.keep_every, prefetch_depth=exp.stream.prefetch_depth,
        activations=exp.stream.activations,
        placement=Placement(compute=exp.store.compute, master=exp.store.master, opt=exp.store.opt),
        store_copies=exp.store.copies,
    )
