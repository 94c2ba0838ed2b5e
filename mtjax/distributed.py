"""Start-up of a multi-process run: one process per host, joined by jax.distributed.

    hosts = distributed.start(exp.distributed)     # None: a one-process run
    distributed.check_same(hosts, "experiment config", text)

Where the settings come from, first match wins:
1. the experiment's `distributed:` section (coordinator, num_processes, process_id);
2. the environment: MTJAX_COORDINATOR, MTJAX_NUM_PROCESSES, MTJAX_PROCESS_ID;
3. a cluster JAX detects itself (a SLURM job of several tasks: `srun` sets SLURM_*),
   through `jax.distributed.initialize()` without arguments;
otherwise the run is one process.

`initialize` of this jax aborts the process with a C++ stack trace when the coordinator
or a peer does not come within its timeout. So start-up runs under a watchdog: when
joining and the start-up checks are not done within `distributed.timeout_s`, the
process prints one line naming the coordinator and exits with status 2 (JAX's own
timeout is set later than the watchdog's).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import threading

import jax
import numpy as np

from mtjax.config import ConfigError, DistributedConfig
from mtjax.errors import MtjaxError
from mtjax.stream.hosts import Hosts

EXIT_STARTUP = 2  # the exit status of a process that could not join its run


class Mismatch(MtjaxError):
    """The processes of a run disagree (config, store shards, process count)."""


def settings(d: DistributedConfig, env=os.environ) -> DistributedConfig | str | None:
    """The settings this process starts with: the config's, else the environment's, else
    "cluster" (a SLURM job of several tasks: JAX finds the rest), else None (one process)."""
    if d.coordinator is not None:
        return d
    if env.get("MTJAX_COORDINATOR"):
        try:
            return DistributedConfig(env["MTJAX_COORDINATOR"], int(env.get("MTJAX_NUM_PROCESSES", "")),
                                     int(env.get("MTJAX_PROCESS_ID", "")), d.timeout_s)
        except ValueError:
            raise ConfigError("MTJAX_COORDINATOR is set: set MTJAX_NUM_PROCESSES and MTJAX_PROCESS_ID to "
                              "integers too (the run's process count and this process's index)") from None
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and env.get("SLURM_JOB_ID"):
        return "cluster"
    return None


def _watchdog(seconds: float, message: list[str]) -> threading.Event:
    """Exit with one line (`message[0]` then) unless the returned event is set within `seconds`."""
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            sys.stderr.write(f"mtjax train: error: {message[0]}\n")
            sys.stderr.flush()
            os._exit(EXIT_STARTUP)

    threading.Thread(target=watch, name="mtjax-startup-watchdog", daemon=True).start()
    return done


class Startup:
    """The bounded start-up of one process: `start` joins the run, the caller runs its
    start-up checks (`check_same`, `agree`), then `done` stops the watchdog."""

    def __init__(self, d: DistributedConfig | str):
        self.d = d
        self.timeout = d.timeout_s if isinstance(d, DistributedConfig) else DistributedConfig().timeout_s
        where = (f"process {d.process_id} of {d.num_processes} could not join the run at the coordinator "
                 f"{d.coordinator}" if isinstance(d, DistributedConfig) else
                 "this SLURM task could not join the run's other tasks")
        # Process 0 hosts the coordinator: it stops last, so that the others' own lines, not
        # JAX's abort when the coordinator goes away, say why they stopped.
        first = isinstance(d, DistributedConfig) and d.process_id == 0
        self.message = [(f"{where} within {self.timeout:g} s (distributed.timeout_s): start every process, each "
                         "with the same coordinator and process count and its own process id, and check that the "
                         "address is reachable")]
        self.ready = _watchdog(self.timeout + (2 if first else 0), self.message)
        atexit.register(self.ready.set)  # runs before jax's own exit handler (shutdown), registered earlier
        self.hosts: Hosts | None = None

    def join(self) -> Hosts:
        late = int(self.timeout) + 60  # after the watchdog: JAX's own timeout aborts with a stack trace
        if isinstance(self.d, DistributedConfig):
            jax.distributed.initialize(self.d.coordinator, self.d.num_processes, self.d.process_id,
                                       initialization_timeout=late)
        else:
            jax.distributed.initialize(initialization_timeout=late)
        self.hosts = Hosts()
        self.message[0] = (f"process {self.hosts.index} of {self.hosts.count} joined the run, but not every process "
                           f"passed the start-up checks within {self.timeout:g} s (distributed.timeout_s); see the "
                           "other processes' errors")
        if isinstance(self.d, DistributedConfig):  # every process says how many it was started for
            check_same(self.hosts, "distributed.num_processes", str(self.d.num_processes))
        return self.hosts

    def done(self) -> None:
        self.ready.set()


def start(d: DistributedConfig) -> Startup | None:
    """Join the run's other processes (None: a one-process run), under the watchdog,
    which the caller stops (`done`) once its start-up checks have passed."""
    chosen = settings(d)
    if chosen is None:
        return None
    startup = Startup(chosen)
    startup.join()
    return startup


def digest(text: str) -> list[int]:
    """Four int32s of a sha256 (jax gathers int32 without x64)."""
    return [int(x) for x in np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], np.int32)]


def check_same(hosts: Hosts, what: str, text: str) -> None:
    """Refuse, on every process, a `what` that differs between processes (by a gathered hash)."""
    table = hosts.gather_ints(digest(text))
    differ = [p for p in range(hosts.count) if not np.array_equal(table[p], table[0])]
    if differ:
        raise Mismatch(f"process{'es' if len(differ) > 1 else ''} {', '.join(map(str, differ))} of {hosts.count} "
                       f"started with another {what} than process 0; start every process with the same one")


def agree(hosts: Hosts, error: MtjaxError | None) -> None:
    """Every process stops if any one does: its own error, or one line naming who stopped."""
    table = hosts.gather_ints([error is not None])
    if error is not None:
        raise error
    stopped = [p for p in range(hosts.count) if table[p][0]]
    if stopped:
        raise Mismatch(f"process {stopped[0]} of {hosts.count} refused to start (its error says why); "
                       "nothing was changed here")
