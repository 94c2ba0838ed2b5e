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
layer of the blocks.

The routed experts of a mixture of experts (mtjax.layers.feedforward.SparseMoE) are
adapted by the target `experts`, as PEFT adapts transformers 5's fused expert tensors
(`target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`, its
ParamWrapper): each expert e gets one adapter over its gate and up projections together,
`gate_up_proj.lora_a` [d, r] and `.lora_b` [r, 2f] (the first f outputs its gate's, the
rest its up's), and one on its down projection, `down_proj.lora_a` [f, r] and `.lora_b`
[r, d]; its kernels run stacked (mtjax.moe) with the delta added, kernel + scale * A_e @ B_e
(`expert_kernels`), as PEFT adds the delta to the expert tensor. Each expert's adapters
are its own leaves, so expert groups (mtjax.expert_groups) carry them with the expert.
PEFT keeps one lora_A [r E, in] and one lora_B [out, r E] per fused tensor (`to_peft`,
`from_peft`). PEFT refuses dropout there (it cannot factor out the input), and so does
mtjax. The router is not adapted, and on a MoE model all-linear and the experts' own
module names are refused: PEFT's all-linear there also adapts the router (and the experts
twice over), and mtjax's adapters equal PEFT's for attention, a dense layer's or shared
expert's own names, and `experts`.
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
EXPERTS = "experts"  # the target of a MoE block's routed experts (their stacked kernels)
# An adapted expert's adapted modules, each a [in, out] kernel pair PEFT adapts as one tensor:
# gate and up together (transformers' gate_up_proj), and down.
EXPERT_MODULES = ("gate_up_proj", "down_proj")
# Families whose transformers 5 experts keep gate_up_proj as [E, d, 2f] (input first): PEFT's
# ParamWrapper factors those the other way round (its A over the 2f outputs), so mtjax's
# expert adapters would not be PEFT's; `experts` is refused there.
INPUT_FIRST_EXPERTS = ("llama4", "llama4_text")
# The linear layers of a MoE block that LoRA leaves alone: its router and shared expert's
# gate (PEFT's all-linear skips them too); its experts are adapted by EXPERTS, not as Dense layers.
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
        if self.dropout > 0 and self.adapts_experts:
            raise ConfigError(f"lora.dropout must be 0 with the target {EXPERTS}: the routed experts' adapters add "
                              "their delta to the stacked kernels, where no input can be dropped (PEFT refuses it too)")

    @property
    def adapts_experts(self) -> bool:
        """Whether the routed experts of MoE blocks get adapters."""
        return EXPERTS in self.target_modules

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


def check(cfg, linear_names: set[str], expert_names: set[str] = frozenset(), adaptable_experts: bool = False) -> None:
    """Refuse, in one line, targets that name no linear layer of the model (`linear_names`:
    the module names of the blocks' adaptable linear layers), or a model with none; on a
    mixture of experts (`expert_names`: its routed experts' linear layers), all-linear and
    those names, which PEFT would apply to more than mtjax does; `experts` where no block's
    routed experts take adapters (`adaptable_experts`: some do)."""
    lora = cfg.lora
    experts = [t for t in lora.target_modules if t in (ALL_LINEAR, *expert_names)] if expert_names else []
    if experts:
        raise ConfigError(f"lora.target_modules {', '.join(experts)} on this MoE model is ambiguous (PEFT's "
                          "all-linear also adapts the router): name its routed experts' kernels as "
                          f"{EXPERTS} and the other linear layers by name: {', '.join(sorted(linear_names - expert_names))}")
    if lora.adapts_experts and cfg.model_type in INPUT_FIRST_EXPERTS:
        raise ConfigError(f"lora.target_modules {EXPERTS} is not supported on {cfg.model_type}: PEFT factors its "
                          "fused expert tensors [E, d, 2f] otherwise than mtjax's adapters; name its other linear "
                          f"layers: {', '.join(sorted(linear_names - expert_names))}")
    if lora.adapts_experts and not adaptable_experts:
        raise ConfigError(f"lora.target_modules {EXPERTS} names the routed experts of MoE blocks, and this model has "
                          f"none that take adapters; name its linear layers: {', '.join(sorted(linear_names)) or 'none'}")
    unknown = [t for t in lora.target_modules if t not in (ALL_LINEAR, EXPERTS) and t not in linear_names]
    if unknown or not linear_names:
        have = ", ".join(sorted(linear_names)) or "none"
        raise ConfigError(f"lora.target_modules {', '.join(unknown) or ALL_LINEAR} names no linear layer of this "
                          f"model's blocks; its linear layers: {have} (or all-linear)")


