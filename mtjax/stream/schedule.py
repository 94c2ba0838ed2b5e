"""One training step of the streaming engine, described before it runs.

    s = describe(cfg, StreamConfig(keep_every=2), StoreConfig(master="disk"), StepShape(2, 128, 4), tx)
    s.transfers          # parts in the order they cross to the device: ("embed", "block.0", ...)
    s.traffic.h2d        # bytes host -> device in one step; also d2h, disk_read, disk_write, host_memory
    s.spill              # where gradients wait for their update: None, "scratch" or "pending"
    s.widens_grads       # the host widens a one-micro-batch gradient to fp32 (spilled or reduce-scattered)
    s.device.total       # device bytes at the peak on each device, by use (DevicePlan)
    s.allreduce          # {part: gradient bytes summed across the devices in one step} (several devices)
    s.operations         # the step as the engine runs it (mtjax.stream.ops); print(s) lists them
    s.staging            # the staging pool's buffer sets per shape, which the engine allocates
    s.reads              # the update's read buffer sets per shape of disk-tier state, likewise
    s.in_place           # parts staged as their master arrays, with no slot (CPU, fp32, no compute copy)

The engine runs `operations`, streams `transfers`, allocates `staging` and `reads` and holds what
`device` allows (its ledger enforces each use), the planner (mtjax.plan.cost) prices `traffic` with a machine's bandwidths, and the
trainer's preflight checks `device` against the budget. tests/test_schedule.py counts
every transfer, disk read and write of real engine steps and finds these numbers.

This module counts the step's traffic and builds its Schedule; which parts it streams, in
what order, and which stay on the device or split is mtjax.stream.step_parts's choice,
the bytes of each part's state mtjax.stream.step_bytes's count, what the step holds in
host memory and on the device mtjax.stream.memory_plan's price, and what one block holds
for its backward mtjax.stream.block_bytes's.

What one step moves (docs/pipeline.md): each part crosses to the device once, whatever
the number of micro-batches (they loop inside each part), and the blocks again for the
backward, one recompute group at a time, groups in reverse; the last block stays on the
device when it is a group of its own. Each part's gradient is summed over the
micro-batches on the device and leaves once, in the compute dtype when there is one
micro-batch and in fp32 when there are several (the embedding's is always fp32). Kept
block inputs waiting in host memory cross each way once per micro-batch. Disk bytes are
those of the steady state: one step's streaming plus one deferred update of every part
(the previous step's), which reads master and optimizer state and writes them back with
the compute copy where one is kept.

Resident parts (`stream.resident`, `resident`) keep their whole state on the device
across steps and are updated there: they cross no link and touch no disk in a step; only
a commit brings their state to the host (every step with a one-copy store, so there it is
step traffic, `d2h_resident`; otherwise at each checkpoint, `commit_bytes`). LoRA
adapters of streamed parts (`stream.adapters`, `adapters`) are resident the same way
while the part's frozen leaves stream: the part is staged (its frozen leaves only), its
gradient stays, and it has no host update.

Over `devices` devices (data parallel, mtjax.stream.mesh) every transfer puts a whole
copy of the part on each device (`h2d_weights` counts each copy; on the CPU backend the
copies alias the staging buffer, like one device's), each micro-batch's rows are split
over them (tokens and kept activations cross once in all), and every program that makes
a weight gradient sums it over the devices by an all-reduce before it leaves the program:
once per micro-batch and part, `allreduce`. The gradient then leaves once, from one
device, and the host update runs once. The device plan is each device's: its share of
the rows, all of the weights.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from mtjax import expert_groups, hostmem, parts
from mtjax.config import StoreConfig, StreamConfig, check_split
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig
from mtjax.partid import EMBED, PartId
from mtjax.stream import fused_adamw, memory_plan, ops, step_parts
from mtjax.stream.block_bytes import residual_bytes
from mtjax.stream.memory_plan import DevicePlan
from mtjax.stream.step_bytes import StateBytes, StepShape, adapters_view, committed, part_bytes, sub_part_bytes

TOKEN_BYTES = 4  # int32 token ids
DOCUMENT_BYTES = 4 + 1  # per token of a packed batch: its int32 document id and bool "counted target"
# With the compute copy on disk, updates run at most this many parts ahead of the staging
# that takes their new copies: each finished update holds one until its part is staged.
HANDED_AHEAD = 2


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes over each link in one step, by what moves."""

    h2d_weights: int  # compute weights of every transfer, a copy to each device
    h2d_tokens: int  # int32 token ids of every micro-batch (with their document ids and targets)
    h2d_activations: int  # kept block inputs coming back for the backward (activations=host)
    d2h_grads: int  # each part's summed gradient, once
    d2h_activations: int  # kept block inputs going out to host memory (activations=host)
    d2h_resident: int  # resident parts' state brought to the host by a one-copy store's commit (every step)
    disk_read: dict  # {"compute" | "master" | "opt" | "grads": bytes}
    disk_write: dict  # same keys; "grads" are the spilled gradient sums
    host_memory: int  # read + written by the host CPU: optimizer, gradients, staging copies, disk I/O
    # Read + written by the resident parts' update where the device is the host: the fused
    # loop's bytes with it (28-30 bytes/param), the optax program's otherwise (46).
    device_update: int = 0
    allreduce: int = 0  # gradient bytes summed across the devices (the size of what is reduced), all parts
    h2d_unrouted: int = 0  # expert weights no token reached, not staged (`Schedule.routed_traffic`; 0 before a step)
    # Disk-tier compute bytes a step stages from its parts' updates instead of the store:
    # each streamed part's first transfer takes the new copy the update just made. A step
    # with no update pending (a fresh engine's first) reads these from the disk as well.
    compute_handed: int = 0

    @property
    def h2d(self) -> int:
        return self.h2d_weights + self.h2d_tokens + self.h2d_activations

    @property
    def d2h(self) -> int:
        return self.d2h_grads + self.d2h_activations + self.d2h_resident

    @property
    def disk_read_bytes(self) -> int:
        return sum(self.disk_read.values())

    @property
    def disk_write_bytes(self) -> int:
        return sum(self.disk_write.values())


