"""One process against two on this machine (127.0.0.1, CPU collectives through gloo):
tokens/s, peak RSS, the resident memory the engine keeps, the master and optimizer bytes
each process holds, and the bytes each process sends over the collectives per step
against the step description (mtjax.plan.hosts.collective_bytes).

    python experiments/bench/multiprocess.py [--layers 4] [--width 256] [--steps 4] [--rounds 3] [--no-doc]

Prints the table and writes it as the "multiprocess" section of docs/benchmarks.md
(`--no-doc`: print only). Both runs train the same global batch (two processes: half its
rows each), all state in RAM, every part streamed (stream.resident=none: a multi-process
run keeps none resident, so the one-process run does not either), one CPU device a process.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import harness

BATCH, SEQ = 4, 128


def child(port: int, count: int, index: int, layers: int, width: int, steps: int) -> None:
    import gc

    import jax
    import numpy as np

    from mtjax import distributed, hostmem, model
    from mtjax.config import DistributedConfig, StoreConfig, StreamConfig
    from mtjax.optim import OptimConfig, make_optimizer
    from mtjax.plan.hosts import collective_bytes
    from mtjax.stream import StreamEngine

    hosts = None
    if count > 1:
        startup = distributed.start(DistributedConfig(f"127.0.0.1:{port}", count, index, timeout_s=120))
        startup.done()
        hosts = startup.hosts
    cfg = harness.llama(layers, width)
    optim = OptimConfig(lr=1e-4, clip_norm=1.0)

    def initial():  # the optimizer's zeros written (np.full), so that their pages are resident now
        params = jax.block_until_ready(model.init_params(cfg, seed=0))
        return params, jax.tree.map(lambda a: np.full(a.shape, 0, a.dtype), make_optimizer(optim).init(params))

    # What the engine keeps: VmRSS before its initial state is built and after the engine
    # is, that state dropped; every allocation of 256 KiB or more its own mmap, unmapped
    # when freed, so that freed memory does not stay resident (as tests/hosts_worker.py).
    hostmem.fix_mmap_threshold()
    initial()
    gc.collect()
    before = harness.vm_rss()
    params, opt_state = initial()
    engine = StreamEngine(cfg, params, optim, StreamConfig(keep_every=1, resident="none"), StoreConfig(),
                          hosts=hosts, opt_state=opt_state)
    del params, opt_state
    gc.collect()
    kept = harness.vm_rss() - before
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, (1, BATCH, SEQ), dtype=np.int32) for _ in range(steps + 1)]
    engine.step(batches[0])  # compiles
    sent0 = dict(hosts.sent) if hosts else {}
    start = time.perf_counter()
    for b in batches[1:]:
        engine.step(b)
    seconds = time.perf_counter() - start
    stages = {k: round(v, 3) for k, v in engine.stage_seconds().items()}  # the last step's
    held = sum(engine.tiers.by_kind[kind].nbytes(kind) for kind in ("master", "opt"))
    sent = {k: (v - sent0[k]) // steps for k, v in hosts.sent.items()} if hosts else {}
    described = collective_bytes(cfg, count)._asdict()
    engine.close()
    harness.report(tokens_per_s=steps * BATCH * SEQ / seconds, peak_rss=harness.peak_rss(), kept=kept, held=held, stages=stages,
                   sent=sent, described=described, params=model.num_params(cfg))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(count: int, args) -> list[dict]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(port), str(count), str(i), str(args.layers),
                               str(args.width), str(args.steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(count)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        if p.returncode:
            sys.exit(f"a child of the {count}-process run failed (exit {p.returncode}):\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of one and of two processes")
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*(int(x) for x in args.child))
        return
    # The two runs alternate, round by round, so that drift in the shared machine's load
    # hits both alike (one run of each, one after the other, read 2.2x for two processes
    # once and 1.0-1.2x when rerun); tokens/s is the median over the rounds.
    runs = {1: [], 2: []}
    for _ in range(args.rounds):
        for count, rounds in runs.items():
            rounds.append(_run(count, args))
    rows, stage_rows = [], []
    for count, rounds in runs.items():
        results = rounds[-1]
        stage_rows.append((count, results[0]))
        r = results[0]
        mib = 2**20
        sent = sum(r["sent"].values()) if r["sent"] else 0
        each = [x[0]["tokens_per_s"] for x in rounds]
        rows.append(f"| {count} | {statistics.median(each):,.0f} ({', '.join(f'{t:,.0f}' for t in each)}) | "
                    f"{max(x['peak_rss'] for x in results) / mib:,.0f} | {max(x['kept'] for x in results) / mib:,.1f} | "
                    f"{r['held'] / mib:,.1f} | "
                    f"{r['sent'].get('reduce_scatter', 0) / mib:,.2f} + {r['sent'].get('all_gather', 0) / mib:,.2f} | "
                    f"{r['described']['reduce_scatter'] / mib:,.2f} + {r['described']['all_gather'] / mib:,.2f} | "
                    f"{'equal' if sent == r['described']['reduce_scatter'] + r['described']['all_gather'] else 'DIFFER'} |")
    command = (f"experiments/bench/multiprocess.py --layers {args.layers} --width {args.width} --steps {args.steps} "
               f"--rounds {args.rounds}")
    body = (f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores), jax {importlib.metadata.version('jax')} on the CPU. "
            f"{results[0]['params'] / 1e6:.1f}M parameters, batch {BATCH} x seq {SEQ}, all state in RAM, every part "
            "streamed, the same global batch; two processes on one 2-core machine share its cores. Kept: the "
            "resident memory a process's engine keeps (its state; with two processes also the compute copy, "
            "whole on each, which one process derives from master instead).\n\n"
            "| processes | tokens/s, median (each round) | peak RSS per process (MiB) | kept per process (MiB) | "
            "master + opt per process (MiB) | sent per step and process, RS + AG (MiB) | described (MiB) | |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    for count, r in stage_rows:
        print(f"{count} process(es), process 0's last step, seconds per stage: {r['stages']}")
    harness.publish("multiprocess", "One process against two (experiments/bench/multiprocess.py)", body, command,
                    write=not args.no_doc)

if __name__ == "__main__":
    main()
