"""What the benchmarks under experiments/bench/ share: the model they build, child
processes, peak memory, the page cache, timing, and their sections of docs/benchmarks.md.

A script imports this module before jax or mtjax: importing it puts the checkout on
sys.path and defaults JAX to the CPU backend.

    python experiments/bench/harness.py section NAME FILE   # FILE's text as section NAME of docs/benchmarks.md
    python experiments/bench/harness.py evict DIR SECONDS   # drop DIR's pages from the cache until SIGTERM
"""

from __future__ import annotations

import json
import os
import platform
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nMeasured numbers, each section written by the script it names.\n"

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mtjax.model_config import ModelConfig  # noqa: E402  (imports no jax)


def llama(layers: int, width: int, *, vocab: int = 8192, ffn: int | None = None, head_dim: int = 64,
          dtype: str = "float32", **fields) -> ModelConfig:
    """A Llama of `layers` blocks: as many heads of `head_dim` as the width holds (one at
    least), as many K/V heads, SwiGLU `ffn` wide (2.75 x width unless given)."""
    head_dim = min(head_dim, width)
    heads = max(width // head_dim, 1)
    return ModelConfig(vocab_size=vocab, hidden_size=width, intermediate_size=ffn or int(width * 2.75),
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       head_dim=head_dim, compute_dtype=dtype, **fields)



def shape_options(ap, *, steps_help: str, **defaults) -> None:
    """Add to `ap` the model-shape and run-length options a benchmark takes, in this
    order: --layers --width --seq --batch --vocab --steps, each an int with the default
    given; an option left out of `defaults` is not added."""
    for name in ("layers", "width", "seq", "batch", "vocab", "steps"):
        if name in defaults:
            ap.add_argument(f"--{name}", type=int, default=defaults[name],
                            help=steps_help if name == "steps" else None)

# --- child processes ---------------------------------------------------------------------------


def run_child(script: str | Path, mode: str, *args: str, show_stderr: bool = False) -> dict:
    """Run `script --child MODE ARGS` in a fresh interpreter (each measurement in a
    process of its own) and return the JSON object on the last line of its stdout ({}
    when it prints none). A failed child ends the benchmark with its stderr's tail;
    `show_stderr` lets the child's stderr through as it runs instead."""
    cmd = [sys.executable, str(script), "--child", mode, *args]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if show_stderr else subprocess.PIPE, text=True)
    if out.returncode:
        sys.exit(f"{Path(script).name} --child {mode} {' '.join(args)} failed (exit {out.returncode})"
                 + (f":\n{out.stderr[-3000:]}" if out.stderr else ""))
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def report(**record) -> None:
    """A child's result: one JSON line on stdout, what `run_child` returns."""
    print(json.dumps(record), flush=True)


# --- peak memory -------------------------------------------------------------------------------


def cpu_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it, for a benchmark's text."""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "an unnamed CPU"


def peak_rss() -> int:
    """This process's peak resident set in bytes: VmHWM of /proc/self/status (Linux).

    Not ru_maxrss: Linux carries the peak of the image a process was exec'd from into it,
    and `subprocess` starts children with vfork, so a child of a large parent reported at
    least the parent's RSS (a 1,077 MiB training child read as 1,223 MiB after the parent
    had run the planner's probe).
    """
    return _status_bytes("VmHWM")


def vm_rss() -> int:
    """This process's resident set now, in bytes: VmRSS of /proc/self/status (Linux)."""
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def reset_peak_rss() -> None:
    """Start `peak_rss` again from the current resident set (Linux's clear_refs 5), so a
    measurement taken between two timed phases does not count as their peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_of(python_args: list[str]) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of `python -m MODULE ...` or `python -c CODE` in a
    fresh process that reports its own VmHWM as it exits (see `peak_rss`)."""
    with tempfile.NamedTemporaryFile("r", suffix=".peak") as peak:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "measure", peak.name, *python_args], cwd=ROOT,
                           stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t
        if r.returncode:
            sys.exit(f"{' '.join(python_args)} failed (exit {r.returncode})")
        return int(Path(peak.name).read_text()), seconds


def _measure(peak_file: str, how: str, what: str, *args: str) -> None:
    """Run a module (`-m`) or code (`-c`) as `python` would, then write this process's peak RSS."""
    try:
        if how == "-m":
            sys.argv = [what, *args]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif how == "-c":
            sys.argv = ["-c", *args]
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
        else:
            raise SystemExit(f"measure takes -m MODULE or -c CODE, not {how}")
    finally:
        Path(peak_file).write_text(str(peak_rss()))


# --- the page cache ----------------------------------------------------------------------------


def drop_page_cache(root: Path, sync: bool = False) -> None:
    """Evict every file under `root` from the page cache, as a store larger than RAM would
    be; `sync` first makes each file durable (dirty pages cannot be dropped). Files that
    vanish meanwhile (a deferred update renaming chunks) are skipped."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                if sync:
                    os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def evict_until_stopped(root: Path, every: float) -> None:
    """Drop `root`'s pages every `every` seconds (or 4x a sweep's time, when longer) at
    nice 10 until SIGTERM, then print the seconds the sweeps took (`harness.py evict`)."""
    os.nice(10)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    busy, wait = 0.0, every
    while not stop.wait(wait):
        t = time.perf_counter()
        drop_page_cache(root)
        took = time.perf_counter() - t
        busy, wait = busy + took, max(every, 4 * took)
    print(busy, flush=True)


# --- timing --------------------------------------------------------------------------------------


def best_seconds(fn, reps: int, warmup: int = 0) -> float:
    """The fastest of `reps` timed calls after `warmup` untimed ones; `fn` must return only
    when its work is done."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def alternating_times(steps: dict, inputs: list) -> dict:
    """Each of `steps` (name -> a function of one input that returns only when its work is
    done) called on every input in turn, so that drift in the machine's load hits them
    alike: name -> seconds of each call on `inputs[1:]` (the first call of each compiles),
    round by round."""
    times = {name: [] for name in steps}
    for i, x in enumerate(inputs):
        for name, step in steps.items():
            t = time.perf_counter()
            step(x)
            if i:
                times[name].append(time.perf_counter() - t)
    return times


def alternating_medians(steps: dict, inputs: list) -> dict:
    """`alternating_times`' median per step: name -> seconds."""
    return {name: statistics.median(ts) for name, ts in alternating_times(steps, inputs).items()}


# --- docs/benchmarks.md ------------------------------------------------------------------------


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace the section `name` (between its two markers), or append it; others stay."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def publish(name: str, title: str, body: str, command: str, write: bool = True) -> None:
    """Print a benchmark's section, `## title`, `body`, then the command that reproduces it
    (`command`: what follows `.venv/bin/python`), and unless told not to (`--no-doc`) write
    it to docs/benchmarks.md."""
    section = f"## {title}\n\n{body.strip()}\n\nCommand: `.venv/bin/python {command}`"
    print(section)
    if write:
        write_section(name, section)
        print(f"\nwrote section {name} of {DOC.relative_to(ROOT)}")


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "section":
        write_section(argv[1], Path(argv[2]).read_text())
        print(f"wrote section {argv[1]} of {DOC.relative_to(ROOT)}")
    elif len(argv) == 3 and argv[0] == "evict":
        evict_until_stopped(Path(argv[1]), float(argv[2]))
    elif len(argv) >= 3 and argv[0] == "measure":
        _measure(*argv[1:])
    else:
        sys.exit("usage: python experiments/bench/harness.py section NAME FILE")


if __name__ == "__main__":
    main(sys.argv[1:])
