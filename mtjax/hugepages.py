"""Start the `mtjax` process with glibc's malloc asking for transparent huge pages.

XLA's CPU client allocates each program's outputs and scratch with malloc at every call,
and glibc serves a block over its mmap threshold (32 MiB at most) with a fresh mapping,
unmapped when freed: every call of a program with a big scratch faults its pages in
again, 4 KiB at a time (a block backward's 62 MB: 16k minor faults per call; docs/cpu.md,
"Page faults"). Where the kernel gives huge pages only to memory that asks for them
(transparent_hugepage "madvise", the common default), glibc's tunable
`glibc.malloc.hugetlb=1` makes malloc ask (madvise MADV_HUGEPAGE) for its mappings and
heap, and those pages fault in 2 MiB at a time. glibc reads tunables only when a process
starts, so `restart` runs the process again, the same command line, with the tunable
added to GLIBC_TUNABLES; a GLIBC_TUNABLES that already names glibc.malloc.hugetlb (=0
turns it off) is left as it is.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), None)


def environment(environ, mode: str | None, libc: str) -> dict | None:
    """`environ` with the tunable added, or None where it would change nothing: not
    glibc, huge pages not given on request ("madvise"), or the tunable already set."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if libc != "glibc" or mode != "madvise" or any(t.split("=")[0] == TUNABLE for t in tunables.split(":")):
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(t for t in (tunables, f"{TUNABLE}=1") if t)}


def restart() -> None:
    """Run this process's command line again with the tunable, where it helps; else
    return. Call it first thing, before any thread starts or input is read."""
    env = environment(os.environ, thp_mode(), platform.libc_ver()[0])
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
