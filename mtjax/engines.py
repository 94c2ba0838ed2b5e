"""The engines that run a training step, and the choice between them.

`make_engine` gives the engine `stream.engine` names: the stream engine (mtjax.stream,
the model streamed one part at a time) or the reference engine (the whole model in
device memory, mtjax.reference). Any object with the `Engine` protocol plugs into a
training run (mtjax.run):

    engine.step(batch, train_state)   a mtjax.batch.Batch (or int32 tokens) [accum, batch, seq] -> {"loss",
                          "grad_norm", ...} (floats); the loss is the mean over the step's counted
                          targets; an engine that commits every step records train_state then
    engine.params()       fp32 params pytree on the host, every pending update applied
    engine.opt_state()    optimizer state shaped as optax's init(params)
    engine.eval_loss(b)   {"loss", "aux_loss" (MoE)} over the counted targets of a batch [n, batch, seq], no update
    engine.stage_seconds()   seconds per stage of the last step (may be empty)
    engine.commits_every_step   whether each step commits itself (before its update runs)
    engine.commit(step, train_state, flush=False)   write the whole state into the run's
                          store and commit it (mtjax.checkpoint): `--run.resume=true`
                          continues from the last commit exactly
    engine.close()        release threads and files at the end of the run
    engine.store          the run's layer store: the closing sample streams its last commit
                          from it (mtjax.stream.sample), whichever engine trained it
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np

import mtjax.store
from mtjax import checkpoint
from mtjax import reference as reference_mod
from mtjax.batch import Batch
from mtjax.config import ExperimentConfig
from mtjax.model_config import ModelConfig
from mtjax.optim import make_optimizer
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine


class Engine(Protocol):
    commits_every_step: bool
    store: mtjax.store.Store

    def step(self, batch: Batch | np.ndarray, train_state: dict | None = None) -> dict[str, float]: ...

    def params(self): ...

    def opt_state(self): ...

    def eval_loss(self, batch: Batch | np.ndarray) -> dict[str, float]: ...

    def stage_seconds(self) -> dict[str, float]: ...

    def commit(self, step: int, train_state: dict, flush: bool = False) -> None: ...

    def close(self) -> None: ...


class ReferenceEngine:
    """The whole model in device memory (mtjax.reference), behind the engine protocol."""

    commits_every_step = False  # each commit writes the whole state

    def __init__(self, exp: ExperimentConfig, cfg: ModelConfig, params, opt_state=None, store=None):
        self.cfg, self.store = cfg, store
        self.trainer = ReferenceTrainer(cfg, params, exp.optim, opt_state=opt_state)

    def step(self, batch, train_state: dict | None = None) -> dict[str, float]:
        return self.trainer.step(batch)  # commits only when asked (`commit`)

    def params(self):
        return jax.device_get(self.trainer.params)

    def opt_state(self):
        return jax.device_get(self.trainer.opt_state)

    def commit(self, step: int, train_state: dict, flush: bool = False) -> None:
        """Write the whole state into the store, one part at a time, and commit it."""
        checkpoint.write_model(self.store, self.params(), self.opt_state(), self.trainer.tx)
        self.store.commit(step, train_state)

    def eval_loss(self, batch) -> dict[str, float]:
        return reference_mod.eval_loss(self.cfg, self.trainer.params, batch)

    def stage_seconds(self) -> dict[str, float]:
        return {}  # one program per step: no stages to time

    def close(self) -> None:
        pass  # nothing held beyond device arrays (the run closes the store)


def make_engine(exp: ExperimentConfig, cfg: ModelConfig, params, opt_state=None, *, store,
                step: int = 0, hosts=None) -> Engine:
    """The engine `exp.stream.engine` names, starting from fp32 `params` (and `opt_state`),
    or from the last commit of `store` (at `step`) when `params` is None; it commits into
    `store`. `hosts`: this process's place in a multi-process run (stream engine only)."""
    if hosts is not None:
        return StreamEngine.from_experiment(exp, cfg, params, opt_state, store=store, step=step, hosts=hosts)
    if exp.stream.engine == "reference":
        if params is None:
            params, opt_state = checkpoint.read_model(store, make_optimizer(exp.optim))
        return ReferenceEngine(exp, cfg, params, opt_state, store=store)
    return StreamEngine.from_experiment(exp, cfg, params, opt_state, store=store, step=step)
