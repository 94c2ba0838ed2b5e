"""Device byte accounting: what the engine holds on the accelerator, against a budget.

`plan_bytes` prices a run from abstract shapes before anything is allocated, so a run
that cannot fit stops before step 1. `DeviceLedger` counts the bytes the running engine
holds (staged weights, kept activations, recompute residuals) and records the peak.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import jax
import numpy as np

from mtjax.errors import MtjaxError


class DeviceBudgetError(MtjaxError):
    """The run needs more device memory than stream.device_budget_bytes allows."""


def tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Bytes the engine may hold on the device at its peak, by use."""

    weights: int  # staged compute weights: prefetched parts plus the parts in use
    activations: int  # kept block inputs (0 when they live in host memory)
    residuals: int  # vjp residuals of one recompute group
    head: int  # logits and their gradient at the LM head
    working: int  # a few hidden-state-sized temporaries and one part's gradients

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.residuals + self.head + self.working

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name) / 2**20:.1f} MiB" for f in dataclasses.fields(self))


def plan_bytes(*, max_part_bytes: int, max_grad_bytes: int, hidden_bytes: int, logits_bytes: int,
               residual_bytes: int, prefetch_depth: int, group: int, kept: int,
               activations_on_device: bool, accum: int = 1, max_part_params: int = 0) -> DevicePlan:
    """The device bytes of one run; every argument comes from abstract shapes. A step
    runs its `accum` micro-batches through each part in turn (hidden states of all of
    them wait between parts) and sums each part's gradient on the device in fp32."""
    sums = group * 4 * max_part_params if accum > 1 else 0
    return DevicePlan(
        # depth parts staged ahead, plus the parts in use: a recompute group, or the head,
        # the tied embedding and the last block (resident from its forward to its backward).
        weights=(prefetch_depth + max(group, 3)) * max_part_bytes,
        activations=accum * kept * hidden_bytes if activations_on_device else 0,
        residuals=group * residual_bytes,
        head=3 * logits_bytes,
        working=(3 + accum) * hidden_bytes + 2 * max_grad_bytes + sums,
    )


def check_budget(plan: DevicePlan, budget: int | None) -> int:
    """The budget to run under; raises before step 1 when the plan does not fit."""
    if budget is None:
        return plan.total
    if plan.total > budget:
        raise DeviceBudgetError(
            f"this run needs {plan.total / 2**20:.1f} MiB on the device ({plan.describe()}) but "
            f"stream.device_budget_bytes is {budget / 2**20:.1f} MiB: raise the budget, lower "
            f"stream.prefetch_depth or stream.keep_every, or set stream.activations=host"
        )
    return budget


class DeviceLedger:
    """Live device bytes held by the engine; thread-safe (the prefetcher stages parts)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def hold(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.held + nbytes > self.budget:
                raise DeviceBudgetError(
                    f"holding {what} would put {self.held + nbytes} bytes on the device, over "
                    f"the budget of {self.budget}: raise stream.device_budget_bytes"
                )
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