def merged(cfg, weights: dict) -> dict:
    """A part's fp32 weights ({leaf: array}) with each adapter folded into its kernel
    (kernel + scale * A @ B; an expert's gate_up_proj adapter into its gate_proj and
    up_proj kernels) and the adapter leaves dropped: the merged model's."""
    out = {n: w for n, w in weights.items() if not is_adapter(n)}
    for name in weights:
        if name.endswith("." + A):
            module = name[:-len(A) - 1]
            a, b = (np.asarray(weights[f"{module}.{x}"], np.float32) for x in (A, B))
            delta = cfg.lora.scale * (a @ b)
            if f"{module}.kernel" in weights:
                out[f"{module}.kernel"] = np.asarray(weights[f"{module}.kernel"], np.float32) + delta
                continue
            expert, f = module.rpartition(".")[0], delta.shape[-1] // 2  # gate_up_proj: the gate's f, then the up's
            for i, half in enumerate(("gate_proj", "up_proj")):
                kernel = f"{expert}.{half}.kernel"
                out[kernel] = np.asarray(weights[kernel], np.float32) + delta[:, i * f:(i + 1) * f]
    return out


def expert_kernels(kernels: dict, scale: float):
    """(gate, up, down) [n, in, out] of n experts from their stacked leaves ({leaf in the
    expert: [n, ...]}: "gate_proj.kernel", ... and, where adapted, "gate_up_proj.lora_a",
    ...), each adapted kernel with its delta scale * A_e @ B_e added, computed in the
    kernel's dtype as PEFT computes it (no fp32 copy of the experts' kernels)."""
    gate, up, down = (kernels[f"{n}.kernel"] for n in ("gate_proj", "up_proj", "down_proj"))

    def delta(module, like):
        a, b = (kernels[f"{module}.{x}"].astype(like.dtype) for x in (A, B))
        return jnp.einsum("eir,ero->eio", a, b, preferred_element_type=like.dtype) * jnp.asarray(scale, like.dtype)

    if f"gate_up_proj.{A}" in kernels:
        gate_up = delta("gate_up_proj", gate)
        gate, up = gate + gate_up[..., :gate.shape[-1]], up + gate_up[..., gate.shape[-1]:]
    if f"down_proj.{A}" in kernels:
        down = down + delta("down_proj", down)
    return gate, up, down


def to_peft(a, b):
    """PEFT's (lora_A [r E, in], lora_B [out, r E]) of one fused expert tensor from the
    experts' stacked factors a [E, in, r] and b [E, r, out] (ParamWrapper: lora_A's rows
    expert-major, lora_B's columns rank-major: column j r-th of expert e is j = r E + e)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    e, d_in, rank = a.shape
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * rank, d_in)),
            np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[-1], rank * e)))


def from_peft(lora_a, lora_b, experts: int):
    """`to_peft`'s inverse: (a [E, in, r], b [E, r, out])."""
    lora_a, lora_b = np.asarray(lora_a, np.float32), np.asarray(lora_b, np.float32)
    rank = lora_a.shape[0] // experts
    a = lora_a.reshape(experts, rank, -1).transpose(0, 2, 1)
    b = lora_b.reshape(lora_b.shape[0], rank, experts).transpose(2, 1, 0)
    return np.ascontiguousarray(a), np.ascontiguousarray(b)