@dataclasses.dataclass(frozen=True)
class Schedule:
    cfg: ModelConfig
    stream: StreamConfig
    store: StoreConfig
    shape: StepShape
    fused: bool  # the update is the one-pass AdamW loop (mtjax.stream.fused_adamw)
    derived_compute: bool  # no compute copy is kept: the prefetcher rounds master into the slot
    spill: str | None  # where gradients wait for their update: None (RAM), "scratch" files, "pending" (one-copy store)
    # The host widens a gradient in the compute dtype (one micro-batch's) to fp32 as it
    # arrives (mtjax.stream.grads): a spill file and the processes' reduce-scatter take
    # fp32; otherwise the update reads it as it is (XLA's program widens it itself).
    widens_grads: bool
    part_bytes: dict  # {part: StateBytes}
    groups: tuple  # recompute groups: block ranges whose first input is kept
    last_stays: bool  # the last block stays on the device from its forward to its backward
    resident: tuple  # parts that stay on the device with their whole state, updated there
    remat: str  # what saved groups keep from the forward: "full" (none saved), "dots" or "none"
    saved: tuple  # recompute groups of resident blocks whose vjps are kept from the forward: not recomputed
    forward: tuple  # parts a forward-only pass (evaluation) streams, in order
    transfers: tuple  # parts a training step streams, in order
    grad_bytes: dict  # {part: bytes of its gradient leaving the device}
    hidden_bytes: int  # one micro-batch's hidden states [batch, seq, hidden]
    traffic: Traffic
    device: DevicePlan  # on each device
    devices: int = 1  # data parallel over this many devices
    allreduce: dict = dataclasses.field(default_factory=dict)  # {part: bytes all-reduced per step}; {} on one device
    split: dict = dataclasses.field(default_factory=dict)  # {split block index: its expert groups (tuples of ids)}
    sub_bytes: dict = dataclasses.field(default_factory=dict)  # {sub-part: StateBytes} of the split blocks
    staging: tuple = ()  # the staging pool's buffer sets: (first transfer of a shape, sets, bytes of one); staging_sets
    reads: tuple = ()  # the update's read buffer sets: (first part of a shape, kind, sets, bytes of one); read_sets
    adapters: tuple = ()  # streamed parts whose trained leaves (LoRA adapters) are resident; step_parts.adapter_parts
    in_place: tuple = ()  # whole streamed parts staged as their master arrays, no slot; step_parts.staged_in_place
    processes: int = 1  # the run's processes, each stepping its rows (mtjax.stream.hosts); derives_compute

    @property
    def device_batch(self) -> int:
        """Rows of a micro-batch on each device."""
        return self.shape.batch // (1 if self.stream.split == "sequence" else self.devices)

    @property
    def device_seq(self) -> int:
        """Tokens of a row on each device."""
        return self.shape.seq // (self.devices if self.stream.split == "sequence" else 1)

    @property
    def computing(self) -> ModelConfig:
        """The model config the step's programs compute with (ModelConfig.split_over)."""
        return self.cfg.split_over(self.stream.split, self.devices)

    def unit(self, name: PartId) -> StateBytes:
        """The state bytes of a transfer: a part's, or a split block's sub-part's."""
        return self.sub_bytes[name] if name.is_sub else self.part_bytes[name]

    def routed_traffic(self, routed: dict, names: tuple | None = None) -> Traffic:
        """`traffic` for a step whose split MoE blocks' experts were reached as `routed`
        says ({block index: bool [E], an expert reached by some token of the step}): an
        expert group stages only its reached experts, and reads only them from a disk
        tier; `h2d_unrouted` counts what stayed behind. `names`: the transfers
        (default: a training step's; `forward` for an evaluation)."""
        compute = master = 0
        for p in self.transfers if names is None else names:
            ids = expert_groups.group_ids(p, self.split[p.block]) if p.is_sub else None
            if ids:  # the experts of a group are alike: each 1/n of its bytes
                left, b = sum(1 for e in ids if not routed[p.block][e]), self.sub_bytes[p]
                compute, master = compute + left * b.compute // len(ids), master + left * b.master // len(ids)
        t = self.traffic
        reads = dict(t.disk_read, compute=t.disk_read["compute"] - compute) if self.store.compute == "disk" \
            else t.disk_read
        staging = compute if self.store.compute == "disk" else (master + compute if self.derived_compute
                                                                  else 2 * compute)
        return dataclasses.replace(t, h2d_weights=t.h2d_weights - compute, h2d_unrouted=compute, disk_read=reads,
                                   host_memory=t.host_memory - staging)

    @property
    def state(self) -> StateBytes:
        """Totals over all parts."""
        return StateBytes(*(sum(b.get(k) for b in self.part_bytes.values()) for k in parts.KINDS),
                          trained=sum(b.trained for b in self.part_bytes.values()))

    @property
    def streamed(self) -> tuple[PartId, ...]:
        """The parts that are not resident, in model order."""
        return tuple(p for p in self.part_bytes if p not in self.resident)

    @property
    def host_updated(self) -> tuple[PartId, ...]:
        """The parts updated on the host: streamed, their adapters not resident."""
        return tuple(p for p in self.streamed if p not in self.adapters)

    @property
    def commit_bytes(self) -> int:
        """Bytes a commit brings from the device to the host: every resident part's (and
        resident adapters') master and optimizer state and trained leaves' compute copy."""
        return sum(committed(self.part_bytes[p], k) for p in self.resident + self.adapters for k in parts.KINDS)

    def __str__(self) -> str:
        """A training step's operations, one a line (`operations`)."""
        return ops.listing(self.operations)

    @functools.cached_property
    def operations(self) -> tuple:
        """A training step as the runner executes it (mtjax.stream.ops; `ops.listing` prints it)."""
        return ops.compile_step(self, train=True)

    @functools.cached_property
    def eval_operations(self) -> tuple:
        """A forward-only pass (evaluation) as the runner executes it."""
        return ops.compile_step(self, train=False)

    @functools.cached_property
    def needed(self) -> tuple[str, ...]:
        """Every part in the order a step's forward first takes its weights: the order its
        deferred update must be done in (mtjax.stream.updates)."""
        return ops.needed(self.eval_operations)

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging pool's buffer sets (`staging`)."""
        return sum(sets * nbytes for _, sets, nbytes in self.staging)

    @property
    def read_bytes(self) -> int:
        """Host bytes of the update's read buffer sets (`reads`)."""
        return sum(sets * nbytes for _, _, sets, nbytes in self.reads)

    @property
    def block_residual_bytes(self) -> int:
        """One recomputed block's vjp residuals, as the device plan counts them."""
        return self.device.residuals // max(len(g) for g in self.groups)

    def saved_residual_bytes(self, spec: LayerSpec) -> int:
        """One micro-batch's residuals a saved block of `spec` keeps from its forward."""
        return residual_bytes(self.cfg, spec, self.device_batch, self.device_seq, self.remat)

    @property
    def kept_bytes(self) -> int:
        """Kept block inputs of every micro-batch (the embedding output and each group's
        input), all held at once between the forward and the backward."""
        return (len(self.groups) - len(self.saved)) * self.shape.accum * self.hidden_bytes


