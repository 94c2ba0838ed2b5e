"""The processes of a multi-process run and the collectives the step uses between them.

    hosts = Hosts()                        after jax.distributed.initialize (mtjax.distributed)
    mine = hosts.reduce_scatter(grads)     this process's rows of the sum over processes
    whole = hosts.all_gather(mine, schema) every process's rows, back to whole leaves
    hosts.all_sum(values), hosts.gather_ints(values), hosts.barrier(name)

Every collective is a jitted program over a mesh of one device per process (axis
"hosts"), fed by `jax.make_array_from_process_local_data`: XLA lowers a sum over the
process axis with a split output to a reduce-scatter, and a split input with a whole
output to an all-gather (on the CPU backend through gloo). No other networking. Every
process must call the same collectives in the same order: the engine issues them from
one thread at a time, in the schedule's part order (docs/parallel.md).

A leaf is split by rows as `mtjax.shard.Shard` says; a leaf that is not split is summed
whole (an all-reduce) and counted once, by process 0, in the squared gradient norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtjax import roles
from mtjax.documents import Inputs
from mtjax.model_config import ConfigError
from mtjax.shard import Shard


def share(rows: int, count: int) -> int:
    """The rows of a micro-batch of `rows` that each of `count` processes trains: an equal
    share (the engine's step, its schedule, and the planner's price of one host)."""
    if rows % count:
        raise ConfigError(f"data.batch_size {rows} must be a multiple of the number of processes ({count}): "
                          f"each process trains an equal share of every micro-batch's rows; use a multiple of {count}")
    return rows // count


# The stream settings a multi-process run trains with: each process holds only its rows of
# every part's state, so every part streams, LoRA adapters included.
STREAMED = {"resident": "none", "adapters": "streamed"}


def check_resident(resident, count: int) -> None:
    """Refuse, in one line, a stream.resident that keeps parts on the device in a run of
    `count` processes (auto streams every part there)."""
    if count > 1 and resident not in ("auto", "none"):
        raise ConfigError(f"stream.resident={resident!r} keeps whole parts on the device, but each of the {count} "
                          "processes holds only its rows of every part's state: set stream.resident=none (auto "
                          "streams every part here)")


def _sum_over_processes(x):
    return x.sum(0)


class Hosts:
    """This process's place among the run's processes, and the collectives between them."""

    def __init__(self):
        self.count, self.index = jax.process_count(), jax.process_index()
        self.shard = Shard(self.index, self.count)
        devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                   for p in range(self.count)]
        mesh = Mesh(np.array(devices), ("hosts",))
        self._split, self._whole = NamedSharding(mesh, PartitionSpec("hosts")), NamedSharding(mesh, PartitionSpec())
        self._scatter = jax.jit(_sum_over_processes, out_shardings=self._split)
        self._reduce = jax.jit(_sum_over_processes, out_shardings=self._whole)
        self._gather = jax.jit(lambda x: x, out_shardings=self._whole)
        # Bytes this process sends over the network so far, as ring algorithms move them
        # (mtjax.plan.hosts describes a step's): a reduce-scatter sends (count - 1) / count
        # of its padded input, an all-reduce twice that, an all-gather its piece count - 1 times.
        self.sent = {"reduce_scatter": 0, "all_gather": 0}

    def _global(self, local: np.ndarray, sharding, shape) -> jax.Array:
        return jax.make_array_from_process_local_data(sharding, local, shape)

    @staticmethod
    def _local(a: jax.Array) -> np.ndarray:
        return np.asarray(a.addressable_shards[0].data)

    # --- the step's collectives ---------------------------------------------------------

    def reduce_scatter(self, grads: dict) -> tuple[dict, jax.Array]:
        """({leaf: this process's rows of the sum over processes}, this process's share of
        the squared global norm) of whole fp32 leaves. A leaf that is not split comes back
        as the whole sum, and only process 0 counts it in the norm: the shares add up to
        the squared norm of the whole summed gradient."""
        out, sq = {}, jnp.float32(0)
        for name, g in grads.items():
            g = np.asarray(g)
            if self.shard.splits(g.shape):
                padded = self.shard.pad_whole(g)
                summed = self._scatter(self._global(padded[None], self._split, (self.count, *padded.shape)))
                start, stop = self.shard.rows(g.shape[0])
                out[name] = self._local(summed)[: stop - start]
            else:
                padded = g
                out[name] = self._local(self._reduce(self._global(g[None], self._split, (self.count, *g.shape))))
            if (self.shard.splits(g.shape) or self.index == 0) and not roles.is_buffer(name):  # a rule input: no norm
                sq = sq + jnp.sum(jnp.square(out[name]))
            ring = 1 if self.shard.splits(g.shape) else 2
            self.sent["reduce_scatter"] += ring * padded.nbytes * (self.count - 1) // self.count
        return out, sq

    def all_gather(self, mine: dict, schema: dict) -> dict:
        """Whole leaves ({leaf: ShapeDtypeStruct} `schema`) from every process's rows `mine`."""
        out = {}
        for name, s in schema.items():
            a = np.asarray(mine[name])
            if not self.shard.splits(s.shape):
                out[name] = a  # every process holds (and updated) all of it
                continue
            n = s.shape[0]
            piece = self.shard.pad_own(a, n)
            whole = self._gather(self._global(piece, self._split, (self.count * piece.shape[0], *piece.shape[1:])))
            out[name] = self.shard.unpad_whole(self._local(whole), n)
            self.sent["all_gather"] += piece.nbytes * (self.count - 1)
        return out

    def all_sum(self, values) -> np.ndarray:
        """The sum over processes of a float32 vector (every process gets it)."""
        v = np.asarray(values, np.float32).reshape(1, -1)
        return self._local(self._reduce(self._global(v, self._split, (self.count, v.shape[1]))))

    def gather_ints(self, values) -> np.ndarray:
        """int32 [count, len(values)]: every process's values (start-up checks)."""
        return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)[None], tiled=True))

    def barrier(self, name: str) -> None:
        multihost_utils.sync_global_devices(name)

    # --- the batch --------------------------------------------------------------------

    def local_inputs(self, inputs: Inputs, weights: np.ndarray) -> tuple[Inputs, np.ndarray]:
        """This process's rows of every micro-batch, and their weights in the step's loss:
        a micro-batch's share of the whole step's counted targets (so the sum over
        processes of their gradients is the gradient of the step's loss)."""
        mine = share(inputs.tokens.shape[1], self.count)
        start, stop = self.index * mine, (self.index + 1) * mine
        local = Inputs(*(None if a is None else np.ascontiguousarray(a[:, start:stop]) for a in inputs))
        if inputs.targets is None:
            return local, weights / self.count
        total = int(inputs.targets.sum())
        return local, local.targets.sum(axis=(1, 2), dtype=np.int64) / total
