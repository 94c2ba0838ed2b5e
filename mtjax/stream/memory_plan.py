"""What a step costs in memory, priced before it runs: the bytes the host CPU reads and
writes in one step (`host_memory`, the optimizer's share `update_bytes`) and the bytes
each device holds at the step's peak, by use (`device_plan`, a `DevicePlan`), which
`check_budget` holds to `stream.device_budget_bytes` before step 1. Every term comes from
abstract shapes: the parts' state bytes (mtjax.stream.step_bytes), the step's part
choices (mtjax.stream.step_parts, passed in), what one block holds for its backward
(mtjax.stream.block_bytes) and the LM head's (mtjax.loss.head_bytes);
mtjax.stream.schedule puts them in a step's Schedule.
"""

from __future__ import annotations

import dataclasses

from mtjax import expert_groups, partid, parts
from mtjax.config import StoreConfig, StreamConfig
from mtjax.loss import head_bytes
from mtjax.model_config import ModelConfig
from mtjax.partid import EMBED, HEAD, PartId
from mtjax.stream.block_bytes import block_working_bytes, residual_bytes, split_residual_bytes
from mtjax.stream.budget import DeviceBudgetError
from mtjax.stream.step_bytes import StateBytes, StepShape, adapters_view
from mtjax.units import size


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Bytes the engine may hold on the device at its peak, by use."""

    weights: int  # staged compute weights: prefetched parts plus the parts in use
    activations: int  # kept block inputs of every micro-batch (0 when they wait in host memory)
    residuals: int  # vjp residuals of one recompute group (the weights they keep are counted above)
    head: int  # the LM head + loss program's chunked logits and kernel-gradient sums (mtjax.loss.head_bytes)
    working: int  # hidden states of every micro-batch between parts, temporaries (a MoE backward's), gradients in flight
    resident: int = 0  # resident parts' compute, master and optimizer state and their fp32 gradient sums
    saved: int = 0  # vjp residuals that saved groups keep from the forward to the backward (every micro-batch)
    routing: int = 0  # split MoE blocks' kept MLP inputs and routing (every micro-batch), zeros for unrouted experts

    @property
    def total(self) -> int:
        return (self.weights + self.activations + self.residuals + self.head + self.working + self.resident
                + self.saved + self.routing)

    def describe(self) -> str:
        return ", ".join(f"{f.name} {size(getattr(self, f.name))}" for f in dataclasses.fields(self))


def staged_at_once(stream: StreamConfig, groups_: tuple[range, ...]) -> int:
    """Parts whose compute weights may be staged at once: `prefetch_depth` ahead of use,
    plus those in use (a recompute group, or the head, a tied embedding and the last
    block staying on the device)."""
    return stream.prefetch_depth + max(max(len(g) for g in groups_), 3)


def expert_bytes(cfg: ModelConfig) -> StateBytes:
    """One expert's compute and master bytes (every expert of every MoE layer is alike)."""
    block = partid.block(expert_groups.split_blocks(cfg)[0])
    got = [sum(parts.nbytes({n: x}) for n, x in parts.schema(cfg, block, k).items() if expert_groups.expert_of(n) == 0)
           for k in ("compute", "master")]
    return StateBytes(*got, 0)


def update_bytes(states, fused: bool, copy: bool, grads: int | None = None) -> int:
    """Bytes AdamW reads and writes on the host CPU updating parts of these StateBytes;
    `copy`: it writes their compute copy; `grads`: the bytes of their gradients as the
    fused loop reads them (None: fp32)."""
    m = sum(b.master for b in states)
    o = sum(b.opt for b in states)
    c = sum(b.trained for b in states) if copy else 0  # frozen leaves' copies are not rewritten
    if fused:  # one loop: reads master, both moments, gradient; writes master, moments (+ copy)
        return 2 * m + 2 * o + (m if grads is None else grads) + c
    # XLA's CPU backend runs the update as four passes (no multi-output fusion): mu and nu
    # (each reads its moment and the gradient, writes the moment), master (reads master and
    # both moments, writes master), the compute copy (reads master): 46 bytes/param for
    # AdamW + bf16. It writes the copy always.
    return 3 * o + 2 * m + 3 * m + sum(b.trained for b in states)


def host_memory(pb: dict[PartId, StateBytes], transfers: list[tuple[StateBytes, bool]], grad: dict, fused: bool,
                 derived: bool, store: StoreConfig, disk_io: int, widens: bool, reads_host: bool,
                 processes: int) -> int:
    """Bytes the host CPU reads and writes in one step (DMA is the link's: the planner
    adds it where the device is not the host). `transfers`: each transfer's bytes, and
    whether it stages the copy its update handed over (a disk-tier compute copy); those
    staged in place (`step_parts.staged_in_place`) copy nothing and are left out;
    `widens`: the host widens narrow gradients (`Schedule.widens_grads`); `reads_host`:
    the device is the host CPU; `processes`: the run's (mtjax.stream.hosts)."""
    # Each gradient as mtjax.stream.grads handles it. A GPU's lands in a transfer buffer
    # and is copied into a CPU-backend array (Placement.host_arrays: read + write); on
    # the CPU the device's own buffer is handed over. One narrower than fp32 (one
    # micro-batch's, in the compute dtype) is widened (read + fp32 write) where the sink
    # widens it (`widens`) or XLA's program updates; for the fused loop it stays as it
    # is. Its squared norm is reduced on the device, from the gradient as computed or,
    # in a run of several processes, from this process's rows of the fp32 sums
    # (mtjax.stream.hosts): host memory only where the device is the host.
    kept = {p: g != pb[p].master and fused and not widens for p, g in grad.items()}
    optimizer = update_bytes(pb.values(), fused, copy=not derived,
                              grads=sum(g if kept[p] else pb[p].master for p, g in grad.items()))
    grads = 0
    for p, g in grad.items():
        copy = 0 if reads_host else 2 * g
        widen = g + pb[p].master if g != pb[p].master and not kept[p] else 0
        norm = (pb[p].master if processes > 1 else g) if reads_host else 0
        grads += copy + widen + norm
    # Each transfer fills a staging slot: a copy of the compute weights (read + write),
    # master rounded into it when no copy is kept, or a disk read (counted in disk_io).
    staging = 0
    for b, handed in transfers:  # each transfer's bytes (a part's or a split block's sub-part's)
        if derived:
            staging += b.master + b.compute
        elif store.compute == "ram" or handed:
            staging += 2 * b.compute
    return optimizer + grads + staging + disk_io  # disk I/O: the kernel copies through the page cache


