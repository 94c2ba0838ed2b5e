"""Planner vs reality: predicted step time against the streaming engine's measured one.

The machine's matmul FLOP/s and memory bandwidth are measured first (as `mtjax probe`
does) and replace those figures of the built-in `cpu-2core` profile; then each model
runs a few StreamEngine steps (RAM tier, k = 1, prefetch depth 2) and the median step is
compared with `mtjax.plan.estimate` for the same model and workload. Writes its section
of docs/benchmarks.md.

    .venv/bin/python experiments/bench/plan_accuracy.py [--steps 3] [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtjax import model  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.optim import OptimConfig, make_optimizer  # noqa: E402
from mtjax.plan import BUILTIN, Workload, estimate  # noqa: E402
from mtjax.plan.probe import matmul_flops, memory_bandwidth  # noqa: E402
from mtjax.stream import StreamEngine  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
SECTION = "plan-accuracy"
CASES = [  # (blocks, width, batch, seq)
    (4, 512, 2, 256),
    (4, 1024, 1, 512),
]


def write_section(body: str) -> None:
    """Replace this benchmark's own section of docs/benchmarks.md (others are left alone)."""
    start, end = f"<!-- {SECTION}:start -->", f"<!-- {SECTION}:end -->"
    text = (DOC.read_text() if DOC.exists()
            else "# Benchmarks\n\nMeasured numbers, each section written by the script it names.\n")
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)


def measure(cfg: ModelConfig, batch: int, seq: int, steps: int) -> float:
    opt = OptimConfig(lr=1e-4)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), opt, keep_every=1, prefetch_depth=2)
    rng = np.random.default_rng(0)
    times = []
    try:
        for i in range(steps + 1):
            tokens = rng.integers(0, cfg.vocab_size, (1, batch, seq), dtype=np.int32)
            t0 = time.perf_counter()
            engine.step(tokens)  # returns floats: the step has finished
            if i:  # step 0 compiles
                times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model (after one warm-up)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    hw = dataclasses.replace(BUILTIN["cpu-2core"], name="cpu-2core, measured now",
                             matmul_flops_fp32=matmul_flops(1024, "float32"),
                             host_memory_bytes_per_s=memory_bandwidth(256 << 20))
    rows = []
    for layers, width, batch, seq in CASES:
        heads = width // 64
        cfg = ModelConfig(vocab_size=8192, hidden_size=width, intermediate_size=int(width * 2.75),
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          head_dim=64, compute_dtype="float32")
        plan = estimate(cfg, Workload(batch_size=batch, seq_len=seq), hw, tx=make_optimizer(OptimConfig(lr=1e-4)))
        measured = measure(cfg, batch, seq, args.steps)
        rows.append((f"{layers} x {width}, batch {batch} x seq {seq} ({plan.num_params / 1e6:.0f}M)",
                     plan.times.device, plan.times.host_memory, plan.times.step, measured))
    lines = [
        "## Planner vs measured step time (experiments/bench/plan_accuracy.py)",
        "",
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores), jax {jax.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}. Profile: cpu-2core with matmul "
        f"{hw.matmul_flops_fp32 / 1e9:.0f} GFLOP/s (fp32, 1024^3) and memory {hw.host_memory_bytes_per_s / 1e9:.1f} "
        f"GB/s moved, both measured in this run. StreamEngine: fp32, RAM tier, k = 1, prefetch depth 2, "
        f"median of {args.steps} steps after one warm-up.",
        "",
        "| model | predicted device (s) | predicted host memory (s) | predicted step (s) | measured step (s) "
        "| measured / predicted |",
        "|---|---|---|---|---|---|",
        *(f"| {name} | {dev:.2f} | {mem:.3f} | {pred:.2f} | {meas:.2f} | {meas / pred:.2f} |"
          for name, dev, mem, pred, meas in rows),
        "",
        "Command: `.venv/bin/python experiments/bench/plan_accuracy.py`",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(body)


if __name__ == "__main__":
    main()
