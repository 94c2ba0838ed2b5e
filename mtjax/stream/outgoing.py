"""What leaves a part once its gradient is summed over a step's micro-batches (mtjax.roles):

    outgoing = Outgoing(cfg)
    grads = outgoing(part, summed, stats)   # {} or None: nothing to update

its trained leaves' gradients, through `mtjax.optim.tap_grads`'s functions, and, beside
them under the buffers' names, the inputs of its buffers' rules (DeepSeek's correction
bias: the step's expert loads, from its MoE layer's router stats of every micro-batch).
Frozen leaves and buffers get no gradient: a split block's expert group with some experts
frozen, or its router part, differentiates them all, and their gradients are dropped here.
"""

from __future__ import annotations

from mtjax import parts, roles
from mtjax.optim import tapped
from mtjax.partid import PartId


class Outgoing:
    def __init__(self, cfg):
        self.cfg = cfg
        leaves = {p.name: parts.leaves(cfg, p.name) for p in parts.parts(cfg)}
        self._untrained = {name: frozenset(n for n, leaf in ls.items() if leaf.role != roles.TRAINED)
                           for name, ls in leaves.items()}
        self._buffers = {name: frozenset(n for n, leaf in ls.items() if leaf.role == roles.BUFFER)
                         for name, ls in leaves.items()}
        self._moe_index = {i: j for j, i in enumerate(sorted(cfg.moe_layers))}  # block -> its place in `stats`

    def __call__(self, part, grads, stats: list):
        """`grads`: the part's summed gradient (None or {} when nothing is trained);
        `stats`: every micro-batch's router stats (one entry per MoE layer)."""
        untrained = self._untrained[PartId(part).owner]
        if grads and untrained:
            grads = {n: g for n, g in grads.items() if n not in untrained}
        if inputs := self._rule_inputs(part, stats):
            return {**(tapped(part, grads) if grads else {}), **inputs}
        return tapped(part, grads) if grads else grads

    def _rule_inputs(self, part, stats: list) -> dict:
        """The rule inputs of the buffers a part holds (a whole block's, or its router
        part's); {} when no rule is on."""
        pid = PartId(part)
        if pid.block not in self._moe_index or pid.group is not None:
            return {}
        layer = [per_batch[self._moe_index[pid.block]] for per_batch in stats]
        inputs = {n: roles.buffer_input(self.cfg, n, layer) for n in sorted(self._buffers[pid.owner])}
        return {n: x for n, x in inputs.items() if x is not None}
