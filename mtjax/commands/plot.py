"""`mtjax plot RUN_DIR...`: charts of runs in one PNG: training and validation loss,
throughput (tokens/s), host memory (RSS) and the time of each stage per step (streaming
runs record it; panels without data say so)."""

from __future__ import annotations

import json
from pathlib import Path

from mtjax.errors import MtjaxError


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="plot loss, throughput, memory and stage times of runs to a PNG", description=__doc__)
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
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    loss_ax, speed_ax, memory_ax, stage_ax = axes.flat
    for run_dir in args.runs:
        records = read_metrics(run_dir)
        name = Path(run_dir).name
        train = _series(records, "loss")
        if train:
            line, = loss_ax.plot(*zip(*train), label=f"{name} train", linewidth=1)
            val = _series(records, "val_loss")
            if val:
                loss_ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{name} validation")
        _plot(speed_ax, _series(records, "tokens_per_s"), name)
        _plot(memory_ax, _series(records, "rss_gib"), f"{name} host RSS")
        _plot(memory_ax, _series(records, "device_mem_gib"), f"{name} device")
        stages = sorted({k for r in records for k in r if k.startswith("stage_") and k.endswith("_s")})
        for key in stages:
            _plot(stage_ax, _series(records, key), f"{name} {key[6:-2]}")
    for ax, ylabel, title in [(loss_ax, "loss (nats/token)", "loss"), (speed_ax, "tokens/s", "throughput"),
                              (memory_ax, "GiB", "memory"), (stage_ax, "seconds", "stage time per step")]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def _plot(ax, series: list[tuple[int, float]], label: str) -> None:
    if series:
        ax.plot(*zip(*series), label=label, linewidth=1)
