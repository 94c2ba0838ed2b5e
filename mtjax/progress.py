"""What a training run shows and records: a progress bar or log lines, and metrics.jsonl.

On a terminal a live tqdm bar carries step, loss, learning rate, gradient norm, tokens/s,
MFU, host RSS and ETA; elsewhere (CI, pipes, files, or a terminal that reports zero
columns) one plain line with the same fields is printed every `log_every` steps, with no
carriage returns. Every step's metrics (plus host RSS, device memory where the backend
reports it, MFU against a named peak, and per-stage seconds when the engine records them)
are appended to <run dir>/metrics.jsonl, one JSON object per line, and go to TensorBoard
(run.tensorboard) and Weights & Biases (run.wandb, mtjax.wandb_log) too. tokens/s (and MFU) is
the rate over the last `RATE_WINDOW` steps, the first step excluded (it pays compilation),
of the tokens the steps trained on (mtjax.documents.trained_tokens: every token of plain
text windows; only the counted targets of chat data, not the prompts and padding it masks).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path
from typing import TextIO

import psutil
from tqdm import tqdm

from mtjax import terminal, writable
from mtjax.errors import MissingPackage
from mtjax.plan import hardware

GiB = 2**30
RATE_WINDOW = 10  # steps over which tokens/s is measured


class Progress:
    def __init__(self, run_dir: Path, total_steps: int, tokens_per_step: int, log_every: int = 10,
                 first_step: int = 0, stream: TextIO | None = None, tensorboard: bool = False,
                 flops_per_token: float | None = None, peak_flops: float | None = None, wandb=None,
                 clock=time.perf_counter):
        self.stream = stream or sys.stderr
        self._clock = clock  # seconds, read once here and once a step (a test gives its own)
        self.total, self.tokens_per_step, self.log_every = total_steps, tokens_per_step, log_every
        self.step = first_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self._process = psutil.Process()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._tb = _tensorboard_writer(run_dir) if tensorboard else None
        self._wandb = wandb  # a mtjax.wandb_log.Logger, or None
        self._metrics = open(Path(run_dir) / "metrics.jsonl", "a")
        self._live = terminal.columns(self.stream) > 0
        self._bar = tqdm(total=total_steps, initial=first_step, file=self.stream, unit="step",
                         dynamic_ncols=True) if self._live else None
        self._start = self._clock()
        # (step, time, tokens trained until then) of the last steps; the first entry is the
        # end of the first step, which pays compilation, so rates start from there.
        self._recent = collections.deque(maxlen=RATE_WINDOW + 1)
        self._tokens = 0

    def update(self, step: int, metrics: dict, tokens: int | None = None) -> None:
        """Record the metrics of finished step `step` (1-based), which trained on `tokens`
        (default: tokens_per_step), and refresh the display."""
        now = self._clock()
        self._tokens += self.tokens_per_step if tokens is None else tokens
        self._recent.append((step, now, self._tokens))
        first, then, before = self._recent[0]
        rate = (step - first) / (now - then) if step > first else 0.0  # steps/s over the window
        record = {"step": step, **metrics, "time_s": round(now - self._start, 3)}
        if rate:
            record["tokens_per_s"] = round((self._tokens - before) / (now - then), 1)
            record["rate_steps"] = step - first  # the steps that rate is measured over
            if self.flops_per_token and self.peak_flops:
                record["mfu"] = round(record["tokens_per_s"] * self.flops_per_token / self.peak_flops, 4)
        record["rss_gib"] = round(self._process.memory_info().rss / GiB, 3)
        device_bytes = device_memory_in_use()
        if device_bytes is not None:
            record["device_mem_gib"] = round(device_bytes / GiB, 3)
        self._write(record)
        self.step = step
        eta = (self.total - step) / rate if rate else None
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(self._summary(metrics, record), refresh=False)
            self._bar.refresh()
        elif step % self.log_every == 0 or step == self.total:
            eta_text = f"  eta {_duration(eta)}" if eta is not None else ""
            self.print(f"step {step:>6}/{self.total}  {self._summary(metrics, record)}{eta_text}")

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
        if self._wandb is not None:
            self._wandb.close()
        self._metrics.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write(self, record: dict) -> None:
        with writable.writing(self._metrics.name):  # a full disk's OSError names the file
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()  # the file stays readable (plots, tail -f) while training runs
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(record)

    @staticmethod
    def _summary(metrics: dict, record: dict) -> str:
        parts = [f"loss {metrics['loss']:.4f}"]
        if "aux_loss" in metrics:  # a MoE model's load-balancing loss (in "loss" times its coefficient)
            parts.append(f"aux {metrics['aux_loss']:.4f}")
        if "lr" in metrics:
            parts.append(f"lr {metrics['lr']:.3g}")
        if "grad_norm" in metrics:
            parts.append(f"gnorm {metrics['grad_norm']:.3f}")
        if record.get("tokens_per_s"):
            n = record["rate_steps"]
            parts.append(f"{record['tokens_per_s']:,.0f} tok/s over {f'{n} steps' if n > 1 else 'the last step'}")
        if "mfu" in record:
            parts.append(f"mfu {record['mfu']:.2%}")
        if "disk_read_gbps" in metrics:
            parts.append(f"disk r {metrics['disk_read_gbps']:.2f} w {metrics['disk_write_gbps']:.2f} GB/s")
        parts.append(f"rss {record['rss_gib']:.2f}G")
        if "device_mem_gib" in record:
            parts.append(f"dev {record['device_mem_gib']:.2f}G")
        return "  ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


# Built-in hardware profiles by the device kind JAX reports (substring, lower case).
_PROFILE_BY_KIND = (("gh200", "gh200"), ("h200", "h200"), ("h100", "h100-pcie5"), ("a100", "a100-80gb-pcie4"))


def peak_flops(device, dtype: str, profile: str | None = None) -> tuple[float | None, str]:
    """(peak matmul FLOP/s, where it comes from) for MFU on `device` in `dtype`.

    `profile` names a built-in profile or a `mtjax probe` JSON; else the built-in
    profile matching the device kind is used (cpu-2core for the CPU backend), else None.
    """
    if profile is None:
        kind = getattr(device, "device_kind", "").lower()
        if device.platform == "cpu":
            profile = "cpu-2core"
        else:
            profile = next((name for key, name in _PROFILE_BY_KIND if key in kind), None)
    if profile is None:
        return None, f"no hardware profile for {getattr(device, 'device_kind', device.platform)}: MFU not shown"
    hw = hardware.load(profile)
    peak = hw.matmul_flops_fp32 if dtype == "float32" else hw.matmul_flops_bf16
    return peak, f"MFU against {peak / 1e12:.3g} TFLOP/s {dtype} ({hw.name}, {hw.source})"


def device_memory_in_use() -> int | None:
    """Bytes in use on the first device, where the backend reports it (not on CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_in_use")


def require_tensorboard():
    """tensorboardX's EventsWriter, or one line saying how to install it (a run checks before it starts)."""
    try:
        import tensorboardX  # noqa: F401  an extra (mtjax[tensorboard]): the maintained writer
        from tensorboardX.event_file_writer import EventsWriter
    except ImportError:
        raise MissingPackage("run.tensorboard", "tensorboardX", "tensorboard") from None
    return EventsWriter


def _tensorboard_writer(run_dir: Path):
    return _Events(Path(run_dir) / "tensorboard", require_tensorboard())


class _Events:
    """TensorBoard scalars written by the step that records them. (tensorboardX's
    SummaryWriter writes from a thread that dies on a full disk, printing a traceback, and
    its close() then waits forever; here a full or read-only disk is an OSError naming
    the event file.)"""

    def __init__(self, directory: Path, writer_class):
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        self._event, self._scalar = Event, scalar
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory
        with writable.writing(directory):
            self._writer = writer_class(str(directory / "events"))
        self.path = Path(getattr(self._writer, "_file_name", directory))  # its name, for messages

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        with writable.writing(self.path):
            self._writer.write_event(self._event(wall_time=time.time(), step=step, summary=self._scalar(tag, value)))
            self._writer.flush()

    def close(self) -> None:
        with writable.writing(self.path):
            self._writer.close()
