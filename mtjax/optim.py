"""AdamW with a learning-rate schedule, and exact global-norm clipping.

Both engines build the same optax transformation from an `OptimConfig`. Clipping is
kept outside it on purpose: the streaming engine updates one block at a time, so it
computes the global norm over all blocks first and hands each block the same scale.
A user-supplied optax transformation must therefore not clip by global norm itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from mtjax import treepath
from mtjax.bounds import AT_LEAST_0, FRACTION, POSITIVE, STEPS, Range, out_of_range
from mtjax.model_config import ConfigError
from mtjax.observers import Observers

# What each number may be (mtjax.bounds); clip_norm has its own check (null disables it).
RANGES = {"lr": POSITIVE, "warmup_steps": STEPS, "decay_steps": STEPS, "min_lr_ratio": Range(0, 1),
          "b1": FRACTION, "b2": FRACTION, "eps": POSITIVE, "weight_decay": AT_LEAST_0}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate
    schedule: str = "cosine"  # constant | cosine | linear (after warmup)
    warmup_steps: int = 0  # linear warmup from 0 to lr
    decay_steps: int = 1000  # steps from the end of warmup to the end of decay
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine and linear)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled; skips norms and biases (1-D tensors)
    clip_norm: float | None = 1.0  # global gradient-norm clip; None disables

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"optim.{f.name} must be a finite number, got {value}")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ConfigError(f"optim.schedule must be constant, cosine or linear, got {self.schedule!r}")
        problem = out_of_range("optim", self, RANGES)
        if problem:
            raise ConfigError(problem)
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ConfigError(f"optim.clip_norm must be positive or null (no clipping), got {self.clip_norm}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, max(cfg.decay_steps, 1), alpha=cfg.min_lr_ratio)
    else:
        after = optax.linear_schedule(cfg.lr, end, max(cfg.decay_steps, 1))
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def lr_at(cfg: OptimConfig, step: int) -> float:
    """The learning rate optimizer step `step` (1-based) applies: the schedule at the
    optimizer's count before that step, step - 1 (so a warmup's first step has lr 0).
    Computed on the CPU where JAX has one: asking it every step then costs the
    accelerator nothing."""
    try:
        where = jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:  # JAX_PLATFORMS without cpu
        where = contextlib.nullcontext()
    with where:
        return float(make_schedule(cfg)(step - 1))


def schedule_warnings(cfg: OptimConfig, steps: int) -> list[str]:
    """What a run of `steps` steps cannot do of the schedule asked for, one sentence each.

    A warmup that does not end before the last step never trains at `lr`; a decay that
    ends before the last step trains the remaining steps at the floor; one that ends
    after it stops short of the floor. Warnings, not errors: a short trial run of a long
    schedule (or a run continued later with more steps) is legitimate.
    """
    if steps < 1:
        return []
    warmup, out = cfg.warmup_steps, []
    if warmup >= steps:
        top = lr_at(cfg, steps)
        out.append(f"optim.warmup_steps ({warmup}) is not shorter than run.steps ({steps}): the learning rate "
                   f"rises to {top:.3g} ({top / cfg.lr:.0%} of optim.lr) and never reaches optim.lr; "
                   f"lower optim.warmup_steps")
    elif cfg.schedule != "constant" and warmup + cfg.decay_steps != steps:
        end = warmup + cfg.decay_steps
        fits = f"optim.decay_steps={steps - warmup} decays over the whole run"
        if end < steps:
            out.append(f"the {cfg.schedule} decay ends at step {end} of {steps}: the last {steps - end} steps "
                       f"train at the floor {cfg.lr * cfg.min_lr_ratio:.3g}; {fits}")
        else:
            last = lr_at(cfg, steps)
            out.append(f"the {cfg.schedule} decay ends at step {end}, after run.steps ({steps}): the run ends at "
                       f"lr {last:.3g} ({last / cfg.lr:.0%} of optim.lr), not at the floor; {fits}")
    return out


def decay_mask(params):
    """Weight decay on matrices only: norms and biases (1-D) are skipped."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    return optax.adamw(
        make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=decay_mask,
    )


@dataclasses.dataclass(frozen=True)
class AdamWState:
    """Where an AdamW's state keeps its moments and step counts: leaf names of a part's
    flat optimizer state (mtjax.treepath), which are also the store's "opt" keys.

    The fused AdamW (mtjax.stream.fused_adamw) reads and writes the state through this,
    and serves a transformation only when `describes` it."""

    mu: str  # the first moment of parameter leaf `n` is "<mu>.<n>"
    nu: str  # the second moment: "<nu>.<n>"
    count: str  # Adam's step count (its bias corrections)
    schedule_count: str  # the learning-rate schedule's step count

    def moments(self, leaf: str) -> tuple[str, str]:
        """(mu, nu) names of a parameter leaf's moments."""
        return f"{self.mu}.{leaf}", f"{self.nu}.{leaf}"

    def names(self, leaves) -> set[str]:
        """Every state leaf name of a part with parameter leaves `leaves`."""
        return {self.count, self.schedule_count} | {m for n in leaves for m in self.moments(n)}

    def describes(self, tx: optax.GradientTransformation) -> bool:
        """Whether `tx`'s state has exactly these leaves (checked on a one-leaf part)."""
        state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((2, 2), jnp.float32)})
        return set(treepath.flatten(state)) == self.names(["w"])


# `make_optimizer`'s state: optax.adamw chains scale_by_adam (0: count, mu, nu), the masked
# weight decay (1: no state) and scale_by_learning_rate (2: the schedule's count).
ADAMW_STATE = AdamWState(mu="0.mu", nu="0.nu", count="0.count", schedule_count="2.count")


_grad_taps = Observers()


def tap_grads(fn):
    """Pass each part's gradient of every step (summed over its micro-batches, before its
    norm is taken) through fn(part, grads) -> grads, in either engine of this process;
    `grads` is {leaf: array} over the part's trained leaves, parts in the backward's order:
    a test's way to make a chosen step's gradients non-finite. Returns the function that
    stops it."""
    return _grad_taps.add(fn)


def tapping() -> bool:
    """Whether any `tap_grads` function is registered (an engine skips the seam if not)."""
    return bool(_grad_taps)


def tapped(part, grads: dict) -> dict:
    """A part's gradient through every `tap_grads` function (unchanged when none)."""
    return _grad_taps.through(grads, part)


def sum_of_squares(tree) -> jnp.ndarray:
    """Sum of squared entries over all leaves, in fp32."""
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def clip_scale(sq_norm: jnp.ndarray, clip_norm: float | None) -> jnp.ndarray:
    """The factor every gradient is multiplied by so the global norm is <= clip_norm."""
    if clip_norm is None:
        return jnp.float32(1.0)
    norm = jnp.sqrt(sq_norm)
    return jnp.where(norm > clip_norm, clip_norm / norm, 1.0).astype(jnp.float32)
