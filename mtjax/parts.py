"""The model as an ordered list of parts: the unit of storage, streaming and update.

Parts are embed, block 0 ... block N-1 and head, each named by a mtjax.partid.PartId
(its name, "embed", "block.3", "head", is the store's key). Each part has three
kinds of state, each a flat {leaf name: array} dict (see mtjax.treepath):

    compute  the weights the device computes with (mtjax.precision: the master rounded
             to the compute dtype), which are streamed to the device
    master   the fp32 master weights
    opt      the optimizer state of the part (e.g. AdamW mu and nu)

Every byte count, store schema and staging buffer derives from `schema`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from mtjax import model, partid, precision, treepath
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig
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


def schema(cfg: ModelConfig, name: str, kind: str, tx=None) -> dict[str, jax.ShapeDtypeStruct]:
    """{leaf name: ShapeDtypeStruct} of one kind of state of one part.

    `tx` (an optax transformation) is needed for kind "opt".
    """
    tree = abstract_part(cfg, name)
    if kind == "compute":  # each leaf's compute representation (mtjax.precision)
        return precision.policy(cfg).schema(treepath.flatten(tree))
    if kind == "opt":
        if tx is None:
            raise ValueError("schema of kind 'opt' needs the optax transformation")
        tree = jax.eval_shape(tx.init, tree)
    elif kind != "master":
        raise ValueError(f"unknown state kind {kind!r}; one of {KINDS}")
    return treepath.flatten(tree)


def nbytes(named: dict) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in named.values())
