"""The model as an ordered list of parts: the unit of storage, streaming and update.

Parts are embed, block 0 ... block N-1 and head, each named by a mtjax.partid.PartId
(its name, "embed", "block.3", "head", is the store's key). Each part has three
kinds of state, each a flat {leaf name: array} dict (see mtjax.treepath):

    compute  the weights the device computes with (mtjax.precision: the master rounded
             to the compute dtype), which are streamed to the device
    master   the fp32 master weights
    opt      the optimizer state of the part (e.g. AdamW mu and nu)

Each leaf is described once, by its `Leaf` spec (`leaves`): shape, master dtype, compute
representation (mtjax.precision) and role (mtjax.roles). The three kinds are views of
it: every leaf has a compute copy; trained leaves and buffers have a master; only
trained leaves have optimizer state (and a gradient). Every byte count, store schema
and staging buffer derives from `schema`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math

import jax
import numpy as np

from mtjax import lora, model, partid, precision, roles, treepath
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ConfigError, ModelConfig
from mtjax.partid import EMBED, HEAD, PartId

KINDS = ("compute", "master", "opt")


@dataclasses.dataclass(frozen=True)
class Part:
    name: PartId  # embed, block 3, head
    fn_kind: str | LayerSpec  # which compiled function runs it: "embed", a block's LayerSpec, "head"
    index: int  # position in the model, 0 = embed


def parts(cfg: ModelConfig) -> list[Part]:
    out = [Part(EMBED, "embed", 0)]
    out += [Part(partid.block(i), spec, i + 1) for i, spec in enumerate(cfg.layer_specs)]
    out.append(Part(HEAD, "head", cfg.num_hidden_layers + 1))
    return out


def part_params(params, name: PartId | str):
    """The params subtree of one part of a model params pytree."""
    name = PartId(name)
    return params["blocks"][name.block] if name.is_block else params[name.kind]


def block_tree(cfg: ModelConfig, spec: LayerSpec, flat: dict):
    """A block's params pytree as its layers take it, from the flat compute weights the
    stream moves: a quantized kernel's bytes decoded (mtjax.precision; traced, so inside
    the block's own programs, on the device)."""
    template = model.abstract_block(cfg, spec)
    shapes = {n: s.shape for n, s in treepath.flatten(template).items()}
    return treepath.unflatten(template, precision.policy(cfg).decoded(flat, shapes))


def whole_params(cfg: ModelConfig, by_part: dict):
    """The model params pytree from each part's subtree {part: subtree} (`part_params`' inverse)."""
    blocks = [by_part[partid.block(i)] for i in range(cfg.num_hidden_layers)]
    return {"embed": by_part[EMBED], "blocks": blocks, "head": by_part[HEAD]}


def fn_kind(cfg: ModelConfig, name: PartId | str) -> str | LayerSpec:
    """Which compiled function runs a part: "embed", a block's LayerSpec, "head"."""
    name = PartId(name)
    return cfg.layer_specs[name.block] if name.is_block else name.kind


def abstract_part(cfg: ModelConfig, name: PartId | str):
    """The fp32 parameter pytree of one part as ShapeDtypeStructs (that part's alone: a
    3000-block model's schemas stay linear in its blocks)."""
    return model.abstract_part(cfg, fn_kind(cfg, name))


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a part, described once: every kind of its state is a view of this."""

    name: str  # dotted, within its part ("attn.q_proj.kernel")
    shape: tuple[int, ...]
    master: np.dtype  # the fp32 master weights' dtype (trained leaves and buffers)
    compute: precision.Compute | precision.Quantized  # what is staged; the device computes with it (decoded)
    role: str  # mtjax.roles: trained, frozen or buffer


@functools.lru_cache(maxsize=4096)
def leaves(cfg: ModelConfig, name: str) -> dict[str, Leaf]:
    """{leaf name: Leaf} of one part, in the part's flat order (shared: do not change it)."""
    policy = precision.policy(cfg)
    return {n: Leaf(n, tuple(s.shape), np.dtype(s.dtype), policy.leaf(n, s, name), roles.role(cfg, name, n))
            for n, s in treepath.flatten(abstract_part(cfg, name)).items()}


def trained(cfg: ModelConfig, name: str) -> tuple[str, ...]:
    """The names of a part's trained leaves (those its vjp is taken against)."""
    return tuple(n for n, leaf in leaves(cfg, name).items() if leaf.role == roles.TRAINED)


@functools.lru_cache(maxsize=64)
def frozen_any(cfg: ModelConfig) -> bool:
    """Whether any leaf of the model is not trained (cached: every schedule asks, and a
    model of hundreds of experts a block has tens of thousands of leaves)."""
    if not cfg.freeze and not roles.BUFFER_RULES and cfg.lora is None:
        return False
    return any(leaf.role != roles.TRAINED for p in parts(cfg) for leaf in leaves(cfg, p.name).values())


def trained_params(cfg: ModelConfig) -> int:
    """How many parameters a step trains: those of the trained leaves (mtjax.roles)."""
    return sum(math.prod(leaf.shape) for p in parts(cfg) for leaf in leaves(cfg, p.name).values()
               if leaf.role == roles.TRAINED)


