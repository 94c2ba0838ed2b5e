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


STREAMED = ("stream", "first_resident", "capped_stream")
FIGURES = {"link_pinned_gbps", "link_mapped_gbps", "block_staging_s", "stream_vs_reference", "capped_vs_reference",
           "first_resident_vs_reference", "capped_stream_state_over_cap", "stream_planned_step_s",
           "first_resident_planned_step_s"} | {
    f"{run}_{name}" for run in (*STREAMED, "reference")
    for name in ("step_s", "tokens_per_s", "mfu", "compiles_after_step_1", "allocator_peak_bytes")} | {
    f"{run}_{name}" for run in STREAMED
    for name in ("forward_wait_s", "forward_wait_share", "device_bytes_at_peak")}


def test_gpu_bench_dry_run_prints_every_figure_and_writes_no_docs(tmp_path):
    doc = ROOT / "docs" / "benchmarks.md"
    before = doc.read_bytes()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable,  # the interpreter running the tests
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")}
    r = subprocess.run(["bash", str(ROOT / "experiments/gpu/bench.sh"), "--dry", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]  # nothing but one JSON line per figure
    figures = {rec["figure"]: rec for rec in lines}
    assert set(figures) == FIGURES and len(lines) == len(FIGURES)
    assert all(rec["dry"] is True for rec in lines)
    assert "DmaMap" in figures["link_mapped_gbps"]["refused"] and figures["link_mapped_gbps"]["value"] is None
    for run in (*STREAMED, "reference"):
        assert figures[f"{run}_tokens_per_s"]["value"] > 0 and 0 < figures[f"{run}_mfu"]["value"] < 1
        assert figures[f"{run}_compiles_after_step_1"]["value"] == 0  # the issue: none after step 1
    for run in STREAMED:  # every streamed forward part waited for, from the last step's trace
        streamed = ["embed", "block.0", "block.1", "head"][2 if run == "first_resident" else 0:]
        assert list(figures[f"{run}_forward_wait_s"]["value"]) == streamed
        assert figures[f"{run}_forward_wait_share"]["value"] >= 0
        at_peak = figures[f"{run}_device_bytes_at_peak"]  # what held the device at its fullest, by shape
        assert at_peak["value"] == at_peak["live_arrays"] > 0 and sum(at_peak["largest"].values()) <= at_peak["value"]
    assert figures["block_staging_s"]["value"] > 0 and figures["capped_vs_reference"]["value"] > 0
    # The planner's step beside the measured one; keeping the first parts resident takes
    # the embedding's host update off the step boundary, so it never plans slower.
    assert figures["first_resident_planned_step_s"]["resident"] == ["embed", "block.0"]
    assert 0 < figures["first_resident_planned_step_s"]["value"] <= figures["stream_planned_step_s"]["value"]
    md = (tmp_path / "bench.md").read_text()
    assert "dry run on the CPU" in md and "| capped_vs_reference |" in md
    assert (tmp_path / "stream_trace.json").exists()
    assert doc.read_bytes() == before  # a dry run's figures mean nothing: the docs keep the measured ones


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


def test_aot_memory_compiles_every_program_on_the_cpu_and_refuses_a_gpu_it_cannot_build_in_one_line():
    """experiments/gpu/aot_memory.py (each streamed program's XLA memory against the plan's
    term, for an H200 compiled without a GPU where jax has its CUDA plugin): its CPU target
    at tiny sizes, so a renamed engine program or planner term breaks here; without the
    plugin, asking for the GPU target is one line and exit 2."""
    script = [sys.executable, str(ROOT / "experiments/gpu/aot_memory.py"), "--layers=1", "--width=64", "--ffn=128",
              "--vocab=256", "--head-dim=16", "--batch=2", "--seq=32"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([*script, "--targets=cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and not line.startswith("| program")]
    assert [row.split(" | ")[0][2:] for row in rows] == [
        "block forward", "block recompute + backward", "block gradient into its fp32 sum", "head loss + grads",
        "embedding backward"]
    assert "failed" not in r.stdout
    if not _plugins():  # this venv's jax has no CUDA plugin (the test extras bring none)
        r = subprocess.run([*script, "--targets=gpu"], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2 and r.stderr.strip().startswith("aot_memory: cannot compile for an H200"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def _plugins() -> list[str]:
    from importlib import metadata

    return [d.metadata["Name"] for d in metadata.distributions() if "cuda" in (d.metadata["Name"] or "")]
