"""The disk tier's step against its disk bound: the bytes the step must move over the probed disk rate.

A fp32 Llama's compute, master and optimizer state all live in the store on disk
(StreamEngine, k = 1, prefetch depth 2). Its step description (mtjax.stream.schedule,
`traffic.disk_read` / `disk_write`) says how many bytes one step reads and writes; the
disk is probed right before the run the way the store uses it (`probe.disk_bandwidth`:
chunk files, reads cold, writes fsynced as a commit does). The bound is the time those
bytes take at those rates, read and write after one another (one disk):

    bound = disk_read_bytes / read rate + disk_write_bytes / write rate

A timed step is a window of `--commit-every` steps and the `commit` that ends it (which
applies the last step's update and makes the window's writes durable), over its steps: a
run commits every `run.checkpoint_every` steps, and between commits each step's writes go
to the disk without an fsync while the next step computes (mtjax.store.durable). The
window is also split into a step between commits (the median of its steps after the
first, each with the last step's update to overlap) and what the commit adds beyond
such steps, which gives the step with a commit every 100 steps (the shipped configs'
shortest `run.checkpoint_every`) without timing 100 steps. The
store's page cache is dropped before each window (harness.drop_page_cache, as the store benchmark
does) and, with --evict (default on), again every few milliseconds while it runs, so
that reads come from the disk as for a store many times the page cache (dirty pages
cannot be dropped: writes still reach the disk at its own pace). The bytes this process
read from and wrote to the block device (/proc/self/io) are reported beside the
description's. The in-memory reference trainer's step on the same model is timed too,
alternating. Prints a table; `--doc` also writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/disk_bound.py --quick          # ~1 minute: shows it works
    .venv/bin/python experiments/bench/disk_bound.py --doc            # 4 x 1024, seq 256, 3 steps
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import numpy as np
import psutil

import mtjax.store
from mtjax import model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import probe
from mtjax.reference import ReferenceTrainer
from mtjax.store.fresh import init_store
from mtjax.stream import StreamEngine

SECTION = "disk-bound"
LONG = 100  # steps between commits in the shipped configs (run.checkpoint_every: 100 or more)
DISK = StoreConfig(compute="disk", master="disk", opt="disk")


def io_bytes() -> tuple[int, int]:
    """(bytes read from, bytes written to) the block device by this process so far."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


class Evictor:
    """Drops the store's clean pages from the page cache every `every` seconds while
    active, from a child process at low priority: a sweep opens every file of the store,
    and in a thread of this process it took the trainer's GIL and most of a core (14 s a
    21 s step on the 2-core machine). Each sweep waits at least 4x its own duration after
    the last, so it takes at most a fifth of a core."""

    busy = 0.0  # seconds the sweeps took, over every Evictor (reported: the trainer's cores are shared)

    def __init__(self, root: Path, every: float):
        self.root, self.every = root, every
        self._proc = None

    def __enter__(self):
        if self.every > 0:
            self._proc = subprocess.Popen([sys.executable, harness.__file__, "evict", str(self.root), str(self.every)],
                                          stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.send_signal(signal.SIGTERM)
            out, _ = self._proc.communicate()
            Evictor.busy += float(out.strip() or 0)


def measure(args, work: Path) -> dict:
    cfg = harness.llama(args.layers, args.width, vocab=args.vocab)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    store_dir = work / "store"
    init_store(cfg, store_dir, seed=0, tx=make_optimizer(opt), copies=args.copies)
    disk_read, disk_write, cold = probe.disk_bandwidth(work, args.probe_mib << 20)
    store = mtjax.store.open(store_dir, writable=True)
    stream = StreamEngine(cfg, optim=opt, stream=StreamConfig(keep_every=1, prefetch_depth=2), store_config=DISK,
                          store=store)
    ref = ReferenceTrainer(cfg, model.init_params(cfg, seed=0), opt) if args.reference else None
    rng = np.random.default_rng(0)
    times = {"stream": [], "reference": [], "steady": [], "extra": []}
    moved = []
    every = args.commit_every
    for i in range(args.steps + 1):  # rounds of `every` steps and a commit; round 0 compiles
        batches = [rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32) for _ in range(every)]
        if ref is not None:
            for tokens in batches:
                t0 = time.perf_counter()
                ref.step(tokens)
                if i:
                    times["reference"].append(time.perf_counter() - t0)
        harness.drop_page_cache(store_dir)
        with Evictor(store_dir, args.evict_ms / 1e3 if args.evict else 0):
            r0, w0 = io_bytes()
            t0 = time.perf_counter()
            ends = []
            for tokens in batches:
                stream.step(tokens)
                ends.append(time.perf_counter())
            stream.commit((i + 1) * every)  # two copies: applies the last update, then makes it durable
            stream.flush()  # one copy: the commit started the update; it is part of the step
            window = time.perf_counter() - t0
            r1, w1 = io_bytes()
        if i:
            times["stream"].append(window / every)
            # A step with the last one's update to overlap (not the first after a commit,
            # which has none), and what the commit adds to the window beyond such steps.
            steady = statistics.median(b - a for a, b in zip(ends, ends[1:])) if every > 1 else window
            times["steady"].append(steady)
            times["extra"].append(window - every * steady)
            moved.append(((r1 - r0) / every, (w1 - w0) / every))
    traffic = stream.schedule.traffic
    stages = stream.stage_seconds()
    if args.trace:
        stream.write_trace(args.trace)
    stream.close()
    store.close()
    bound = traffic.disk_read_bytes / disk_read + traffic.disk_write_bytes / disk_write
    evicting = Evictor.busy / (args.steps + 1) / args.commit_every  # per step, the warm-up window included
    return dict(
        params=model.num_params(cfg),
        read=traffic.disk_read_bytes, write=traffic.disk_write_bytes, read_rate=disk_read, write_rate=disk_write,
        cold=cold, bound=bound, stream=statistics.median(times["stream"]),
        steady=statistics.median(times["steady"]), extra=statistics.median(times["extra"]),
        reference=statistics.median(times["reference"]) if times["reference"] else None,
        measured_read=statistics.median(m[0] for m in moved), measured_write=statistics.median(m[1] for m in moved),
        stages=stages, evicting=evicting)


