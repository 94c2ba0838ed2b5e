"""Which parts one training step streams, in what order, and which stay on the device:
the recompute groups, the parts a forward and a training step stage (`forward_parts`,
`train_parts`), the resident parts and resident adapters, the saved groups, the MoE
blocks split into expert groups and the parts staged in place. Each picks parts or blocks
from the model config, the stream options and a few facts of the step (where the store
keeps the compute copy, whether the device reads host memory); no bytes are counted here.
mtjax.stream.schedule.describe builds a step's Schedule from these choices.
"""

from __future__ import annotations

import functools

import numpy as np

from mtjax import expert_groups, partid, parts, roles
from mtjax.config import StreamConfig
from mtjax.errors import MtjaxError
from mtjax.model_config import ModelConfig
from mtjax.partid import EMBED, HEAD, PartId


def groups(num_blocks: int, keep_every: int, alone=()) -> tuple[range, ...]:
    """Recompute groups of `keep_every` blocks (0: as many as run together); the blocks
    in `alone` (split MoE blocks) are groups of their own."""
    out, run = [], []

    def close():
        k = len(run) if keep_every == 0 else keep_every
        out.extend(range(s, min(s + k, run[-1] + 1)) for s in range(run[0], run[-1] + 1, k))
        run.clear()

    for i in range(num_blocks):
        if i not in alone:
            run.append(i)
            continue
        if run:
            close()
        out.append(range(i, i + 1))
    if run:
        close()
    return tuple(out)


def last_stays(groups_: tuple[range, ...], split=()) -> bool:
    """Whether the last block's weights stay on the device from its forward to its
    backward (saves one transfer): when it is a recompute group of its own, not split."""
    return len(groups_[-1]) == 1 and groups_[-1].start not in split


def _block_units(i: int, split: dict, backward: bool = False) -> list[PartId]:
    """What crosses for block i: the block, or a split block's sub-parts (router part,
    then its expert groups; in the backward the groups in reverse, then the router part)."""
    if i not in split:
        return [partid.block(i)]
    names = list(expert_groups.names(partid.block(i), split[i]))
    return names[:0:-1] + names[:1] if backward else names


def forward_parts(cfg: ModelConfig, split=None) -> tuple[PartId, ...]:
    """embed, the blocks (split ones as their sub-parts), head, and embed again when tied
    (the head's kernel)."""
    fwd = [EMBED, *(u for i in range(cfg.num_hidden_layers) for u in _block_units(i, split or {})), HEAD]
    return tuple(fwd + ([EMBED] if cfg.tie_word_embeddings else []))


def train_parts(cfg: ModelConfig, groups_: tuple[range, ...], split=None) -> tuple[PartId, ...]:
    """The forward, then the blocks of each recompute group, groups in reverse, blocks in
    forward order within a group; without the last block when it stays on the device."""
    split = split or {}
    bwd = [u for g in reversed(groups_) for i in g for u in _block_units(i, split, backward=True)]
    return forward_parts(cfg, split) + tuple(bwd[1:] if last_stays(groups_, split) else bwd)


def first_transfers(transfers: tuple[PartId, ...]) -> set[int]:
    """Indices of the transfers that first stage each part (a split block: its first
    sub-part): those a pending update hands its new compute copy to."""
    seen, first = set(), set()
    for i, p in enumerate(transfers):
        if p.owner not in seen:
            seen.add(p.owner)
            first.add(i)
    return first


def residency_order(cfg: ModelConfig, groups_: tuple[range, ...]) -> tuple[PartId, ...]:
    """Every part, those whose streaming costs most first: by how often a step streams it
    (blocks of multi-block recompute groups and a tied embedding twice, the rest once),
    then in model order. `stream.resident: N` keeps the first N resident."""
    crossings = {}
    for p in train_parts(cfg, groups_):
        crossings[p] = crossings.get(p, 0) + 1
    names = [p.name for p in parts.parts(cfg)]
    return tuple(sorted(names, key=lambda p: -crossings.get(p, 0)))


@functools.lru_cache(maxsize=16)
def with_buffers(cfg: ModelConfig) -> tuple[PartId, ...]:
    """The parts holding buffers (mtjax.roles): their rule updates them on the host only,
    so they stream."""
    return tuple(p.name for p in parts.parts(cfg)
                 if any(leaf.role == roles.BUFFER for leaf in parts.leaves(cfg, p.name).values()))