def device_plan(cfg: ModelConfig, stream: StreamConfig, shape: StepShape, pb: dict[PartId, StateBytes],
                 grps: tuple[range, ...], grad: dict, hidden: int, resident: tuple = (), saved: tuple = (),
                 remat: str = "full", split: dict | None = None, sub: dict | None = None,
                 dispatch: str | None = None, adapters: tuple = (), sequence_devices: int = 1,
                 platform: str | None = None) -> DevicePlan:
    """Device bytes of the step; every term comes from abstract shapes. Every micro-batch
    runs through a part before the next part (their hidden states wait between parts),
    and each part's gradient is summed on the device in fp32. Resident parts (and resident
    adapters) hold their state and an fp32 gradient sum (their update's input) for the
    whole run; a part whose adapters are resident stages its frozen leaves. `shape` is one
    device's share: of the rows, or of each row's tokens split over `sequence_devices`.
    `platform`: the device planned for, "cpu" or "gpu" (default the backend's here), whose
    kernels the mixers' working bytes and the head's are priced for (`block_working_bytes`,
    mtjax.loss.head_bytes)."""
    split, sub = split or {}, sub or {}
    group = max(len(g) for g in grps)
    # Staging slots hold streamed parts only (a split block's sub-parts); none when everything is resident.
    units = {**{p: adapters_view(b) if p in adapters else b for p, b in pb.items()
                if p not in resident and p.block not in split}, **sub}
    max_part = max((b.compute for b in units.values()), default=0)
    whole = {spec for i, spec in enumerate(cfg.layer_specs) if i not in split}
    residual = max((residual_bytes(cfg, spec, shape.batch, shape.seq) for spec in whole), default=0)
    tokens = shape.batch * shape.seq
    size = None
    if split:  # a split block's backward holds one sub-part's residuals at a time
        size = max(len(g) for grps_ in split.values() for g in grps_)
        residual = max(residual, *(split_residual_bytes(cfg, cfg.layer_specs[i], shape.batch, shape.seq, size)
                                   for i in split))
    # One block's backward at a time: what its mixer's kernels and its feed-forward (a MoE's
    # expert dispatch) hold beyond the residuals, a whole block's or a split one's larger program's.
    transient = block_working_bytes(cfg, shape.batch, shape.seq, dispatch, split, size, platform, sequence_devices)
    # Several micro-batches: the fp32 sums in progress, a group's blocks' or the head's
    # (with the tied embedding's).
    blocks = max(b.master for p, b in pb.items() if p.is_block)
    at_head = pb[HEAD].master + (pb[EMBED].master if cfg.tie_word_embeddings else 0)
    sums = max(group * blocks, at_head) if shape.accum > 1 else 0
    return DevicePlan(
        # depth parts staged ahead, plus the parts in use: a recompute group, or the head,
        # the tied embedding and the last block (resident from its forward to its backward).
        weights=staged_at_once(stream, grps) * max_part,
        activations=(len(grps) - len(saved)) * shape.accum * hidden if stream.activations == "device" else 0,
        # A recompute group's (saved groups recompute nothing).
        residuals=max((len(g) for g in grps if g not in saved), default=0) * residual,
        head=head_bytes(cfg, tokens, platform),  # chunked logits (mtjax.loss)
        working=(3 + shape.accum) * hidden + 2 * max(grad.values()) + sums + transient,
        resident=sum(pb[p].compute + 2 * pb[p].master + pb[p].opt for p in resident)
        + sum(pb[p].trained + 2 * pb[p].master + pb[p].opt for p in adapters),
        saved=shape.accum * sum(residual_bytes(cfg, cfg.layer_specs[i], shape.batch, shape.seq, remat)
                                for g in saved for i in g),
        # Kept from a split block's router part to its backward (expert_groups.kept_bytes);
        # and one zero expert on the device standing in for the experts no token reached.
        routing=(shape.accum * sum(expert_groups.kept_bytes(cfg, cfg.layer_specs[i], hidden, tokens) for i in split)
                 + expert_bytes(cfg).compute) if split else 0,
    )


def check_budget(plan: DevicePlan, budget: int | None) -> int:
    """The budget to run under; raises before step 1 when the plan does not fit."""
    if budget is None:
        return plan.total
    if plan.total > budget:
        raise DeviceBudgetError(
            f"this run needs {size(plan.total)} on the device ({plan.describe()}) but "
            f"stream.device_budget_bytes is {size(budget)}: raise the budget, lower "
            f"stream.prefetch_depth, stream.keep_every or stream.resident, set stream.activations=host, or "
            f"(a MoE model) a smaller stream.expert_group_size"
        )
    return budget
