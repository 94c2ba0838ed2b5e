"""The devices a step runs on: a mesh of one axis, "data" (or "sequence"), over the devices used.

    mesh = DeviceMesh.local(stream.devices, stream.split)  # "all" local devices, or the first N
    mesh.count                               # devices in the mesh
    mesh.replicated                          # weights: one whole copy on every device
    mesh.batch                               # a micro-batch's [batch, seq, ...] arrays: split along
                                             # axis 0 (rows), or 1 (tokens) with split "sequence"
    mesh.one_copy(tree)                      # one device's copy of replicated arrays (what leaves for the host)

Data parallel: every device holds every staged part and runs its 1/count of each
micro-batch's rows; the compiled step functions are plain `jax.jit` programs, so XLA's
sharding propagation keeps hidden states batch-sharded between blocks and makes each
weight gradient replicated, summed over the devices by an all-reduce inside the program
that computes it (docs/parallel.md, "Several devices"). With one device both shardings
are that device's `SingleDeviceSharding`, as they always were: the same programs, the
same transfers. A batch whose rows do not split evenly is refused by the step's
schedule (`mtjax.config.check_split`).

Context parallel (split "sequence"): the same, but each device runs its share of every
row's tokens; the mesh axis is mtjax.attention_chunked.SEQUENCE, which the attention of a model
config with `sequence_devices` > 1 splits over (mtjax.attention_chunked.split_attention), XLA's
propagation keeping every token-wise step split as it comes.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from mtjax.attention_chunked import SEQUENCE
from mtjax.errors import MtjaxError

AXIS = "data"


class DeviceCountError(MtjaxError, ValueError):
    """stream.devices asks for more devices than this process has."""


def local_devices(spec: int | str = "all") -> list[jax.Device]:
    """The devices `stream.devices` names: "all" this process's devices, or the first N."""
    available = jax.local_devices()
    if spec == "all":
        return list(available)
    if spec > len(available):
        raise DeviceCountError(
            f"stream.devices is {spec} but this process has {len(available)} {available[0].platform} device(s): "
            f"set stream.devices to at most {len(available)}, or to all")
    return list(available[:spec])


class DeviceMesh:
    """Shardings of a one-axis mesh over `devices` (in mesh order), splitting batches by
    `split`: "batch" (rows) or "sequence" (tokens)."""

    def __init__(self, devices: list[jax.Device], split: str = "batch"):
        self.devices = list(devices)
        self.count = len(self.devices)
        self.split = split
        if self.count == 1:
            self.mesh = None
            self.replicated = self.batch = SingleDeviceSharding(self.devices[0])
        elif split == "sequence":
            self.mesh = Mesh(np.array(self.devices), (SEQUENCE,))
            self.replicated = NamedSharding(self.mesh, PartitionSpec())
            self.batch = NamedSharding(self.mesh, PartitionSpec(None, SEQUENCE))
        else:
            self.mesh = Mesh(np.array(self.devices), (AXIS,))
            self.replicated = NamedSharding(self.mesh, PartitionSpec())
            self.batch = NamedSharding(self.mesh, PartitionSpec(AXIS))

    @classmethod
    def local(cls, spec: int | str = "all", split: str = "batch") -> DeviceMesh:
        return cls(local_devices(spec), split)

    def share(self, nbytes: int) -> int:
        """Bytes on each device of a batch-sharded array of `nbytes` in all."""
        return nbytes // self.count

    def one_copy(self, tree):
        """The first device's copy of each replicated array (single-device arrays as they are)."""
        if self.count == 1:
            return tree
        return jax.tree.map(lambda a: a.addressable_data(0), tree)
