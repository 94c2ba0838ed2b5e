"""Streaming overhead: streamed step time / reference step time, same model, one run.

Both engines run the same fp32 Llama (8 blocks of width 1024 by default) with the same
per-block recomputation (the reference checkpoints every block; the stream keeps every
block input, k = 1) and AdamW; the stream keeps all state in the RAM tier. Steps of the
two engines alternate, so drift in machine load hits both alike. Prints a table and
writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/stream_overhead.py            # ~3-5 minutes on 2 cores
    .venv/bin/python experiments/bench/stream_overhead.py --layers 2 --width 256 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import numpy as np

from mtjax import model
from mtjax.config import StreamConfig
from mtjax.optim import OptimConfig
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

SECTION = "stream-overhead"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.shape_options(ap, layers=8, width=1024, seq=512, batch=1, vocab=8192, steps=3,
                          steps_help="timed steps per engine (after one warm-up)")
    ap.add_argument("--dtype", default="float32", help="compute dtype")
    ap.add_argument("--trace", type=Path, help="also write the stream's Chrome trace here")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()

    cfg = harness.llama(args.layers, args.width, vocab=args.vocab, dtype=args.dtype)
    params = model.init_params(cfg, seed=0)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32) for _ in range(args.steps + 1)]

    ref = ReferenceTrainer(cfg, params, opt)
    stream = StreamEngine(cfg, params, opt, StreamConfig(keep_every=1, prefetch_depth=2))
    del params
    # A step returns floats: it has finished when it returns.
    med = harness.alternating_medians({"reference": ref.step, "stream": stream.step}, data)
    ref_s, stream_s = med["reference"], med["stream"]
    stages = stream.stage_seconds()
    if args.trace:
        stream.write_trace(args.trace)
    stream.close()

    n_params = model.num_params(cfg)
    tokens = args.batch * args.seq
    rows = [
        ("reference (whole model, remat per block)", ref_s),
        ("stream (RAM tier, k=1, depth 2)", stream_s),
    ]
    lines = [
        f"Model: Llama {args.layers} blocks x width {args.width}, vocab {args.vocab}, "
        f"{n_params / 1e6:.1f}M params, {args.dtype}; batch {args.batch} x seq {args.seq}; AdamW, clip 1.0.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; median of {args.steps} steps after one warm-up, engines alternating.",
        "",
        "| engine | step (s) | tokens/s |",
        "|---|---|---|",
        *(f"| {name} | {s:.2f} | {tokens / s:.0f} |" for name, s in rows),
        "",
        f"**streamed / reference = {stream_s / ref_s:.3f}** (goal <= 1.10)",
        "",
        "Stream stage seconds in the last step (summed over parts; stages overlap): "
        + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()),
    ]
    harness.publish(SECTION, "Streaming overhead (experiments/bench/stream_overhead.py)", "\n".join(lines),
                    f"experiments/bench/stream_overhead.py --layers {args.layers} --width {args.width} --seq {args.seq}",
                    write=not args.no_doc)


if __name__ == "__main__":
    main()
