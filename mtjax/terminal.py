"""Whether output goes to a terminal, and the progress bar of long work other than training
steps (mtjax.progress shows those): `data prepare`, `generate`, `eval`.

A bar is drawn on stderr, only when stderr is a terminal and only once the work has taken
SHOW_AFTER_S (short work shows nothing), and it is cleared when the work ends; a log file
or a pipe gets no carriage returns, and the command prints its result when done.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

SHOW_AFTER_S = 2.0


def columns(stream) -> int:
    """The width of the terminal `stream` writes to; 0 when it is not a terminal or
    reports no width (a bar would then be unreadable)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (AttributeError, OSError, ValueError):
        return 0


def bar(total: int | None, desc: str, unit: str = "it", **kwargs) -> tqdm:
    """A progress bar of `total` units on stderr (disabled, so free to update, elsewhere)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                delay=SHOW_AFTER_S, disable=columns(sys.stderr) == 0, **kwargs)
