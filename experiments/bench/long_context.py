"""Long rows on the CPU: peak RSS against the sequence length, and its bytes per token.

Trains a small Llama (state in RAM, k = 1) on one row of 4k, 16k and 64k tokens, each
length in a fresh subprocess, with the chunked head (mtjax.loss) and the chunked
feed-forward (model.ffn_chunk_tokens) on. The goal is memory linear in the row (see its
section of docs/benchmarks.md for where it stands). Reports each run's peak RSS, the fitted bytes
per token (the slope of peak RSS against tokens, and its intercept), the worst point's
distance from that line, and tokens/s of the fastest step. Prints a table and writes its
section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/long_context.py --steps 1              # 4k, 16k, 64k: about 10 minutes on 2 cores
    .venv/bin/python experiments/bench/long_context.py --seq 1024 2048 4096 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import os
import time

import harness  # first: the checkout on sys.path, JAX on the CPU

import numpy as np

from mtjax import loss, model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig
from mtjax.plan import BUILTIN, StepShape, estimate
from mtjax.stream import StreamEngine

FFN_CHUNK = 4096


def model_config(width: int, layers: int, seq: int):
    return harness.llama(layers, width, vocab=8192, ffn_chunk_tokens=FFN_CHUNK, max_position_embeddings=max(seq, 2048))


def child_train(args) -> None:
    seq = args.seq[0]
    cfg = model_config(args.width, args.layers, seq)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), OptimConfig(lr=1e-4), StreamConfig(keep_every=1))
    rng = np.random.default_rng(0)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step(rng.integers(0, cfg.vocab_size, (1, 1, seq), dtype=np.int32))
        times.append(time.perf_counter() - t0)
    engine.close()
    harness.report(seq=seq, peak_rss=harness.peak_rss(), step_s=min(times), first_step_s=times[0],
                   params=model.num_params(cfg), head_chunk=loss.chunk_rows(cfg.vocab_size, seq))


def planned_ram(seq: int, width: int, layers: int) -> int:
    """The planner's host RAM for the measured run (cpu-2core profile, state in RAM, k = 1)."""
    plan = estimate(model_config(width, layers, seq), StreamConfig(resident=(), keep_every=1), StoreConfig(),
                    StepShape(1, seq), BUILTIN["cpu-2core"])
    return plan.ram_needed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--child", choices=["train"], help=argparse.SUPPRESS)
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.child == "train":
        return child_train(args)

    rows = []
    for seq in args.seq:
        rows.append(harness.run_child(__file__, "train", "--seq", str(seq), "--width", str(args.width),
                                      "--layers", str(args.layers), "--steps", str(args.steps)))
        print(rows[-1], flush=True)
    tokens = np.array([r["seq"] for r in rows], float)
    rss = np.array([r["peak_rss"] for r in rows], float)
    slope, intercept = np.polyfit(tokens, rss, 1)
    off = np.max(np.abs(rss - (slope * tokens + intercept)) / rss)
    cfg = model_config(args.width, args.layers, rows[0]["seq"])
    lines = [
        f"A Llama of {args.layers} blocks, width {args.width}, SwiGLU {cfg.intermediate_size}, vocab "
        f"{cfg.vocab_size} ({rows[0]['params'] / 1e6:.1f}M params, fp32), batch 1, state in RAM, k = 1; "
        f"chunked head (rows of logits per chunk as listed) and feed-forward chunks of {FFN_CHUNK} tokens; "
        f"{args.steps} step(s) each in a fresh process (peak RSS = VmHWM; tokens/s of the fastest step, which with "
        f"one step includes its compilation). {harness.cpu_name()}, {os.cpu_count()} cores shared with other jobs "
        f"(load average {os.getloadavg()[0]:.1f} at the end): step times are loose.",
        "",
        "| seq | head chunk | peak RSS | RSS / token | planned RAM | step (s) | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['seq']:,} | {r['head_chunk']:,} | {r['peak_rss'] / 2**20:,.0f} MiB | "
                     f"{r['peak_rss'] / r['seq'] / 1024:.1f} KiB | "
                     f"{planned_ram(r['seq'], args.width, args.layers) / 2**20:,.0f} MiB | "
                     f"{r['step_s']:.1f} | {r['seq'] / r['step_s']:,.0f} |")
    lines += ["", f"**Peak RSS = {intercept / 2**20:,.0f} MiB + {slope / 1024:.1f} KiB per token** (least squares over "
              f"the rows; the farthest row is {off:.1%} off the line). The [tokens, vocab] logits would alone be "
              f"{4 * cfg.vocab_size / 1024:.0f} KiB per token (x3 with softmax and gradient)."]
    harness.publish("long-context", "Long rows on the CPU (experiments/bench/long_context.py)", "\n".join(lines),
                    f"experiments/bench/long_context.py --seq {' '.join(map(str, args.seq))} --width {args.width} "
                    f"--layers {args.layers} --steps {args.steps}", write=not args.no_doc)


if __name__ == "__main__":
    main()
