"""What to plan: a model config and the settings of a run, from the paths a user has at hand.

CONFIG is a Hugging Face ``config.json``, a checkpoint directory holding one, or an
experiment YAML (read by `mtjax.config`; its data, stream and store groups give the
step's shape and settings, its optim group the optimizer). Command-line values override
the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from mtjax import config as experiment  # its load is the one reader of experiment files
from mtjax.config import DataConfig, StoreConfig, StreamConfig
from mtjax.errors import MtjaxError
from mtjax.model_config import ModelConfig, load_hf_config
from mtjax.optim import make_optimizer
from mtjax.plan import compute_dtype
from mtjax.plan.hardware import HardwareProfile
from mtjax.stream.step_bytes import StepShape

# A bare model config plans one 2048-token sequence per step (the model's context, if shorter).
DEFAULT_DATA = DataConfig(batch_size=1, seq_len=2048, grad_accum=1)


class PlanInputError(MtjaxError, ValueError):
    """A CONFIG the planner cannot read."""


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A run to plan: the model and the config groups that shape its step."""

    cfg: ModelConfig
    stream: StreamConfig
    store: StoreConfig
    data: DataConfig
    tx: object | None  # optax transformation; None: mtjax's default AdamW
    dtype_choice: str | None = None  # what model.compute_dtype=auto resolved to, and why (mtjax.plan.compute_dtype)

    @property
    def shape(self) -> StepShape:
        return StepShape.of(self.data)


def load(path: str | Path, hardware: Callable[[], HardwareProfile] | None = None, **model_overrides) -> Inputs:
    """The run CONFIG at `path` describes, `model_overrides` applied; a compute_dtype auto
    (in the file or the overrides) resolved for the profile `hardware()` gives (called
    only then: it may probe this machine), as a run resolves it."""
    if hardware is None:
        def hardware():
            raise PlanInputError("compute dtype auto is chosen for a hardware profile: none was given")
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        exp = experiment.load(path)
        if model_overrides:
            model = dict(exp.model.overrides, **model_overrides)
            exp = dataclasses.replace(exp, model=dataclasses.replace(exp.model, overrides=tuple(model.items())))
        choice = None
        if compute_dtype.asks_auto(exp.model.overrides):  # hardware() only then: it may probe
            exp, choice = compute_dtype.resolve(exp, hardware())
        return dataclasses.replace(from_experiment(exp), dtype_choice=choice)
    if not path.exists():
        raise PlanInputError(f"{path} does not exist: pass an HF config.json, a checkpoint dir or an experiment YAML")
    choice = None
    if compute_dtype.asks_auto(model_overrides):
        dtype, why = compute_dtype.choose(hardware())
        model_overrides, choice = {**model_overrides, "compute_dtype": dtype}, compute_dtype.describe(dtype, why)
    cfg = load_hf_config(path, **model_overrides)
    data = dataclasses.replace(DEFAULT_DATA, seq_len=min(DEFAULT_DATA.seq_len, max(cfg.max_position_embeddings, 2)))
    return Inputs(cfg, StreamConfig(), StoreConfig(), data, None, choice)


def from_experiment(exp) -> Inputs:
    """The run a loaded `ExperimentConfig` describes: what the trainer's preflight hands
    to `estimate` and then `check`."""
    return Inputs(experiment.model_config(exp), exp.stream, exp.store, exp.data, make_optimizer(exp.optim))


def run_steps(path: str | Path) -> int:
    """The optimizer steps of the run: an experiment YAML's run.steps, else the default's."""
    path = Path(path)
    exp = experiment.load(path) if path.suffix in (".yaml", ".yml") else experiment.ExperimentConfig()
    return exp.run.steps
