"""mtjax's per-part CPU AdamW update against torch.optim.AdamW(fused=True).

One part of ~113M fp32 parameters (a Llama block with hidden 3072, SwiGLU 8192) is
updated by `mtjax.stream.update.PartUpdate` (one jitted optax AdamW program with donated
buffers that also writes the bf16 compute copy) and by torch's fused CPU AdamW on the
same shapes. Each side runs warm-up steps, then timed steps; the table gives ns/param,
the mtjax/torch ratio and the ratio to the memory-bandwidth bound of 28 bytes/param
(read master, mu, nu, grad; write master, mu, nu) at the copy bandwidth measured in the
same run. Writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/optimizer.py [--steps 8] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import re
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtjax import parts  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.optim import OptimConfig, make_optimizer  # noqa: E402
from mtjax.plan.probe import memory_bandwidth  # noqa: E402
from mtjax.stream.update import PartUpdate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
HEADING = "## Optimizer update: mtjax vs torch fused AdamW (experiments/bench/optimizer.py)"
BOUND_BYTES = 28  # fp32 AdamW: read master, mu, nu, grad; write master, mu, nu
CFG = ModelConfig(vocab_size=256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=1,
                  num_attention_heads=24, num_key_value_heads=24, head_dim=128, compute_dtype="bfloat16")
OPT = OptimConfig(lr=1e-4, schedule="constant", weight_decay=0.1)


def _timed(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def bench_mtjax(warmup: int, steps: int) -> tuple[int, list[float]]:
    update = PartUpdate(CFG, make_optimizer(OPT))
    schema = parts.schema(CFG, "block.0", "master")
    rng = np.random.default_rng(0)
    cpu = update.cpu
    master = {n: jax.device_put(rng.standard_normal(s.shape, np.float32) * 0.02, cpu) for n, s in schema.items()}
    grads = {n: jax.device_put(rng.standard_normal(s.shape, np.float32) * 1e-3, cpu) for n, s in schema.items()}
    opt = update.init_state(master)
    compute = update.compute_copy(master)
    scale = jnp.float32(1.0)
    state = [master, opt, compute]

    def step():
        # block_until_ready: the update is async; time the whole pass over memory.
        state[:] = update("block.0", *state, grads, scale)
        jax.block_until_ready(state)

    n = sum(int(np.prod(s.shape)) for s in schema.values())
    times = _timed(step, warmup, steps)
    del state, master, grads, opt, compute
    return n, times


def bench_torch(warmup: int, steps: int, bf16_copy: bool) -> tuple[int, list[float]]:
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

    n = sum(p.numel() for p in params)
    times = _timed(step, warmup, steps)
    del opt, params, copies
    return n, times


def table(rows: list[tuple[str, float, float]], bound_ns: float, torch_ns: float) -> str:
    lines = ["| implementation | bytes/param | ns/param (median) | ns/param (best) | vs torch fused | vs bound |",
             "|---|---|---|---|---|---|"]
    for name, per_param_bytes, med, best in rows:
        lines.append(f"| {name} | {per_param_bytes} | {med:.3f} | {best:.3f} | {med / torch_ns:.2f}x | "
                     f"{med / bound_ns:.2f}x |")
    lines.append(f"| memory-bandwidth bound | {BOUND_BYTES} | {bound_ns:.3f} | | | 1.00x |")
    return "\n".join(lines)


def write_section(body: str) -> None:
    DOC.parent.mkdir(exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n\nEach section is written by the script it names.\n"
    section = f"{HEADING}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    DOC.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    copy_bw = memory_bandwidth(512 << 20, repeats=5)  # bytes moved (read + written) per second
    bound_ns = BOUND_BYTES / copy_bw * 1e9
    n, t_mtjax = bench_mtjax(args.warmup, args.steps)
    gc.collect()
    _, t_torch = bench_torch(args.warmup, args.steps, bf16_copy=False)
    gc.collect()
    _, t_torch_copy = bench_torch(args.warmup, args.steps, bf16_copy=True)
    ns = lambda ts: (statistics.median(ts) / n * 1e9, min(ts) / n * 1e9)  # noqa: E731
    rows = [("mtjax PartUpdate (jit, donated, + bf16 copy)", 30, *ns(t_mtjax)),
            ("torch AdamW(fused=True)", 28, *ns(t_torch)),
            ("torch AdamW(fused=True) + bf16 copy", 30, *ns(t_torch_copy))]
    torch_ns = rows[1][2]
    body = (
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores, {platform.machine()}), "
        f"jax {jax.__version__}, torch {__import__('torch').__version__}. One part of {n / 1e6:.1f}M fp32 "
        f"parameters, {args.steps} timed steps after {args.warmup} warm-up, median and best. Copy bandwidth "
        f"measured in the same run: {copy_bw / 1e9:.1f} GB/s moved (read + written), so the 28-byte bound is "
        f"{bound_ns:.3f} ns/param. Ratios use the medians.\n\n"
        + table(rows, bound_ns, torch_ns)
        + "\n\nRun: `.venv/bin/python experiments/bench/optimizer.py`"
    )
    print(body)
    if not args.no_write:
        write_section(body)
        print(f"\nwrote the section of {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
