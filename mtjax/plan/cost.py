"""The per-step cost model of the streaming engine: bytes, FLOPs and seconds.

Every byte count is a sum over `mtjax.parts.schema` (ShapeDtypeStructs, nothing
allocated), so the planner, the trainer's preflight and the stores agree. One step of
`grad_accum` micro-batches, each streaming every part:

    forward    reads every part's compute weights once (host -> device)
    backward   reads every block's compute weights again; each block runs forward twice
               (the pass and the recompute that builds its vjp) and backward once:
               4 forward-equivalents = ~8 * params * tokens FLOPs, plus attention
    gradients  of every part go device -> host, in the compute dtype (embedding: fp32)
    optimizer  once per step on the host, as one fused loop (mtjax.stream.fused_adamw):
               28 bytes/param for fp32 AdamW, 30 with a bf16 compute copy; the RAM tier
               keeps no copy (the prefetcher rounds master). Without numba, XLA's four
               passes: 46 bytes/param
    disk tier  state kept on disk is read and written from disk instead of RAM; with
               master weights on disk, fp32 gradient sums are spilled to disk too

Stages run pipelined, so the step takes as long as its busiest resource plus the part
that cannot overlap (the embedding: its gradient arrives last and it is needed first).
See docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from mtjax import model, parts, treepath
from mtjax.model_config import SLIDING, ModelConfig
from mtjax.plan.hardware import GiB, HardwareProfile

TIERS = ("ram", "disk")
RUNTIME_OVERHEAD_BYTES = 2 * GiB  # Python, JAX runtime and compiled programs in host RAM (profiles' default)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each kind of state lives between uses: "ram" or "disk"."""

    compute: str = "ram"  # weights in the compute dtype, streamed to the device
    master: str = "ram"  # fp32 master weights
    opt: str = "ram"  # optimizer state (AdamW mu, nu)

    def __post_init__(self):
        for kind in parts.KINDS:
            if getattr(self, kind) not in TIERS:
                raise ValueError(f"placement.{kind} must be 'ram' or 'disk', got {getattr(self, kind)!r}")

    def on(self, tier: str) -> tuple[str, ...]:
        return tuple(k for k in parts.KINDS if getattr(self, k) == tier)

    def __str__(self):
        return ",".join(f"{k}={getattr(self, k)}" for k in parts.KINDS)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one training step does, as far as costs go."""

    batch_size: int = 1  # sequences per micro-batch
    seq_len: int = 2048  # tokens per sequence
    grad_accum: int = 1  # micro-batches per optimizer step; each streams every part
    keep_every: int = 1  # k: keep every k-th block input, recompute the rest; 0 keeps only the first
    prefetch_depth: int = 2  # parts fetched ahead of the one computing
    activations: str = "device"  # where kept block inputs live: device | host
    loss_chunk: int | None = None  # tokens per head chunk (logits never exist whole); None = seq_len
    placement: Placement = Placement()
    store_copies: int = 2  # copies of the disk-tier state: 2 (A/B slots) or 1 (one copy + pending gradients)

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefetch_depth < 0 or self.keep_every < 0:
            raise ValueError("prefetch_depth and keep_every must be >= 0")
        if self.activations not in ("device", "host"):
            raise ValueError(f"activations must be 'device' or 'host', got {self.activations!r}")

    def group(self, num_blocks: int) -> int:
        """Blocks per recompute group: k, or all of them when k is 0."""
        return min(self.keep_every or num_blocks, num_blocks)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum


@dataclasses.dataclass(frozen=True)
class StateBytes:
    compute: int
    master: int
    opt: int

    def get(self, kind: str) -> int:
        return getattr(self, kind)


def part_bytes(cfg: ModelConfig, tx) -> dict[str, StateBytes]:
    """{part name: bytes of its compute, master and opt state}, from `parts.schema`."""
    by_kind: dict[str, StateBytes] = {}
    out = {}
    for p in parts.parts(cfg):
        # Parts of one fn_kind have one parameter layout: derive its schema once.
        if p.fn_kind not in by_kind:
            by_kind[p.fn_kind] = StateBytes(
                *(parts.nbytes(parts.schema(cfg, p.name, kind, tx)) for kind in parts.KINDS))
        out[p.name] = by_kind[p.fn_kind]
    return out


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    weights: int  # staged compute weights: prefetched parts + a recompute group (or head + embed)
    kept_inputs: int  # ceil(L / k) block inputs [batch, seq, hidden]; 0 when they live on the host
    residuals: int  # k blocks' vjp residuals during a group's backward
    head: int  # logits, softmax and their gradient at the LM head
    working: int  # hidden-state temporaries and two parts' gradients
    peak: int  # the sum: every term can be live at once


@dataclasses.dataclass(frozen=True)
class HostMemory:
    state: int  # compute/master/opt state placed in RAM
    grads: int  # fp32 gradient sums of every part, held until the clip norm is known (0: spilled to disk)
    staging: int  # page-aligned buffers for the parts in flight
    activations: int  # kept block inputs, when they live on the host
    runtime: int
    total: int


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes moved over each link in one step."""

    h2d: int
    d2h: int
    disk_read: int
    disk_write: int
    host_memory: int  # read + written by the CPU (optimizer, gradient sums, DMA, disk buffers)


