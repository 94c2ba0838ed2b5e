"""The numbers a setting can mean: each config class keeps a table {field: Range} and
refuses a value outside it with one line naming the field, the value and the range; a
command's numeric flag is declared with `type=flag(int or float, Range)`, and argparse
refuses a value outside it in the same words.

This module imports nothing of mtjax, so every config class (mtjax.config,
mtjax.optim, mtjax.model_config) can check itself with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

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
EVERY = Range(1, MAX_STEPS, note=_COUNTER)  # at least one step: an interval, or a run's length
FRACTION = Range(0, 1, high_open=True)  # [0, 1)
SEQ_LEN = Range(2)  # tokens per row: a row predicts each of its tokens but the first
# jax.random.key keeps the low 32 bits of a seed (without x64), so 2**32 + s would seed as s
# does, and one past int64 overflows: only the seeds that differ are meant.
SEED = Range(0, 2**32 - 1, note="JAX keeps a seed's low 32 bits")


def out_of_range(group: str, obj, table: dict[str, Range]) -> str | None:
    """The line refusing the first field of `obj` outside its range in `table`, or None.
    Fields that are None (unset), or not numbers, are left to their own checks."""
    for name, allowed in table.items():
        value = getattr(obj, name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in allowed:
            return f"{group}.{name} must be {allowed}, got {value!r}"
    return None


def flag(kind: type, allowed: Range):
    """An argparse `type=` for a command's numeric flag: its text read as `kind` (int or
    float; a float also finite, as the config's floats) and refused outside `allowed`,
    worded as the config checks word it. argparse prints the line
    "mtjax generate: error: argument --tokens: must be >= 1, got 0"."""

    def parse(text: str):
        value = kind(text)  # a ValueError: argparse's own "invalid int value: 'many'"
        if kind is float and not math.isfinite(value):  # nan and inf parse as floats
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value!r}")
        return value

    parse.__name__ = kind.__name__  # the name argparse gives the type in "invalid int value"
    return parse