def unit_schema(cfg: ModelConfig, name: PartId, split: dict, adapters: tuple = ()) -> dict:
    """The compute schema a transfer stages: its part's (its frozen leaves only when its
    adapters are resident, `adapters`), or a split block's sub-part's leaves of it
    (`split`: {block index: expert groups})."""
    schema = parts.schema(cfg, name.owner, "compute")
    if name in adapters:
        trained = parts.trained(cfg, name)
        return {n: x for n, x in schema.items() if n not in trained}
    if not name.is_sub:
        return schema
    return {n: schema[n] for n in expert_groups.leaves(schema, name, split[name.block])}


@functools.lru_cache(maxsize=1024)
def _unit_shape(cfg: ModelConfig, name: PartId, groups: tuple, adapters: tuple = ()) -> tuple[tuple, int]:
    schema = unit_schema(cfg, name, {name.block: groups}, adapters)
    return hostmem.shape_key(schema), parts.nbytes(schema)


def staging_sets(cfg: ModelConfig, stream: StreamConfig, groups_: tuple[range, ...], transfers: tuple[PartId, ...],
                 split: dict, adapters: tuple = (), in_place: tuple = ()) -> tuple[tuple[PartId, int, int], ...]:
    """The staging pool's buffer sets, per shape of what crosses: (its first transfer, how
    many sets, bytes of one). As many sets as a step has transfers of that shape, at most
    the `prefetch_depth` staged ahead plus a recompute group's in use: the prefetcher
    acquires a set only below `prefetch_depth` staged and untaken, so a set is always
    free then (its readers may still run: the acquire waits for them). The engine
    allocates exactly these before its first step, and the planner prices them as host
    staging. Parts staged `in_place` (as their master arrays, `step_parts.staged_in_place`)
    take none."""
    most = stream.prefetch_depth + max(len(g) for g in groups_)
    by_shape: dict[tuple, list] = {}
    by_kind = {p.name: p.fn_kind for p in parts.parts(cfg)}
    first: dict = {}  # parts of one fn_kind (and adapters resident or not) have one schema: look each up once
    for name in (p for p in transfers if p not in in_place):
        mine = (name,) if name in adapters else ()
        like = first.setdefault((by_kind[name.owner], bool(mine)), name.owner)
        unit = name.in_block(like.block) if name.is_block else name
        key, nbytes = _unit_shape(cfg, unit, split.get(name.block, ()), (unit,) if mine else ())
        entry = by_shape.setdefault(key, [name, 0, nbytes])
        entry[1] += 1
    return tuple((name, min(count, most), nbytes) for name, count, nbytes in by_shape.values())