@dataclasses.dataclass(frozen=True)
class Times:
    """Seconds each resource is busy in one step, and the predicted step time."""

    device: float
    link: float  # the busier direction of the full-duplex host<->device link
    disk: float
    host_memory: float
    startup: float  # not overlapped: the embedding's gradient -> update -> weights chain (GPU); the fixed per-part cost (CPU)
    step: float
    bound: str  # the resource that sets the step time


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: ModelConfig
    workload: Workload
    hardware: HardwareProfile
    part_bytes: dict[str, StateBytes]
    num_params: int
    flops: float  # device FLOPs executed per step (recompute included)
    model_flops: float  # 6 * params * tokens + attention: the work the step is worth
    state: StateBytes  # totals over all parts
    device: DeviceMemory
    host: HostMemory
    disk_bytes: int
    checkpoint_bytes: int  # written by one checkpoint of the RAM-resident master and opt state
    traffic: Traffic
    times: Times

    @property
    def ram_needed(self) -> int:
        """Host RAM the run needs; when the device is the host, its peak is host RAM too."""
        return self.host.total + (self.device.peak if self.hardware.device_is_host else 0)

    @property
    def tokens_per_s(self) -> float:
        return self.workload.tokens_per_step / self.times.step


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _kept_inputs(cfg: ModelConfig, w: Workload) -> int:
    """ceil(L / k) block inputs [batch, seq, hidden] in the compute dtype."""
    hidden = w.batch_size * w.seq_len * cfg.hidden_size * _itemsize(cfg.compute_dtype)
    return math.ceil(cfg.num_hidden_layers / w.group(cfg.num_hidden_layers)) * hidden


def _keys_per_query(cfg: ModelConfig, kind: str, seq: int) -> float:
    """Average number of keys a query may see (causal, optionally windowed)."""
    w = cfg.sliding_window if kind == SLIDING else None
    if not w or w >= seq:
        return (seq + 1) / 2
    return (w * (w + 1) / 2 + (seq - w) * w) / seq


def block_forward_flops(cfg: ModelConfig, kind: str, block_params: int, batch: int, seq: int,
                        executed: bool = True) -> float:
    """FLOPs of one block's forward. `executed`: what the model's XLA attention runs (every
    query against every key, masked afterwards); otherwise only the keys a query may see."""
    matmuls = 2.0 * block_params * batch * seq
    keys = seq if executed else _keys_per_query(cfg, kind, seq)
    attention = 4.0 * batch * seq * cfg.num_attention_heads * cfg.head_dim * keys  # QK^T and AV
    return matmuls + attention


@functools.lru_cache(maxsize=64)
def residual_bytes(cfg: ModelConfig, kind: str, batch: int, seq: int) -> int:
    """Bytes a block's vjp keeps beyond its own weights, traced from the real block
    (`jax.eval_shape` of `jax.vjp`: nothing runs, nothing is allocated). Includes
    whatever the attention implementation saves, e.g. [batch, heads, seq, seq] scores."""
    name = f"block.{cfg.layer_types.index(kind)}"
    weights = parts.schema(cfg, name, "compute")
    template = parts.abstract_part(cfg, name)
    x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype))

    def forward(w, x):
        return model.block_forward(cfg, kind, treepath.unflatten(template, w), x)

    saved = jax.tree.leaves(jax.eval_shape(lambda w, x: jax.vjp(forward, w, x)[1], weights, x))
    # The weights appear among the residuals but are already counted as staged weights.
    unmatched = [(tuple(v.shape), np.dtype(v.dtype)) for v in weights.values()]
    total = 0
    for leaf in saved:
        key = (tuple(leaf.shape), np.dtype(leaf.dtype))
        if key in unmatched:
            unmatched.remove(key)
        else:
            total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    return total


