"""Packing with document masks against unmasked packing: step time of each, same model, one run.

Both kinds of step train the same fp32 Llama on the same packed rows: documents of random
lengths (a mean of seq / 4 tokens) back to back. "Unmasked" is a plain batch, as text
windows are trained: every token attends to everything before it in the row and every
target counts. "Document masks" is the same rows as a chat dataset gives them: segment
ids confine attention to each document and restart its positions, and a loss mask keeps
the second half of each document (its answer). Steps of the two kinds alternate on one
engine, so drift in machine load hits both alike. The goal: masks cost <= 5% of a step.
Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/packing.py               # ~3-5 minutes on 2 cores
    .venv/bin/python experiments/bench/packing.py --quick       # smoke: tiny model, 2 steps, no doc
"""

from __future__ import annotations

import argparse
import os
import platform

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import numpy as np

from mtjax import documents, model
from mtjax.batch import Batch
from mtjax.config import StreamConfig
from mtjax.optim import OptimConfig
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

SECTION = "packing-masks"


def packed_rows(rng, shape: tuple[int, int, int], vocab: int) -> tuple[Batch, Batch]:
    """(unmasked, masked) batches of the same packed rows: documents of random lengths."""
    accum, batch, seq = shape
    tokens = rng.integers(0, vocab, shape, dtype=np.int32)
    segments, mask = np.zeros(shape, np.int32), np.zeros(shape, bool)
    for a in range(accum):
        for b in range(batch):
            start, doc = 0, 1
            while start < seq:
                n = min(int(rng.integers(seq // 8, seq * 3 // 8 + 1)), seq - start)
                segments[a, b, start:start + n] = doc
                mask[a, b, start + n // 2:start + n] = True  # the answer: the document's second half
                start, doc = start + n, doc + 1
    return Batch(tokens), Batch(tokens, mask, segments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.shape_options(ap, layers=8, width=1024, seq=512, batch=1, vocab=8192, steps=3,
                          steps_help="timed steps of each kind (after one warm-up each)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--engine", choices=("stream", "reference"), default="stream")
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 2 steps, no doc")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width, args.seq, args.vocab, args.steps, args.no_doc = 2, 128, 64, 512, 2, True

    cfg = harness.llama(args.layers, args.width, vocab=args.vocab)
    params = model.init_params(cfg, seed=0)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    if args.engine == "stream":
        engine = StreamEngine(cfg, params, opt, StreamConfig(keep_every=1, prefetch_depth=2))
    else:
        engine = ReferenceTrainer(cfg, params, opt)
    del params
    rng = np.random.default_rng(0)
    steps = [packed_rows(rng, (args.accum, args.batch, args.seq), cfg.vocab_size) for _ in range(args.steps + 1)]
    # A step returns floats: it has finished when it returns.
    med = harness.alternating_medians({"unmasked": lambda pair: engine.step(pair[0]),
                                       "masked": lambda pair: engine.step(pair[1])}, steps)
    if args.engine == "stream":
        engine.close()
    plain_s, masked_s = med["unmasked"], med["masked"]
    trained = {"unmasked": documents.trained_tokens(steps[-1][0]), "masked": documents.trained_tokens(steps[-1][1])}
    tokens = args.accum * args.batch * args.seq
    rows = [("unmasked packing (plain rows)", plain_s, trained["unmasked"]),
            ("document masks (segments + loss mask)", masked_s, trained["masked"])]
    lines = [
        f"Model: Llama {args.layers} blocks x width {args.width}, vocab {args.vocab}, "
        f"{model.num_params(cfg) / 1e6:.1f}M params, fp32; {args.accum} x {args.batch} x {args.seq} tokens a step "
        f"({args.engine} engine), documents of {args.seq // 8}-{args.seq * 3 // 8} tokens.",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; median of {args.steps} steps of each after one warm-up, kinds alternating.",
        "",
        "| step | step (s) | tokens/s (all) | tokens trained on a step |",
        "|---|---|---|---|",
        *(f"| {name} | {s:.3f} | {tokens / s:.0f} | {n:,} |" for name, s, n in rows),
        "",
        f"**masked / unmasked = {masked_s / plain_s:.3f}** (goal <= 1.05)",
    ]
    harness.publish(SECTION, "Packing with document masks (experiments/bench/packing.py)", "\n".join(lines),
                    f"experiments/bench/packing.py --layers {args.layers} --width {args.width} --seq {args.seq} "
                    f"--accum {args.accum} --engine {args.engine}", write=not args.no_doc)


if __name__ == "__main__":
    main()
