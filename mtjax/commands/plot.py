"""`mtjax plot RUN_DIR...`: training and validation loss curves of runs, as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from mtjax.errors import MtjaxError


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="plot the loss curves of runs to a PNG", description=__doc__)
    p.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", default="loss.png", help="output image (default: loss.png)")
    p.set_defaults(func=run)


def read_metrics(run_dir: str | Path) -> list[dict]:
    file = Path(run_dir) / "metrics.jsonl"
    if not file.exists():
        raise MtjaxError(f"{run_dir} has no metrics.jsonl; pass a run directory such as runs/default")
    records = []
    for line in file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a run killed mid-write leaves a partial last line
    return records


def run(args) -> int:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run_dir in args.runs:
        records = read_metrics(run_dir)
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        name = Path(run_dir).name
        if train:
            line, = ax.plot(*zip(*train), label=f"{name} train", linewidth=1)
            if val:
                ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0
