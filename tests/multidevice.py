"""Child Python processes with several CPU devices, for tests of data parallelism.

JAX fixes its device count when its backend starts, so code that needs N devices runs in
a child started with N CPU devices (the CPU backend only): JAX_NUM_CPU_DEVICES=N (jax's
`jax_num_cpu_devices`) and, for the same count where that option is not read,
XLA_FLAGS=--xla_force_host_platform_device_count=N. The child prints its results as one
JSON line, its last line of stdout; the test asserts on them. One child should run many
cases: most of its time is the JAX import and the compiles.

    results = multidevice.run(["tests/multidevice_cases.py"], devices=2)
    procs = [multidevice.spawn([script, str(i)], devices=2, MTJAX_RANK=str(i)) for i in range(2)]
    outs = [multidevice.result(p, timeout=120) for p in procs]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COUNT_FLAG = "--xla_force_host_platform_device_count"


def env(devices: int = 2, **extra: str) -> dict[str, str]:
    """This process's environment for a child with `devices` CPU devices, the checkout and
    tests/ first on its path, plus `extra` variables."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(COUNT_FLAG)]
    path = [str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
            "XLA_FLAGS": " ".join([*flags, f"{COUNT_FLAG}={devices}"]), "PYTHONPATH": os.pathsep.join(path), **extra}


def spawn(args: list[str], devices: int = 2, cwd: str | Path | None = None, **extra: str) -> subprocess.Popen:
    """Start `python args...` with `devices` CPU devices; stdout and stderr piped."""
    return subprocess.Popen([sys.executable, *args], env=env(devices, **extra), cwd=cwd or ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The JSON of a child's last stdout line; fails the test (with its stderr's tail)
    when it times out (it is killed) or exits non-zero."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} ran past {timeout} s; its stderr ends:\n{err[-3000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{proc.args} exited with {proc.returncode}; its stderr ends:\n{err[-3000:]}")
    lines = out.strip().splitlines()
    assert lines, f"{proc.args} printed nothing; its stderr ends:\n{err[-3000:]}"
    return json.loads(lines[-1])


def run(args: list[str], devices: int = 2, timeout: float = 300, **extra: str) -> dict:
    """Run one child to its end: `result(spawn(...))`."""
    return result(spawn(args, devices, **extra), timeout)