def frozen_leaves_any(cfg: ModelConfig) -> bool:
    """Whether any leaf of the model is frozen (by `model.freeze` or under LoRA adapters;
    buffers aside: they have masters)."""
    return any(leaf.role == roles.FROZEN for p in parts(cfg) for leaf in leaves(cfg, p.name).values())


def trained_only(cfg: ModelConfig, params):
    """A model-layout params pytree (mtjax.model) with every leaf that is not trained
    replaced by None: what the whole-model gradient and optimizer state cover."""
    def part(name: str, tree):
        keep = trained(cfg, name)
        flat = treepath.flatten(tree)
        return treepath.unflatten(tree, {n: a if n in keep else None for n, a in flat.items()}) \
            if len(keep) < len(flat) else tree

    return {"embed": part("embed", params["embed"]), "head": part("head", params["head"]),
            "blocks": [part(partid.block(i), b) for i, b in enumerate(params["blocks"])]}


def fp32_weights(cfg: ModelConfig, name: PartId | str, master: dict, read_compute) -> dict:
    """A part's fp32 weights, {leaf: array}: its `master` ({leaf: array}), and where a leaf
    has none (frozen, mtjax.roles) its compute copy in fp32 (a quantized one's decoded),
    which is all it has; `read_compute()` gives the compute copy, read only when a leaf
    needs it."""
    specs = leaves(cfg, name)
    if len(master) == len(specs):
        return master
    compute = read_compute()
    return {n: master[n] if n in master else leaf.compute.to_fp32(compute[n], leaf.shape) for n, leaf in specs.items()}


def check_roles(cfg: ModelConfig) -> None:
    """Refuse bad freeze patterns (mtjax.roles.check), LoRA targets (mtjax.lora.check),
    a base format (mtjax.precision) with no frozen leaf to apply to and a buffer rule's
    rate on a model without the buffer, in one line."""
    if cfg.lora is not None:
        lora.check(cfg, model.linear_names(cfg), model.linear_names(cfg, experts=True), model.adaptable_experts(cfg))
    if cfg.freeze:
        roles.check(cfg, {p.name: list(treepath.flatten(abstract_part(cfg, p.name))) for p in parts(cfg)})
    if cfg.base_format != "compute" and not any(isinstance(leaf.compute, precision.Quantized)
                                                 for p in parts(cfg) for leaf in leaves(cfg, p.name).values()):
        raise ConfigError(f"model.base_format {cfg.base_format} applies to frozen 2-D kernels of blocks, and "
                          "model.freeze freezes none; freeze them, e.g. model.freeze=block.*/*.kernel")
    for glob, rule in roles.BUFFER_RULES.items():
        if getattr(cfg, rule.rate) and not any(roles.is_buffer(n) and fnmatch.fnmatchcase(n, glob)
                                               for p in parts(cfg) for n in leaves(cfg, p.name)):
            raise ConfigError(f"model.{rule.rate} updates {glob}, which this model ({cfg.model_type}) does not "
                              f"have; set it to 0")


def schema(cfg: ModelConfig, name: str, kind: str, tx=None) -> dict[str, jax.ShapeDtypeStruct]:
    """{leaf name: ShapeDtypeStruct} of one kind of state of one part: a view of its
    leaves (`leaves`) by role. `tx` (an optax transformation) is needed for kind "opt"."""
    specs = leaves(cfg, name)
    if kind == "compute":  # every leaf's compute representation (mtjax.precision)
        return {n: leaf.compute.struct(leaf.shape) for n, leaf in specs.items()}
    if kind == "master":
        return {n: jax.ShapeDtypeStruct(leaf.shape, leaf.master) for n, leaf in specs.items()
                if leaf.role in roles.HAS_MASTER}
    if kind == "opt":
        if tx is None:
            raise ValueError("schema of kind 'opt' needs the optax transformation")
        trained_ = trained_master(cfg, name)  # a part with none has no optimizer state at all
        return treepath.flatten(jax.eval_shape(tx.init, trained_)) if trained_ else {}
    raise ValueError(f"unknown state kind {kind!r}; one of {KINDS}")


def trained_master(cfg: ModelConfig, name: str) -> dict[str, jax.ShapeDtypeStruct]:
    """{leaf: ShapeDtypeStruct} of the trained leaves' masters: what the optimizer and the
    gradient cover (a flat dict: the optimizer state's names are "<prefix>.<leaf>")."""
    return {n: jax.ShapeDtypeStruct(leaf.shape, leaf.master) for n, leaf in leaves(cfg, name).items()
            if leaf.role == roles.TRAINED}


def quantized_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(bytes of the quantized leaves' compute copies (mtjax.precision), the bytes they
    would take in the compute dtype): what a base format saves on each pass of the stream."""
    specs = [leaf for p in parts(cfg) for leaf in leaves(cfg, p.name).values()
             if isinstance(leaf.compute, precision.Quantized)]
    return (sum(nbytes({leaf.name: leaf.compute.struct(leaf.shape)}) for leaf in specs),
            sum(math.prod(leaf.shape) * leaf.compute.dtype.itemsize for leaf in specs))


def nbytes(named: dict) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in named.values())
