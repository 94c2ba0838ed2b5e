"""A multi-process run's step, priced per host: its share of the state, and the network.

    c = collective_bytes(cfg, processes)     bytes each process sends per step
    h = per_host(plan, processes)            the plan's RAM and disk per host, network time

Each process keeps its rows of every part's master weights and optimizer state
(mtjax.shard) and the whole compute copy; per step it sends its gradient sums into one
reduce-scatter per leaf (fp32, padded to equal pieces) and its rows of the new compute
copy into one all-gather per leaf. The bytes are what ring algorithms send from each
process: (N - 1) / N of a reduce-scatter's padded input (twice that for a leaf too small
to split, which is all-reduced), and N - 1 pieces of an all-gather. Priced against the
hardware profile's `network_bytes_per_s`; the collectives run after the backward
(reduce-scatter, overlapping the backward's later parts) and before the next forward
(all-gather), so their time is added to the step, not hidden under it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from mtjax import parts
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.shard import Shard


class Collectives(NamedTuple):
    reduce_scatter: int  # bytes each process sends per step (gradients)
    all_gather: int  # bytes each process sends per step (new compute weights)

    @property
    def total(self) -> int:
        return self.reduce_scatter + self.all_gather


def collective_bytes(cfg: ModelConfig, processes: int) -> Collectives:
    """The bytes process 0 sends per step in a run of `processes` (0 for one process)."""
    if processes < 2:
        return Collectives(0, 0)
    shard, compute = Shard(0, processes), np.dtype(cfg.compute_dtype).itemsize
    rs = ag = 0
    for p in parts.parts(cfg):
        for s in parts.schema(cfg, p.name, "master").values():
            rows, rest = (s.shape[0], int(np.prod(s.shape[1:]))) if s.shape else (1, 1)
            if shard.splits(s.shape):
                rs += processes * shard.block(rows) * rest * 4 * (processes - 1) // processes
                ag += shard.block(rows) * rest * compute * (processes - 1)
            else:
                rs += 2 * rows * rest * 4 * (processes - 1) // processes
    return Collectives(rs, ag)


class PerHost(NamedTuple):
    processes: int
    ram_bytes: int  # the plan's host RAM on one host
    disk_bytes: int  # the plan's store on one host's disk (its shard)
    collectives: Collectives
    network_s: float  # seconds per step the collectives take at the profile's network rate
    step_s: float  # the plan's step time plus the collectives' (not hidden under compute)


def _sharded_bytes(cfg: ModelConfig, kind: str, shard: Shard, tx) -> int:
    return sum(parts.nbytes(shard.schema(parts.schema(cfg, p.name, kind, tx))) for p in parts.parts(cfg))


def per_host(plan, processes: int, optim=None) -> PerHost:
    """`plan` (mtjax.plan.cost.Plan of the whole step on one host) as each host of a run
    of `processes` carries it: its rows of the master weights, the optimizer state and the
    gradient sums waiting for their update (wherever they are placed), the whole compute
    copy (always kept: a host cannot round it from master rows it does not hold)."""
    cfg, store, state, s = plan.cfg, plan.store, plan.state, plan.schedule
    tx = make_optimizer(optim) if optim is not None else make_optimizer(OptimConfig())
    shard = Shard(0, max(processes, 1))
    mine = {k: _sharded_bytes(cfg, k, shard, tx) for k in ("master", "opt")}
    less = {k: state.get(k) - mine[k] for k in mine}  # the other hosts' rows
    ram = plan.ram_needed - sum(less[k] for k in less if getattr(store, k) == "ram")
    ram -= plan.host.grads - plan.host.grads * mine["master"] // max(state.master, 1)
    if s.derived_compute:  # kept after all
        ram += state.compute
    disk = plan.disk_bytes - store.copies * sum(less.values()) - (less["master"] if s.spill else 0)
    c = collective_bytes(cfg, processes)
    rate = plan.hardware.network_bytes_per_s
    seconds = c.total / rate if processes > 1 else 0.0
    return PerHost(processes, ram, disk, c, seconds, plan.times.step + seconds)


def host_plan(plan, processes: int):
    """`plan` with the host RAM and disk of one host of `processes` (its other figures as
    they were): what the preflight checks against one machine."""
    if processes < 2:
        return plan
    h = per_host(plan, processes)
    host = dataclasses.replace(plan.host, total=plan.host.total - (plan.ram_needed - h.ram_bytes))
    return dataclasses.replace(plan, host=host, disk_bytes=h.disk_bytes)
