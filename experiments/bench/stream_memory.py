"""Peak host RSS of streamed training does not grow with depth.

Trains Llama models of 4, 16 and 64 blocks of the same width with every kind of state
(compute, master, optimizer) in the layer store on disk, each in a fresh subprocess,
and reports the subprocess's peak RSS. Beyond the kept activations (one hidden state
per kept block input) it should grow < 10% from 4 to 64 blocks. Prints a table and
writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/stream_memory.py          # a few minutes; ~6 GB of disk at 64 blocks
    .venv/bin/python experiments/bench/stream_memory.py --layers 2 4 --width 128 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import numpy as np

import mtjax.store
from mtjax import model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.store.fresh import init_store
from mtjax.stream import StreamEngine


def model_config(layers: int, width: int):
    return harness.llama(layers, width, vocab=2048, dtype="bfloat16")


def child_init(args) -> None:
    """Fill a store (holds the whole model once, so it runs in its own process)."""
    init_store(model_config(args.layers, args.width), args.dir, seed=0, tx=make_optimizer(OptimConfig()))


def child_train(args) -> None:
    """Open the store and train; report peak RSS."""
    cfg = model_config(args.layers, args.width)
    store = mtjax.store.open(args.dir, writable=True)
    engine = StreamEngine(cfg, optim=OptimConfig(lr=1e-4), stream=StreamConfig(keep_every=1, prefetch_depth=2),
                          store_config=StoreConfig(compute="disk", master="disk", opt="disk"), store=store)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step(rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32))
        times.append(time.perf_counter() - t0)
    engine.commit()
    engine.close()
    store.close()
    kept = len(engine.groups) * args.batch * args.seq * args.width * np.dtype(cfg.compute_dtype).itemsize
    harness.report(layers=args.layers, params=model.num_params(cfg), peak_rss=harness.peak_rss(), kept=kept,
                   step_s=min(times), slots=engine.pool.allocated)


def run_child(mode: str, args, layers: int, store_dir: Path) -> dict:
    return harness.run_child(__file__, mode, "--layers", str(layers), "--width", str(args.width), "--seq",
                             str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--dir",
                             str(store_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dir", type=Path, help="scratch directory for the stores (default: a temp dir)")
    ap.add_argument("--child", choices=["init", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.child:
        args.layers = args.layers[0]
    if args.child == "init":
        return child_init(args)
    if args.child == "train":
        return child_train(args)

    scratch = Path(tempfile.mkdtemp(prefix="mtjax-mem-", dir=args.dir))
    rows = []
    try:
        for layers in args.layers:
            store_dir = scratch / f"store-{layers}"
            run_child("init", args, layers, store_dir)
            rows.append(run_child("train", args, layers, store_dir))
            shutil.rmtree(store_dir)
            print(rows[-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    base = rows[0]["peak_rss"] - rows[0]["kept"]
    lines = [
        f"Llama blocks of width {args.width} (bf16 compute, fp32 master + AdamW), batch {args.batch} x seq "
        f"{args.seq}; compute, master and optimizer state all in the store on disk; k = 1, prefetch depth 2; "
        f"{args.steps} steps, each model in a fresh process (peak RSS = VmHWM, experiments/bench/harness.py).",
        "",
        "| blocks | params | state on disk | peak RSS | kept activations | RSS - kept vs first | step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        growth = (r["peak_rss"] - r["kept"]) / base - 1
        lines.append(f"| {r['layers']} | {r['params'] / 1e6:.0f}M | {r['params'] * 14 / 2**30:.2f} GiB | "
                     f"{r['peak_rss'] / 2**20:.0f} MiB | {r['kept'] / 2**20:.1f} MiB | {growth:+.1%} | {r['step_s']:.1f} |")
    last = (rows[-1]["peak_rss"] - rows[-1]["kept"]) / base - 1
    lines += ["", f"**Growth beyond kept activations, {rows[0]['layers']} -> {rows[-1]['layers']} blocks: "
              f"{last:+.1%}** (goal < 10%)"]
    harness.publish("stream-memory", "Streaming memory vs depth (experiments/bench/stream_memory.py)", "\n".join(lines),
                    f"experiments/bench/stream_memory.py --layers {' '.join(map(str, args.layers))} --width {args.width}",
                    write=not args.no_doc)


if __name__ == "__main__":
    main()
