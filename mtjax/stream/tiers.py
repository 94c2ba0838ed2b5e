"""Where state lives between uses: host RAM, or the layer store on disk.

Each kind of state (compute weights, master weights, optimizer state) is placed in one
tier. Both tiers answer the store's calls (`read(part, kind, out)` and
`write(part, kind, arrays)`, each returning a Future), so the engine never asks where a
kind lives. RAM-tier arrays are numpy arrays on huge pages that the fused optimizer
updates in place (`mtjax.hostmem.huge_empty`), or, with the optax program, jax arrays
on the CPU backend that it donates.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping

import jax
import numpy as np

from mtjax.errors import MtjaxError
from mtjax.parts import KINDS

TIER_NAMES = ("ram", "disk")


def host_device() -> jax.Device:
    """The CPU device that holds host-resident state and runs the optimizer."""
    return jax.local_devices(backend="cpu")[0]  # this process's (a multi-process run lists all)


def _done(value) -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_result(value)
    return fut


def _fill(out: dict | None, arrays: Mapping) -> dict:
    """`arrays`, copied into the caller's buffers when it gave some."""
    if out is None:
        return dict(arrays)
    for name, buf in out.items():
        np.copyto(buf, np.asarray(arrays[name]), casting="no")
    return out


class RamTier:
    """State held in host RAM; reads and writes complete at once."""

    name = "ram"

    def __init__(self):
        self._data: dict[tuple[str, str], dict] = {}

    def read(self, part: str, kind: str, out: dict | None = None) -> cf.Future:
        try:
            return _done(_fill(out, self._data[part, kind]))
        except KeyError:
            raise MtjaxError(f"no {kind} state for part {part} in the RAM tier") from None

    def write(self, part: str, kind: str, arrays: Mapping) -> cf.Future:
        # A compute copy's leaves not given (frozen, mtjax.roles) keep their arrays, as the
        # disk tier carries them.
        kept = self._data.get((part, kind), {}) if kind == "compute" else {}
        self._data[part, kind] = {**kept, **arrays}
        return _done(None)

    def nbytes(self, kind: str) -> int:
        """Bytes held of one kind of state, over all parts."""
        return sum(np.asarray(a).nbytes for (_, k), arrays in self._data.items() if k == kind for a in arrays.values())

    def close(self) -> None:
        self._data.clear()


class DiskTier:
    """State read from and written to the layer store (mtjax.store).

    Writes become durable at the store's next `commit`; until then the store serves
    reads of the latest written arrays.
    """

    name = "disk"

    def __init__(self, store):
        self.store = store

    def read(self, part: str, kind: str, out: dict | None = None) -> cf.Future:
        return self.store.read(part, kind, out=out)

    def write(self, part: str, kind: str, arrays: Mapping) -> cf.Future:
        # np.asarray waits for the jitted update that produced the arrays (host sync, on
        # the caller's thread: in a step, an update worker): the store needs their bytes.
        # A compute copy's leaves not given (frozen, mtjax.roles: the update writes the
        # trained ones) keep their stored values, carried by the store without a byte written.
        values = {n: np.asarray(a) for n, a in arrays.items()}
        if kind == "compute" and set(values) < set(self.store.schema(part, kind)):
            return self.store.write(part, kind, values, carry=True)
        return self.store.write(part, kind, values)

    def close(self) -> None:
        pass


class Tiers:
    """The tier of each kind of state: {"compute": tier, "master": tier, "opt": tier}."""

    def __init__(self, placement: Mapping[str, str], store=None):
        unknown = sorted(set(placement) - set(KINDS))
        if unknown:
            raise MtjaxError(f"store.tiers has unknown state kind(s) {unknown}; use {list(KINDS)}")
        bad = {k: v for k, v in placement.items() if v not in TIER_NAMES}
        if bad:
            raise MtjaxError(f"store.tiers values must be 'ram' or 'disk', got {bad}")
        self.placement = {kind: placement.get(kind, "ram") for kind in KINDS}
        if "disk" in self.placement.values() and store is None:
            raise MtjaxError("a 'disk' tier needs a layer store: pass store=mtjax.store.create(...)")
        self.store = store
        ram, disk = RamTier(), DiskTier(store) if store is not None else None
        self.by_kind = {kind: ram if where == "ram" else disk for kind, where in self.placement.items()}

    def read(self, part: str, kind: str, out: dict | None = None) -> cf.Future:
        return self.by_kind[kind].read(part, kind, out)

    def write(self, part: str, kind: str, arrays: Mapping) -> cf.Future:
        return self.by_kind[kind].write(part, kind, arrays)

    def kinds_in(self, tier_name: str) -> list[str]:
        return [k for k, v in self.placement.items() if v == tier_name]

    def schema(self, part: str, kind: str) -> dict:
        """{leaf: ShapeDtypeStruct} of a disk-tier kind, as the store holds it."""
        return self.store.schema(part, kind)

    def wait(self) -> None:
        """Wait for the store's reads and writes in flight; re-raise the first failure."""
        if self.store is not None:
            self.store.wait()

    def close(self) -> None:
        for tier in set(self.by_kind.values()):
            tier.close()