def read_sets(cfg: ModelConfig, store: StoreConfig, pb: dict[str, StateBytes],
              streamed: tuple[str, ...]) -> tuple[tuple[str, str, int, int], ...]:
    """The update's read buffer sets, per shape of the disk-tier state it reads (master
    and optimizer state of the `streamed` parts): (the first part of that shape, kind, how
    many sets, bytes of one). Two sets of a shape several parts have (one part's update
    computing while the next part's reads run ahead, mtjax.stream.readahead), one of a
    shape a single part has. The engine allocates exactly these before its first step,
    and the planner prices them as host staging."""
    by_kind = {p.name: p.fn_kind for p in parts.parts(cfg)}
    by_shape: dict[str, list] = {}
    for part in streamed:
        entry = by_shape.setdefault(by_kind[part], [part, 0])
        entry[1] += 1
    return tuple((part, kind, min(2, count), pb[part].get(kind)) for part, count in by_shape.values()
                 for kind in ("master", "opt") if getattr(store, kind) == "disk")


def derives_compute(fused: bool, store: StoreConfig, frozen: bool = False, processes: int = 1) -> bool:
    """Whether no compute copy is kept: with the fused update and both master and compute
    weights in RAM, the prefetcher rounds master straight into the staging slot
    (docs/device.md, "The compute copy"). Not with `frozen` leaves (mtjax.roles): their
    compute copy is all they have; nor in a run of several `processes` (mtjax.stream.hosts):
    a process holds only its rows of master, so it cannot round the compute copy from them."""
    return fused and store.master == "ram" and store.compute == "ram" and not frozen and processes == 1


