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
import statistics
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
    """Device budgets from the step's least (nothing resident) to one that holds the whole
    state with every residual kept (the planner free to choose any remat), evenly spaced,
    plus a quarter of the state where the step fits in it."""
    def total(resident, remat="full"):
        return estimate(cfg, dataclasses.replace(stream, resident=resident, remat=remat), StoreConfig(), shape, hw,
                        tx=make_optimizer(OptimConfig())).device.total

    lo = total(())
    hi = max(total("all", m) for m in ("full", "dots", "none"))
    quarter = sum(dataclasses.astuple(estimate(cfg, stream, StoreConfig(), shape, hw).state)) // 4
    return sorted({*(int(b) for b in np.linspace(lo, hi, points)), *([quarter] if quarter >= lo else [])})


def plot(rows, ref_s: float, state: int, path: Path) -> None:
    import matplotlib  # only the PNG needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    auto = [(b, s) for name, b, s, *_ in rows if name == "auto"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([b / 2**20 for b, _ in auto], [s for _, s in auto], "o-", label="stream, planner's residency")
    ax.plot([b / 2**20 for name, b, *_ in rows if name == "all"], [s for name, _, s, *_ in rows if name == "all"],
            "s", label="stream, all resident, remat full")
    ax.axhline(ref_s, color="gray", linestyle="--", label="reference (in memory, remat full)")
    ax.axvline(state / 4 / 2**20, color="gray", linestyle=":", label="a quarter of the state")
    ax.set_xlabel("device budget (MiB)")
    ax.set_ylabel("step (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.shape_options(ap, layers=8, width=512, seq=256, batch=1, vocab=8192, steps=3,
                          steps_help="timed steps per engine (after one warm-up)")
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
    points = budgets(cfg, base, shape, hw, args.points)
    for b in points:
        stream = residency.resolve(cfg, dataclasses.replace(base, device_budget_bytes=b), StoreConfig(), shape, hw)
        engines["auto", b] = StreamEngine(cfg, params, opt, stream)
    # Like for like with the reference (which recomputes every block): all resident, remat full.
    engines["all", points[-1]] = StreamEngine(cfg, params, opt, dataclasses.replace(base, resident="all", remat="full"))
    del params
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32) for _ in range(args.steps + 1)]
    # A step returns floats: it has finished when it returns.
    times = harness.alternating_times({key: engine.step for key, engine in engines.items()}, data)
    ref = times["reference", 0]
    ref_s = statistics.median(ref)
    rows = []  # (name, budget, median step, median of its ratios to the reference's step of the same round, resident, remat)
    for (name, b), engine in engines.items():
        if name != "reference":
            ratio = statistics.median(t / r for t, r in zip(times[name, b], ref))
            rows.append((name, b, statistics.median(times[name, b]), ratio, len(engine.resident.names),
                         engine.schedule.remat if engine.schedule else engine.options.remat))
            engine.close()
    parts = cfg.num_hidden_layers + 2
    state = sum(dataclasses.astuple(estimate(cfg, base, StoreConfig(), shape, hw).state))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, ref_s, state, args.png)

    lines = [
        f"Model: Llama {args.layers} blocks x width {args.width}, vocab {args.vocab}, "
        f"{model.num_params(cfg) / 1e6:.1f}M params, fp32; batch {args.batch} x seq {args.seq}; AdamW, clip 1.0; "
        f"residency priced with the {hw.name} profile.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; median of {args.steps} steps after one warm-up, engines alternating step by "
        "step (the ratio: median over rounds of a step over the reference's step of the same round).",
        "",
        f"State {state / 2**20:.1f} MiB (compute, master, AdamW moments); a quarter: {state / 4 / 2**20:.1f} MiB.",
        "",
        "| stream.resident | device budget (MiB) | resident parts | remat | step (s) | / reference (paired) |",
        "|---|---|---|---|---|---|",
        f"| (reference, in memory) | | {parts} of {parts} | full | {ref_s:.3f} | 1.000 |",
        *(f"| {name} | {b / 2**20:.1f} | {n} of {parts} | {m} | {s:.3f} | {r:.3f} |" for name, b, s, r, n, m in rows),
        "",
        f"Goal: with a budget >= the state, streamed <= 1.03x reference. Curve: `{args.png.relative_to(harness.ROOT)}`"
        if args.png.is_relative_to(harness.ROOT) else f"Curve: {args.png}",
    ]
    harness.publish(SECTION, "Residency: step time against the device budget (experiments/bench/residency.py)",
                    "\n".join(lines), f"experiments/bench/residency.py --layers {args.layers} --width {args.width} "
                    f"--seq {args.seq} --vocab {args.vocab} --steps {args.steps} --points {args.points} "
                    f"--hardware {args.hardware}", write=not args.no_doc)


if __name__ == "__main__":
    main()
