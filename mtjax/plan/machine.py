"""This machine's hardware profile: measured once by a quick probe, then read from a cache.

`mtjax plan` without `--hardware` plans for the machine it runs on (and a run with
model.compute_dtype=auto chooses for it, mtjax.plan.compute_dtype). The first time it
runs `probe.run(quick=True)` (a rough profile in seconds) and saves it under
$XDG_CACHE_HOME/mtjax (default ~/.cache/mtjax), one JSON file per machine, named by host
name, CPU model, core count and JAX backend, so that a profile measured on one machine,
or with the CPU backend on a GPU machine, is not used for another. Later runs read the
file; `--reprobe` measures again. The disk figures are those of the directory probed, and
its free space is the free space when probed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import jax

from mtjax.errors import MtjaxError
from mtjax.plan import probe
from mtjax.plan.hardware import HardwareError, HardwareProfile, load


class ProbeError(MtjaxError):
    """This machine could not be measured."""


@dataclasses.dataclass(frozen=True)
class LocalProfile:
    profile: HardwareProfile
    path: Path  # the cache file
    probed_at: float  # seconds since the epoch
    probed_now: bool
    cached: str  # "" when saved, else why not

    def describe(self) -> str:
        """One line: which profile, probed when, cached where."""
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.probed_at))
        when = "probed now" if self.probed_now else f"probed {stamp}"
        where = f"cached at {self.path}" if not self.cached else f"not cached ({self.cached})"
        return f"this machine, {when} (quick probe: rough figures), {where}; --reprobe measures again"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mtjax"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def key() -> str:
    """This machine's name in the cache: host, backend, and a digest of the CPU and core count."""
    cpu = f"{_cpu_model()} x{os.cpu_count()}"
    digest = hashlib.sha256(cpu.encode()).hexdigest()[:8]
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", platform.node() or "host")
    return f"{host}-{jax.default_backend()}-{digest}"


def profile(cache: Path | None = None, reprobe: bool = False, probe_dir: str | Path = ".") -> LocalProfile:
    """This machine's profile from the cache, or probed now (and cached) when there is
    none, it cannot be read, or `reprobe`."""
    path = (cache or cache_dir()) / f"hardware-{key()}.json"
    if path.exists() and not reprobe:
        try:
            return LocalProfile(load(path), path, path.stat().st_mtime, False, "")
        except HardwareError:
            pass  # a cache file from another version or half written by hand: measure again
    print(f"mtjax: probing this machine (a few seconds; disk in {probe_dir})", file=sys.stderr)
    try:
        measured = probe.run(probe_dir, quick=True, name=f"this-machine-{platform.node()}")
    except OSError as e:
        raise ProbeError(f"cannot probe this machine's disk in {probe_dir} ({e.strerror or e}): run from a "
                         "writable directory or pass --hardware") from None
    except subprocess.CalledProcessError as e:  # the probe's tiny training process failed
        last = (e.stderr or "").strip().splitlines()[-1:] or [f"exit status {e.returncode}"]
        raise ProbeError(f"cannot probe this machine ({last[0]}): pass --hardware") from None
    cached = ""
    try:
        measured.save(path)
    except OSError as e:
        cached = f"{path.parent}: {e.strerror or e}"
    return LocalProfile(measured, path, time.time(), True, cached)
