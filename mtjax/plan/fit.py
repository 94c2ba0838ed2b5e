"""Does a plan fit the machine, and what should change if not.

`check` is what the trainer's preflight calls; `limits` and `short_of` say which of a
profile's RAM, disk and device memory a plan exceeds (the marks of `mtjax plan`'s
placement table, and its exit status); `recommend` picks the placement of each kind of
state, the prefetch depth and the checkpoint interval for a machine.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from mtjax import parts
from mtjax.config import StoreConfig
from mtjax.plan import hosts
from mtjax.plan.cost import Plan, estimate
from mtjax.plan.hardware import HardwareProfile
from mtjax.units import size

RAM_HEADROOM = 0.9  # leave 10% of RAM to the OS and page cache
DEVICE_HEADROOM = 0.9  # XLA needs scratch space beyond the buffers the plan counts
MTBF_S = 24 * 3600.0  # assumed mean time between failures of one machine


def _with_placement(plan: Plan, placement: StoreConfig, tx=None) -> Plan:
    """`plan` with its state placed as `placement` says. One host's plan of a run of several
    processes (mtjax.plan.hosts.host_plan, priced with the optimizer `tx`) stays one."""
    s = plan.schedule
    placed = estimate(plan.cfg, plan.stream, placement, plan.shape, plan.hardware, part_bytes_=plan.part_bytes,
                      devices=s.devices, processes=s.processes)
    return hosts.host_plan(placed, s.processes, tx)


def _placements(current: StoreConfig) -> list[StoreConfig]:
    """Every tier of every kind; a one-copy store only where all of them are on disk."""
    out = []
    for tiers in itertools.product(("ram", "disk"), repeat=len(parts.KINDS)):
        copies = current.copies if set(tiers) == {"disk"} else 2
        out.append(dataclasses.replace(current, **dict(zip(parts.KINDS, tiers)), copies=copies))
    return out


def _changes(current: StoreConfig, new: StoreConfig) -> list[str]:
    """The store settings to change from `current` to `new`, as `store.KEY=VALUE`."""
    return [f"store.{k}={getattr(new, k)}" for k in (*parts.KINDS, "copies") if getattr(new, k) != getattr(current, k)]


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a run may use of a machine, in bytes (device None: the device is the host)."""

    ram: float
    disk: float
    device: float | None


def limits(hw: HardwareProfile) -> Limits:
    """A profile's RAM and device memory less their headroom, and its disk."""
    return Limits(hw.host_ram_bytes * RAM_HEADROOM, hw.disk_bytes,
                  None if hw.device_is_host else hw.device_memory_bytes * DEVICE_HEADROOM)


def short_of(plan: Plan, room: Limits) -> tuple[str, ...]:
    """The resources `plan` needs more of than `room` has: "RAM", "disk", "device"."""
    over = (("RAM", plan.ram_needed > room.ram), ("disk", plan.disk_bytes > room.disk),
            ("device", room.device is not None and plan.device.total > room.device))
    return tuple(name for name, exceeded in over if exceeded)


@dataclasses.dataclass(frozen=True)
class Option:
    """One row of the placement table: a placement priced with the run's other settings."""

    placement: StoreConfig
    plan: Plan
    short: tuple[str, ...]  # what it does not fit (empty: it fits)
    configured: bool  # the placement `plan` was priced with


def placements(plan: Plan, room: Limits) -> list[Option]:
    """Every placement of compute, master and opt state, fastest first."""
    options = [(p, _with_placement(plan, p)) for p in _placements(plan.store)]
    options.sort(key=lambda o: o[1].times.step)
    return [Option(p, q, short_of(q, room), p == plan.store) for p, q in options]


def check(plan: Plan, available_ram: float, free_disk: float, device_memory: float | None = None,
          tx=None) -> str | None:
    """None when the run fits; otherwise one line: what does not fit, by how much, what to change.
    `plan` may be one host's of a multi-process run (`host_plan`, priced with the optimizer
    `tx`): the placement it suggests is then priced on that host's share too."""
    device = None if plan.hardware.device_is_host else device_memory  # else its peak is in ram_needed
    over = short_of(plan, Limits(available_ram, free_disk, device))
    problems = []
    if "RAM" in over:
        short = plan.ram_needed - available_ram
        fix = "use a machine with more RAM"
        current = plan.store
        placed = {p: _with_placement(plan, p, tx) for p in _placements(current)}
        fits = [p for p, q in placed.items() if q.ram_needed <= available_ram]
        if fits:
            # The smallest change: the fewest kinds moved from RAM to disk, then the fastest.
            best = min(fits, key=lambda p: (len(_changes(current, p)), placed[p].times.step))
            changes = _changes(current, best)
            fix = f"set {' '.join(changes)}" if changes else fix
        problems.append(f"needs {size(plan.ram_needed)} of host RAM but {size(available_ram)} is available "
                        f"(short by {size(short)}): {fix}")
    if "disk" in over:
        short = plan.disk_bytes - free_disk
        on_disk = [k for k in parts.KINDS if getattr(plan.store, k) == "disk"]
        fix = (f"free {size(short)} on the store's disk" +
               (f" or keep {'/'.join(on_disk)} in RAM" if on_disk else ""))
        problems.append(f"needs {size(plan.disk_bytes)} of free disk but {size(free_disk)} is free "
                        f"(short by {size(short)}): {fix}")
    if "device" in over:
        short = plan.device.total - device_memory
        fix = []
        if plan.stream.prefetch_depth > 1:
            fix.append("lower prefetch_depth")
        if (0 < plan.stream.keep_every < plan.cfg.num_hidden_layers
                and plan.device.activations > plan.device.residuals):
            fix.append("raise keep_every")
        fix.append("lower batch_size (raise grad_accum to keep the tokens per step)")
        problems.append(f"needs {size(plan.device.total)} of device memory but {size(device_memory)} is available "
                        f"(short by {size(short)}): {' or '.join(fix)}")
    return "; ".join(problems) or None