def spill(store: StoreConfig) -> str | None:
    """Where summed gradients wait for their deferred update: "pending" files of a
    one-copy store (durable), "scratch" files beside the store when the master weights
    are on disk, else None (host RAM)."""
    if store.copies == 1:
        return "pending"
    return "scratch" if store.master == "disk" else None


def describe(cfg: ModelConfig, stream: StreamConfig, store: StoreConfig, shape: StepShape, tx,
             fused: bool | None = None, part_bytes_: dict[PartId, StateBytes] | None = None,
             devices: int = 1, dispatch: str | None = None, reads_host: bool | None = None,
             processes: int = 1) -> Schedule:
    """The schedule of one step of `shape` under `stream` and `store`'s placement, data
    parallel over `devices` devices (shape.batch splits over them, or shape.seq with
    stream.split sequence: mtjax.config.check_split), on one process of a run of
    `processes` (mtjax.stream.hosts): a run of several keeps a compute copy
    (`derives_compute`), so it stages nothing in place.
    `dispatch`: the MoE grouped matmul of the device planned for (mtjax.moe.dispatch; default
    the backend's here), which decides what an expert backward allocates. `reads_host`:
    whether that device computes on host memory (default: the backend here is the CPU),
    which decides the parts staged in place (`step_parts.staged_in_place`) and the kernels
    whose working bytes the mixers are priced with (the CPU's, else the GPU's).

    `tx` is the optax transformation (its state's bytes); `fused`: whether the update is
    the fused AdamW loop (default: what an OptimConfig gets, `fused_adamw.supports`).
    `part_bytes_` saves recomputing `part_bytes(cfg, tx)` when pricing many variants.

    MoE blocks are split into expert groups (mtjax.expert_groups) of
    `stream.expert_group_size` experts; unset, only when the step does not fit
    `stream.device_budget_bytes` whole: then the largest groups (E, E/2, E/4 ... 1
    experts) that fit, or the smallest plan of them when none does (memory_plan.check_budget says so).
    """
    fused = fused_adamw.supports(cfg.compute_dtype) if fused is None else fused
    pb = part_bytes(cfg, tx) if part_bytes_ is None else part_bytes_
    reads_host = jax.default_backend() == "cpu" if reads_host is None else reads_host
    size, budget = stream.expert_group_size, stream.device_budget_bytes
    if size is not None or budget is None or not expert_groups.split_blocks(cfg):
        return _describe(cfg, stream, store, shape, tx, fused, pb, size, devices, dispatch, reads_host, processes)
    plans = [_describe(cfg, stream, store, shape, tx, fused, pb, None, devices, dispatch, reads_host, processes)]
    size = cfg.num_experts
    while plans[-1].device.total > budget and size >= 1:  # groups of E, E // 2, ... 1 experts
        plans.append(_describe(cfg, stream, store, shape, tx, fused, pb, size, devices, dispatch, reads_host,
                               processes))
        size //= 2
    fits = [p for p in plans if p.device.total <= budget]
    return fits[0] if fits else min(plans, key=lambda p: p.device.total)


