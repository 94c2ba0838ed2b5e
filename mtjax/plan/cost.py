"""The per-step cost model of the streaming engine: the step's schedule, priced.

`mtjax.stream.schedule.describe` says what one step moves: the parts in the order they
cross to the device, the bytes on each link (host->device, device->host, disk read and
write, host memory) and the device bytes it holds. This module takes those bytes as
they are and prices them with a hardware profile's bandwidths; it adds what is not
bytes moved: the FLOPs (each block runs forward twice, the pass and the recompute that
builds its vjp, and backward once: 4 forward-equivalents, ~8 * params * tokens, plus
attention; a MoE block's params are its active ones, k experts of E, while its bytes are
all E, and its experts cost the rows their dispatch pads them to, `mtjax.moe.dispatch_rows`),
the host RAM and disk the run occupies, and the DMA's share of host memory traffic where
the device is not the host.

Stages run pipelined, so the step takes as long as its busiest resource plus the part
that cannot overlap (the embedding: its gradient arrives last and it is needed first).
Over several devices (data parallel) each device computes its share of the rows, its own
link carries one copy of the weights and its share of the tokens, the gradients leave
over one device's link, and the all-reduce is priced as a ring on the device
interconnect (2 (N-1) / N of the reduced bytes each way per device; host memory traffic
where the devices are the host). See docs/planner.md.
"""

from __future__ import annotations

import collections

import dataclasses
import functools
import math


from mtjax import model, moe, partid, parts
from mtjax.config import StoreConfig, StreamConfig
from mtjax.layers import registry
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan.hardware import GiB, HardwareProfile
from mtjax.stream.memory_plan import DevicePlan
from mtjax.stream.schedule import HANDED_AHEAD, Schedule, describe
from mtjax.stream.step_bytes import StateBytes, StepShape, committed

RUNTIME_OVERHEAD_BYTES = 2 * GiB  # Python, JAX runtime and compiled programs in host RAM (profiles' default)


@dataclasses.dataclass(frozen=True)
class HostMemory:
    state: int  # compute/master/opt state placed in RAM
    grads: int  # fp32 gradient sums of every part, held until the clip norm is known (0: spilled to disk)
    staging: int  # page-aligned buffers for the parts in flight
    activations: int  # kept block inputs, when they live on the host
    runtime: int
    total: int
    slots: int = 0  # of staging: the staging pool's buffer sets (`Schedule.staging_bytes`)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes over each link in one step: the schedule's, plus the DMA on host memory."""

    h2d: int
    d2h: int
    disk_read: int
    disk_write: int
    host_memory: int  # read + written by the CPU (optimizer, gradients, staging copies, disk I/O) and the DMA
    allreduce: int = 0  # gradient bytes summed across the devices in one step (the schedule's)


@dataclasses.dataclass(frozen=True)
class Times:
    """Seconds each resource is busy in one step, and the predicted step time."""

    device: float
    link: float  # the busier direction of the full-duplex host<->device link
    disk: float
    host_memory: float
    startup: float  # not overlapped: the embedding's gradient -> update -> weights (GPU); the fixed per-transfer cost (CPU)
    step: float
    bound: str  # the resource that sets the step time
    interconnect: float = 0.0  # the gradients' all-reduce between devices (several devices)


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: Schedule  # what the step moves (cfg, stream, store and shape included)
    hardware: HardwareProfile
    num_params: int
    flops: float  # device FLOPs executed per step (recompute included; a CPU MoE dispatch's block overhead as rows)
    model_flops: float  # 6 * params * tokens + attention: the work the step is worth
    host: HostMemory
    disk_bytes: int
    checkpoint_bytes: int  # written by one checkpoint: every RAM-tier kind of state, into the run's store
    traffic: Traffic
    times: Times

    cfg = property(lambda self: self.schedule.cfg)
    stream = property(lambda self: self.schedule.stream)
    store = property(lambda self: self.schedule.store)
    shape = property(lambda self: self.schedule.shape)
    part_bytes = property(lambda self: self.schedule.part_bytes)
    state = property(lambda self: self.schedule.state)  # totals over all parts

    @property
    def device(self) -> DevicePlan:
        return self.schedule.device

    @property
    def ram_needed(self) -> int:
        """Host RAM the run needs; when the devices are the host, their peaks are host RAM too."""
        return self.host.total + (self.device.total * self.schedule.devices if self.hardware.device_is_host else 0)

    @property
    def tokens_per_s(self) -> float:
        return self.shape.tokens / self.times.step


