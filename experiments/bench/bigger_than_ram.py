"""Training a model whose state does not fit in this machine's RAM, all of it on disk.

`mtjax.store.fresh.init_store` writes a fresh Llama (one part in memory at a time), then a
StreamEngine with compute, master and optimizer state on the disk tier trains it for a
few steps on one fixed batch (so the loss must fall). Init and training each run in a
fresh subprocess; the training child reports its peak RSS (VmHWM), per-step time,
loss and the bytes it read and wrote (/proc/self/io). The store is deleted at the end.
Writes its section of docs/benchmarks.md.

The store is a one-copy store (`--copies 1`, store.copies=1): one copy of the 14 bytes of
state per parameter plus the 4-byte fp32 gradient sums committed with each step, about
18 bytes per parameter on disk (`--copies 2`: A/B slots, 32). Check `df -h` first.

    nohup .venv/bin/python experiments/bench/bigger_than_ram.py --dir /work/btr > /tmp/btr.log 2>&1 &
    .venv/bin/python experiments/bench/bigger_than_ram.py --layers 2 --width 256 --vocab 512 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import numpy as np
import psutil

import mtjax.store
from mtjax import model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.store.fresh import init_store
from mtjax.stream import StreamEngine

STATE_BYTES = 2 + 4 + 4 + 4  # bf16 compute + fp32 master + AdamW mu + nu, per parameter


def model_config(args):
    return harness.llama(args.layers, args.width, vocab=args.vocab, ffn=args.ffn or int(args.width * 2.7),
                         head_dim=128, dtype="bfloat16")


def io_bytes() -> tuple[int, int]:
    """(bytes read from, bytes written to) the block device by this process so far."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def child_init(args) -> None:
    t0 = time.perf_counter()
    init_store(model_config(args), args.dir / "store", seed=0, tx=make_optimizer(OptimConfig()), copies=args.copies)
    harness.report(init_s=time.perf_counter() - t0, init_peak_rss=harness.peak_rss(), written=io_bytes()[1])


def child_train(args) -> None:
    cfg = model_config(args)
    store = mtjax.store.open(args.dir / "store", writable=True)
    engine = StreamEngine(cfg, optim=OptimConfig(lr=args.lr, schedule="constant"),
                          stream=StreamConfig(keep_every=1, prefetch_depth=2),
                          store_config=StoreConfig(compute="disk", master="disk", opt="disk"), store=store)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32)
    steps = []
    for i in range(args.steps):
        r0, w0 = io_bytes()
        t0 = time.perf_counter()
        out = engine.step(tokens)  # the same batch each step: the loss must fall
        if not engine.commits_every_step:  # one copy: the step committed itself (state + pending gradients)
            engine.commit(i + 1)  # every step durable
        dt = time.perf_counter() - t0
        r1, w1 = io_bytes()
        steps.append({"step": i + 1, "s": dt, "loss": out["loss"], "read": r1 - r0, "written": w1 - w0,
                      "disk_usage": store.disk_usage()})
        print(json.dumps(steps[-1]), file=sys.stderr, flush=True)
    engine.close()
    store.close()
    harness.report(params=model.num_params(cfg), peak_rss=harness.peak_rss(), steps=steps)


