"""`mtjax init`: a new store with freshly initialised weights (mtjax.model.init_params)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from flax import nnx

from mtjax import config as experiment  # its load is the one reader of experiment files
from mtjax import model, parts, treepath
from mtjax.errors import MtjaxError
from mtjax.model_config import ModelConfig, load_hf_config
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.partid import EMBED, HEAD
from mtjax.store import fill
from mtjax.store.errors import StoreError


def load_config(path: str | Path, compute_dtype: str | None = None) -> tuple[ModelConfig, object]:
    """(model config, optax transformation) from an HF config.json, a checkpoint dir or an
    experiment YAML (whose optim group gives the optimizer; otherwise default AdamW).
    `compute_dtype` replaces the file's; an experiment's `auto` must be resolved by the
    caller (`mtjax init` does it as a run does, mtjax.commands.store)."""
    path = Path(path)
    try:
        if path.suffix in (".yaml", ".yml"):
            exp = experiment.load(path)
            if compute_dtype:  # before the model config is built: it replaces the file's (auto included)
                model_overrides = {**dict(exp.model.overrides), "compute_dtype": compute_dtype}
                exp = dataclasses.replace(exp, model=dataclasses.replace(exp.model,
                                                                         overrides=tuple(model_overrides.items())))
            cfg = experiment.model_config(exp)
            return cfg, make_optimizer(exp.optim)
        return load_hf_config(path, compute_dtype=compute_dtype or "bfloat16"), make_optimizer(OptimConfig())
    except MtjaxError as e:
        raise StoreError(f"cannot init a store from {path}: {e}") from None


def init_store(cfg: ModelConfig, store_dir: str | Path, seed: int = 0, tx=None, copies: int = 2) -> Path:
    """A new store at `store_dir` (step 0) holding `init_params(cfg, seed)` and tx.init state
    (`copies`: 2 or 1 copies of the state on disk, see mtjax.store.create)."""
    tx = tx or make_optimizer(OptimConfig())
    fill.check_destination(Path(store_dir))
    with fill.staged(store_dir, cfg, tx, copies) as store:
        fill_parts(store, seed, tx)
        store.commit(0)
    return Path(store_dir)


def fill_parts(store, seed: int, tx) -> None:
    """Write fresh weights (`init_params(store.config, seed)`'s values) and tx.init state
    into every part of the new, writable `store`, one part at a time (uncommitted): the
    whole model is never on the device nor in host memory at once."""
    for part, params in _part_params(store.config, seed, store.parts):
        named = treepath.flatten(params)
        fill.write_part(store, part, {k: np.asarray(v, np.float32) for k, v in named.items()}, tx)
        del params, named  # one part in host memory at a time: models larger than RAM


def _part_params(cfg: ModelConfig, seed: int, names: list[str]):
    """Yield (part, fresh fp32 params) one part at a time, drawing from one nnx.Rngs in
    init_params's order (embed, blocks, head), so the values equal init_params(cfg, seed)."""
    assert names[0] == EMBED and names[-1] == HEAD, names
    rngs = nnx.Rngs(seed)
    for name in names:
        yield name, model.init_part(cfg, parts.fn_kind(cfg, name), rngs)
