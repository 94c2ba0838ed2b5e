"""Residency: streamed step time against the device budget, beside the reference trainer.

One fp32 Llama, AdamW with clipping, every block recomputed in both engines (the
reference checkpoints each block; the stream keeps every block input). The stream runs at
device budgets from the least its step needs (nothing resident: today's engine) to one
that holds the whole state, the planner choosing the resident parts for each
(`mtjax.plan.residency`, priced with `--hardware`), plus `stream.resident=all`. Steps of
all engines alternate, so drift in machine load hits them alike. Prints a table, writes
a PNG of step time against budget and its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/residency.py                  # ~5 minutes on 2 cores
    .venv/bin/python experiments/bench/residency.py --quick --no-doc # smoke: tiny model, 1 step
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import numpy as np

from mtjax import model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import StepShape, estimate, load, residency
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

SECTION = "residency"


def budgets(cfg, stream: StreamConfig, shape: StepShape, hw, points: int) -> list[int]:
    """Device budgets from the step's least (nothing resident) to the whole state resident."""
    def total(resident):
        return estimate(cfg, dataclasses.replace(stream, resident=resident), StoreConfig(), shape, hw,
                        tx=make_optimizer(OptimConfig())).device.total

    lo, hi = total(()), total("all")
    return [int(b) for b in np.linspace(lo, hi, points)]


def plot(rows, ref_s: float, path: Path) -> None:
    import matplotlib  # only the PNG needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    auto = [(b, s) for name, b, s, _ in rows if name == "auto"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([b / 2**20 for b, _ in auto], [s for _, s in auto], "o-", label="stream, planner's residency")
    ax.axhline(ref_s, color="gray", linestyle="--", label="reference (in memory)")
    ax.set_xlabel("device budget (MiB)")
    ax.set_ylabel("step (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per engine (after one warm-up)")
    ap.add_argument("--points", type=int, default=5, help="budgets on the curve")
    ap.add_argument("--hardware", default="cpu-2core", help="profile the planner prices residency with")
    ap.add_argument("--png", type=Path, default=harness.ROOT / "docs" / "img" / "residency.png")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 timed step, 3 budgets (a smoke test)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width, args.seq, args.vocab, args.steps, args.points = 2, 64, 32, 256, 1, 3

    cfg = harness.llama(args.layers, args.width, vocab=args.vocab)
    hw = load(args.hardware)
    shape = StepShape(args.batch, args.seq)
    base = StreamConfig(keep_every=1, prefetch_depth=2)
    params = model.init_params(cfg, seed=0)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    engines = {("reference", 0): ReferenceTrainer(cfg, params, opt)}
    for b in budgets(cfg, base, shape, hw, args.points):
        stream = residency.resolve(cfg, dataclasses.replace(base, device_budget_bytes=b), StoreConfig(), shape, hw)
        engines["auto", b] = StreamEngine(cfg, params, opt, stream)
    engines["all", b] = StreamEngine(cfg, params, opt, dataclasses.replace(base, resident="all"))
    del params
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32) for _ in range(args.steps + 1)]
    # A step returns floats: it has finished when it returns.
    med = harness.alternating_medians({key: engine.step for key, engine in engines.items()}, data)
    ref_s = med["reference", 0]
    rows = []
    for (name, b), engine in engines.items():
        if name != "reference":
            rows.append((name, b, med[name, b], len(engine.resident.names)))
            engine.close()
    parts = cfg.num_hidden_layers + 2
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, ref_s, args.png)

    lines = [
        f"Model: Llama {args.layers} blocks x width {args.width}, vocab {args.vocab}, "
        f"{model.num_params(cfg) / 1e6:.1f}M params, fp32; batch {args.batch} x seq {args.seq}; AdamW, clip 1.0; "
        f"residency priced with the {hw.name} profile.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; median of {args.steps} steps after one warm-up, engines alternating.",
        "",
        "| stream.resident | device budget (MiB) | resident parts | step (s) | / reference |",
        "|---|---|---|---|---|",
        f"| (reference, in memory) | | {parts} of {parts} | {ref_s:.3f} | 1.000 |",
        *(f"| {name} | {b / 2**20:.1f} | {n} of {parts} | {s:.3f} | {s / ref_s:.3f} |" for name, b, s, n in rows),
        "",
        f"Goal: with a budget >= the state, streamed <= 1.03x reference. Curve: `{args.png.relative_to(harness.ROOT)}`"
        if args.png.is_relative_to(harness.ROOT) else f"Curve: {args.png}",
    ]
    harness.publish(SECTION, "Residency: step time against the device budget (experiments/bench/residency.py)",
                    "\n".join(lines), f"experiments/bench/residency.py --layers {args.layers} --width {args.width} "
                    f"--seq {args.seq} --hardware {args.hardware}", write=not args.no_doc)


if __name__ == "__main__":
    main()
