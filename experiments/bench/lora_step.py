"""A LoRA step against a full fine-tuning step: same model, engine and placement.

Each run is a process of its own (its peak RSS is its own): the stream engine on a fp32
Llama, compute copy in RAM, master weights and optimizer state on disk in a layer store,
so the bytes a step writes are the state it updates. The full fine-tune trains every
leaf; the LoRA run adapts every linear layer of the blocks (rank 16) over the frozen
base, its adapters resident on the device (stream.adapters, the default), and again with
them streamed (updated on the host, their state on disk); the NF4 run does the same over
the base's kernels in NF4 (mtjax.quant), adapters resident. The bound
is the same LoRA step in memory (mtjax.reference: forward + backward and the adapters'
update, nothing streamed): on the CPU, whose "device" is host memory, the frozen base's
transfer costs nothing, so the bound is the compute alone. Prints a table and writes its
section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/lora_step.py                 # ~3 minutes on 2 cores
    .venv/bin/python experiments/bench/lora_step.py --layers 2 --width 256 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import dataclasses

import jax
import numpy as np

import mtjax.store
from mtjax import lora, model, parts
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

SECTION = "lora-step"
RANK = 16
RUNS = {"full": "full fine-tune", "lora": "LoRA, adapters resident", "lora-streamed": "LoRA, adapters streamed",
        "nf4": "LoRA over an NF4 base", "bound": "bound: LoRA in memory"}


def _config(args, run: str):
    cfg = harness.llama(args.layers, args.width, vocab=args.vocab)
    if run == "full":
        return cfg
    cfg = dataclasses.replace(cfg, lora=lora.LoraConfig(rank=RANK, alpha=2.0 * RANK))
    return dataclasses.replace(cfg, base_format="nf4") if run == "nf4" else cfg


def _bound(args, cfg, opt, data) -> None:
    """The LoRA step in memory: the in-memory trainer's forward + backward and update."""
    trainer = ReferenceTrainer(cfg, model.init_params(cfg, seed=0), opt)
    trainer.step(data[0])  # compiles
    times = []
    for batch in data[1:]:
        t = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - t)
    harness.report(step=statistics.median(times), h2d=0, planned_write=0, written=0, rss=harness.peak_rss(),
                   trained=parts.trained_params(cfg), params=model.num_params(cfg))


def child(args) -> None:
    cfg = _config(args, "lora" if args.child in ("bound", "lora-streamed") else args.child)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32) for _ in range(args.steps + 1)]
    if args.child == "bound":
        return _bound(args, cfg, opt, data)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        store = mtjax.store.create(Path(tmp) / "store", cfg, make_optimizer(opt))
        placement = StoreConfig(master="disk", opt="disk")
        adapters = "streamed" if args.child == "lora-streamed" else "resident"
        engine = StreamEngine(cfg, model.init_params(cfg, seed=0), opt, StreamConfig(keep_every=1, adapters=adapters),
                              placement, store=store)
        engine.step(data[0])  # compiles
        written, times = store.io_bytes[1], []
        for batch in data[1:]:
            t = time.perf_counter()
            engine.step(batch)  # returns floats: the step has finished
            times.append(time.perf_counter() - t)
        written = (store.io_bytes[1] - written) / args.steps
        traffic = engine.plan(args.batch, args.seq).traffic
        engine.close()
        store.close()
    harness.report(step=statistics.median(times), h2d=traffic.h2d, planned_write=traffic.disk_write_bytes,
                   written=written, rss=harness.peak_rss(), trained=parts.trained_params(cfg),
                   params=model.num_params(cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.shape_options(ap, layers=8, width=1024, seq=512, batch=1, vocab=8192, steps=3,
                          steps_help="timed steps (after one that compiles)")
    ap.add_argument("--scratch", default=None, help="directory of the runs' stores (default: the system's temp)")
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    passed = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "seq", "batch", "vocab", "steps")]
    passed += [f"--scratch={args.scratch}"] if args.scratch else []
    load = os.getloadavg()[0]
    runs = {mode: harness.run_child(__file__, mode, *passed) for mode in RUNS}
    full, adapted, bound = runs["full"], runs["lora"], runs["bound"]
    mib = 2 ** 20
    lines = [
        f"Model: Llama {args.layers} blocks x width {args.width}, vocab {args.vocab}, {full['params'] / 1e6:.1f}M "
        f"params, float32; batch {args.batch} x seq {args.seq}; AdamW; stream engine, keep_every 1; compute copy in "
        f"RAM, master and optimizer state on disk. LoRA: rank {RANK} on every linear layer of the blocks "
        f"({adapted['trained'] / 1e6:.2f}M trained).",
        f"Machine: {harness.cpu_name()}, {os.cpu_count()} cores, jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"median of {args.steps} steps after one that compiles; each run a process of its own; load average "
        f"{load:.1f} when it started (other work on the machine slows both runs).",
        "",
        "| run | step (s) | host->device per step (MiB) | disk written per step (MiB, planned) | peak RSS (MiB) |",
        "|---|---|---|---|---|",
        *(f"| {name} | {r['step']:.2f} | {r['h2d'] / mib:.1f} | {r['written'] / mib:.1f} ({r['planned_write'] / mib:.1f}) "
          f"| {r['rss'] / mib:.0f} |" for name, r in ((RUNS[m], runs[m]) for m in RUNS)),
        "",
        f"**LoRA step / full step = {adapted['step'] / full['step']:.2f}**; disk written per step: none with the "
        f"adapters resident (a commit writes them), {full['written'] / max(runs['lora-streamed']['written'], 1):.0f}x "
        f"less than the full step's with them streamed. **LoRA step / its bound = "
        f"{adapted['step'] / bound['step']:.2f}** (goal: at most 1.10); adapters streamed "
        f"{runs['lora-streamed']['step'] / bound['step']:.2f}; over the NF4 base "
        f"{runs['nf4']['step'] / bound['step']:.2f}.",
    ]
    harness.publish(SECTION, "LoRA step against a full fine-tuning step (experiments/bench/lora_step.py)",
                    "\n".join(lines), f"experiments/bench/lora_step.py --layers {args.layers} --width {args.width} "
                    f"--seq {args.seq}", write=not args.no_doc)


if __name__ == "__main__":
    main()
