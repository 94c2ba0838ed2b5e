"""Quantities as text for people: bytes, seconds, FLOPs, rates and durations (of a plan, a device budget)."""

from __future__ import annotations


def size(n: float) -> str:
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def seconds(s: float) -> str:
    """A time of a step or a stage: us, ms or s, then as a `duration` past 1000 s."""
    if s >= 1000:
        return duration(s)
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def flops(n: float) -> str:
    for unit, scale in (("EF", 1e18), ("PF", 1e15), ("TF", 1e12), ("GF", 1e9)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} F"


def count(x: float) -> str:
    """A rate such as tokens/s: whole numbers with separators, three figures below 100."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def rate(bytes_: float, s: float) -> str:
    return f"{bytes_ / s / 1e9:.1f} GB/s" if s > 0 else "-"


def duration(s: float) -> str:
    """A wall time: seconds below a minute, then minutes, hours or days."""
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= scale:
            return f"{s / scale:.1f} {unit}"
    return seconds(s)
