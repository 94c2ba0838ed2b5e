"""What a whole run costs: a step's plan times the number of steps.

Wall time is steps x the predicted step time (one device, so device-hours are wall
hours); the cost is device-hours x a price per hour, the user's or a built-in profile's
typical one. Streaming rewrites the disk-tier state every step, so the bytes written to
the store's drive per run are set against the drive's rated endurance when the profile
gives one.
"""

from __future__ import annotations

import dataclasses

from mtjax.plan.hardware import TYPICAL_ENDURANCE, TYPICAL_PRICE, is_builtin
from mtjax.plan.cost import Plan


@dataclasses.dataclass(frozen=True)
class RunCost:
    steps: int
    steps_from: str  # where the number of steps comes from, in words
    wall_s: float
    device_hours: float
    price_per_hour: float | None  # USD; None: no price given and none in the profile
    price_from: str  # where the price comes from, in words ("" without a price)
    cost: float | None  # USD
    disk_write_per_step: int  # bytes the step writes to the store's drive
    disk_write: int  # over the whole run
    endurance_bytes: int | None  # the drive's rated bytes written, from the profile
    endurance_from: str

    @property
    def endurance_used(self) -> float | None:
        """Share of the drive's rated endurance the run writes."""
        return self.disk_write / self.endurance_bytes if self.endurance_bytes else None


def price(plan: Plan, steps: int, steps_from: str = "", price_per_hour: float | None = None) -> RunCost:
    """The run of `steps` steps priced at `price_per_hour` (default: the profile's price)."""
    hw = plan.hardware
    builtin = is_builtin(hw)
    wall = steps * plan.times.step
    hours = wall / 3600  # one device
    if price_per_hour is not None:
        rate, rate_from = price_per_hour, "--price-per-hour"
    elif hw.price_per_hour is not None:
        rate = hw.price_per_hour
        rate_from = f"{TYPICAL_PRICE}, profile {hw.name}" if builtin else f"profile {hw.name}"
    else:
        rate, rate_from = None, ""
    endurance_from = ""
    if hw.drive_endurance_bytes:
        endurance_from = f"{TYPICAL_ENDURANCE}, profile {hw.name}" if builtin else f"profile {hw.name}"
    per_step = plan.traffic.disk_write
    return RunCost(steps, steps_from, wall, hours, rate, rate_from, None if rate is None else hours * rate,
                   per_step, steps * per_step, hw.drive_endurance_bytes, endurance_from)
