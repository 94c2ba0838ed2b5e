"""One process against two on this machine (127.0.0.1, CPU collectives through gloo):
tokens/s, peak RSS, the master and optimizer bytes each process holds, and the bytes each
process sends over the collectives per step against the step description
(mtjax.plan.hosts.collective_bytes).

    python experiments/bench/multiprocess.py [--layers 4] [--width 256] [--steps 4] [--doc]

Prints the table; `--doc` also writes it as the "multiprocess" section of docs/benchmarks.md.
Both runs train the same global batch (two processes: half its rows each), all state in RAM.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import harness

BATCH, SEQ = 4, 128


def child(port: int, count: int, index: int, layers: int, width: int, steps: int) -> None:
    import numpy as np

    from mtjax import distributed, model
    from mtjax.config import DistributedConfig, StoreConfig, StreamConfig
    from mtjax.optim import OptimConfig
    from mtjax.plan.hosts import collective_bytes
    from mtjax.stream import StreamEngine

    hosts = None
    if count > 1:
        startup = distributed.start(DistributedConfig(f"127.0.0.1:{port}", count, index, timeout_s=120))
        startup.done()
        hosts = startup.hosts
    cfg = harness.llama(layers, width)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), OptimConfig(lr=1e-4, clip_norm=1.0),
                          StreamConfig(keep_every=1), StoreConfig(), hosts=hosts)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, (1, BATCH, SEQ), dtype=np.int32) for _ in range(steps + 1)]
    engine.step(batches[0])  # compiles
    sent0 = dict(hosts.sent) if hosts else {}
    start = time.perf_counter()
    for b in batches[1:]:
        engine.step(b)
    seconds = time.perf_counter() - start
    held = sum(engine.tiers.by_kind[kind].nbytes(kind) for kind in ("master", "opt"))
    sent = {k: (v - sent0[k]) // steps for k, v in hosts.sent.items()} if hosts else {}
    described = collective_bytes(cfg, count)._asdict()
    engine.close()
    harness.report(tokens_per_s=steps * BATCH * SEQ / seconds, peak_rss=harness.peak_rss(), held=held,
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
    ap.add_argument("--doc", action="store_true", help="also write the section of docs/benchmarks.md")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*(int(x) for x in args.child))
        return
    rows = []
    for count in (1, 2):
        results = _run(count, args)
        r = results[0]
        mib = 2**20
        sent = sum(r["sent"].values()) if r["sent"] else 0
        rows.append(f"| {count} | {sum(x['tokens_per_s'] for x in results[:1]):,.0f} | "
                    f"{max(x['peak_rss'] for x in results) / mib:,.0f} | {r['held'] / mib:,.1f} | "
                    f"{r['sent'].get('reduce_scatter', 0) / mib:,.2f} + {r['sent'].get('all_gather', 0) / mib:,.2f} | "
                    f"{r['described']['reduce_scatter'] / mib:,.2f} + {r['described']['all_gather'] / mib:,.2f} | "
                    f"{'equal' if sent == r['described']['reduce_scatter'] + r['described']['all_gather'] else 'DIFFER'} |")
    body = (f"{rows and results[0]['params'] / 1e6:.1f}M parameters, batch {BATCH} x seq {SEQ}, "
            f"all state in RAM, the same global batch; two processes on one 2-core machine share its cores.\n\n"
            "| processes | tokens/s | peak RSS per process (MiB) | master + opt per process (MiB) | "
            "sent per step and process, RS + AG (MiB) | described (MiB) | |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    harness.publish("multiprocess", "One process against two (experiments/bench/multiprocess.py)", body,
                    f"experiments/bench/multiprocess.py --layers {args.layers} --width {args.width} --steps {args.steps}",
                    write=args.doc)


if __name__ == "__main__":
    main()
