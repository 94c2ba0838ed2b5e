"""Transparent huge pages for glibc's allocator: the environment `mtjax train` runs in.

XLA's CPU backend allocates each execution's temporary buffer afresh (400 MB for the
in-memory reference step of a 119M-parameter model), and glibc serves buffers that size
with new mmaps, faulted in 4 KiB at a time on every step. glibc's tunable
`glibc.malloc.hugetlb=1` (glibc >= 2.35) advises those mappings for transparent huge
pages, so each fault brings in 2 MiB. On the 2-core VM (docs/benchmarks.md) the
reference step ran 4% faster and the streamed RAM tier 3-11%; torch, whose allocations
are mostly reused, was unchanged.

Tunables are read only when a process starts, so `mtjax train` executes itself again,
once, with the tunable added to GLIBC_TUNABLES. MTJAX_HUGE_PAGES=0 turns this off. Scripts
using the Python API get the same by exporting GLIBC_TUNABLES=glibc.malloc.hugetlb=1.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
OPT_OUT = "MTJAX_HUGE_PAGES"


def _glibc_has_tunable() -> bool:
    lib, version = platform.libc_ver()
    try:
        return sys.platform == "linux" and lib == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)
    except ValueError:
        return False


def environment(env: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """`env` with the tunable added, or None when there is nothing to add (already set,
    opted out, or not a glibc that knows it)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get(OPT_OUT) == "0" or TUNABLE in tunables or not _glibc_has_tunable():
        return None
    return dict(env, GLIBC_TUNABLES=f"{tunables}:{SETTING}" if tunables else SETTING)


def reexec() -> None:
    """Execute this process's command line again with the tunable set; returns only when
    there is nothing to do or the exec failed (the run then goes on without it)."""
    env = environment()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return
