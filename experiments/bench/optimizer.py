"""mtjax's per-part CPU AdamW update against torch.optim.AdamW(fused=True).

One part of ~113M fp32 parameters (a Llama block with hidden 3072, SwiGLU 8192) is
updated by `mtjax.stream.update.PartUpdate` (one jitted optax AdamW program with donated
buffers that also writes the bf16 compute copy) and by torch's fused CPU AdamW on the
same shapes, steps interleaved so machine load hits both alike. The table gives ns/param,
the mtjax/torch ratio and the ratio to the memory-bandwidth bound of 28 bytes/param
(read master, mu, nu, grad; write master, mu, nu) at the copy bandwidth measured in the
same run. Writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/optimizer.py [--steps 8] [--no-write]
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
import jax.numpy as jnp  # noqa: E402
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
Why mtjax moves more than 30 bytes/param: XLA's CPU backend has no multi-output fusion, so
the update compiles to four passes over memory: mu (read mu, grad; write mu), nu (read nu,
grad; write nu), master (read master, new mu, new nu; write master) and the bf16 copy (read
master; write bf16): 32 bytes read + 14 written = 46 bytes/param, against 28 for torch's
single fused loop (30 with the copy). Tried: donation of the compute copy was silently
lost because jit pruned the unread argument (fixed with `keep_unused=True`, saving a fresh
page-faulting bf16 buffer per update); a cache-blocked update (a `fori_loop` over row
chunks with in-place `dynamic_update_slice`) needs
`--xla_cpu_copy_insertion_use_region_analysis=true` to avoid whole-array copies and is
still 3-160x slower than one pass (smaller chunks are worse) under the thunk runtime;
unrolled static chunks allocate temporaries per chunk (out of memory); `--xla_cpu_use_multi_output_fusion` is not a flag
in this jaxlib. Calling the same program once per 4 MiB chunk array (last row) keeps
its four passes in cache; it needs a RAM tier that stores state as chunk arrays. A fused
kernel outside XLA is the other way to reach the 28-byte bound."""


def setup_mtjax():
    """(step function, parameter count): PartUpdate on one part held on the CPU backend."""
    update = PartUpdate(CFG, make_optimizer(OPT))
    schema = parts.schema(CFG, "block.0", "master")
    rng = np.random.default_rng(0)
    cpu = update.cpu
    master = {n: jax.device_put(rng.standard_normal(s.shape, np.float32) * 0.02, cpu) for n, s in schema.items()}
    grads = {n: jax.device_put(rng.standard_normal(s.shape, np.float32) * 1e-3, cpu) for n, s in schema.items()}
    state = [master, update.init_state(master), update.compute_copy(master)]
    scale = jnp.float32(1.0)

    def step():
        state[:] = update("block.0", *state, grads, scale)
        jax.block_until_ready(state)  # the update is asynchronous: time the whole pass

    return step, sum(int(np.prod(s.shape)) for s in schema.values())


def setup_mtjax_chunked(chunk_bytes: int = 4 << 20):
    """The same jitted program called once per ~4 MiB chunk array: its four passes over a
    chunk then hit cache, not DRAM. Needs a tier that holds state as chunk arrays."""
    update = PartUpdate(CFG, make_optimizer(OPT))
    rng = np.random.default_rng(0)
    cols = 1024
    rows = chunk_bytes // (4 * cols)
    count = sum(int(np.prod(s.shape)) for s in parts.schema(CFG, "block.0", "master").values()) // (rows * cols)
    states = []
    for _ in range(count):
        master = {"w": jnp.asarray(rng.standard_normal((rows, cols), np.float32) * 0.02)}
        opt = update.tx.init(master)
        states.append([master, opt, {"w": master["w"].astype(CFG.compute_dtype)}, {"w": master["w"] * 1e-3}])
    scale = jnp.float32(1.0)

    def step():
        for st in states:
            st[0], st[1], st[2] = update._update(st[0], st[1], st[2], st[3], scale)
        jax.block_until_ready([st[:3] for st in states])

    return step, count * rows * cols


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


def table(rows: list[tuple[str, float, float]], bound_ns: float, torch_ns: float) -> str:
    lines = ["| implementation | bytes/param | ns/param (median) | ns/param (best) | vs torch fused | vs bound |",
             "|---|---|---|---|---|---|"]
    for name, per_param_bytes, med, best in rows:
        lines.append(f"| {name} | {per_param_bytes} | {med:.3f} | {best:.3f} | {med / torch_ns:.2f}x | "
                     f"{med / bound_ns:.2f}x |")
    lines.append(f"| memory-bandwidth bound | {BOUND_BYTES} | {bound_ns:.3f} | | | 1.00x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    copy_step, copy_bytes = setup_copy()
    mtjax_step, n = setup_mtjax()
    torch_step, n_torch = setup_torch(bf16_copy=False)
    torch_copy_step, _ = setup_torch(bf16_copy=True)
    chunked_step, n_chunked = setup_mtjax_chunked()
    assert n == n_torch
    names = {"mtjax": "mtjax PartUpdate (jit, donated, + bf16 copy)", "torch": "torch AdamW(fused=True)",
             "torch+copy": "torch AdamW(fused=True) + bf16 copy",
             "chunked": "same mtjax program, one call per 4 MiB chunk array"}
    times = run_interleaved({"mtjax": mtjax_step, "torch": torch_step, "torch+copy": torch_copy_step,
                             "chunked": chunked_step, "copy": copy_step}, args.warmup, args.steps)
    copy_bw = copy_bytes / statistics.median(times["copy"])  # bytes moved per second
    bound_ns = BOUND_BYTES / copy_bw * 1e9
    ns = lambda ts: (statistics.median(ts) / n * 1e9, min(ts) / n * 1e9)  # noqa: E731
    rows = [(names["mtjax"], 30, *ns(times["mtjax"])), (names["torch"], 28, *ns(times["torch"])),
            (names["torch+copy"], 30, *ns(times["torch+copy"])),
            (names["chunked"], 30, *(t * n / n_chunked for t in ns(times["chunked"])))]
    torch_ns = rows[1][2]
    body = (
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores, {platform.machine()}), "
        f"jax {jax.__version__}, torch {__import__('torch').__version__}. One part of {n / 1e6:.1f}M fp32 "
        f"parameters, {args.steps} timed rounds (one step of each, interleaved) after {args.warmup} warm-up, "
        f"load average {os.getloadavg()[0]:.1f} at the end. Copy bandwidth (median of a 512 MiB "
        f"multi-threaded copy in each round): {copy_bw / 1e9:.1f} GB/s moved (read + written), so the "
        f"28-byte bound is {bound_ns:.3f} ns/param. Ratios use the medians.\n\n"
        + table(rows, bound_ns, torch_ns) + "\n\n" + NOTES
        + "\n\nRun: `.venv/bin/python experiments/bench/optimizer.py`"
    )
    print(body)
    if not args.no_write:
        write_section(SECTION, f"{HEADING}\n\n{body}")
        print(f"\nwrote the section of {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
