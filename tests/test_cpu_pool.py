"""XLA's CPU client gets enough threads for several CPU devices (mtjax.cpu_pool).

The hang it prevents needs two CPU devices with their queues full on a two-core machine,
which no test can bring about on purpose; what is tested is that importing mtjax gives
the backend the threads before it starts, and that a user's own setting wins.
"""

from __future__ import annotations

import json
import subprocess
import sys

import multidevice
import pytest

from mtjax import cpu_pool


@pytest.mark.parametrize("environ,devices", [
    ({}, 1),
    ({"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"}, 4),
    ({"JAX_NUM_CPU_DEVICES": "3"}, 3),
    ({"JAX_NUM_CPU_DEVICES": "2", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, 2),
])
def test_requested_devices_reads_both_settings(environ, devices):
    assert cpu_pool.requested_devices(environ) == devices


def test_ensure_sets_the_pool_only_when_asked_for_several_devices():
    one = {}
    cpu_pool.ensure(one)
    assert "PJRT_NPROC" not in one
    two = {"JAX_NUM_CPU_DEVICES": "2"}
    cpu_pool.ensure(two)
    assert int(two["PJRT_NPROC"]) >= 2 * 2 + 2
    mine = {"JAX_NUM_CPU_DEVICES": "2", "PJRT_NPROC": "3"}
    cpu_pool.ensure(mine)
    assert mine["PJRT_NPROC"] == "3"


def test_importing_mtjax_sets_the_pool_before_the_backend_starts():
    code = ("import os, json, jax, mtjax; n = len(jax.devices()); "
            "print(json.dumps({'nproc': os.environ.get('PJRT_NPROC'), 'devices': n}))")
    env = multidevice.env(2)
    env.pop("PJRT_NPROC", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["devices"] == 2
    assert int(got["nproc"]) >= 6