def _device_memory(cfg: ModelConfig, w: Workload, pb: dict[str, StateBytes]) -> DeviceMemory:
    """The same terms the engine's own accounting uses (mtjax.stream.budget)."""
    L = cfg.num_hidden_layers
    k = w.group(L)
    max_part = max(b.compute for b in pb.values())
    hidden = w.batch_size * w.seq_len * cfg.hidden_size * _itemsize(cfg.compute_dtype)
    # depth parts staged ahead, plus the parts in use: a recompute group, or head + embedding.
    weights = (w.prefetch_depth + max(k, 2)) * max_part
    kept = _kept_inputs(cfg, w) if w.activations == "device" else 0
    residuals = k * max(residual_bytes(cfg, kind, w.batch_size, w.seq_len) for kind in cfg.block_kinds)
    chunk = min(w.loss_chunk or w.seq_len, w.seq_len)
    head = 3 * w.batch_size * chunk * cfg.vocab_size * 4  # fp32 logits, softmax and their gradient
    # The embedding's gradient is a dense fp32 table; the other parts' are in the compute dtype.
    max_grad = max(max(b.compute for b in pb.values()), pb["embed"].master)
    working = 4 * hidden + 2 * max_grad
    return DeviceMemory(weights, kept, residuals, head, working, weights + kept + residuals + head + working)


def parts_streamed(cfg: ModelConfig) -> int:
    """Parts streamed to the device per micro-batch: every part forward, every block again
    for the backward (the probe times the engine's fixed cost per one of these)."""
    return 2 * cfg.num_hidden_layers + 2


def fused_update(cfg: ModelConfig) -> bool:
    """Whether the engine updates with the fused loop (numba installed, bf16/fp32 compute)."""
    from mtjax.stream import fused_adamw

    return fused_adamw.supports(cfg.compute_dtype)


def derived_compute(cfg: ModelConfig, place: Placement) -> bool:
    """Whether the RAM tier keeps no compute copy (StreamEngine.derived_compute)."""
    from mtjax.stream.tiers import derives_compute

    return derives_compute(fused_update(cfg), place.master, place.compute)


