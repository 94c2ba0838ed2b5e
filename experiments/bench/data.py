"""Data pipeline throughput: tokenizing into shards, and the loader against a plain slice.

    .venv/bin/python experiments/bench/data.py [--mb 8] [--reps 3] [--no-doc]

prepare: the shipped Shakespeare slice repeated to --mb MB of text, tokenized with each
tokenizer (bpe:8192 includes training the BPE on that text); MB of input text per second.
loader: random [accum 1, batch 8, seq 2048] batches from the prepared byte dataset,
against the floor of the same number of contiguous numpy slices of one in-memory array.
The table goes to stdout and to this benchmark's section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import numpy as np

from mtjax.data import Dataset, Loader, prepare

SECTION = "data"
ROOT = harness.ROOT
QWEN2 = ROOT / "tests" / "data" / "qwen2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="MB of input text")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    corpus = gzip.open(ROOT / "mtjax" / "assets" / "shakespeare.txt.gz").read().decode()
    copies = max(1, int(args.mb * 1e6 / len(corpus.encode())))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        src = Path(tmp) / "input.txt"
        src.write_text(corpus * copies)
        mb = src.stat().st_size / 1e6
        for spec in ("bytes", "bpe:8192", str(QWEN2)):
            out = Path(tmp) / "ds"
            seconds = harness.best_seconds(lambda: prepare([src], out, spec, overwrite=True), args.reps)
            tokens = Dataset(out).meta["num_tokens"]
            name = "qwen2 tokenizer.json" if spec == str(QWEN2) else spec
            rows.append((f"prepare, {name}", f"{mb / seconds:.1f} MB/s", f"{tokens / seconds / 1e6:.2f} M tokens/s"))
        prepare([src], Path(tmp) / "bytes", "bytes", overwrite=True)
        ds = Dataset(Path(tmp) / "bytes")
        batches = 50
        loader = Loader(ds, "train", 2048, 8, 1, seed=0)
        t_loader = harness.best_seconds(lambda: [loader.next() for _ in range(batches)], args.reps)
        flat = ds.tokens(*ds.split("train"))
        starts = np.random.default_rng(0).integers(0, flat.size - 2048, (batches, 8))
        t_floor = harness.best_seconds(lambda: [np.stack([flat[s:s + 2048] for s in row]) for row in starts], args.reps)
        n = batches * 8 * 2048
        rows.append(("loader, [1, 8, 2048] batches", f"{n / t_loader / 1e6:.0f} M tokens/s",
                     f"{t_loader / t_floor:.1f}x the in-memory slice floor ({n / t_floor / 1e6:.0f} M tokens/s)"))
    lines = ["| what | throughput | also |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "The default run consumes ~2-4 thousand tokens/s on 2 CPU cores, so neither preparing nor "
                  "loading is on its critical path."]
    harness.publish(SECTION, f"Data pipeline ({mb:.1f} MB of text; `experiments/bench/data.py`, best of {args.reps})",
                    "\n".join(lines), f"experiments/bench/data.py --mb {args.mb:g} --reps {args.reps}", write=not args.no_doc)


if __name__ == "__main__":
    main()
