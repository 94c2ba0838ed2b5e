"""The embedded default run (`mtjax train` with no arguments), timed end to end.

    .venv/bin/python experiments/bench/default_run.py [--no-doc] [--group.key=value ...]

Runs the default experiment (plus any overrides) in a temporary run directory and
reports wall time from the call to the summary (compilation, data preparation, the
closing checkpoint and sample included), throughput, losses and peak RSS. The table
goes to stdout and to this benchmark's section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

from mtjax import config
from mtjax import run as run_lib

SECTION = "default-run"


def main() -> None:
    args = sys.argv[1:]
    no_doc = "--no-doc" in args
    overrides = [a for a in args if a != "--no-doc"]
    with tempfile.TemporaryDirectory(prefix="bench-default-") as tmp:
        exp = config.load(None, [*overrides, f"--run.dir={tmp}/run"])
        start = time.perf_counter()
        summary = run_lib.train(exp, stream=open(os.devnull, "w"))
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    # The run average after the first step (metrics.jsonl's tokens_per_s is a recent rate).
    steps = [r for r in records if "loss" in r]
    timed = steps[-1]["time_s"] - steps[0]["time_s"] if len(steps) > 1 else 0
    rates = [(steps[-1]["step"] - steps[0]["step"]) * summary["tokens"] / summary["steps"] / timed] if timed else []
    peak_gb = harness.peak_rss() / 1e9
    load = os.getloadavg()[0]
    rows = [
        ("steps x tokens per step", f"{summary['steps']} x {summary['tokens'] // max(summary['steps'], 1):,}"),
        ("wall time, call to summary (compile, data, checkpoint, sample included)", f"{wall:.0f} s"),
        ("training throughput after the first step (run average)", f"{rates[-1]:,.0f} tokens/s" if rates else "-"),
        ("loss: first step -> mean of the last 10", f"{summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"),
        ("validation loss at the end", f"{summary['val_loss']:.3f}" if summary["val_loss"] is not None else "-"),
        ("peak RSS", f"{peak_gb:.2f} GB"),
    ]
    shown = " ".join(overrides) or "no overrides"
    lines = [f"{platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the end "
             "(the machine is shared: compare ratios within one run, not absolute times across runs).", "",
             "| quantity | value |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "Sample after training:", "", "```", summary["sample"].strip(), "```"]
    harness.publish(SECTION, f"Embedded default run (`experiments/bench/default_run.py`, {shown})", "\n".join(lines),
                    " ".join(["experiments/bench/default_run.py", *overrides]), write=not no_doc)


if __name__ == "__main__":
    main()