def run_child(mode: str, args) -> dict:
    opts = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "ffn", "vocab", "seq", "batch", "steps", "lr", "copies")]
    return harness.run_child(__file__, mode, "--dir", str(args.dir), *opts, show_stderr=True)  # per-step lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--copies", type=int, choices=(1, 2), default=1, help="copies of the state in the store")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mtjax-bigger-than-ram"),
                    help="scratch directory on the disk to test (deleted at the end)")
    ap.add_argument("--child", choices=["init", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    if args.child == "init":
        return child_init(args)
    if args.child == "train":
        return child_train(args)

    cfg = model_config(args)
    ram = psutil.virtual_memory().total
    state = model.num_params(cfg) * STATE_BYTES
    need = args.copies * state + 4 * model.num_params(cfg)  # the state's copies + fp32 gradient sums
    free = shutil.disk_usage(args.dir.parent if not args.dir.exists() else args.dir).free
    print(f"{model.num_params(cfg) / 1e9:.2f}B params, state {state / 1e9:.1f} GB = {state / ram:.2f}x RAM "
          f"({ram / 1e9:.1f} GB); disk free {free / 1e9:.0f} GB, the store will reach ~{need / 1e9:.0f} GB", flush=True)
    if need + 10e9 > free:
        sys.exit("not enough free disk for the state, the gradient sums and 10 GB: choose a smaller model")
    args.dir.mkdir(parents=True, exist_ok=False)
    try:
        init = run_child("init", args)
        print(json.dumps(init), flush=True)
        train = run_child("train", args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)

    steps = train["steps"]
    lines = [
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores, RAM {ram / 1e9:.1f} GB, no swap), "
        f"load average {os.getloadavg()[0]:.1f} at the end. Llama {args.layers} blocks x width {args.width} (FFN "
        f"{args.ffn}, vocab {args.vocab}), {train['params'] / 1e9:.2f}B parameters; bf16 compute, fp32 master, "
        f"AdamW; batch {args.batch} x seq {args.seq}, the same batch every step; compute, master and optimizer "
        f"state all on the disk tier (k = 1, prefetch depth 2), a {args.copies}-copy store, a commit after every step. Init and training each in "
        f"a fresh process; peak RSS = VmHWM (experiments/bench/harness.py); bytes = /proc/self/io of the training process.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| persistent training state (14 bytes/param) | {state / 1e9:.1f} GB = {state / ram:.2f}x RAM |",
        f"| store on disk after each step ({args.copies} cop{'y' if args.copies == 1 else 'ies'} + pending gradients) | "
        f"{', '.join(format(s_['disk_usage'] / 1e9, '.1f') for s_ in steps)} GB |",
        f"| init (`init_store`, one part at a time) | {init['init_s']:.0f} s, peak RSS {init['init_peak_rss'] / 1e9:.2f} GB |",
        f"| training peak RSS | {train['peak_rss'] / 1e9:.2f} GB = {train['peak_rss'] / ram:.1%} of RAM |",
        "",
        "| step | time (s) | loss | read (GB) | written (GB) | disk GB/s (read + written) / step time |",
        "|---|---|---|---|---|---|",
    ]
    for s in steps:
        lines.append(f"| {s['step']} | {s['s']:.0f} | {s['loss']:.4f} | {s['read'] / 1e9:.1f} | {s['written'] / 1e9:.1f} | "
                     f"{(s['read'] + s['written']) / s['s'] / 1e9:.2f} |")
    falls = all(b["loss"] < a["loss"] for a, b in zip(steps, steps[1:]))
    lines += ["", f"**Loss {'falls' if falls else 'does NOT fall'} every step; peak RSS "
              f"{train['peak_rss'] / ram:.1%} of RAM** (goal: state >= 1.5x RAM, peak RSS < 50% of RAM)", "",
              f"Disk sets the size here: {free / 1e9:.0f} GB were free. A one-copy store needs 18 bytes/param (the 14 "
              f"bytes of state once, and the fp32 gradient sums it commits with each step); A/B slots would need 32, "
              f"{2 * ram / 14 * 32 / 1e9:.0f} GB for state of 2x RAM. Step times include each step's commit (fsync of "
              f"every written chunk and gradient file) and ran beside other jobs on the 2 cores."]
    harness.publish("bigger-than-ram", "Bigger than RAM (experiments/bench/bigger_than_ram.py)", "\n".join(lines),
                    f"experiments/bench/bigger_than_ram.py --layers {args.layers} --width {args.width} --ffn "
                    f"{args.ffn} --vocab {args.vocab} --dir DIR", write=not args.no_doc)


if __name__ == "__main__":
    main()
