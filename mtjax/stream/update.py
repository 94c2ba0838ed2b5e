"""The optimizer stage: one part's AdamW update on host-resident state.

One jitted program for the CPU backend reads the fp32 master weights, the optimizer
state, the old compute copy and the accumulated gradient, and writes master, optimizer
state and the new compute copy in place (donated buffers: one pass over optimizer
memory at memory bandwidth, DESIGN-NOTES point 4). Every part gets the same clip scale,
computed from the global gradient norm before any part is updated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax import model, parts, treepath
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream.tiers import host_device


def _update(tx, compute_dtype, master, opt_state, compute, grads, scale):
    del compute  # donated: its buffer receives the new compute copy
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads)
    updates, opt_state = tx.update(grads, opt_state, master)
    master = optax.apply_updates(master, updates)
    return master, opt_state, jax.tree.map(lambda w: w.astype(compute_dtype), master)


class PartUpdate:
    """AdamW (any optax transformation) applied one part at a time on the CPU backend."""

    def __init__(self, cfg: ModelConfig, tx: optax.GradientTransformation):
        self.cfg, self.tx = cfg, tx
        self.cpu = host_device()
        # keep_unused: jit drops the unread `compute` argument otherwise, and with it the
        # donation, so every update would page-fault a fresh bf16 output buffer.
        self._update = jax.jit(functools.partial(_update, tx, np.dtype(cfg.compute_dtype)), donate_argnums=(0, 1, 2),
                               keep_unused=True)
        self._init = jax.jit(tx.init)
        self._templates = {p.name: jax.eval_shape(tx.init, parts.schema(cfg, p.name, "master")) for p in parts.parts(cfg)}

    def init_state(self, master: dict) -> dict:
        """Flat optimizer state of one part from its flat fp32 master weights."""
        return treepath.flatten(self._init(jax.device_put(master, self.cpu)))

    def compute_copy(self, master: dict) -> dict:
        dtype = np.dtype(self.cfg.compute_dtype)
        return {n: jax.device_put(np.asarray(w).astype(dtype), self.cpu) for n, w in master.items()}

    def __call__(self, part: str, master: dict, opt: dict, compute: dict, grads: dict, scale):
        """(master, opt, compute) of `part` after one update; all flat dicts on the CPU."""
        # Arrays read from disk arrive as numpy: place them on the CPU backend, not the
        # default (accelerator) device.
        master, opt, compute, grads = jax.device_put((master, opt, compute, grads), self.cpu)
        opt_tree = treepath.unflatten(self._templates[part], opt)
        master, opt_tree, compute = self._update(master, opt_tree, compute, grads, scale)
        return master, treepath.flatten(opt_tree), compute


@functools.lru_cache(maxsize=8)
def update_for(cfg: ModelConfig, optim: OptimConfig) -> PartUpdate:
    """The compiled update of an OptimConfig, shared by every engine that uses it."""
    return PartUpdate(cfg, make_optimizer(optim))


def _part_leaf_names(cfg: ModelConfig, tx, part: parts.Part):
    """(per-part opt leaf name, whole-model opt leaf name) pairs of one part."""
    path = "blocks." + part.name.split(".")[1] if part.name.startswith("block.") else part.name
    leaves = sorted(parts.schema(cfg, part.name, "master"), key=len, reverse=True)
    for name in parts.schema(cfg, part.name, "opt", tx):
        leaf = next((x for x in leaves if name == x or name.endswith("." + x)), None)
        yield name, name if leaf is None else f"{name[: -len(leaf)]}{path}.{leaf}"


def split_opt_state(cfg: ModelConfig, tx: optax.GradientTransformation, full) -> dict[str, dict]:
    """The inverse of `full_opt_state`: {part name: flat per-part optimizer state}."""
    named = treepath.flatten(full)
    return {p.name: {mine: np.asarray(named[whole]) for mine, whole in _part_leaf_names(cfg, tx, p)}
            for p in parts.parts(cfg)}


def full_opt_state(cfg: ModelConfig, tx: optax.GradientTransformation, per_part: dict[str, dict]):
    """The optimizer state of the whole model, shaped as `tx.init(params)` would make it.

    A per-part leaf named `<prefix>.<param leaf>` (e.g. "0.mu.mlp.up_proj.kernel") is
    the whole model's `<prefix>.<part path>.<param leaf>`; other leaves (step counts)
    are the same in every part and appear once.
    """
    template = jax.eval_shape(tx.init, model.abstract_params(cfg))
    named = {}
    for p in parts.parts(cfg):
        for mine, whole in _part_leaf_names(cfg, tx, p):
            named.setdefault(whole, per_part[p.name][mine])
    return treepath.unflatten(template, named)
