"""Streaming overhead as a curve: streamed / reference step time against block size.

For each width, a fresh subprocess trains the same fp32 Llama (4 blocks, seq 256 by
default) with mtjax's in-memory ReferenceTrainer (remat per block) and with the
StreamEngine (k = 1, prefetch depth 2), first with every kind of state in the RAM tier,
then in the disk tier (page cache of the store dropped before each step, as for a store
larger than RAM); steps of the engines alternate so load drift hits all alike. Prints a
table, plots docs/img/overhead_curve.png and writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/overhead_curve.py                       # ~5-8 minutes
    .venv/bin/python experiments/bench/overhead_curve.py --widths 128 256 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import numpy as np

import mtjax.store
from mtjax import model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.reference import ReferenceTrainer
from mtjax.store.fresh import init_store
from mtjax.stream import StreamEngine

SECTION = "overhead-curve"
PNG = harness.ROOT / "docs" / "img" / "overhead_curve.png"


def child(args) -> None:
    w = args.width
    cfg = harness.llama(args.layers, w, vocab=args.vocab)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    store_dir = Path(args.dir) / "store"
    init_store(cfg, store_dir, seed=0, tx=make_optimizer(opt))
    params = model.init_params(cfg, seed=0)
    store = mtjax.store.open(store_dir, writable=True)
    engines = {
        "reference": ReferenceTrainer(cfg, params, opt),
        "ram": StreamEngine(cfg, params, opt, StreamConfig(keep_every=1, prefetch_depth=2)),
        "disk": StreamEngine(cfg, optim=opt, stream=StreamConfig(keep_every=1, prefetch_depth=2),
                             store_config=StoreConfig(compute="disk", master="disk", opt="disk"), store=store),
    }
    del params
    rng = np.random.default_rng(0)
    times = {k: [] for k in engines}
    for i in range(args.steps + 1):
        tokens = rng.integers(0, cfg.vocab_size, (1, 1, args.seq), dtype=np.int32)
        for name, e in engines.items():
            if name == "disk":
                harness.drop_page_cache(store_dir)
            t0 = time.perf_counter()
            e.step(tokens)  # returns floats: the step has finished
            if name != "reference":
                # The streamed update is deferred to overlap the next forward; finished here
                # so that none of it runs during (and is charged to) another engine's step.
                e.flush()
            if i:  # step 0 compiles
                times[name].append(time.perf_counter() - t0)
    for name in ("ram", "disk"):
        engines[name].close()
    store.close()
    block_bytes = (4 * w * w + 3 * w * cfg.intermediate_size) * 4
    harness.report(width=w, block_mib=block_bytes / 2**20, params=model.num_params(cfg),
                   **{k: statistics.median(v) for k, v in times.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory for the stores")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md or the plot")
    ap.add_argument("--child", choices=["train"], help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    rows = []
    for w in args.widths:
        with tempfile.TemporaryDirectory(prefix="mtjax-curve-", dir=args.dir) as d:
            rows.append(harness.run_child(__file__, "train", "--width", str(w), "--dir", d, "--layers",
                                          str(args.layers), "--seq", str(args.seq), "--vocab", str(args.vocab),
                                          "--steps", str(args.steps)))
            print(rows[-1], flush=True)

    ram_over = [100 * (r["ram"] / r["reference"] - 1) for r in rows]
    ram_lo, ram_hi = max(0.0, min(ram_over)), max(ram_over)
    lines = [
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores), jax {jax.__version__}, load average "
        f"{os.getloadavg()[0]:.1f} at the end. fp32 Llama, {args.layers} blocks, vocab {args.vocab}, batch 1 x seq "
        f"{args.seq}, AdamW + clip 1.0; reference = in-memory ReferenceTrainer (remat per block); stream = "
        f"StreamEngine, k = 1, prefetch depth 2, every kind of state in the RAM tier or in the disk tier (page cache "
        f"dropped before each step). Median of {args.steps} steps after one warm-up, the three engines alternating "
        f"in one fresh process per width; a streamed step includes finishing its deferred update (else it would run "
        f"during the next engine's step).",
        "",
        "| width | block (MiB fp32) | params | reference (s) | stream RAM (s) | stream disk (s) | RAM / reference "
        "| disk / reference |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {r['width']} | {r['block_mib']:.0f} | {r['params'] / 1e6:.0f}M | {r['reference']:.2f} | {r['ram']:.2f} | "
          f"{r['disk']:.2f} | {r['ram'] / r['reference']:.2f} | {r['disk'] / r['reference']:.2f} |" for r in rows),
        "",
        "![streamed / reference step time vs block size](img/overhead_curve.png)",
        "",
        f"The RAM tier costs {ram_lo:.0f}-{ram_hi:.0f}% over the in-memory reference at these block sizes (its "
        "optimizer update, deferred to overlap the next forward on a GPU, is counted in full here: on 2 cores there "
        "is nothing to overlap it with). Runs before 2026-11-30 let each streamed engine's deferred update run "
        "during the next engine's timed step, which hid it and slowed the reference (2.04 s at width 1024 then). "
        "The disk tier reads and writes every kind of state each step (fp32 compute + master + AdamW: 16 "
        "bytes/param written; the gradient sums spilled and read back), with no fsync until a commit (none in these "
        "timed steps): the disk, not compute, sets its step (the disk-bound section compares it with the time its "
        "bytes take at the probed rates), and on 2 cores the I/O threads share the cores that compute. Bigger blocks "
        "do not amortise it: bytes moved grow with the parameters, as compute does at a fixed number of tokens.",
    ]
    harness.publish(SECTION, "Streaming overhead vs block size (experiments/bench/overhead_curve.py)", "\n".join(lines),
                    f"experiments/bench/overhead_curve.py --widths {' '.join(map(str, args.widths))}",
                    write=not args.no_doc)
    if args.no_doc:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    x = [r["block_mib"] for r in rows]
    ax.plot(x, [r["ram"] / r["reference"] for r in rows], "o-", label="stream, RAM tier")
    ax.plot(x, [r["disk"] / r["reference"] for r in rows], "s-", label="stream, disk tier (cold)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (MiB, fp32)")
    ax.set_ylabel("streamed / reference step time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    PNG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PNG)


if __name__ == "__main__":
    main()
