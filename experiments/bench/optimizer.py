"""mtjax's per-part CPU AdamW update against torch.optim.AdamW(fused=True).

One part of ~113M fp32 parameters (a Llama block with hidden 3072, SwiGLU 8192) is
updated by the engine's own optimizer stage, `mtjax.stream.update.PartUpdate`, on RAM-tier
state (row-chunked, in place, writing the bf16 compute copy too), by the same class
limited to whole-part programs (the previous path), and by torch's fused CPU AdamW on the
same shapes, steps interleaved so machine load hits all of them alike. The table gives
ns/param, the mtjax/torch ratio, and the time expressed as bytes/param at the copy
bandwidth measured in the same run, against the memory-bandwidth bound of 28 bytes/param
(read master, mu, nu, grad; write master, mu, nu). Writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/optimizer.py [--steps 10] [--chunk-mib 4] [--sweep 1,16] [--no-write]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtjax import parts  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.optim import OptimConfig, make_optimizer  # noqa: E402
from mtjax.stream.update import PartUpdate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
from benchdoc import DOC, write_section  # noqa: E402

SECTION = "optimizer-update"
HEADING = "## Optimizer update: mtjax vs torch fused AdamW (experiments/bench/optimizer.py)"
BOUND_BYTES = 28  # fp32 AdamW: read master, mu, nu, grad; write master, mu, nu
CFG = ModelConfig(vocab_size=256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=1,
                  num_attention_heads=24, num_key_value_heads=24, head_dim=128, compute_dtype="bfloat16")
OPT = OptimConfig(lr=1e-4, schedule="constant", weight_decay=0.1)


NOTES = """\
Why chunks: XLA's CPU backend has no multi-output fusion, so one AdamW program over whole
leaves compiles to four passes over memory: mu (read mu, grad; write mu), nu (read nu,
grad; write nu), master (read master, new mu, new nu; write master) and the bf16 copy (read
master; write bf16): 32 bytes read + 14 written = 46 bytes/param, against 28 for torch's
single fused loop (30 with the copy). `PartUpdate` therefore calls the same jitted optax
program once per row chunk of each leaf (16 MiB of fp32 by default), so that the four
passes over a chunk can hit cache and memory sees about one. The RAM tier holds master weights and AdamW
moments as `RowChunks` (one XLA buffer per chunk), donated to the chunk's program so it
runs in place; the program also writes its rows of the leaf's whole bf16 compute copy (an
update-slice of the donated copy, done on uint16 words because XLA's CPU backend widens a
bf16 update-slice to fp32 over the whole array). All chunk programs are dispatched with no
host sync. Chunking is used only for transformations that are elementwise per leaf, which
`mtjax.stream.elementwise` checks on the traced program (AdamW, SGD, Lion are; global-norm
clipping inside the transformation, Adafactor or added noise are not, and run as one
whole-part program, as does disk-tier state). Results equal the whole-leaf program within
fp32 rounding (tests/test_update.py). Tried and dropped: copying each chunk's results back
into whole numpy-backed leaves (the copies and per-chunk syncs cost more than the passes
they save: 2.4x torch); donating zero-copy numpy views (XLA never writes a donated foreign
buffer in place, it allocates a new output); a `fori_loop` over chunks inside one program
(3-160x slower under the thunk runtime); fewer divisions (bias corrections as reciprocals:
no change, the update is not compute-bound); `--xla_cpu_use_multi_output_fusion` (not
accepted by this jaxlib, neither as XLA_FLAGS nor as a compile option).

What the chunks buy depends on the load. Interleaved runs of this script in one session
(2026-11-29), ratio to torch fused: load 6-8: 4 MiB chunks 1.01-1.23x, whole-part program
1.20-1.44x; load 3-4: 16 MiB chunks 1.30-1.38x, 8 and 32 MiB 1.25-1.26x, whole-part
1.31-1.43x, 4 MiB 1.45-1.59x. When the machine is quiet its memory system moves the 46
bytes of the whole-part program at about 35 GB/s, faster than the 2-thread numpy copy
yardstick, and the chunks (whose working set, master + moments + gradient + copy, exceeds
the 1 MiB L2 per core and competes for the shared L3) save little while each chunk program
costs a dispatch (executed inline: the calling thread waits). The goal ratio <= 1.0 is
therefore met only on a busy machine; within 1.5x of the 28-byte bound it is met
throughout (1.0-1.2x). Reaching torch's single pass needs a fused kernel (one loop writing
master, moments and the bf16 copy), which XLA's CPU backend does not generate."""


def setup_mtjax(chunk_bytes: int | None):
    """(step function, parameter count): the engine's PartUpdate on one RAM-tier part."""
    update = PartUpdate(CFG, make_optimizer(OPT), chunk_bytes=chunk_bytes)
    schema = parts.schema(CFG, "block.0", "master")
    rng = np.random.default_rng(0)
    cpu = update.cpu
    master = {n: jax.device_put(rng.standard_normal(s.shape, np.float32) * 0.02, cpu) for n, s in schema.items()}
    grads = {n: jax.device_put(rng.standard_normal(s.shape, np.float32) * 1e-3, cpu) for n, s in schema.items()}
    state = [master, update.init_state(master), update.compute_copy(master)]

    def step():
        state[:] = update("block.0", *state, grads, np.float32(1.0))
        jax.block_until_ready(state)  # time the whole update, not its dispatch

    return step, sum(int(np.prod(s.shape)) for s in schema.values())


