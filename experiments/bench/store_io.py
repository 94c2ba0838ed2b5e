"""Layer-store read and write throughput against plain sequential file I/O of the same bytes.

    .venv/bin/python experiments/bench/store_io.py [--layers 4] [--reps 3] [--dir /tmp] [--no-doc]

A Llama-shaped model's fp32 master weights (one array per leaf, ~1.3 GB at the default
size) are written and read back in one run, alternating plain and store rounds:

  plain  one file per leaf: write + fsync; read with `readinto` a preallocated buffer
  store  store.write of every part (futures in flight together) + commit; store.read
         of every part into preallocated, pre-touched buffers

The page cache is dropped before every read (fsync, then posix_fadvise(DONTNEED) on
every file), so reads come from the disk. Writes count their fsyncs. The table goes
to stdout and to this benchmark's section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import numpy as np

import mtjax.store
from mtjax.hostmem import aligned_empty
from mtjax.model_config import ModelConfig
from mtjax.store import layout

SECTION = "store-io"


def plain_round(root: Path, data: dict, bufs: dict) -> tuple[float, float]:
    root.mkdir()
    t = time.perf_counter()
    for (part, leaf), array in data.items():
        with open(root / f"{part}.{leaf}", "wb", buffering=0) as f:
            f.write(memoryview(array).cast("B"))
            os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    harness.drop_page_cache(root, sync=True)
    t = time.perf_counter()
    for (part, leaf), array in bufs.items():
        with open(root / f"{part}.{leaf}", "rb", buffering=0) as f:
            f.readinto(memoryview(array).cast("B"))
    read_s = time.perf_counter() - t
    shutil.rmtree(root)
    return write_s, read_s


def store_round(root: Path, cfg: ModelConfig, data: dict, bufs: dict) -> tuple[float, float]:
    store = mtjax.store.create(root, cfg)
    by_part = {p: {leaf: a for (q, leaf), a in data.items() if q == p} for p in store.parts}
    out = {p: {leaf: a for (q, leaf), a in bufs.items() if q == p} for p in store.parts}
    t = time.perf_counter()
    futures = [store.write(p, "master", arrays) for p, arrays in by_part.items()]
    for f in futures:
        f.result()
    store.commit(1)
    write_s = time.perf_counter() - t
    store.close()
    harness.drop_page_cache(root, sync=True)
    store = mtjax.store.open(root)
    t = time.perf_counter()
    futures = [store.read(p, "master", out=out[p]) for p in store.parts]
    for f in futures:
        f.result()
    read_s = time.perf_counter() - t
    store.close()
    shutil.rmtree(root)
    return write_s, read_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="blocks of a d_model 2048 Llama (each 205 MB in fp32)")
    ap.add_argument("--reps", type=int, default=3, help="alternating plain/store rounds")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()

    cfg = harness.llama(args.layers, 2048, vocab=32000, ffn=5632, head_dim=128)
    base = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    probe = mtjax.store.create(base / "probe", cfg)
    schema = {(p, leaf): s for p in probe.parts for leaf, s in probe.schema(p, "master").items()}
    probe.close()
    shutil.rmtree(base / "probe")
    rng = np.random.default_rng(0)
    data = {k: aligned_empty(s.shape, s.dtype) for k, s in schema.items()}
    for a in data.values():
        a[...] = rng.random(a.shape, np.float32)
    bufs = {k: aligned_empty(s.shape, s.dtype) for k, s in schema.items()}
    total = sum(a.nbytes for a in data.values())
    print(f"{len(data)} arrays, {total / 1e9:.2f} GB per round, chunks of {layout.CHUNK_BYTES >> 20} MiB, dir {base}")

    rows = []
    try:
        for rep in range(args.reps):
            pw, pr = plain_round(base / f"plain{rep}", data, bufs)
            sw, sr = store_round(base / f"store{rep}", cfg, data, bufs)
            for (k, src) in data.items():
                assert bufs[k].tobytes() == src.tobytes(), f"store read back wrong bytes for {k}"
            rows.append((pw, pr, sw, sr))
            print(f"round {rep}: write plain {total / pw / 1e9:.2f} GB/s store {total / sw / 1e9:.2f} GB/s "
                  f"({pw / sw:.0%}); read plain {total / pr / 1e9:.2f} store {total / sr / 1e9:.2f} ({pr / sr:.0%})")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = [statistics.median(col) for col in zip(*rows)]
    ratio_w = statistics.median(r[0] / r[2] for r in rows)
    ratio_r = statistics.median(r[1] / r[3] for r in rows)
    table = (
        "| direction | plain GB/s | store GB/s | store / plain |\n|---|---|---|---|\n"
        f"| write (+fsync, commit) | {total / med[0] / 1e9:.2f} | {total / med[2] / 1e9:.2f} | {ratio_w:.0%} |\n"
        f"| read, cold cache | {total / med[1] / 1e9:.2f} | {total / med[3] / 1e9:.2f} | {ratio_r:.0%} |\n"
    )
    body = (
        f"fp32 master weights of a d_model 2048 Llama with {args.layers} blocks: {len(data)} arrays, "
        f"{total / 1e9:.2f} GB per round, {layout.CHUNK_BYTES >> 20} MiB zarr3 chunks with crc32c; "
        f"median of {args.reps} alternating rounds in one run on a shared 2-core machine (load average "
        f"{os.getloadavg()[0]:.1f} at the end: absolute GB/s are low and noisy, compare the ratios); reads after fsync + "
        "posix_fadvise(DONTNEED) of every file (cold page cache). Plain = one file per array, "
        "`write` + fsync, `readinto` a preallocated buffer. Ratios are per round, then the median.\n\n"
        + table
    )
    harness.publish(SECTION, "Layer store I/O (experiments/bench/store_io.py)", body,
                    f"experiments/bench/store_io.py --layers {args.layers} --reps {args.reps}", write=not args.no_doc)


if __name__ == "__main__":
    main()
