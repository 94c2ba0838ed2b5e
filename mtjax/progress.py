"""What a training run shows and records: a progress bar or log lines, and metrics.jsonl.

On a terminal a live tqdm bar carries step, loss, tokens/s and ETA; elsewhere (CI,
pipes, files) one plain line is printed every `log_every` steps. Every step's metrics
are appended to <run dir>/metrics.jsonl, one JSON object per line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

from tqdm import tqdm


class Progress:
    def __init__(self, run_dir: Path, total_steps: int, tokens_per_step: int, log_every: int = 10,
                 first_step: int = 0, stream: TextIO | None = None, tensorboard: bool = False):
        self.stream = stream or sys.stderr
        self.total, self.tokens_per_step, self.log_every = total_steps, tokens_per_step, log_every
        self.step = first_step
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._tb = _tensorboard_writer(run_dir) if tensorboard else None
        self._metrics = open(Path(run_dir) / "metrics.jsonl", "a")
        self._live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = tqdm(total=total_steps, initial=first_step, file=self.stream, unit="step",
                         dynamic_ncols=True) if self._live else None
        self._start = time.perf_counter()
        self._timed_from = first_step  # the first step pays compilation: rates exclude it
        self._timed_start = None

    def update(self, step: int, metrics: dict) -> None:
        """Record the metrics of finished step `step` (1-based) and refresh the display."""
        now = time.perf_counter()
        if self._timed_start is None:
            self._timed_start, self._timed_from = now, step
        timed = step - self._timed_from
        rate = timed / (now - self._timed_start) if timed else 0.0
        record = {"step": step, **metrics, "time_s": round(now - self._start, 3)}
        if rate:
            record["tokens_per_s"] = round(rate * self.tokens_per_step, 1)
        self._write(record)
        self.step = step
        eta = (self.total - step) / rate if rate else None
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(self._summary(metrics, record.get("tokens_per_s")), refresh=False)
            self._bar.refresh()
        elif step % self.log_every == 0 or step == self.total:
            eta_text = f"  eta {_duration(eta)}" if eta is not None else ""
            self.print(f"step {step:>6}/{self.total}  {self._summary(metrics, record.get('tokens_per_s'))}{eta_text}")

    def record(self, step: int, metrics: dict) -> None:
        """Record non-step metrics (e.g. a validation loss) and print them as a line."""
        self._write({"step": step, **metrics})
        self.print(f"step {step:>6}/{self.total}  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._metrics.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write(self, record: dict) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()  # the file stays readable (plots, tail -f) while training runs
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    @staticmethod
    def _summary(metrics: dict, tokens_per_s: float | None) -> str:
        parts = [f"loss {metrics['loss']:.4f}"]
        if "grad_norm" in metrics:
            parts.append(f"gnorm {metrics['grad_norm']:.3f}")
        if tokens_per_s:
            parts.append(f"{tokens_per_s:,.0f} tok/s")
        return "  ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


def _tensorboard_writer(run_dir: Path):
    from mtjax.config import ConfigError

    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("run.tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(str(Path(run_dir) / "tensorboard"))
