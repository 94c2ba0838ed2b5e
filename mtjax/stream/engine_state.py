"""The engine's state into and out of its places: the tiers filled at start (from fp32
params, or a store's RAM-tier kinds), resident parts loaded onto the device and brought
back to the tiers for a commit, and one kind of a part read whole (params, opt_state).
Every write goes through the updater, as the deferred updates' own do."""

from __future__ import annotations

import jax
import numpy as np

from mtjax import parts, treepath
from mtjax.stream.tiers import host_device
from mtjax.stream.update import split_opt_state


def fill(cfg, update, updater, names, params, opt_state=None, *, derived_compute: bool, hosts=None) -> None:
    """Fill the tiers of parts `names` from fp32 `params` and, when resuming, the
    whole-model `opt_state` (`hosts`: this process's rows of master and optimizer state)."""
    opt_parts = None if opt_state is None else split_opt_state(cfg, update.tx, opt_state)
    for name in names:
        master = {n: np.asarray(a, np.float32) for n, a in treepath.flatten(parts.part_params(params, name)).items()}
        if not derived_compute:
            updater.write(name, "compute", update.compute_copy(master, name))
        master = {n: master[n] for n in parts.schema(cfg, name, "master")}  # frozen leaves have none (mtjax.roles)
        if hosts is not None:  # this process's rows of master (and so of the optimizer state)
            # Copies: device_put may alias a host array on the CPU, and a view of the
            # rows would keep the whole leaf resident for as long as the tier holds it.
            master = {n: np.array(hosts.shard.take(a)) for n, a in master.items()}
            if opt_parts is not None:
                opt_parts[name] = {n: np.array(hosts.shard.take(a)) for n, a in opt_parts[name].items()}
        master = jax.device_put(master, host_device())
        trained = {n: master[n] for n in parts.trained(cfg, name)}
        opt = (update.init_state(trained) if trained else {}) if opt_parts is None else jax.device_put(opt_parts[name], host_device())
        updater.write(name, "opt", opt)
        updater.write(name, "master", master)
    updater.wait_writes()


def load_ram_kinds(updater, tiers, store, names) -> None:
    """Bring the RAM-tier kinds of a store-backed run into memory."""
    for kind in updater.kept_in_ram():
        for name in names:
            arrays = store.read(name, kind).result()
            tiers.write(name, kind, jax.device_put(arrays, host_device()))


def load_resident(updater, resident) -> None:
    """Resident parts' state onto the device, from the tiers (a resumed one-copy store's
    pending update of such a part is applied first, on the host)."""
    for name in resident.names:
        updater.updated(name)
    updater.wait_writes()
    for name in resident.names:
        compute = updater.read(name, "compute") if resident.frozen[name] else None  # their copy is all they have
        resident.load(name, updater.read(name, "master"), updater.read(name, "opt"), compute)


def resident_to_tiers(updater, resident, *, derived_compute: bool) -> None:
    """A commit brings the resident state to the host: into the tiers, from where the
    commit writes it like any other (no compute copy where none is kept; of the compute
    copy, the trained leaves': frozen ones are never written, mtjax.stream.tiers)."""
    for name in resident.names:
        for kind in parts.KINDS:
            if kind == "compute" and derived_compute:
                continue
            arrays = resident.to_host(name, kind, frozen=False)
            if arrays or kind != "compute":  # a part with no trained leaf has no compute copy to write
                updater.write(name, kind, arrays)
    updater.wait_writes()


def read(cfg, tx, updater, resident, part: str, kind: str, hosts=None) -> dict:
    """One kind of a part's current state, as host arrays, wherever it lives (in a
    multi-process run, all-gathered from every process's rows: every process calls it)."""
    if part in resident:
        arrays = resident.to_host(part, kind)
        if kind == "compute" and len(arrays) < len(parts.leaves(cfg, part)):  # its frozen leaves are staged
            arrays = {**updater.read(part, kind), **arrays}
        return arrays
    arrays = updater.read(part, kind)
    if hosts is not None and kind != "compute":
        arrays = hosts.all_gather(arrays, parts.schema(cfg, part, kind, tx))
    return arrays