def allreduce_bytes(cfg: ModelConfig, pb: dict[PartId, StateBytes], accum: int, devices: int) -> dict[PartId, int]:
    """{part: bytes its gradients all-reduce in one step}: every micro-batch's gradient, as
    the program that makes it returns it (the compute dtype; the embedding lookup's fp32,
    plus the head's use of a tied embedding); nothing on one device."""
    if devices == 1:
        return {}
    out = {p: accum * (b.master if p == EMBED else b.trained) for p, b in pb.items()}
    if cfg.tie_word_embeddings:
        out[EMBED] += accum * pb[EMBED].trained
    return out


def _describe(cfg: ModelConfig, stream: StreamConfig, store: StoreConfig, shape: StepShape, tx, fused: bool,
              pb: dict[PartId, StateBytes], size: int | None, devices: int = 1,
              dispatch: str | None = None, reads_host: bool = False, processes: int = 1) -> Schedule:
    """`describe` with the MoE blocks split into groups of `size` experts (None: whole)."""
    resident = step_parts.resident_parts(cfg, stream.resident,
                                         step_parts.groups(cfg.num_hidden_layers, stream.keep_every))
    adapters = step_parts.adapter_parts(cfg, stream, resident)
    split = step_parts.split_blocks(cfg, size, resident + adapters)
    grps = step_parts.groups(cfg.num_hidden_layers, stream.keep_every, alone=split)
    sub = sub_part_bytes(cfg, tx, split)
    unit = {**pb, **{p: adapters_view(pb[p]) for p in adapters}, **sub}
    transfers = tuple(p for p in step_parts.train_parts(cfg, grps, split) if p not in resident)
    # State that lives on the host (of a part whose adapters are resident: its frozen leaves).
    streamed = {p: adapters_view(b) if p in adapters else b for p, b in pb.items() if p not in resident}
    remat = step_parts.remat_of(stream)
    saved = step_parts.saved_groups(grps, resident, remat)
    derived = derives_compute(fused, store, parts.frozen_any(cfg), processes)
    in_place = step_parts.staged_in_place(cfg, derived, reads_host, streamed, adapters, split)
    where = spill(store)
    widens = where is not None or processes > 1  # Schedule.widens_grads
    check_split(stream.split, shape.batch, shape.seq, devices)
    hidden = shape.batch * shape.seq * cfg.hidden_size * np.dtype(cfg.compute_dtype).itemsize
    # Summed over several micro-batches a gradient is fp32; alone it leaves as computed,
    # in the compute dtype, except the embedding's (a dense fp32 table, also when tied).
    # Only trained leaves have one (mtjax.roles).
    grad = {p: b.master if shape.accum > 1 or p == EMBED else b.trained for p, b in pb.items()}
    kept = (len(grps) - len(saved)) * shape.accum * hidden
    on_host = stream.activations == "host"

    h2d_weights = sum(unit[p].compute for p in transfers)  # one device's
    reads = dict.fromkeys(("compute", "master", "opt", "grads"), 0)
    writes = dict(reads)
    # (a part whose adapters are resident has no host update to hand a new copy on)
    handed = {i for i in step_parts.first_transfers(transfers) if transfers[i].owner not in adapters} \
        if store.compute == "disk" else set()
    if store.compute == "disk":  # every other transfer reads its part from the store
        # (a part's frozen leaves, mtjax.roles, are read too: the update hands on the trained ones')
        reads["compute"] = h2d_weights - sum(unit[transfers[i]].trained for i in handed
                                             if pb[transfers[i].owner].trained)
    for kind in ("master", "opt"):  # the update reads them and writes them back
        if getattr(store, kind) == "disk":
            reads[kind] = writes[kind] = sum(b.get(kind) for b in streamed.values())
    if store.compute == "disk":  # the update writes the new copy (and hands it to the next step's staging)
        writes["compute"] = sum(b.trained for b in streamed.values())
    grad32 = sum(b.master for b in streamed.values())
    if where is not None:  # each fp32 sum goes to its file once and comes back for the update
        reads["grads"] = writes["grads"] = grad32
    d2h_resident = 0
    if store.copies == 1 and resident + adapters:  # each step's commit writes the resident state into the store
        d2h_resident = sum(committed(pb[p], k) for p in resident + adapters for k in parts.KINDS)
        for kind in parts.KINDS:
            writes[kind] += sum(committed(pb[p], kind) for p in resident + adapters)

    allreduce = allreduce_bytes(cfg, pb, shape.accum, devices)
    traffic = Traffic(
        h2d_weights=h2d_weights * devices,
        h2d_tokens=shape.tokens * (TOKEN_BYTES + (DOCUMENT_BYTES if shape.documents else 0)),
        h2d_activations=kept if on_host else 0,
        d2h_grads=sum(g for p, g in grad.items() if p in streamed and p not in adapters),
        d2h_activations=kept if on_host else 0,
        d2h_resident=d2h_resident,
        disk_read=reads, disk_write=writes,
        host_memory=memory_plan.host_memory(streamed, [(unit[p], i in handed) for i, p in enumerate(transfers)
                                                       if p not in in_place],
                                            {p: g for p, g in grad.items() if p in streamed and p not in adapters},
                                            fused, derived, store,
                                            sum(reads.values()) + sum(writes.values()), widens, reads_host,
                                            processes),
        # On the host the fused loop writes a compute copy unless it is the fp32 master itself.
        device_update=memory_plan.update_bytes([pb[p] for p in resident + adapters], fused,
                                               copy=not fused or np.dtype(cfg.compute_dtype) != np.float32),
        allreduce=sum(allreduce.values()),
        compute_handed=sum(unit[transfers[i]].compute for i in handed),
    )
    forward = tuple(p for p in step_parts.forward_parts(cfg, split) if p not in resident)
    # Each device holds all of the weights and its share of every micro-batch's rows (or,
    # split by sequence, of every row's tokens: attention's gathered keys and values aside).
    if stream.split == "sequence":
        local = dataclasses.replace(shape, seq=shape.seq // devices)
    else:
        local = dataclasses.replace(shape, batch=shape.batch // devices)
    device = memory_plan.device_plan(cfg, stream, local, pb, grps, grad, hidden // devices, resident, saved, remat,
                                     split, sub, dispatch, adapters,
                                     cfg.split_over(stream.split, devices).sequence_devices,
                                     "cpu" if reads_host else "gpu")
    return Schedule(
        cfg=cfg, stream=stream, store=store, shape=shape, fused=fused, derived_compute=derived, spill=where,
        widens_grads=widens, part_bytes=pb, groups=grps, last_stays=step_parts.last_stays(grps, split),
        resident=resident, remat=remat, saved=saved, forward=forward, transfers=transfers, grad_bytes=grad,
        hidden_bytes=hidden, traffic=traffic, device=device, devices=devices, allreduce=allreduce, split=split,
        sub_bytes=sub,
        staging=staging_sets(cfg, stream, grps, transfers, split, adapters, in_place),
        reads=read_sets(cfg, store, pb, tuple(p for p in streamed if p not in adapters)), adapters=adapters,
        in_place=in_place, processes=processes)
