"""LoRA adapters over a frozen base, as PEFT defines them.

A targeted linear layer (mtjax.layers.basic.Dense, kernel [in, out]) gains two trained
leaves beside its kernel, `lora_a` [in, r] and `lora_b` [r, out], and computes

    y = x @ kernel (+ bias) + scale * (x @ lora_a) @ lora_b,   scale = alpha / r  (alpha / sqrt(r): rsLoRA)

PEFT's `lora_A.weight` [r, in] and `lora_B.weight` [out, r] are their transposes. A is
drawn as PEFT's default draws it (kaiming-uniform with a = sqrt(5): uniform within
+-1/sqrt(in)), B is zero, so a fresh adapter leaves the model's output unchanged.

With adapters every other leaf of the model is frozen (mtjax.roles): its compute copy
is streamed to the device and never written again; the adapters have the fp32 master,
the optimizer state and the gradients. Targets are module names as PEFT's
`target_modules` gives them (`q_proj`, `down_proj`, ...), or "all-linear": every linear
layer of the blocks. The routed experts and the router of a mixture of experts are not
adapted (their kernels run stacked, mtjax.moe). PEFT, on transformers 5, adapts them (its
fused expert tensors, by target_parameters) where a target names them (their gate_proj,
up_proj, down_proj; all-linear, which also adapts the router): so on a MoE model targets
that would reach the routed experts are refused, and mtjax's adapters equal PEFT's for
the others (attention; a dense layer's or shared expert's own names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.families.hf_config import ConfigError

A, B = "lora_a", "lora_b"  # the adapter leaves of a targeted linear layer
ALL_LINEAR = "all-linear"
EXPERTS = "experts"  # a MoE block's routed experts: not adaptable (refused by name)
# The linear layers of a MoE block that LoRA leaves alone: its router and shared expert's
# gate (PEFT's all-linear skips them too), and its experts (their kernels run stacked).
NOT_ADAPTED = ("gate", "shared_expert_gate")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the blocks' linear layers; the rest of the model is frozen."""

    rank: int | None = None  # adapter rank r; null: no adapters (every leaf trains, unless model.freeze)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / r
    rslora: bool = False  # scale by alpha / sqrt(r) instead (rank-stabilised LoRA)
    dropout: float = 0.0  # dropout on the adapter's input (PEFT's lora_dropout), in training steps only
    target_modules: tuple[str, ...] = (ALL_LINEAR,)  # linear layers by module name (q_proj, v_proj, ...), or all-linear

    def __post_init__(self):
        # One name or a list (YAML, JSON, PEFT's config, whose order is a set's), in one order:
        # the same targets are the same config, which a store compares.
        names = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
        object.__setattr__(self, "target_modules", tuple(sorted(set(names))))
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:  # with no rank too: a value no run can mean is refused, not ignored
            raise ConfigError(f"lora.dropout must be at least 0 and below 1, got {self.dropout!r}")
        if self.rank is None:
            return
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora.rank must be a positive integer (or null: no adapters), got {self.rank!r}")
        if not self.target_modules:
            raise ConfigError("lora.target_modules is empty; name linear layers (q_proj, v_proj, ...) or all-linear")

    @property
    def scale(self) -> float:
        """What the adapter's output is multiplied by."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targets(self, path: tuple) -> bool:
        """Whether the linear layer at module path `path` in a block (e.g. ("self_attn",
        "q_proj")) gets an adapter."""
        names = [str(p) for p in path]
        if names[-1] in NOT_ADAPTED or EXPERTS in names:
            return False
        return ALL_LINEAR in self.target_modules or names[-1] in self.target_modules


# Dropout on the adapters' input (PEFT's lora_dropout: lora_B(lora_A(dropout(x))) * scale).
# A training step's block programs are traced inside `dropout_scope(key)`, `key` drawn by
# `dropout_key` from the run's seed, the step, the micro-batch and the block: each adapted
# layer the block calls takes the next key of the scope (in call order, the same in the
# forward and its recompute), so the streamed engine and the reference drop the same
# entries. Outside a scope (evaluation, sampling) nothing is dropped.
_scope = threading.local()


def dropout_key(seed: int, step: int, micro: int, block: int):
    """The dropout key of one block of one micro-batch of one training step (`micro` may be
    traced: the reference trainer scans over micro-batches)."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(jax.random.fold_in(key, micro), block)


