"""mtjax's per-part CPU AdamW update against torch.optim.AdamW(fused=True).

One part of ~113M fp32 parameters (a Llama block with hidden 3072, SwiGLU 8192) is
updated by the engine's optimizer stage, `mtjax.stream.update.PartUpdate`, on RAM-tier
state in place: as the fused loop (mtjax.stream.fused_adamw) without and with the bf16
compute copy, and as the whole-part optax program on XLA's CPU backend, against torch's
fused CPU AdamW on the same shapes, without and with a bf16 copy.
Steps are interleaved so machine load hits all of them alike. The table gives ns/param,
the ratio to torch, and the time expressed as bytes/param at the copy bandwidth measured
in the same run, against the memory-bandwidth bound of 28 bytes/param (read master, mu,
nu, grad; write master, mu, nu). Writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/optimizer.py [--steps 10] [--no-doc]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import platform
import statistics
import time

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import parts
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream.update import PartUpdate

SECTION = "optimizer-update"
BOUND_BYTES = 28  # fp32 AdamW: read master, mu, nu, grad; write master, mu, nu
CFG = ModelConfig(vocab_size=256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=1,
                  num_attention_heads=24, num_key_value_heads=24, head_dim=128, compute_dtype="bfloat16")
OPT = OptimConfig(lr=1e-4, schedule="constant", weight_decay=0.1)


NOTES = """\
The fused loop is mtjax's AdamW compiled as one host loop (numba, `mtjax.stream.fused_adamw`):
it reads master, both moments and the gradient once and writes master and moments once,
in place, on all cores (each leaf split into one contiguous piece per core). It computes what XLA
computes for the same optax transformation (bias corrections as reciprocals, the same
fused multiply-adds, round-to-nearest-even bf16), so results agree with the optax program
within fp32 rounding (tests/test_fused_adamw.py). Where the engine keeps master weights
and the compute copy in RAM it keeps no copy at all (the prefetcher rounds master into the
staging slot), so its update is the first row: the same 28 bytes/param as torch's. With
master or compute on disk the update writes the bf16 copy too (second row, 30 bytes + the
copy's write-allocate). With bf16 compute and one micro-batch the gradient arrives in bf16
and the loop reads it as it is (third row, 26 bytes); the engine used to widen it to fp32
first, an XLA program writing a new fp32 array (fourth row: 2 + 4 bytes more, and every
page of the new array faulted in).

What made the loop fast: numba widens integer arithmetic to 64 bits, which halved the
vector width of the bf16 rounding until it was written as LLVM IR on 32-bit integers; and
LLVM vectorizes a loop whose outputs may alias its inputs only after a runtime check that
fails when they are the same arrays, so the in-place update is its own loop. Each leaf is split into one
contiguous piece per core (many small pieces taken in turn scaled worse to the second core),
and RAM-tier state lives on transparent huge pages (madvise): ~9% faster than 4 KiB pages.

The optax program row is what runs without numba or for other optax transformations:
one jitted program per part, its inputs donated. XLA's CPU backend has no multi-output
fusion, so it makes four passes over memory (46 bytes/param). Tried and dropped on that
path: running the program per 16 MiB row chunk so the passes hit cache (1.09 ns/param
against 1.01 whole, on 2026-11-30: slower, and ~280 lines); copying chunk results back
into whole leaves (2.4x torch); donating numpy views (XLA allocates a new output); a
`fori_loop` over chunks (3-160x slower); `--xla_cpu_use_multi_output_fusion` (not accepted
by this jaxlib). And on the loop: software prefetching (it stops LLVM from vectorizing: 4x
slower).

On this 2-core VM the update is bound by memory bandwidth, and load from other jobs moves
every row by 10-30% between runs; the interleaving keeps the ratios comparable within a
run."""


def setup_mtjax(fused: bool, copy: bool = True, grad: str = "float32"):
    """(step function, parameter count): the engine's PartUpdate on one RAM-tier part,
    as the fused one-pass loop (with or without writing the bf16 compute copy) or as the
    optax program on XLA's CPU backend. `grad`: the gradient's dtype, "float32", or
    "bfloat16" (bf16 compute, one micro-batch), or "widened" (bf16 widened to fp32 by an
    XLA program first, as the engine's gradient sink did before 2026-12-07)."""
    update = PartUpdate(CFG, make_optimizer(OPT), optim=OPT if fused else None)
    assert (update.fused is not None) == fused, "the fused loop needs numba"
    schema = parts.schema(CFG, "block.0", "master")
    rng = np.random.default_rng(0)
    cpu = update.cpu
    master = {n: jax.device_put(rng.standard_normal(s.shape, np.float32) * 0.02, cpu) for n, s in schema.items()}
    grads = {n: jax.device_put((rng.standard_normal(s.shape, np.float32) * 1e-3).astype(
        np.float32 if grad == "float32" else jnp.bfloat16), cpu) for n, s in schema.items()}
    state = [master, update.init_state(master), update.compute_copy(master)]
    widen = jax.jit(lambda g: {n: x.astype(jnp.float32) for n, x in g.items()})

    def step():
        g = widen(grads) if grad == "widened" else grads
        new = update("block.0", *state, g, np.float32(1.0), own=("master", "opt", "compute"), copy=copy)
        state[:] = new if copy else (*new[:2], state[2])
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
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    copy_step, copy_bytes = setup_copy()
    steps = {"copy": copy_step}
    fused_step, n = setup_mtjax(fused=True, copy=False)
    steps["fused"] = fused_step
    steps["fused+copy"] = setup_mtjax(fused=True)[0]
    steps["fused bf16"] = setup_mtjax(fused=True, copy=False, grad="bfloat16")[0]
    steps["fused widened"] = setup_mtjax(fused=True, copy=False, grad="widened")[0]
    steps["whole"] = setup_mtjax(fused=False)[0]
    torch_step, n_torch = setup_torch(bf16_copy=False)
    steps["torch"] = torch_step
    steps["torch+copy"] = setup_torch(bf16_copy=True)[0]
    assert n == n_torch
    times = run_interleaved(steps, args.warmup, args.steps)
    copy_bw = copy_bytes / statistics.median(times["copy"])  # bytes moved per second
    ns = lambda name: (statistics.median(times[name]) / n * 1e9, min(times[name]) / n * 1e9)  # noqa: E731
    rows = [("mtjax PartUpdate, fused loop, in place (RAM tier: no compute copy)", 28, *ns("fused")),
            ("mtjax PartUpdate, fused loop, in place, + bf16 copy (master or compute on disk)", 30,
             *ns("fused+copy")),
            ("mtjax PartUpdate, fused loop, in place, bf16 gradient read as it is (bf16 compute, one "
             "micro-batch)", 26, *ns("fused bf16")),
            ("the same bf16 gradient widened to fp32 by an XLA program first (the engine before "
             "2026-12-07)", 34, *ns("fused widened")),
            ("mtjax PartUpdate, optax program, whole part, in place (without numba; other optax "
             "transformations)", 30, *ns("whole")),
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
    )
    harness.publish(SECTION, "Optimizer update: mtjax vs torch fused AdamW (experiments/bench/optimizer.py)", body,
                    "experiments/bench/optimizer.py", write=not args.no_doc)


if __name__ == "__main__":
    main()
