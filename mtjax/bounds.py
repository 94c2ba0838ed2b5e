"""The numbers a setting can mean: each config class keeps a table {field: Range} and
refuses a value outside it with one line naming the field, the value and the range.

This module imports nothing of mtjax, so every config class (mtjax.config,
mtjax.optim, mtjax.model_config) can check itself with it.
"""

from __future__ import annotations

import dataclasses

# optax counts optimizer steps in int32 and stops counting at its largest value, so the
# schedule of a longer run would stall there: no step count or interval beyond it is meant.
MAX_STEPS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers from `low` to `high` (None: unbounded), each end included unless open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # why the range ends where it does, said with it

    def __contains__(self, value) -> bool:
        lo, hi = self.low, self.high
        above = lo is None or (value > lo if self.low_open else value >= lo)
        below = hi is None or (value < hi if self.high_open else value <= hi)
        return bool(above and below)  # False for NaN, which compares false with everything

    def __str__(self) -> str:
        if self.high is None:
            text = "positive" if self.low == 0 and self.low_open else f"{'>' if self.low_open else '>='} {self.low}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        return f"{text} ({self.note})" if self.note else text


POSITIVE = Range(0, low_open=True)
AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
_COUNTER = "the optimizer counts steps in int32"
STEPS = Range(0, MAX_STEPS, note=_COUNTER)  # a step count or interval, 0 allowed (its field says what 0 means)
EVERY = Range(1, MAX_STEPS, note=_COUNTER)  # an interval of at least one step
FRACTION = Range(0, 1, high_open=True)  # [0, 1)


def out_of_range(group: str, obj, table: dict[str, Range]) -> str | None:
    """The line refusing the first field of `obj` outside its range in `table`, or None.
    Fields that are None (unset), or not numbers, are left to their own checks."""
    for name, allowed in table.items():
        value = getattr(obj, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in allowed:
            return f"{group}.{name} must be {allowed}, got {value!r}"
    return None
