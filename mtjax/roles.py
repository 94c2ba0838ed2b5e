"""Leaf roles: how each leaf of the model is changed by a step, decided in one place.

    trained  has fp32 master weights, optimizer state and a gradient; the update writes
             its master, optimizer state and compute copy
    frozen   only its compute copy: staged to the device like any weight, never
             differentiated, updated or written again
    buffer   stored (master and compute copy) and staged, changed only by its owner's
             rule (`BUFFER_RULES`), never by a gradient

`role(cfg, part, leaf)` is the only function that decides; a leaf's spec
(mtjax.parts.Leaf) carries the answer and every schema, byte count and vjp reads it
there. A model's `freeze` patterns (ModelConfig.freeze, the experiment's `model.freeze`)
freeze leaves; with LoRA adapters (ModelConfig.lora, mtjax.lora) every leaf but the
adapters' is frozen; a layer declares its buffers.

A pattern is `PART` or `PART/LEAF`:
    PART  `embed`, `head`, `block.N`, `block.A-B` (A to B, both included) or a glob
          (`block.*`, `*`)
    LEAF  a glob over the leaf's dotted name in its part (`mlp.*`, `*.kernel`,
          `self_attn.q_proj.kernel`); no LEAF: every leaf of the part
e.g. `embed`, `block.0-15`, `block.*/mlp.*`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable

from mtjax import lora, moe, partid
from mtjax.model_config import ConfigError
from mtjax.partid import PartId

TRAINED, FROZEN, BUFFER = "trained", "frozen", "buffer"
ROLES = (TRAINED, FROZEN, BUFFER)
HAS_MASTER = (TRAINED, BUFFER)  # the roles with fp32 master weights in the store

# Declared buffers: {leaf name glob: rule}. DeepSeek-V3's routing bias is the first: used
# by its router to choose experts (mtjax.moe.route_grouped), never differentiated. A rule
# maps (model config, old master, the step's rule input) to the new master; the runner
# sends a buffer's rule input out of the step in place of its gradient (the part's
# gradient dict, under the buffer's name: not counted in the gradient norm), so it is
# spilled, committed and resumed with the step's gradients, and the update
# (mtjax.stream.update.PartUpdate; the reference trainer alike) applies the rule where
# the part's state is updated. No input (a rule that is off): the buffer stays as it is.
@dataclasses.dataclass(frozen=True)
class BufferRule:
    rate: str  # the ModelConfig field that turns the rule on (0, the default: off, the buffer frozen)
    rule_input: Callable  # its MoE layer's router stats over the step's micro-batches -> the input
    update: Callable  # (old master, the input summed over processes, rate) -> the new master


BUFFER_RULES: dict = {"mlp.gate.e_score_correction_bias":
                      BufferRule("router_bias_update_rate", moe.excess_load, moe.balance_bias)}

_RANGE = re.compile(r"^block\.(\d+)-(\d+)$")
_PART = re.compile(r"^[A-Za-z0-9_.*?\[\]-]+$")  # a part name, a block range or a glob


def _part_matches(selector: str, part: str) -> bool:
    if m := _RANGE.match(selector):
        lo, hi = int(m.group(1)), int(m.group(2))
        pid = PartId(part)
        return pid.is_block and not pid.is_sub and lo <= pid.block <= hi
    return fnmatch.fnmatchcase(part, selector)


def _split(pattern: str) -> tuple[str, str]:
    part, _, leaf = pattern.partition("/")
    return part, leaf or "*"


def matches(pattern: str, part: str, leaf: str) -> bool:
    """Whether `pattern` names leaf `leaf` of part `part`."""
    selector, leaf_glob = _split(pattern)
    return _part_matches(selector, part) and fnmatch.fnmatchcase(leaf, leaf_glob)


def is_buffer(leaf: str) -> bool:
    """Whether a leaf (its dotted name in its part) is a declared buffer: not a parameter."""
    return any(fnmatch.fnmatchcase(leaf, glob) for glob in BUFFER_RULES)


def without_buffers(grads: dict) -> dict:
    """A part's gradient dict without its buffers' rule inputs: what the norm counts."""
    return {n: g for n, g in grads.items() if not is_buffer(n)}


def _rule(leaf: str) -> BufferRule:
    return next(r for glob, r in BUFFER_RULES.items() if fnmatch.fnmatchcase(leaf, glob))


def buffer_input(cfg, leaf: str, stats: list[dict]):
    """The rule input of buffer `leaf` from its MoE layer's router stats of the step (one
    per micro-batch), or None when its rule is off."""
    rule = _rule(leaf)
    return rule.rule_input(stats) if getattr(cfg, rule.rate) else None


def apply_rule(cfg, leaf: str, old, rule_input):
    """Buffer `leaf`'s new master from its old one and the step's rule input."""
    rule = _rule(leaf)
    return rule.update(old, rule_input, getattr(cfg, rule.rate))


def role(cfg, part: str, leaf: str) -> str:
    """The role of leaf `leaf` of part `part` of a model config (a ModelConfig)."""
    if is_buffer(leaf):
        return BUFFER
    if any(matches(p, part, leaf) for p in cfg.freeze):
        return FROZEN
    if cfg.lora is not None and not lora.is_adapter(leaf):  # LoRA: the adapters train, the base is frozen
        return FROZEN
    return TRAINED


def check(cfg, leaves_of) -> None:
    """Refuse, in one line, a malformed freeze pattern, one that names no leaf, or a set
    that freezes every leaf. `leaves_of`: {part: [leaf names]} of the model."""
    for pattern in cfg.freeze:
        selector, leaf_glob = _split(pattern)
        if not selector or pattern.count("/") > 1 or not _PART.match(selector) or not leaf_glob.strip():
            raise ConfigError(f"model.freeze pattern {pattern!r} is malformed; write PART or PART/LEAF, "
                              f"e.g. embed, block.0-15, block.*/mlp.*")
        if (m := _RANGE.match(selector)) and int(m.group(1)) > int(m.group(2)):
            raise ConfigError(f"model.freeze pattern {pattern!r}: the range {selector} is empty; write block.A-B with A <= B")
        if not any(matches(pattern, p, n) for p, names in leaves_of.items() for n in names):
            raise ConfigError(f"model.freeze pattern {pattern!r} names no leaf of this model (parts embed, "
                              f"block.0-{len(leaves_of) - 3}, head; block.0's leaves: {', '.join(leaves_of[partid.block(0)])})")
    if cfg.freeze and not any(role(cfg, p, n) == TRAINED for p, names in leaves_of.items() for n in names):
        raise ConfigError("model.freeze freezes every leaf: nothing is left to train")
