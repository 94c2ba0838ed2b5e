"""`mtjax plot RUN_DIR...`: charts of runs in one image: training and validation loss, the
learning rate, the gradient norm, throughput (tokens/s over recent steps), memory (host
RSS, device; from zero) and the time of each stage per step (streaming runs record it;
panels without data say so). Written into the first run directory unless --out names
another file; the extension picks the format (png, pdf, svg, ...)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from mtjax import textfile
from mtjax.errors import MissingPackage, MtjaxError

DEFAULT_NAME = "charts.png"  # in the first run directory

# (metrics.jsonl key, y label, title) of the panels that plot one series per run.
_PANELS = (("lr", "learning rate", "learning rate"), ("grad_norm", "global norm (before clipping)", "gradient norm"),
           ("tokens_per_s", "tokens/s", "throughput"))


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="plot loss, learning rate, gradient norm, throughput, memory and stage "
                              "times of runs", description=__doc__)
    p.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", help=f"output image (default: RUN_DIR/{DEFAULT_NAME} of the first run)")
    p.set_defaults(func=run)


def read_metrics(run_dir: str | Path) -> list[dict]:
    file = Path(run_dir) / "metrics.jsonl"
    if not file.exists():
        raise MtjaxError(f"{run_dir} has no metrics.jsonl; pass a run directory such as runs/default")
    records = []
    for line in textfile.read(file).splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a run killed mid-write leaves a partial last line
    return records


def run(args) -> int:
    out = Path(args.out) if args.out else Path(args.runs[0]) / DEFAULT_NAME
    runs = {run_dir: read_metrics(run_dir) for run_dir in args.runs}
    fig = figure(runs)
    _check_format(fig, out)
    save(fig, out)
    print(f"wrote {out}")
    return 0


def figure(runs: dict):
    """The charts of `runs` ({run dir: its metrics.jsonl records}) as a matplotlib Figure."""
    try:  # an extra (mtjax[plot]): only this command draws
        from matplotlib.figure import Figure  # no pyplot: files only, no display
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise MissingPackage("drawing charts", "matplotlib", "plot") from None

    fig = Figure(figsize=(13, 10), layout="constrained")
    axes = fig.subplots(3, 2)
    loss_ax, lr_ax, gnorm_ax, speed_ax, memory_ax, stage_ax = axes.flat
    for run_dir, records in runs.items():
        name = Path(run_dir).name
        train = _series(records, "loss")
        if train:
            line, = loss_ax.plot(*zip(*train), label=f"{name} train", linewidth=1)
            val = _series(records, "val_loss")
            if val:
                loss_ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{name} validation")
        for ax, (key, _, _) in zip((lr_ax, gnorm_ax, speed_ax), _PANELS):
            _plot(ax, _series(records, key), name)
        _plot(memory_ax, _series(records, "rss_gib"), f"{name} host RSS")
        _plot(memory_ax, _series(records, "device_mem_gib"), f"{name} device")
        stages = sorted({k for r in records for k in r if k.startswith("stage_") and k.endswith("_s")})
        for key in stages:
            _plot(stage_ax, _series(records, key), f"{name} {key[6:-2]}")
    series_labels = [(ax, y, t) for ax, (_, y, t) in zip((lr_ax, gnorm_ax, speed_ax), _PANELS)]
    labels = [(loss_ax, "loss (nats/token)", "loss"), *series_labels, (memory_ax, "GiB", "memory"),
              (stage_ax, "seconds", "stage time per step")]
    for ax, ylabel, title in labels:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            # Beside the plot, not on it: the legend never hides a line.
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    memory_ax.set_ylim(bottom=0)  # memory in use is read against none at all
    speed_ax.set_ylim(bottom=0)
    return fig


def _check_format(fig, out: Path) -> None:
    formats = fig.canvas.get_supported_filetypes()
    ext = out.suffix.lower().lstrip(".")
    if ext not in formats:
        what = f"matplotlib writes no .{ext} images" if ext else "the name has no extension to pick the format by"
        raise MtjaxError(f"--out {out}: {what}; end it in one of {', '.join('.' + f for f in sorted(formats))}")


def save(fig, out: Path) -> None:
    """Write `fig` to `out` whole or not at all (a temporary file renamed into place)."""
    if out.parent.exists() and not out.parent.is_dir():
        raise MtjaxError(f"--out {out}: {out.parent} is a file, not a directory; choose another --out")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=120, format=out.suffix.lower().lstrip("."))
        os.replace(tmp, out)
    except OSError as e:
        with contextlib.suppress(OSError):  # nothing there to remove, or nowhere to remove it from
            tmp.unlink()  # a partial image (a full disk) is not left behind
        raise MtjaxError(f"cannot write {out} ({e.strerror or e}); choose another --out") from None


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def _plot(ax, series: list[tuple[int, float]], label: str) -> None:
    if series:
        ax.plot(*zip(*series), label=label, linewidth=1)
