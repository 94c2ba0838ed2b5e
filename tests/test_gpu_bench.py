"""experiments/gpu/bench.sh in its dry mode on the CPU: the GPU benchmark's every section
runs end to end (tiny sizes), so the script a lent GPU runs is known to work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the GPU benchmark's dry run in a subprocess

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_dry_run_measures_every_section(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable}  # the interpreter running the tests
    r = subprocess.run(["bash", str(ROOT / "experiments/gpu/bench.sh"), "--dry", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    records = json.loads((tmp_path / "bench.json").read_text())
    sections = {rec["section"] for rec in records}
    assert {"device", "link", "throughput", "summary"} <= sections
    link = next(rec for rec in records if rec["section"] == "link")
    assert link["h2d_pageable"] > 0 and link["d2h_pageable"] > 0 and link["h2d_engine_path"] > 0
    assert link["h2d_engine_block"] > 0
    engines = {rec["engine"]: rec for rec in records if rec["section"] == "throughput"}
    assert set(engines) == {"reference", "stream"}
    for rec in engines.values():
        assert rec["tokens_per_s"] > 0 and 0 < rec["mfu"] < 1
    stream = engines["stream"]  # the trace's figures: every forward part waited for, the h2d lane busy
    assert stream["h2d_effective_gbps"] > 0 and stream["h2d_weight_bytes"] > 0
    assert list(stream["forward_wait_s"]) == ["embed", "block.0", "block.1", "head"]
    assert stream["forward_wait_per_block_s"] >= 0
    summary = next(rec for rec in records if rec["section"] == "summary")
    assert summary["stream_vs_reference"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "| stream |" in md and "| reference |" in md and "MFU formula" in md
    assert "effective host-to-device rate" in md and "per block" in md
    assert (tmp_path / "stream_trace.json").exists()


def _shims(tmp_path, *names):
    """A directory of modules that raise what a missing package raises on import."""
    shim = tmp_path / "shim"
    shim.mkdir()
    for name in names:
        (shim / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return shim


@pytest.mark.parametrize("script", ["bench.sh", "smoke.sh"])
def test_missing_packages_are_named_in_one_line(tmp_path, script):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable,
           "PYTHONPATH": str(_shims(tmp_path, "tqdm", "numba", "crc32c"))}
    r = subprocess.run(["bash", str(ROOT / "experiments/gpu" / script), "--dry", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"{script}: missing python packages: crc32c, numba, tqdm; install them into ")
    assert r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_crc32c_is_not_needed_where_numba_is(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(_shims(tmp_path, "crc32c"))}
    r = subprocess.run([sys.executable, str(ROOT / "experiments/gpu/check_env.py"), "bench.sh"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "bench.sh: crc32c is not installed: the store's checksums use mtjax's numba fallback (slower)\n"
