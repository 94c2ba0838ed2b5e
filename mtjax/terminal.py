"""Whether output goes to a terminal, and the progress bar of long work other than training
steps (mtjax.progress shows those): `data prepare`, `generate`, `eval`.

A bar is drawn on stderr, only when stderr is a terminal and only once the work has taken
SHOW_AFTER_S (short work shows nothing), and it is cleared when the work ends; a log file
or a pipe gets no carriage returns, and the command prints its result when done.
MTJAX_PROGRESS=always in the environment draws bars (and `mtjax train`'s live line) on any
stream, at once, 80 columns wide where the stream reports no width: progress through a
pipe, and what tests check. Another value is refused in one line (mtjax.environment).
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

SHOW_AFTER_S = 2.0


def _always() -> bool:
    return os.environ.get("MTJAX_PROGRESS", "").strip() == "always"  # another value: mtjax.environment refuses it


def columns(stream) -> int:
    """The width of the terminal `stream` writes to; 0 when it is not a terminal or
    reports no width (a bar would then be unreadable), unless MTJAX_PROGRESS=always (80)."""
    try:
        width = os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (AttributeError, OSError, ValueError):
        width = 0
    return width or (80 if _always() else 0)


def bar(total: int | None, desc: str, unit: str = "it", **kwargs) -> tqdm:
    """A progress bar of `total` units on stderr (disabled, so free to update, elsewhere)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                delay=0 if _always() else SHOW_AFTER_S, disable=columns(sys.stderr) == 0, **kwargs)
