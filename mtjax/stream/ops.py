"""One step as an explicit list of operations, compiled from its schedule.

    s = engine.plan(2, 128, accum=2)
    s.operations                 # a training step's operations, in the order they run
    s.eval_operations            # a forward-only pass (evaluation)
    print(listing(s.operations))

The schedule builder decides; the runner (mtjax.stream.runner) executes one operation
after another and decides nothing. Each mode of the step is a choice of operations here:

- residency: a resident part is `Resident` (its weights already on the device) instead of
  `Stage` + `Release`, and its gradient `GradStays` instead of `GradOut`; a part whose
  adapters are resident is staged (its frozen leaves) and released, its gradient `GradStays`;
- saved groups: their blocks' forward is `Save` (keeping the vjp) and their backward
  `SavedBackward`; no input is kept for them (no `Keep`);
- split MoE blocks: `SplitForward` / `SplitBackward`, which stage their own sub-parts;
- host activations: `Keep` / `Unkeep` with `host=True`;
- the last block staying on the device: no `Release` after its forward, no `Stage` before
  its backward;
- tied embeddings: the head stages the embedding too (`Head(tied=True)`);
- a one-copy store: the step ends with its `Commit`, which starts the updates.

Every `Stage` takes the next part the prefetcher loads: the `Stage` operations, with the
split blocks' sub-parts, are the schedule's `transfers` in order (forward: `forward`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from mtjax import partid
from mtjax.partid import EMBED, HEAD, PartId


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation. Its line in a listing is `verb` formatted with the operation (`op`),
    then `flagged` where its one bool field is set.

    An operation's fields are those of what it acts on (`PartOp`, `BlockOp`, `TiedOp`,
    `GroupOp`): a kind of operation is a subclass with its own `verb`, and a dataclass of
    its own only where it adds a field."""

    verb: ClassVar[str] = ""
    flagged: ClassVar[str] = ""

    def __str__(self) -> str:
        flags = [getattr(self, f.name) for f in dataclasses.fields(self) if f.type == "bool"]
        return self.verb.format(op=self) + (self.flagged if any(flags) else "")


@dataclasses.dataclass(frozen=True)
class PartOp(Op):
    """An operation on one part's weights or gradient."""

    part: PartId


@dataclasses.dataclass(frozen=True)
class BlockOp(Op):
    """An operation on block `block`, over every micro-batch."""

    block: int


@dataclasses.dataclass(frozen=True)
class TiedOp(Op):
    """An operation at the head or the embedding (`tied`: the embedding's weights are the
    head's kernel, so it takes both)."""

    tied: bool


@dataclasses.dataclass(frozen=True)
class GroupOp(Op):
    """An operation on the blocks of a group, `first`..`last`."""

    blocks: range

    @property
    def first(self) -> int:
        return self.blocks.start

    @property
    def last(self) -> int:
        return self.blocks[-1]


class Stage(PartOp):
    """Take the next staged part from the prefetcher: its weights are on the device (with
    its resident adapters', where they are)."""

    verb = "stage {op.part}"


class Resident(PartOp):
    """A resident part's weights, on the device already: nothing crosses."""

    verb = "resident {op.part}"


class Release(PartOp):
    """Hand a staged part's slot back, fenced by the outputs of its last programs."""

    verb = "release {op.part}"


class Embed(Op):
    """The embedding over every micro-batch: token ids -> hidden states."""

    verb = "forward embed"


class Forward(BlockOp):
    """Block `block`'s forward, nothing kept."""

    verb = "forward block.{op.block}"


class Save(BlockOp):
    """Block `block`'s one forward in a saved group: every micro-batch's vjp is kept."""

    verb = "forward block.{op.block}, keep its vjp"


@dataclasses.dataclass(frozen=True)
class SplitForward(BlockOp):
    """A split MoE block's forward, sub-part by sub-part (stages them itself); `keep`:
    its routing is kept for the backward."""

    verb, flagged = "forward split block.{op.block}", ", keep its routing"
    keep: bool


@dataclasses.dataclass(frozen=True)
class Keep(BlockOp):
    """Keep every micro-batch's hidden states as block `block`'s input, for the backward
    (`host`: in host memory)."""

    verb, flagged = "keep input of block.{op.block}", " in host memory"
    host: bool = False


@dataclasses.dataclass(frozen=True)
class Unkeep(BlockOp):
    """Bring back the input kept for block `block`."""

    verb, flagged = "take back input of block.{op.block}", " from host memory"
    host: bool = False


class Head(TiedOp):
    """Loss and gradients of every micro-batch at the LM head; the gradient w.r.t. the
    hidden states flows back."""

    verb, flagged = "forward+backward head", " (tied embedding)"


class HeadLoss(TiedOp):
    """The loss of every micro-batch (evaluation)."""

    verb, flagged = "loss at head", " (tied embedding)"


class Backward(BlockOp):
    """One block's recompute and backward in one program (a group of one)."""

    verb = "recompute+backward block.{op.block}"