def estimate(cfg: ModelConfig, workload: Workload, hardware: HardwareProfile,
             tx=None, part_bytes_: dict[str, StateBytes] | None = None) -> Plan:
    """Price one training step of `cfg` under `workload` on `hardware`."""
    if part_bytes_ is None:
        if tx is None:
            from mtjax.optim import OptimConfig, make_optimizer

            tx = make_optimizer(OptimConfig())
        part_bytes_ = part_bytes(cfg, tx)
    pb, w, hw, place = part_bytes_, workload, hardware, workload.placement
    state = StateBytes(*(sum(b.get(kind) for b in pb.values()) for kind in parts.KINDS))
    block_names = [f"block.{i}" for i in range(cfg.num_hidden_layers)]
    tied = cfg.tie_word_embeddings
    c_item = _itemsize(cfg.compute_dtype)
    num_params = state.master // 4

    # --- FLOPs, per micro-batch then per step -----------------------------------------
    tokens = w.batch_size * w.seq_len

    def forward(executed):
        return sum(block_forward_flops(cfg, kind, pb[n].compute // c_item, w.batch_size, w.seq_len, executed)
                   for n, kind in zip(block_names, cfg.layer_types))

    head_fwd = 2.0 * cfg.hidden_size * cfg.vocab_size * tokens
    # Blocks: forward, recompute forward, backward (2x) = 4 forwards; head: forward + backward.
    flops = w.grad_accum * (4 * forward(True) + 3 * head_fwd)
    model_flops = w.grad_accum * (3 * forward(False) + 3 * head_fwd)

    # --- link traffic: blocks twice (forward, backward); the embedding's backward needs
    # only token ids; the head runs loss and gradient in one pass (tied: embedding again).
    h2d_once = 2 * sum(pb[n].compute for n in block_names) + pb["head"].compute
    h2d_once += pb["embed"].compute * (2 if tied else 1)
    # Gradients leave in the compute dtype, but the embedding's is a dense fp32 table.
    d2h_once = state.compute - pb["embed"].compute + pb["embed"].master + (pb["embed"].compute if tied else 0)
    if w.activations == "host":  # kept block inputs go out in the forward and come back in the backward
        kept_bytes = _kept_inputs(cfg, w)
        h2d_once += kept_bytes
        d2h_once += kept_bytes
    h2d, d2h = w.grad_accum * h2d_once, w.grad_accum * d2h_once

    # --- disk traffic: each disk-tier kind is read where it is used and rewritten by the update.
    disk_read = disk_write = 0
    if place.compute == "disk":
        disk_read += h2d
        disk_write += state.compute
    for kind in ("master", "opt"):
        if getattr(place, kind) == "disk":
            disk_read += state.get(kind)
            disk_write += state.get(kind)
    grad32 = state.master  # fp32 gradient sums, shaped like the master weights
    spill = place.master == "disk"  # the engine keeps gradient sums in scratch files then
    if spill:  # each micro-batch writes the sums; the next one and the update read them back
        disk_write += w.grad_accum * grad32
        disk_read += w.grad_accum * grad32

    # --- host memory traffic --------------------------------------------------------------
    fused = fused_update(cfg)
    derived = derived_compute(cfg, place)
    if fused:  # one loop: reads master, both moments, gradient; writes master, moments (+ copy)
        optimizer = 2 * state.master + 2 * state.opt + grad32 + (0 if derived else state.compute)
    else:
        # XLA's CPU backend runs the update as four passes (no multi-output fusion): mu and
        # nu (each reads its moment and the gradient, writes the moment), master (reads
        # master and both moments, writes master), the compute copy (reads master): 46
        # bytes/param for AdamW + bf16.
        optimizer = 3 * state.opt + 2 * grad32 + 3 * state.master + state.compute
    # Each micro-batch's gradient is read once and summed into the fp32 buffer (the first writes it).
    grad_sums = w.grad_accum * d2h_once + grad32 + (w.grad_accum - 1) * 2 * grad32
    dma = 0 if hw.h2d_bytes_per_s is None else h2d + d2h  # the device reads/writes host RAM
    host_traffic = optimizer + grad_sums + dma + disk_read + disk_write
    traffic = Traffic(h2d, d2h, disk_read, disk_write, host_traffic)

    # --- memory and disk footprints -------------------------------------------------------
    device = _device_memory(cfg, w, pb)
    biggest = max(pb.values(), key=lambda b: b.compute + b.master + b.opt)
    in_ram = sum(state.get(k) for k in place.on("ram") if not (k == "compute" and derived))
    staging = (w.prefetch_depth + 1) * biggest.compute  # compute weights in flight to the device
    # The optimizer's disk reads land in reused buffers, one set per part shape and kind
    # (a mtjax.hostmem.BufferPool): the embedding, the head and each block kind.
    shapes = {p.fn_kind: pb[p.name] for p in parts.parts(cfg)}
    staging += sum(b.get(k) for b in shapes.values() for k in ("master", "opt") if getattr(place, k) == "disk")
    staging += 2 * biggest.master if spill else 0  # a part's gradient sum on its way to and from disk
    activations = _kept_inputs(cfg, w) if w.activations == "host" else 0
    grads_in_ram = 0 if spill else grad32
    runtime = hw.runtime_bytes
    host = HostMemory(in_ram, grads_in_ram, staging, activations, runtime,
                      in_ram + grads_in_ram + staging + activations + runtime)
    checkpoint = sum(state.get(k) for k in ("master", "opt") if getattr(place, k) == "ram")
    # Two copies of everything on disk, so a crash mid-write never loses the committed one;
    # a one-copy store instead keeps the pending gradients durable (counted in the spill).
    disk_bytes = w.store_copies * (sum(state.get(k) for k in place.on("disk")) + checkpoint) + (grad32 if spill else 0)

    times = _times(w, hw, pb, flops, traffic, c_item, cfg)
    return Plan(cfg, w, hw, pb, num_params, flops, model_flops, state, device, host, disk_bytes,
                checkpoint, traffic, times)


def _times(w: Workload, hw: HardwareProfile, pb: dict[str, StateBytes], flops: float, t: Traffic,
           c_item: int, cfg: ModelConfig) -> Times:
    device = flops / hw.matmul_flops(cfg.compute_dtype)
    if hw.h2d_bytes_per_s is None:  # the device is the host: a staged buffer is used in place
        link = 0.0
        h2d_rate = d2h_rate = math.inf
    else:
        h2d_rate, d2h_rate = hw.h2d_bytes_per_s, hw.d2h_bytes_per_s
        link = max(t.h2d / h2d_rate, t.d2h / d2h_rate)
    disk = t.disk_read / hw.disk_read_bytes_per_s + t.disk_write / hw.disk_write_bytes_per_s
    host_mem = t.host_memory / hw.host_memory_bytes_per_s
    stages = {"device compute": device, "host<->device link": link, "disk": disk, "host memory": host_mem}
    if hw.device_is_host:
        # One set of cores does everything: nothing overlaps, not even the engine's fixed
        # cost per part streamed.
        fixed = hw.part_overhead_s * w.grad_accum * parts_streamed(cfg)
        return Times(device, link, disk, host_mem, fixed, sum(stages.values()) + fixed, max(stages, key=stages.get))
    # The embedding's gradient leaves the device last and its new weights are needed first.
    e = pb["embed"]
    place = w.placement
    startup = e.master / d2h_rate + e.compute / h2d_rate  # its gradient is a dense fp32 table
    startup += (2 * e.master + 2 * e.opt + e.master + e.compute) / hw.host_memory_bytes_per_s
    for kind in ("compute", "master", "opt"):
        if getattr(place, kind) == "disk":
            startup += e.get(kind) / hw.disk_read_bytes_per_s
    bound = max(stages, key=stages.get)
    return Times(device, link, disk, host_mem, startup, stages[bound] + startup, bound)
