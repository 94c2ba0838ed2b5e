"""The device->host stage for gradients: copy each part's gradient to host memory and
sum it there over micro-batches, on a worker thread so the device loop never waits.

`finish` returns the summed gradients and the squared global norm (a lazy scalar on
the CPU backend), which fixes the clip scale before any part is updated.
"""

from __future__ import annotations

import concurrent.futures as cf

import jax
import jax.numpy as jnp

from mtjax.optim import sum_of_squares
from mtjax.stream.staging import Placement


def _add(acc: dict, g: dict) -> dict:
    return {n: acc[n] + g[n].astype(jnp.float32) for n in acc}


def _to_f32(g: dict) -> dict:
    return {n: x.astype(jnp.float32) for n, x in g.items()}


class GradSink:
    def __init__(self, placement: Placement, tracer):
        self.placement, self.tracer = placement, tracer
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="mtjax-grads")
        self._add = jax.jit(_add, donate_argnums=0)
        self._to_f32 = jax.jit(_to_f32)
        self._sq = jax.jit(sum_of_squares)
        self._sums: dict[str, dict] = {}
        self._futures: list[cf.Future] = []

    def add(self, part: str, grads: dict) -> None:
        """Queue a part's device gradients; returns at once (the copy is asynchronous)."""
        self.placement.start_to_host(grads)
        self._futures.append(self._pool.submit(self._accumulate, part, grads))

    def _accumulate(self, part: str, grads: dict) -> None:
        with self.tracer.span("d2h", part):
            host = self.placement.host_arrays(grads)
        # fp32 sums on the CPU backend; the first copy also frees the device's buffers.
        acc = self._sums.get(part)
        self._sums[part] = self._to_f32(host) if acc is None else self._add(acc, host)

    def finish(self) -> tuple[dict[str, dict], jax.Array]:
        """(summed gradients per part, squared global norm); re-raises worker errors."""
        for fut in self._futures:
            fut.result()
        self._futures.clear()
        sums, self._sums = self._sums, {}
        sq = sum(self._sq(g) for g in sums.values())
        return sums, sq

    def close(self) -> None:
        self._pool.shutdown(wait=True)