class RecomputeBackward(GroupOp):
    """A recompute group: its blocks' forward recomputed from the kept input, keeping
    their vjps, then walked back; per micro-batch."""

    verb = "recompute block.{op.first}..{op.last}, backward in reverse"


class SavedBackward(GroupOp):
    """A saved group's backward from the vjps its forward kept: nothing recomputed."""

    verb = "backward block.{op.first}..{op.last} from the kept vjps"


class SplitBackward(BlockOp):
    """A split MoE block's backward, sub-part by sub-part (stages them itself)."""

    verb = "backward split block.{op.block}"


class EmbedBackward(TiedOp):
    """The embedding lookup's gradient (plus the head's, when tied)."""

    verb, flagged = "backward embed", " (+ the head's use of it)"


class GradOut(PartOp):
    """A part's gradient, summed over the micro-batches, leaves for the host."""

    verb = "gradient out {op.part}"


class GradStays(PartOp):
    """A resident part's summed gradient stays on the device for its update there."""

    verb = "gradient stays {op.part}"


class Update(Op):
    """The clip scale from every gradient's norm (a host sync), then every part's update:
    streamed parts' deferred to their next staging, resident ones' on the device now."""

    verb = "update (clip scale known)"


class Commit(Op):
    """The step into the store: a one-copy store's (the state before its update plus its
    gradients, durable); only then may the updates overwrite the one copy, and they start."""

    verb = "commit (state before the update + gradients)"


def needed(operations) -> tuple[PartId, ...]:
    """Every part whose weights `operations` take, in the order they first take them (a
    split block's when it stages its first sub-part): the order in which the next step's
    forward needs the parts' updates done."""
    seen: dict[PartId, None] = {}
    for op in operations:
        if isinstance(op, (Stage, Resident)):
            seen.setdefault(op.part)
        elif isinstance(op, SplitForward):
            seen.setdefault(partid.block(op.block))
    return tuple(seen)


def listing(operations) -> str:
    """The operations, one a line, numbered."""
    return "\n".join(f"{i:3d}  {op}" for i, op in enumerate(operations))


class _Builder:
    def __init__(self, s, train: bool):
        self.s, self.train, self.out = s, train, []
        self.host = s.stream.activations == "host"
        self.saved = {i for g in s.saved for i in g} if train else set()
        self.starts = {g.start for g in s.groups if g not in s.saved} if train else set()

    def weights(self, part: PartId) -> None:
        self.out.append(Resident(part) if part in self.s.resident else Stage(part))

    def release(self, part: PartId) -> None:
        if part not in self.s.resident:
            self.out.append(Release(part))

    def grad(self, part: PartId) -> None:
        stays = part in self.s.resident or part in self.s.adapters
        self.out.append(GradStays(part) if stays else GradOut(part))

    def keep(self, block: int) -> None:
        if block in self.starts:
            self.out.append(Keep(block, self.host))

    def forward(self) -> None:
        s, n = self.s, self.s.cfg.num_hidden_layers
        self.weights(EMBED)
        self.out.append(Embed())
        self.release(EMBED)
        self.keep(0)
        for i in range(n):
            name = partid.block(i)
            if i in s.split:
                self.out.append(SplitForward(i, self.train))
            else:
                self.weights(name)
                self.out.append(Save(i) if i in self.saved else Forward(i))
                if not (self.train and s.last_stays and i == n - 1):  # else the backward starts with it
                    self.release(name)
            self.keep(i + 1)
        tied = s.cfg.tie_word_embeddings
        self.weights(HEAD)
        if tied:
            self.weights(EMBED)
        self.out.append(Head(tied) if self.train else HeadLoss(tied))
        self.release(HEAD)
        if self.train:
            self.grad(HEAD)
        if tied:
            self.release(EMBED)  # a tied embedding's gradient from the head waits on the device

    def backward(self) -> None:
        s, n = self.s, self.s.cfg.num_hidden_layers
        for group in reversed(s.groups):
            names = [partid.block(i) for i in group]
            if group.start in s.split:
                self.out += [Unkeep(group.start, self.host), SplitBackward(group.start)]
                self.grad(names[0])
                continue
            if group in s.saved:
                self.out.append(SavedBackward(group))
                for name in reversed(names):
                    self.grad(name)
                continue
            self.out.append(Unkeep(group.start, self.host))
            stays = s.last_stays and group.start == n - 1  # staged since its forward
            for name in names:
                if not stays:
                    self.weights(name)
            self.out.append(Backward(group.start) if len(group) == 1 else RecomputeBackward(group))
            for name in reversed(names):
                self.release(name)
                self.grad(name)
        self.out.append(EmbedBackward(s.cfg.tie_word_embeddings))
        self.grad(EMBED)
        self.out.append(Update())
        if s.store.copies == 1:  # one copy of the state: committed before an update may overwrite it
            self.out.append(Commit())


def compile_step(s, train: bool = True) -> tuple:
    """The operations of one training step (`train`) or forward-only pass of schedule `s`."""
    b = _Builder(s, train)
    b.forward()
    if train:
        b.backward()
    return tuple(b.out)