def resident_parts(cfg: ModelConfig, spec, groups_: tuple[range, ...]) -> tuple[PartId, ...]:
    """The resident parts `stream.resident` names (a list of part names, or PartIds), in
    model order. "auto" is the planner's to resolve (mtjax.plan.residency); unresolved,
    nothing is resident. A part's frozen leaves (mtjax.roles) stay as their compute copy;
    parts with buffers (`with_buffers`) are never resident: "all" and N skip them, a list
    naming one is refused."""
    names = [p.name for p in parts.parts(cfg)]
    streamed = with_buffers(cfg)
    if spec in ("auto", "none"):
        chosen = ()
    elif spec == "all":
        chosen = tuple(names)
    elif isinstance(spec, int):
        chosen = tuple(p for p in residency_order(cfg, groups_) if p not in streamed)[:spec]
    else:
        unknown = [p for p in spec if p not in names]
        if unknown:
            raise MtjaxError(f"stream.resident names {unknown}, which this model does not have; its parts are "
                             f"{EMBED}, {names[1]} ... {names[-2]}, {HEAD}")
        if buffered := [p for p in spec if p in streamed]:
            raise MtjaxError(f"stream.resident names {buffered}, whose buffers ({', '.join(roles.BUFFER_RULES)}) are "
                             f"updated on the host only; leave them out (all and N skip them)")
        chosen = tuple(spec)
    return tuple(p for p in names if p in chosen and p not in streamed)


def adapter_parts(cfg: ModelConfig, stream: StreamConfig, resident: tuple) -> tuple[PartId, ...]:
    """The streamed parts whose trained leaves, LoRA adapters, stay resident while their
    frozen leaves stream (`stream.adapters`: resident): every part with adapters but the
    wholly resident ones, those with buffers (`with_buffers`) and the MoE blocks that may
    split into expert groups (a group size or a device budget given: their adapters
    stream with them)."""
    if cfg.lora is None or stream.adapters != "resident":
        return ()
    may_split = stream.expert_group_size is not None or stream.device_budget_bytes is not None
    splits = {partid.block(i) for i in expert_groups.split_blocks(cfg)} if may_split else set()
    streamed = splits | set(resident) | set(with_buffers(cfg))
    return tuple(p.name for p in parts.parts(cfg) if parts.trained(cfg, p.name) and p.name not in streamed)


def remat_of(stream: StreamConfig) -> str:
    """The remat policy of saved groups: "auto" unresolved by the planner is "full"."""
    return "full" if stream.remat == "auto" else stream.remat


def saved_groups(groups_: tuple[range, ...], resident: tuple[PartId, ...], remat: str) -> tuple[range, ...]:
    """The recompute groups whose blocks are all resident, when the policy keeps their
    vjps from the forward (remat dots or none): their backward needs no kept input and
    their weights never leave, so nothing is recomputed beyond what the policy drops."""
    if remat == "full":
        return ()
    return tuple(g for g in groups_ if all(partid.block(i) in resident for i in g))


def staged_in_place(cfg: ModelConfig, derived: bool, reads_host: bool, streamed, adapters: tuple,
                    split: dict) -> tuple[PartId, ...]:
    """The `streamed` parts staged as their master arrays (mtjax.stream.stager): where the
    device reads host memory (`reads_host`: the CPU backend, `Placement.reads_host`), with
    fp32 compute and no compute copy kept (`derived`), the master arrays are the compute
    weights, and copying them into a staging slot would only move 8 bytes/param per step
    for nothing. Whole parts only: a split block's sub-parts and a part whose adapters
    are resident (its frozen leaves) stage into slots."""
    if not (derived and reads_host and np.dtype(cfg.compute_dtype) == np.float32):
        return ()
    return tuple(p for p in streamed if p not in adapters and p.block not in split)


def split_blocks(cfg: ModelConfig, size: int | None, resident: tuple) -> dict:
    """{block index: expert groups} of the streamed blocks whose feed-forward can split
    before its experts (its registry entry's split_points), split into groups of `size`
    experts (none when `size` is None; resident blocks stay whole)."""
    if size is None:
        return {}
    return {i: expert_groups.groups_of(cfg.num_experts, min(size, cfg.num_experts))
            for i in expert_groups.split_blocks(cfg) if partid.block(i) not in resident}
