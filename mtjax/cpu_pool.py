"""Enough threads for XLA's CPU client when it has several devices.

XLA's CPU client runs every device's programs, and launches them, on one thread pool of
max(cores, devices) threads (PJRT_NPROC, read once when JAX's backend starts, sets the
core count it uses). A program with a collective holds its thread until every device
has reached the collective, and a launch that waits for a device's queue of in-flight
programs (32 at most) holds one too. On a two-core machine with two CPU devices both
threads can end up waiting this way, one in the collective for the other device, one
launching onto that device, and nothing is left to run the device's queue: the step
hangs, without an error (seen in a multi-process test: one process waiting in its
reduce-scatter, the other in a local all-reduce). With 2 x devices + 2 threads every
device can have one thread waiting in a collective and one in a launch, and threads are
still free to run the queues.

`ensure()` runs when mtjax is imported, before any of its code starts the backend: when
the environment asks the CPU backend for several devices (JAX_NUM_CPU_DEVICES or
XLA_FLAGS=--xla_force_host_platform_device_count=N) and PJRT_NPROC is not set, it sets
PJRT_NPROC to max(cores, 2 x devices + 2). A value the user set is kept. Extra threads
cost nothing while idle; compute runs on the same cores.
"""

from __future__ import annotations

import os
import re

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def requested_devices(environ=os.environ) -> int:
    """The CPU device count the environment asks JAX for (1 when it asks for none)."""
    counts = [int(m) for m in _COUNT_FLAG.findall(environ.get("XLA_FLAGS", ""))]
    if environ.get("JAX_NUM_CPU_DEVICES", "").strip().isdigit():
        counts.append(int(environ["JAX_NUM_CPU_DEVICES"]))
    return max(counts, default=1)


def threads_for(devices: int, cores: int) -> int:
    return max(cores, 2 * devices + 2)


def ensure(environ=os.environ) -> None:
    devices = requested_devices(environ)
    if devices > 1 and "PJRT_NPROC" not in environ:
        environ["PJRT_NPROC"] = str(threads_for(devices, os.cpu_count() or 1))