@contextlib.contextmanager
def dropout_scope(key):
    """Trace a block with dropout on its adapters' input, drawn from `key` (None: none)."""
    before = getattr(_scope, "state", None)
    _scope.state = None if key is None else [key, 0]
    try:
        yield
    finally:
        _scope.state = before


def dropped(x, rate: float):
    """x with PEFT's inverted dropout of `rate` applied, inside a `dropout_scope`; else x."""
    state = getattr(_scope, "state", None)
    if state is None or rate == 0:
        return x
    key = jax.random.fold_in(state[0], state[1])
    state[1] += 1
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def is_adapter(leaf: str) -> bool:
    """Whether a part's leaf (dotted name) is an adapter's."""
    return leaf.rpartition(".")[2] in (A, B)


def init_a(key, d_in: int, rank: int) -> jnp.ndarray:
    """A fresh adapter's A [in, r]: PEFT's kaiming-uniform (a = sqrt(5)), uniform within +-1/sqrt(in)."""
    bound = 1.0 / math.sqrt(d_in)
    return jax.random.uniform(key, (d_in, rank), jnp.float32, -bound, bound)


def fresh(leaves: dict, seed: int, salt: int) -> dict[str, np.ndarray]:
    """Fresh values of the adapter leaves among `leaves` ({name: Leaf or ShapeDtypeStruct}
    of one part): for a base that comes from a checkpoint. `salt` (the part's index)
    gives each part its own draws."""
    key = jax.random.fold_in(jax.random.key(seed), salt)
    out = {}
    for i, (name, leaf) in enumerate(sorted(leaves.items())):
        if name.endswith("." + A):
            out[name] = np.asarray(init_a(jax.random.fold_in(key, i), *leaf.shape))
        elif name.endswith("." + B):
            out[name] = np.zeros(leaf.shape, np.float32)
    return out


def check(cfg, linear_names: set[str], expert_names: set[str] = frozenset()) -> None:
    """Refuse, in one line, targets that name no linear layer of the model (`linear_names`:
    the module names of the blocks' adaptable linear layers), or a model with none; on a
    mixture of experts (`expert_names`: its routed experts' linear layers), targets that
    PEFT would apply to the routed experts too (all-linear, or their names)."""
    lora = cfg.lora
    experts = [t for t in lora.target_modules if t in (ALL_LINEAR, EXPERTS, *expert_names)] if expert_names else []
    if experts:
        raise ConfigError(f"lora.target_modules {', '.join(experts)} reaches this MoE model's routed experts, which "
                          "mtjax cannot adapt yet (PEFT adapts transformers 5's fused experts by target_parameters); "
                          f"name the other linear layers: {', '.join(sorted(linear_names - expert_names))}")
    unknown = [t for t in lora.target_modules if t != ALL_LINEAR and t not in linear_names]
    if unknown or not linear_names:
        have = ", ".join(sorted(linear_names)) or "none"
        raise ConfigError(f"lora.target_modules {', '.join(unknown) or ALL_LINEAR} names no linear layer of this "
                          f"model's blocks; its linear layers: {have} (or all-linear)")


def merged(cfg, weights: dict) -> dict:
    """A part's fp32 weights ({leaf: array}) with each adapter folded into its kernel
    (kernel + scale * A @ B) and the adapter leaves dropped: the merged model's."""
    out = {n: w for n, w in weights.items() if not is_adapter(n)}
    for name in weights:
        if name.endswith("." + A):
            module = name[:-len(A) - 1]
            a, b = (np.asarray(weights[f"{module}.{x}"], np.float32) for x in (A, B))
            out[f"{module}.kernel"] = np.asarray(weights[f"{module}.kernel"], np.float32) + cfg.lora.scale * (a @ b)
    return out
