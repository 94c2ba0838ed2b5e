"""The functions registered on one of the package's seams (a test's fault injection, a
benchmark's probe): one `Observers` per seam, so each seam registers, calls and removes
them the same way.

    seam = Observers()
    stop = seam.add(fn)            # fn is called from now on; stop() removes it
    seam(*args)                    # fn(*args) for each, in the order added
    value = seam.through(value, *args)  # each may replace a value: value = fn(*args, value)
    if seam: ...                   # whether any is registered (a hot path skips the seam if not)
"""

from __future__ import annotations


class Observers:
    def __init__(self):
        self._fns: list = []

    def add(self, fn):
        """Register fn; returns the function that removes it."""
        self._fns.append(fn)
        return lambda: self._fns.remove(fn)

    def __call__(self, *args) -> None:
        for fn in list(self._fns):
            fn(*args)

    def through(self, value, *args):
        for fn in list(self._fns):
            value = fn(*args, value)
        return value

    def __bool__(self) -> bool:
        return bool(self._fns)
