"""Streaming overhead: streamed step time / reference step time, same model, one run.

Both engines run the same Llama (8 blocks of width 1024 by default; fp32 compute, or
`--dtype bfloat16` with fp32 masters and AdamW state) with AdamW and clipping. The
reference trainer recomputes every block in the backward (remat "full") or keeps the
blocks' projection outputs (remat "dots"); the stream keeps every block input
(k = 1) with all state in the RAM tier (every part streamed, each block recomputed: remat
"full"), and, with an unlimited device budget, keeps every part resident with either
remat (`stream.resident=all`, `stream.remat`). Steps of all engines alternate, so drift in
machine load hits them alike; each step is timed by wall clock and by this process's CPU
time (all threads: on a shared machine the steadier figure; its system share and the
minor page faults beside it), and a streamed step includes finishing its deferred update
(else it would run during the next engine's step). Prints a table and writes its section of docs/benchmarks.md (one per compute
dtype: fp32's `stream-overhead`, the others' `stream-overhead-<dtype>`).

    .venv/bin/python experiments/bench/stream_overhead.py            # ~5-8 minutes on 2 cores
    .venv/bin/python experiments/bench/stream_overhead.py --dtype bfloat16
    .venv/bin/python experiments/bench/stream_overhead.py --layers 2 --width 256 --no-doc   # smoke
    .venv/bin/python experiments/bench/stream_overhead.py --layers 4 --dtype bfloat16 --faults-per-call --no-doc
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import time
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


def timed_steps(engines: dict, data: list) -> dict:
    """name -> ([wall seconds], [CPU seconds], [system CPU seconds], [minor page faults])
    of each engine's steps on data[1:] (the first compiles), the engines taking turns; a
    streamed step ends with its update done."""
    out = {name: ([], [], [], []) for name in engines}
    for i, tokens in enumerate(data):
        for name, engine in engines.items():
            wall, cpu, use = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            engine.step(tokens)  # returns host floats: the step has finished
            if isinstance(engine, StreamEngine):
                engine.flush()
            if i:
                done = resource.getrusage(resource.RUSAGE_SELF)
                out[name][0].append(time.perf_counter() - wall)
                out[name][1].append(time.process_time() - cpu)
                out[name][2].append(done.ru_stime - use.ru_stime)
                out[name][3].append(done.ru_minflt - use.ru_minflt)
    return out


def faults_per_call(engine: StreamEngine, tokens) -> dict:
    """{program or host step: [calls, minor page faults]} of one streamed step, each call
    waited for before and after, so that a call's faults are its own (but for the
    prefetch thread's rounding, which runs beside them: its count takes what the others
    fault meanwhile). The step runs one call at a time: its time means nothing here."""
    counts, undo = {}, []

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def wrap(name, fn, wait=True):
        def counted(*args, **kw):
            jax.block_until_ready(args)
            start = faults()
            out = fn(*args, **kw)
            if wait:
                jax.block_until_ready(out)
            c = counts.setdefault(name, [0, 0])
            c[0], c[1] = c[0] + 1, c[1] + faults() - start
            return out
        return counted

    def patch(owner, attr, name, wait=True):
        fn = getattr(owner, attr)
        if isinstance(fn, dict):  # programs per block kind
            for k, f in list(fn.items()):
                fn[k] = wrap(name, f, wait)
                undo.append(lambda d=fn, k=k, f=f: d.__setitem__(k, f))
        elif callable(fn):
            setattr(owner, attr, wrap(name, fn, wait))
            undo.append(lambda: setattr(owner, attr, fn))

    for attr in ("embed_forward", "forward", "recompute", "grad", "backward", "head", "embed_backward",
                 "grad_add", "grad_to_f32"):
        patch(engine.fns, attr, f"program {attr}")
    for attr in ("to_device", "start_to_host", "host_arrays"):
        patch(engine.placement, attr, f"placement {attr}")
    patch(engine.updater.state, "compute_into", "staging copy (compute_into)", wait=False)
    try:
        engine.step(tokens)
        engine.flush()
    finally:
        for fn in undo:
            fn()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.shape_options(ap, layers=8, width=1024, seq=512, batch=1, vocab=8192, steps=5,
                          steps_help="timed steps per engine (after one warm-up)")
    ap.add_argument("--dtype", default="float32", help="compute dtype")
    ap.add_argument("--trace", type=Path, help="also write the RAM-tier stream's Chrome trace here")
    ap.add_argument("--faults-per-call", action="store_true",
                    help="also count the RAM-tier stream's page faults per program call in one more step")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()

    load_at_start = os.getloadavg()[0]
    cfg = harness.llama(args.layers, args.width, vocab=args.vocab, dtype=args.dtype)
    params = model.init_params(cfg, seed=0)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32) for _ in range(args.steps + 1)]

    def stream(**kw):
        return StreamEngine(cfg, params, opt, StreamConfig(keep_every=1, prefetch_depth=2, **kw))

    # (row, remat, engine); each stream row is compared with the reference of its remat.
    rows = [("reference (whole model in memory)", "full", ReferenceTrainer(cfg, params, opt)),
            ("stream, RAM tier (every part streamed)", "full", stream(resident="none")),
            ("stream, unlimited budget (every part resident)", "full", stream(resident="all", remat="full")),
            ("reference (whole model in memory)", "dots", ReferenceTrainer(cfg, params, opt, remat="dots")),
            ("stream, unlimited budget (every part resident)", "dots", stream(resident="all", remat="dots"))]
    del params
    times = timed_steps({(name, remat): engine for name, remat, engine in rows}, data)
    ram = rows[1][2]
    stages = ram.stage_seconds()
    if args.trace:
        ram.write_trace(args.trace)
    per_call = faults_per_call(ram, data[-1]) if args.faults_per_call else {}
    for _, _, engine in rows:
        if isinstance(engine, StreamEngine):
            engine.close()

    med = {k: tuple(statistics.median(x) for x in v) for k, v in times.items()}
    tokens = args.batch * args.seq
    table = []
    for name, remat, _ in rows:
        (wall, cpu, system, faults), (ref_wall, ref_cpu, *_) = med[name, remat], \
            med["reference (whole model in memory)", remat]
        table.append(f"| {name} | {remat} | {wall:.2f} | {cpu:.2f} | {system:.2f} | {faults / 1e3:.0f}k | "
                     f"{tokens / wall:.0f} | {wall / ref_wall:.3f} | {cpu / ref_cpu:.3f} | "
                     f"{', '.join(f'{t:.2f}' for t in times[name, remat][1])} |")
    lines = [
        f"{datetime.date.today()}, {harness.cpu_name()}, {os.cpu_count()} cores, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, load average {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} "
        f"at the end (the run itself keeps the cores busy). Llama {args.layers} blocks x width {args.width}, vocab "
        f"{args.vocab}, {model.num_params(cfg) / 1e6:.1f}M params, {args.dtype}; batch {args.batch} x seq "
        f"{args.seq}; AdamW, clip 1.0. Median of {args.steps} steps after one warm-up, the engines' steps "
        f"interleaved; CPU = this process's CPU seconds (every thread), steadier than wall time on a shared "
        f"machine; system = its kernel share, mostly minor page faults (XLA's CPU client mallocs a program's "
        f"scratch at each call); ratios against the reference of the same remat. GLIBC_TUNABLES="
        f"{os.environ.get('GLIBC_TUNABLES', '')!r} (glibc.malloc.hugetlb=1: docs/cpu.md, \"Page faults\"); "
        f"peak RSS of the process (all {len(rows)} engines) {harness.peak_rss() / 2**30:.2f} GiB.",
        "",
        "| engine | remat | step wall (s) | step CPU (s) | of it system (s) | minor faults | tokens/s | "
        "wall / reference | CPU / reference | every step's CPU (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *table,
        "",
        "Goal (issue 33): streamed / reference <= 1.03 when the state fits the device.",
        "",
        "RAM-tier stream's stage seconds in the last step (summed over parts; stages overlap): "
        + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()),
    ]
    if per_call:
        lines += ["", "RAM-tier stream's minor page faults per call in one more step, each call waited for "
                  "(`--faults-per-call`): " + ", ".join(
                      f"{name} {f / n / 1e3:.1f}k x {n}" for name, (n, f) in
                      sorted(per_call.items(), key=lambda x: -x[1][1]))]
    fp32 = args.dtype == "float32"
    title = "Streaming overhead" + ("" if fp32 else f", {args.dtype} compute")
    harness.publish(SECTION if fp32 else f"{SECTION}-{args.dtype}",
                    f"{title} (experiments/bench/stream_overhead.py)", "\n".join(lines),
                    f"experiments/bench/stream_overhead.py --layers {args.layers} --width {args.width} --seq {args.seq}"
                    + ("" if fp32 else f" --dtype {args.dtype}") + (" --faults-per-call" if per_call else ""),
                    write=not args.no_doc)


if __name__ == "__main__":
    main()
