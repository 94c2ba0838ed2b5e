"""A multi-process run's step, priced per host: its share of the state, and the network.

    c = collective_bytes(cfg, processes)     bytes each process sends per step
    h = per_host(plan, processes, tx)        the plan's RAM and disk per host, network time

Each process trains its rows of every micro-batch (mtjax.stream.hosts.share) and keeps its
rows of every part's master weights and optimizer state (mtjax.shard) and the whole compute
copy (its schedule, `estimate(..., processes=N)`, says so); per step it sends its gradient
sums into one reduce-scatter per leaf (fp32, padded to equal pieces) and its rows of the
new compute copy into one all-gather per leaf. The bytes are what ring algorithms send
from each process: (N - 1) / N of a reduce-scatter's padded input (twice that for a leaf too small
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
from mtjax.plan.cost import Plan, estimate
from mtjax.shard import Shard
from mtjax.stream.hosts import share


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
    step_s: float  # one process's step (its rows of the batch) plus the collectives' (not hidden under it)


def _state_bytes(cfg: ModelConfig, kind: str, shard: Shard, tx) -> tuple[int, int]:
    """(bytes of all parts' state of `kind`, of `shard`'s rows of it)."""
    schemas = [parts.schema(cfg, p.name, kind, tx) for p in parts.parts(cfg)]
    return sum(map(parts.nbytes, schemas)), sum(parts.nbytes(shard.schema(x)) for x in schemas)


def of_processes(plan: Plan, processes: int) -> Plan:
    """`plan` (of the whole step, one process) priced as the step of one process of a run of
    `processes`: its share of every micro-batch's rows, and what such a run keeps (its
    schedule, mtjax.stream.schedule.describe). A plan that already is one process's of
    `processes` is returned as it is."""
    s = plan.schedule
    if s.processes == processes:
        return plan
    if s.processes != 1:
        raise ValueError(f"of_processes prices a plan of one process, not one of {s.processes}")
    shape = dataclasses.replace(plan.shape, batch=share(plan.shape.batch, processes))
    return estimate(plan.cfg, plan.stream, plan.store, shape, plan.hardware, part_bytes_=plan.part_bytes,
                    devices=s.devices, fused=s.fused, processes=processes)


def per_host(plan: Plan, processes: int, tx=None) -> PerHost:
    """`plan` (of the whole step on one host) as each host of a run of `processes` carries
    it: the step of one process of such a run (`of_processes`: its rows of the batch, the
    whole compute copy kept), less the other hosts' rows of the master weights, the
    optimizer state and the gradient sums waiting for their update (wherever they are
    placed). `tx`: the optax transformation the plan was priced with (`estimate`'s; default
    mtjax's AdamW): its state is what each host keeps rows of."""
    plan = of_processes(plan, max(processes, 1))
    cfg, store, state, s = plan.cfg, plan.store, plan.state, plan.schedule
    shard = Shard(0, max(processes, 1))
    tx = make_optimizer(OptimConfig()) if tx is None else tx
    whole, mine = {}, {}
    for k in ("master", "opt"):
        whole[k], mine[k] = _state_bytes(cfg, k, shard, tx)
    if whole != {k: state.get(k) for k in whole}:
        raise ValueError("per_host: the plan's state was priced with another optimizer than `tx`; pass the one "
                         "given to estimate")
    less = {k: whole[k] - mine[k] for k in mine}  # the other hosts' rows
    ram = plan.ram_needed - sum(less[k] for k in less if getattr(store, k) == "ram")
    ram -= plan.host.grads - plan.host.grads * mine["master"] // max(state.master, 1)
    disk = plan.disk_bytes - store.copies * sum(less.values()) - (less["master"] if s.spill else 0)
    c = collective_bytes(cfg, processes)
    rate = plan.hardware.network_bytes_per_s
    seconds = c.total / rate if processes > 1 else 0.0
    return PerHost(processes, ram, disk, c, seconds, plan.times.step + seconds)


def host_plan(plan: Plan, processes: int, tx=None) -> Plan:
    """The step of one process of a run of `processes` (`of_processes`), with the host RAM
    and disk of its host (`per_host`, with `tx`): what the preflight checks against one
    machine."""
    if processes < 2:
        return plan
    plan = of_processes(plan, processes)
    h = per_host(plan, processes, tx)
    host = dataclasses.replace(plan.host, total=plan.host.total - (plan.ram_needed - h.ram_bytes))
    return dataclasses.replace(plan, host=host, disk_bytes=h.disk_bytes)