@dataclasses.dataclass(frozen=True)
class Advice:
    placement: StoreConfig
    prefetch_depth: int
    checkpoint_every: int  # steps between checkpoints of the RAM-resident state
    checkpoint_seconds: float  # time to write one checkpoint
    plan: Plan  # the plan under this advice
    fits: bool
    why: str


def checkpoint_interval(plan: Plan, mtbf_s: float = MTBF_S) -> tuple[int, float]:
    """Steps between checkpoints by Young's rule sqrt(2 * cost * MTBF), and the cost in seconds."""
    cost = plan.checkpoint_bytes / plan.hardware.disk_write_bytes_per_s
    if cost == 0:
        return 1, 0.0  # all state is in the disk store, which commits every step
    return max(1, round(math.sqrt(2 * cost * mtbf_s) / plan.times.step)), cost


def _fit_device(plan: Plan, device_bytes: float, ram_bytes: float = math.inf) -> Plan:
    """Prefetch depth 2 (one part computing, one arriving, one queued to absorb link and
    disk jitter) or 1; if neither fits, the recompute group and activation tier that
    need the least device memory. A deeper prefetch also stages more in host RAM, so a
    depth fits only where the plan still fits `ram_bytes`."""
    def at(**changes) -> Plan:
        return estimate(plan.cfg, dataclasses.replace(plan.stream, **changes), plan.store, plan.shape, plan.hardware,
                        part_bytes_=plan.part_bytes, devices=plan.schedule.devices)

    def fits(p: Plan) -> bool:
        return p.device.total <= device_bytes and p.ram_needed <= ram_bytes

    for depth in (2, 1):
        p = at(prefetch_depth=depth)
        if fits(p):
            return p
    L = plan.cfg.num_hidden_layers
    groups = sorted({1, 2, 4, 8, 16, L, plan.stream.keep_every or L} & set(range(1, L + 1)))
    options = [at(prefetch_depth=1, keep_every=k, activations=a) for k in groups for a in ("device", "host")]
    fitting = [p for p in options if fits(p)]
    return min(fitting, key=lambda p: p.times.step) if fitting else min(options, key=lambda p: p.device.total)


def recommend(plan: Plan, available_ram: int | None = None, free_disk: int | None = None) -> Advice:
    """The fastest placement that fits RAM and disk, the deepest prefetch (<= 2) that fits
    the device (changing keep_every or the activation tier only if nothing else fits),
    and a checkpoint interval."""
    hw = plan.hardware
    ram = available_ram * RAM_HEADROOM if available_ram is not None else limits(hw).ram
    disk = free_disk if free_disk is not None else hw.disk_bytes
    dev = hw.device_memory_bytes * DEVICE_HEADROOM
    candidates = [_with_placement(plan, p) for p in _placements(plan.store)]
    fitting = [c for c in candidates if c.ram_needed <= ram and c.disk_bytes <= disk]
    if fitting:
        best = min(fitting, key=lambda c: (c.times.step, c.ram_needed))
        why = f"fastest of {len(fitting)} placements that fit {size(ram)} of RAM and {size(disk)} of disk"
    else:
        best = min(candidates, key=lambda c: c.ram_needed)
        why = "no placement fits RAM and disk; this one needs the least RAM"
    chosen = _fit_device(best, dev, ram if fitting else math.inf)
    s0, s1 = plan.stream, chosen.stream
    stream = f"keep_every {s1.keep_every}, activations on the {s1.activations}"
    if chosen.device.total > dev:
        why += (f"; the device does not fit even with prefetch_depth 1, {stream} "
                f"({size(chosen.device.total)} > {size(dev)}): lower batch_size or seq_len")
    elif (s1.keep_every, s1.activations) != (s0.keep_every, s0.activations):
        why += f"; {stream} to fit the device"
    every, cost = checkpoint_interval(chosen)
    fits = bool(fitting) and chosen.device.total <= dev and chosen.ram_needed <= ram
    return Advice(chosen.store, s1.prefetch_depth, every, cost, chosen, fits, why)
