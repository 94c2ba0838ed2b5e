"""Quantities as text for people: bytes, seconds, rates and durations (of a plan, a device budget)."""

from __future__ import annotations


def size(n: float) -> str:
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def rate(bytes_: float, s: float) -> str:
    return f"{bytes_ / s / 1e9:.1f} GB/s" if s > 0 else "-"


def duration(s: float) -> str:
    """A wall time: seconds below a minute, then minutes, hours or days."""
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= scale:
            return f"{s / scale:.1f} {unit}"
    return seconds(s)
