"""Device byte accounting: what the engine holds on the accelerator, against its plan.

The step's device plan (mtjax.stream.memory_plan) prices the device bytes of a run from
abstract shapes, so a run that cannot fit stops before step 1. `DeviceLedger` counts the
bytes the running engine holds (staged weights, kept activations, recompute residuals,
the state of resident parts, the residuals kept from the forward, split MoE blocks'
kept routing),
by use, and refuses a hold past the budget or past the plan's bytes for that use; it
records the peaks.
"""

from __future__ import annotations

import math
import threading

import jax
import numpy as np

from mtjax.errors import MtjaxError

USES = ("weights", "activations", "residuals", "resident", "saved", "routing")  # what the ledger counts; the plan's other terms are XLA's


class DeviceBudgetError(MtjaxError):
    """The run needs more device memory than stream.device_budget_bytes allows."""


def tree_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class DeviceLedger:
    """Live device bytes held by the engine; thread-safe (the prefetcher stages parts)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.limits: dict[str, int] = {}  # per use, from the plan (none: only the budget)
        self.held = 0
        self.peak = 0
        self.held_by_use = dict.fromkeys(USES, 0)
        self.peak_by_use = dict.fromkeys(USES, 0)
        self._lock = threading.Lock()

    def enforce(self, plan, budget: int) -> None:
        """Hold the engine to `plan` (a memory_plan.DevicePlan): each use to its planned
        bytes, everything to `budget`."""
        with self._lock:
            self.budget = budget
            self.limits = {use: getattr(plan, use) for use in USES}

    def hold(self, nbytes: int, what: str, use: str | None = None) -> None:
        with self._lock:
            if self.held + nbytes > self.budget:
                raise DeviceBudgetError(
                    f"holding {what} would put {self.held + nbytes} bytes on the device, over "
                    f"the budget of {self.budget}: raise stream.device_budget_bytes"
                )
            if use is not None:
                now = self.held_by_use[use] + nbytes
                if use in self.limits and now > self.limits[use]:
                    # The schedule's plan is wrong, not the user's settings.
                    raise DeviceBudgetError(f"holding {what} would put {now} bytes of {use} on the device, over "
                                            f"the {self.limits[use]} the step's plan allows (mtjax.stream.memory_plan)")
                self.held_by_use[use] = now
                self.peak_by_use[use] = max(self.peak_by_use[use], now)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def free(self, nbytes: int, use: str | None = None) -> None:
        with self._lock:
            self.held -= nbytes
            if use is not None:
                self.held_by_use[use] -= nbytes

    def reset(self) -> None:
        """Nothing but resident state is held (between steps, even after a failed one)."""
        with self._lock:
            self.held = self.held_by_use["resident"]
            self.held_by_use = {use: self.held if use == "resident" else 0 for use in USES}
