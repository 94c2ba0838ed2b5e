"""A multi-process run's step, priced per host: its share of the state, and the network.

    c = collective_bytes(cfg, processes)     bytes each process sends per step
    h = per_host(plan, processes, hw)        the plan's RAM and disk per host, network time

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

from typing import NamedTuple

import numpy as np

from mtjax import parts
from mtjax.model_config import ModelConfig
from mtjax.optim import make_optimizer
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
    state_bytes: int  # master + optimizer state one process holds (RAM or disk, as placed)
    compute_bytes: int  # the whole compute copy, on every host
    ram_bytes: int  # the plan's host RAM on one host
    disk_bytes: int  # the plan's store on one host's disk
    collectives: Collectives
    network_s: float  # seconds per step the collectives take at the profile's rate


def state_bytes(cfg: ModelConfig, processes: int, optim=None) -> tuple[int, int]:
    """(master + optimizer bytes one process holds, the whole compute copy's bytes)."""
    tx = make_optimizer(optim) if optim is not None else None
    shard = Shard(0, max(processes, 1))
    held = sum(parts.nbytes(shard.schema(parts.schema(cfg, p.name, kind, tx)))
               for p in parts.parts(cfg) for kind in ("master", "opt"))
    return held, sum(parts.nbytes(parts.schema(cfg, p.name, "compute")) for p in parts.parts(cfg))


def per_host(plan, processes: int, network_bytes_per_s: float | None, optim=None) -> PerHost:
    """`plan` (mtjax.plan.cost.Plan of the whole model on one host) as one host of
    `processes` holds it: the master and optimizer state wherever they are placed fall
    by the process count, the compute copy does not."""
    cfg, store = plan.schedule.cfg, plan.schedule.store
    held, compute = state_bytes(cfg, processes, optim)
    whole, _ = state_bytes(cfg, 1, optim)
    saved = whole - held  # the other processes' rows
    in_ram = [k for k in ("master", "opt") if store.tiers[k] == "ram"]
    share = {k: sum(parts.nbytes(parts.schema(cfg, p.name, k, make_optimizer(optim) if optim else None))
                    for p in parts.parts(cfg)) for k in ("master", "opt")}
    ram_saved = sum(share[k] for k in in_ram) * saved // max(whole, 1)
    disk_saved = saved * 2 - sum(share[k] for k in in_ram) * saved // max(whole, 1)  # two slots of each
    c = collective_bytes(cfg, processes)
    seconds = c.total / network_bytes_per_s if network_bytes_per_s and processes > 1 else 0.0
    return PerHost(processes, held, compute, plan.ram_needed - ram_saved, plan.disk_bytes - max(disk_saved, 0),
                   c, seconds)
