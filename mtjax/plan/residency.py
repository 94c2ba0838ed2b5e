"""Which parts stay on the device: of the resident sets whose step fits the device
budget, the one the cost model prices fastest.

    plan = residency.choose(cfg, stream, store, shape, hardware, budget, tx)
    plan.schedule.resident        # ("block.0", "block.1", ...): stream.resident for the run

Parts that the schedule streams equally often and that hold the same bytes are
interchangeable in the step's price (traffic, device plan and fixed costs depend only on
how many of them are resident), so the candidates are every combination of a count per
such class (`classes`): at most 8 (L + 1) sets for L identical blocks, not 2^(L + 2);
only those whose resident state alone fits the budget are priced (`choose`).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax

from mtjax import parts
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import fit, inputs
from mtjax.plan.cost import Plan, estimate
from mtjax.plan.hardware import BUILTIN, HardwareProfile
from mtjax.stream import step_parts
from mtjax.stream.hosts import STREAMED, check_resident, share
from mtjax.stream.step_bytes import StepShape, part_bytes


def classes(cfg: ModelConfig, stream: StreamConfig) -> list[tuple[str, ...]]:
    """The parts in groups the cost model cannot tell apart: same layout (fn_kind, hence
    the same bytes, by leaf role: a frozen leaf's compute copy only) and streamed as often
    in a step; each group in residency order. Parts with buffers are never resident
    (`step_parts.with_buffers`)."""
    grps = step_parts.groups(cfg.num_hidden_layers, stream.keep_every)
    crossings = {}
    for p in step_parts.train_parts(cfg, grps):
        crossings[p] = crossings.get(p, 0) + 1
    kind = {p.name: p.fn_kind for p in parts.parts(cfg)}
    out: dict[tuple, list[str]] = {}
    streamed = step_parts.with_buffers(cfg)
    for p in step_parts.residency_order(cfg, grps):
        if p not in streamed:
            out.setdefault((kind[p], parts.trained(cfg, p), crossings[p]), []).append(p)
    return [tuple(v) for v in out.values()]


def candidates(cfg: ModelConfig, stream: StreamConfig, each: list[int] | None = None,
               budget: int | None = None) -> list[tuple[str, ...]]:
    """Every resident set worth pricing: a count of each class, its first members. With
    `each` (the device bytes one resident part of each class holds, `classes`' order),
    only the sets whose resident parts alone fit `budget`."""
    cls = classes(cfg, stream)
    counts = itertools.product(*(range(len(c) + 1) for c in cls))
    if each is not None:
        counts = (n for n in counts if sum(k * b for k, b in zip(n, each)) <= budget)
    return [tuple(p for c, k in zip(cls, n) for p in c[:k]) for n in counts]


def choose(cfg: ModelConfig, stream: StreamConfig, store: StoreConfig, shape: StepShape, hardware: HardwareProfile,
           budget: int | None, tx=None, processes: int = 1) -> Plan:
    """The plan of the fastest resident set and remat policy (stream.remat, or each when
    auto) whose device plan fits `budget`; among equally
    fast ones (streaming hidden behind compute), the one that moves fewest bytes over the
    link, then the fewest device bytes. With no budget, or none that fits, nothing is resident.
    `shape` and `processes`: the step of one process of a run of that many (its rows)."""
    pb = part_bytes(cfg, make_optimizer(OptimConfig()) if tx is None else tx)

    def at(resident) -> Plan:
        return estimate(cfg, dataclasses.replace(stream, resident=tuple(resident), remat=step_parts.remat_of(stream)),
                        store, shape, hardware, part_bytes_=pb, processes=processes)

    if budget is None:
        return at(())
    # With room left after residency, the backward may keep more instead of recomputing.
    remats = ("full", "dots", "none") if stream.remat == "auto" else (stream.remat,)
    # A set whose resident state alone exceeds the budget cannot fit (the device plan
    # adds its other uses to it), so it is not priced. The resident state is the sum of
    # each resident part's, alike within a class: one part of each class priced resident
    # alone says it. On a model of big blocks most of the (L + 1)^k sets are out
    # (gpt-oss-120b's 8,226 plans on an H200 become 116).
    each = [at(c[:1]).device.resident for c in classes(cfg, stream)]
    plans = [estimate(cfg, dataclasses.replace(stream, resident=r, remat=m), store, shape, hardware, part_bytes_=pb,
                      processes=processes) for r in candidates(cfg, stream, each, budget) for m in remats]
    fitting = [p for p in plans if p.device.total <= budget]
    if not fitting:
        return at(())
    return min(fitting, key=lambda p: (p.times.step, p.traffic.h2d + p.traffic.d2h, p.device.total))


def budget_for(stream: StreamConfig, hardware: HardwareProfile) -> int | None:
    """The device bytes residency may plan against: stream.device_budget_bytes, else the
    profile's device memory less headroom (None where the device is the host)."""
    if stream.device_budget_bytes is not None:
        return stream.device_budget_bytes
    return fit.limits(hardware).device


def resolve(cfg: ModelConfig, stream: StreamConfig, store: StoreConfig, shape: StepShape, hardware: HardwareProfile,
            tx=None, processes: int = 1) -> StreamConfig:
    """`stream` with resident=auto replaced by the parts `choose` keeps resident (as a list
    of names) and remat=auto by its policy; settings given are kept (an explicit resident
    with remat=auto gets the fastest policy that fits for those parts). `shape` and
    `processes` as `choose`'s."""
    if stream.resident == "auto":
        plan = choose(cfg, stream, store, shape, hardware, budget_for(stream, hardware), tx, processes)
        return dataclasses.replace(stream, resident=plan.schedule.resident, remat=plan.schedule.remat)
    if stream.remat == "auto":
        budget = budget_for(stream, hardware)
        plans = [estimate(cfg, dataclasses.replace(stream, remat=m), store, shape, hardware, tx=tx, processes=processes)
                 for m in ("full", "dots", "none")]
        fitting = [p for p in plans if budget is None or p.device.total <= budget] or plans[:1]
        return dataclasses.replace(stream, remat=min(fitting, key=lambda p: (p.times.step, p.device.total)).stream.remat)
    return stream


def profile_of(device: jax.Device) -> HardwareProfile:
    """The built-in profile a run prices its residency with: the project's GPU machine
    for an accelerator, the dev machine's for the CPU (`mtjax plan --hardware` prices any),
    with this process's device count."""
    hw = dataclasses.replace(BUILTIN["cpu-2core" if device.platform == "cpu" else "h200-lent"],
                             devices=len(jax.local_devices()))
    limit = None if device.platform == "cpu" else (device.memory_stats() or {}).get("bytes_limit")
    return dataclasses.replace(hw, device_memory_bytes=int(limit)) if limit else hw


def for_inputs(run: inputs.Inputs, hardware: HardwareProfile, processes: int = 1) -> StreamConfig:
    """The run's stream settings with resident=auto and remat=auto resolved (`resolve`) for
    `hardware`, as a run resolves them; the reference engine's, and settings given, as they are.
    In a run of several `processes` each sizes its own step: its share of every
    micro-batch's rows (mtjax.stream.hosts.share), and every part streams, LoRA adapters
    included (mtjax.stream.hosts.STREAMED; a residency that keeps parts is refused in one line):
    the one place both the trainer (`for_run`) and `mtjax plan --processes` apply it."""
    stream = run.stream
    if processes > 1:
        check_resident(stream.resident, processes)
        stream = dataclasses.replace(stream, **STREAMED)
    if stream.engine != "stream" or "auto" not in (stream.resident, stream.remat):
        return stream
    shape = dataclasses.replace(run.shape, batch=share(run.shape.batch, processes))
    return resolve(run.cfg, stream, run.store, shape, hardware, run.tx, processes)


def for_run(exp, processes: int = 1):
    """The experiment config with stream.resident and stream.remat=auto resolved for this
    process's device and its share of a run of `processes` (the trainer calls it before its
    preflight, which then checks the choice)."""
    stream = for_inputs(inputs.from_experiment(exp), profile_of(jax.local_devices()[0]), processes)
    return exp if stream is exp.stream else dataclasses.replace(exp, stream=stream)