def setup_torch(bf16_copy: bool):
    import torch

    schema = parts.schema(CFG, "block.0", "master")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s.shape, generator=gen) * 0.02) for s in schema.values()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    # Same decay rule as mtjax: matrices only.
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": OPT.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=OPT.lr, betas=(OPT.b1, OPT.b2), eps=OPT.eps, fused=True)
    copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params] if bf16_copy else []

    def step():
        opt.step()
        for c, p in zip(copies, params):  # the compute copy mtjax writes in the same program
            c.copy_(p.detach())

    return step, sum(p.numel() for p in params)


def setup_copy(nbytes: int = 512 << 20):
    """A multi-threaded copy between pre-touched buffers: the memory-bandwidth yardstick."""
    workers = os.cpu_count() or 1
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    bounds = np.linspace(0, nbytes, workers + 1, dtype=np.int64)
    pieces = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    pool = concurrent.futures.ThreadPoolExecutor(workers)  # np.copyto releases the GIL

    def step():
        list(pool.map(lambda p: np.copyto(*p), pieces))

    return step, 2 * nbytes  # bytes moved: each byte read once and written once


def run_interleaved(steps: dict, warmup: int, rounds: int) -> dict[str, list[float]]:
    """Alternate one step of each implementation per round, so drifting machine load
    (other processes on a shared machine) hits all of them alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def table(rows: list[tuple[str, int, float, float]], copy_bw: float, torch_ns: float) -> str:
    bound_ns = BOUND_BYTES / copy_bw * 1e9
    lines = ["| implementation | bytes/param it must move | ns/param (median) | ns/param (best) | vs torch fused "
             "| time as bytes/param at copy bandwidth | vs 28-byte bound |", "|---|---|---|---|---|---|---|"]
    for name, must, med, best in rows:
        lines.append(f"| {name} | {must} | {med:.3f} | {best:.3f} | {med / torch_ns:.2f}x | "
                     f"{med * copy_bw / 1e9:.1f} | {med / bound_ns:.2f}x |")
    lines.append(f"| memory-bandwidth bound | {BOUND_BYTES} | {bound_ns:.3f} | | | {BOUND_BYTES} | 1.00x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each implementation)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk-mib", type=float, default=None,
                    help="chunk size of the main mtjax row (default: the engine's)")
    ap.add_argument("--sweep", default="", help="extra chunk sizes in MiB, comma-separated (one more part each)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    from mtjax.stream.update import CHUNK_BYTES

    chunk = CHUNK_BYTES if args.chunk_mib is None else int(args.chunk_mib * (1 << 20))
    load_before = os.getloadavg()[0]
    copy_step, copy_bytes = setup_copy()
    steps = {"copy": copy_step}
    mtjax_step, n = setup_mtjax(chunk)
    steps["mtjax"] = mtjax_step
    steps["whole"] = setup_mtjax(None)[0]
    sweep = [float(x) for x in args.sweep.split(",") if x]
    for mib in sweep:
        steps[f"chunk {mib:g}"] = setup_mtjax(int(mib * (1 << 20)))[0]
    torch_step, n_torch = setup_torch(bf16_copy=False)
    steps["torch"] = torch_step
    steps["torch+copy"] = setup_torch(bf16_copy=True)[0]
    assert n == n_torch
    times = run_interleaved(steps, args.warmup, args.steps)
    copy_bw = copy_bytes / statistics.median(times["copy"])  # bytes moved per second
    ns = lambda name: (statistics.median(times[name]) / n * 1e9, min(times[name]) / n * 1e9)  # noqa: E731
    main_row = f"mtjax PartUpdate, RAM tier ({chunk / (1 << 20):g} MiB row chunks, in place, + bf16 copy)"
    rows = [(main_row, 30, *ns("mtjax")),
            *[(f"mtjax PartUpdate, {mib:g} MiB row chunks", 30, *ns(f"chunk {mib:g}")) for mib in sweep],
            ("mtjax PartUpdate, whole-part program (before chunking)", 30, *ns("whole")),
            ("torch AdamW(fused=True)", 28, *ns("torch")),
            ("torch AdamW(fused=True) + bf16 copy", 30, *ns("torch+copy"))]
    torch_ns = ns("torch")[0]
    body = (
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores, {platform.machine()}), "
        f"jax {jax.__version__}, torch {__import__('torch').__version__}. One part of {n / 1e6:.1f}M fp32 "
        f"parameters, {args.steps} timed rounds (one step of each, interleaved) after {args.warmup} warm-up; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (a shared machine). Copy bandwidth "
        f"(median of a 512 MiB multi-threaded copy in each round): {copy_bw / 1e9:.1f} GB/s moved (read + written), "
        f"so the 28-byte bound is {BOUND_BYTES / copy_bw * 1e9:.3f} ns/param. Ratios use the medians.\n\n"
        + table(rows, copy_bw, torch_ns) + "\n\n" + NOTES
        + "\n\nRun: `.venv/bin/python experiments/bench/optimizer.py` (chunk sizes: `--sweep 1,16`)"
    )
    print(body)
    if not args.no_write:
        write_section(SECTION, f"{HEADING}\n\n{body}")
        print(f"\nwrote the section of {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