def table(args, r: dict) -> str:
    gb = 1e9
    ratio_ref = f"{r['stream'] / r['reference']:.2f}" if r["reference"] else "-"
    ref = f"{r['reference']:.2f}" if r["reference"] else "-"
    measured_bound = r["measured_read"] / r["read_rate"] + r["measured_write"] / r["write_rate"]
    ram = psutil.virtual_memory()
    lines = [
        f"{time.strftime('%Y-%m-%d')}, {platform.node() or 'this machine'} ({os.cpu_count()} cores, RAM "
        f"{ram.total / gb:.1f} GB), jax {jax.__version__}, load average {os.getloadavg()[0]:.1f} at the end. "
        f"fp32 Llama {args.layers} blocks x width {args.width}, vocab {args.vocab}, {r['params'] / 1e6:.1f}M params, "
        f"batch {args.batch} x seq {args.seq}; AdamW + clip 1.0; StreamEngine k = 1, prefetch depth 2, compute, "
        f"master and optimizer state on the disk tier, a {args.copies}-copy store, a commit every "
        f"{args.commit_every} steps (a timed step: a window of them and its commit, over {args.commit_every}). "
        "Disk probed "
        f"right before the run ({args.probe_mib} MiB, `probe.disk_bandwidth`"
        f"{'' if r['cold'] else ', read possibly warm'}). Page cache of the store dropped before each step"
        + (f" and every {args.evict_ms} ms during it (or 4x a sweep's time, when longer)" if args.evict else "")
        + f". Median of {args.steps} windows after one warm-up window.",
        "",
        "| | read (GB) | written (GB) | time (s) |",
        "|---|---|---|---|",
        f"| step description (bytes the step must move) | {r['read'] / gb:.3f} | {r['write'] / gb:.3f} | |",
        f"| probed disk (GB/s) | {r['read_rate'] / gb:.2f} | {r['write_rate'] / gb:.2f} | |",
        f"| disk bound = read / read rate + written / write rate | | | {r['bound']:.2f} |",
        f"| measured streamed step (steps + commit, per step), block-device bytes | {r['measured_read'] / gb:.3f} | "
        f"{r['measured_write'] / gb:.3f} | {r['stream']:.2f} |",
        f"| of it: a step between commits (median, after the first of a window) | | | {r['steady']:.2f} |",
        f"| of it: what a commit adds (the window less {args.commit_every} such steps) | | | {r['extra']:.2f} |",
        f"| in-memory reference step | | | {ref} |",
        "",
        f"**streamed step / disk bound = {r['stream'] / r['bound']:.2f}** with a commit every "
        f"{args.commit_every} steps, {r['steady'] / r['bound']:.2f} between commits, "
        f"{(r['steady'] + r['extra'] / LONG) / r['bound']:.2f} with a commit every {LONG} (goal <= 1.3); "
        f"streamed / reference = {ratio_ref}. Some reads are served from the page cache all the same (a page "
        f"read right after it was written, before a sweep drops it): at the bytes the block device moved "
        f"({r['measured_read'] / gb:.3f} GB read) the bound would be {measured_bound:.2f} s, and a step between "
        f"commits {r['steady'] / measured_bound:.2f}x it. The bound adds the read and the write times as if the "
        "disk served one at a time; a disk that serves concurrent reads and writes faster than that (this VM's "
        "virtual disk can) lets a step come in under it.",
        "",
        f"The evictor's sweeps took {r['evicting']:.2f} s a step (a child process at nice 10, on the same cores).",
        "",
        "Stream stage seconds in the last step (summed over parts; stages overlap): "
        + ", ".join(f"{k} {v:.2f}" for k, v in r["stages"].items()),
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model and 2 steps: shows the script works")
    harness.shape_options(ap, layers=4, width=1024, seq=256, batch=1, vocab=8192, steps=3,
                          steps_help="timed steps (after one warm-up)")
    ap.add_argument("--copies", type=int, choices=[1, 2], default=2, help="store copies")
    ap.add_argument("--commit-every", type=int, default=4,
                    help="steps between commits (a run's run.checkpoint_every); a timed step is the window's "
                         "time over its steps, the commit included")
    ap.add_argument("--probe-mib", type=int, default=512, help="MiB the disk probe writes and reads")
    ap.add_argument("--evict", action=argparse.BooleanOptionalAction, default=True,
                    help="keep dropping the store's pages during each step")
    ap.add_argument("--evict-ms", type=int, default=20)
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the in-memory reference trainer")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory for the store (on the disk to test)")
    ap.add_argument("--trace", type=Path, help="also write the streamed engine's Chrome trace here")
    ap.add_argument("--doc", action="store_true", help="write the section of docs/benchmarks.md")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width, args.seq, args.vocab, args.steps, args.probe_mib = 2, 512, 64, 2048, 2, 128
    work = Path(tempfile.mkdtemp(prefix="mtjax-disk-bound-", dir=args.dir))
    try:
        r = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    harness.publish(SECTION, "Disk tier against its disk bound (experiments/bench/disk_bound.py)", table(args, r),
                    "experiments/bench/disk_bound.py" + (" --quick" if args.quick else "")
                    + (f" --commit-every {args.commit_every}" if args.commit_every != 4 else ""), write=args.doc)


if __name__ == "__main__":
    main()