def block_forward_flops(cfg: ModelConfig, spec: LayerSpec, block_params: int, batch: int, seq: int,
                        executed: bool = True, dispatch: str = "ragged") -> float:
    """FLOPs of one block's forward: 2 per parameter and token, plus what its mixer and
    feed-forward add (their registry entries). `executed`: what the compiled program runs
    (softmax attention: every query against every key, masked afterwards; a MoE: the
    padding its expert `dispatch`, mtjax.moe.dispatch, adds); otherwise only the useful
    work (the keys a query may see, the k experts of each token)."""
    matmuls = 2.0 * block_params * batch * seq
    extra = registry.feed_forward(spec).flops(cfg, spec, batch * seq, executed, dispatch)
    return matmuls + extra + registry.mixer(spec).flops(cfg, spec, batch, seq, executed)


def mfu_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token that MFU counts: 6 per active parameter (forward and
    backward matmuls) plus 3 forwards of each layer's mixer over rows of `seq` as
    executed (for softmax attention the usual convention, 12 x seq x heads x head_dim
    per layer; heads x head_dim is not hidden_size in Gemma). The MFU of `mtjax train`'s
    progress line and of experiments/gpu/bench.py counts this."""
    mixers = sum(registry.mixer(spec).flops(cfg, spec, 1, seq, True) for spec in cfg.layer_specs)
    return 6.0 * model.num_active_params(cfg) + 3.0 * mixers / seq


@functools.lru_cache(maxsize=64)
def _params_of(cfg: ModelConfig) -> dict:
    """{part: its parameters}: every leaf's, frozen ones too (mtjax.roles), counted from
    the leaves' shapes (a quantized base's compute bytes, mtjax.precision, are not its
    parameters); each layout counted once. Cached: the planner prices one model many
    times (residency candidates, placements). Shared: do not change it."""
    by_kind: dict = {}
    for p in parts.parts(cfg):
        if p.fn_kind not in by_kind:
            by_kind[p.fn_kind] = sum(math.prod(leaf.shape) for leaf in parts.leaves(cfg, p.name).values())
    return {p.name: by_kind[p.fn_kind] for p in parts.parts(cfg)}


def estimate(cfg: ModelConfig, stream: StreamConfig, store: StoreConfig, shape: StepShape, hardware: HardwareProfile,
             tx=None, part_bytes_: dict[str, StateBytes] | None = None, devices: int | None = None,
             fused: bool | None = None, processes: int = 1) -> Plan:
    """Price one training step of `cfg` of `shape` under `stream` and `store` on `hardware`.
    `tx`: the optax transformation (default: mtjax's AdamW). `devices`: data parallel over
    that many (default: stream.devices, "all" being the profile's `devices`). `fused`:
    whether the update is the one-pass AdamW loop (default: where numba is installed and
    the compute dtype allows it, as the engine decides). `processes`: the step of one
    process of a run of that many, with the whole state (mtjax.plan.hosts takes the other
    hosts' rows off)."""
    tx = make_optimizer(OptimConfig()) if tx is None and part_bytes_ is None else tx
    if devices is None:
        devices = stream.devices if isinstance(stream.devices, int) else hardware.devices
    dispatch = moe.dispatch("cpu" if hardware.device_is_host else "gpu")  # the planned device's grouped matmul
    s = describe(cfg, stream, store, shape, tx, fused=fused, part_bytes_=part_bytes_, devices=devices,
                 dispatch=dispatch, reads_host=hardware.device_is_host, processes=processes)
    pb, hw, state = s.part_bytes, hardware, s.state
    params_of = _params_of(cfg)
    num_params = sum(params_of.values())

    # --- FLOPs, per micro-batch then per step: every micro-batch runs through every part.
    # Summed over the devices, each of which runs its share (_times divides): on rows split
    # over them, as the engine's model config says (work a layer repeats on every device,
    # the delta rule's scan, counts once per device).
    tokens = shape.batch * shape.seq
    computing = s.computing

    def forward(executed):
        # A MoE block computes with its active parameters (k experts); its bytes are all of them.
        active = [params_of[partid.block(i)] - model.inactive_params(cfg, spec)
                  for i, spec in enumerate(cfg.layer_specs)]
        return sum(block_forward_flops(computing, spec, n, shape.batch, shape.seq, executed, dispatch)
                   for n, spec in zip(active, cfg.layer_specs))

    head_fwd = 2.0 * cfg.hidden_size * cfg.vocab_size * tokens
    # Blocks: forward, recompute forward, backward (2x) = 4 forwards; head: forward, the
    # chunked loss's recompute of each chunk's logits (mtjax.loss), backward (2x) = 4 too.
    # A saved group's blocks are not recomputed: remat none skips the whole second forward,
    # dots all but its attention (the projections are kept; the elementwise rest is not counted).
    saved = 0.0
    for i in (i for g in s.saved for i in g):
        spec = cfg.layer_specs[i]
        params_i = params_of[partid.block(i)] - model.inactive_params(cfg, spec)
        whole = block_forward_flops(computing, spec, params_i, shape.batch, shape.seq, dispatch=dispatch)
        saved += whole if s.remat == "none" else 2.0 * params_i * tokens
    flops = shape.accum * (4 * forward(True) - saved + 4 * head_fwd)
    model_flops = shape.accum * (3 * forward(False) + 3 * head_fwd)

    # --- the links: the schedule's bytes; the device reads and writes host RAM by DMA.
    t = s.traffic
    dma = 0 if hw.h2d_bytes_per_s is None else t.h2d + t.d2h
    # The resident parts' update: host memory traffic where the device is the host; on an
    # accelerator it runs at device-memory bandwidth (TB/s), which the profiles do not hold,
    # and is priced as free.
    resident_update = t.device_update if hw.device_is_host else 0
    # Where the devices are the host, a ring all-reduce reads and writes host memory:
    # each of the N devices 2 (N-1) / N of the reduced bytes.
    ring = 2 * (devices - 1) * t.allreduce if hw.device_is_host else 0
    traffic = Traffic(t.h2d, t.d2h, t.disk_read_bytes, t.disk_write_bytes,
                      t.host_memory + dma + resident_update + ring, t.allreduce)

    # --- memory and disk footprints -------------------------------------------------------
    biggest = max(pb.values(), key=lambda b: b.compute + b.master + b.opt)
    in_ram = sum(state.get(k) for k in parts.KINDS
                 if getattr(store, k) == "ram" and not (k == "compute" and s.derived_compute))
    # Compute weights in flight to the device: the staging pool's sets, which the engine
    # allocates as the schedule says (`schedule.staging_sets`).
    staging = slots = s.staging_bytes
    # The optimizer's disk reads land in reused buffers, as the schedule says
    # (`schedule.read_sets`) and the engine allocates them.
    staging += s.read_bytes
    sets = collections.Counter(p.fn_kind for p in parts.parts(cfg))
    # With the next part read ahead, an update can finish while the last one's new state
    # still waits for the disk: one more part's new disk-tier state in flight, and no more
    # (an update waits for the writes of the update before last; RAM-tier kinds are
    # updated in place). Measured on the disk rows of the planner benchmark.
    if sets and max(sets.values()) > 1 and any(getattr(store, k) == "disk" for k in ("master", "opt")):
        staging += sum(biggest.get(k) for k in parts.KINDS if getattr(store, k) == "disk"
                       and not (k == "compute" and s.derived_compute))
    staging += 2 * biggest.master if s.spill else 0  # a part's gradient sum on its way to and from disk
    if store.compute == "disk":  # new compute copies handed to staging: those waiting, and the one being staged
        staging += (HANDED_AHEAD + 1) * biggest.compute
    activations = s.kept_bytes if stream.activations == "host" else 0
    grads_in_ram = 0 if s.spill else sum(pb[p].master for p in s.host_updated)  # resident parts' stay on the device
    runtime = hw.runtime_bytes
    host = HostMemory(in_ram, grads_in_ram, staging, activations, runtime,
                      in_ram + grads_in_ram + staging + activations + runtime, slots)
    # A commit writes every RAM-tier kind into the run's store, the compute copy included
    # (rounded from master when none is kept), into the slot not holding the last commit,
    # and the disk-tier kinds of resident parts (their state is in no store between commits).
    in_store = sum(state.get(k) for k in parts.KINDS if getattr(store, k) == "ram")
    checkpoint = in_store + sum(committed(pb[p], k) for p in s.resident for k in parts.KINDS
                                if getattr(store, k) == "disk")
    # Two copies of everything on disk, so a crash mid-write never loses the committed one;
    # a one-copy store instead keeps the pending gradients durable (counted in the spill).
    on_disk = sum(state.get(k) for k in parts.KINDS if getattr(store, k) == "disk")
    disk_bytes = store.copies * (on_disk + in_store) + (state.master if s.spill else 0)

    times = _times(s, hw, flops, traffic)
    return Plan(s, hw, num_params, flops, model_flops, host, disk_bytes, checkpoint, traffic, times)


def _times(s: Schedule, hw: HardwareProfile, flops: float, t: Traffic) -> Times:
    n = s.devices
    device = flops / n / hw.matmul_flops(s.cfg.compute_dtype)  # each device its share of the rows
    interconnect = 0.0
    if hw.h2d_bytes_per_s is None:  # the device is the host: a staged buffer is used in place
        link = 0.0
        h2d_rate = d2h_rate = math.inf
    else:
        h2d_rate, d2h_rate = hw.h2d_bytes_per_s, hw.d2h_bytes_per_s
        # Each device's own link: one copy of the weights and its share of the tokens.
        link = max(t.h2d / n / h2d_rate, t.d2h / d2h_rate)
        interconnect = 2 * (n - 1) / n * t.allreduce / (hw.interconnect_bytes_per_s or h2d_rate)
    disk = t.disk_read / hw.disk_read_bytes_per_s + t.disk_write / hw.disk_write_bytes_per_s
    host_mem = t.host_memory / hw.host_memory_bytes_per_s
    stages = {"device compute": device, "host<->device link": link, "disk": disk, "host memory": host_mem}
    if n > 1 and not hw.device_is_host:
        stages["device interconnect"] = interconnect
    if hw.device_is_host:
        # One set of cores does everything: nothing overlaps, not even the engine's fixed
        # cost per part streamed (`part_overhead_s`, measured per transfer of a step).
        fixed = hw.part_overhead_s * len(s.transfers)
        return Times(device, link, disk, host_mem, fixed, sum(stages.values()) + fixed, max(stages, key=stages.get))
    if partid.EMBED in s.resident:  # the first part needed is already there, updated
        bound = max(stages, key=stages.get)
        return Times(device, link, disk, host_mem, 0.0, stages[bound], bound, interconnect)
    # The embedding's gradient leaves the device last and its new weights are needed first.
    e = s.part_bytes[partid.EMBED]
    startup = s.grad_bytes[partid.EMBED] / d2h_rate + e.compute / h2d_rate  # its gradient is a dense fp32 table
    startup += (2 * e.master + 2 * e.opt + e.master + e.compute) / hw.host_memory_bytes_per_s
    for kind in parts.KINDS:
        if getattr(s.store, kind) == "disk":
            startup += e.get(kind) / hw.disk_read_bytes_per_s
    bound = max(stages, key=stages.get)
    return Times(device, link, disk, host_mem, startup, stages[bound] + startup, bound, interconnect)
