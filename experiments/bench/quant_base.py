"""A quantized frozen base: the bytes a step streams, and what decoding costs on this CPU.

    .venv/bin/python experiments/bench/quant_base.py [--reps 3] [--no-doc]

planned: dense models of experiments/hf_configs with every block's kernels frozen
(model.freeze block.*/*.kernel, compute dtype bf16), one step of batch 1 x seq 4096 on
the built-in h200 profile, for each model.base_format: the frozen kernels' bytes, the
step's host-to-device bytes as the schedule counts them (tests/test_quant.py checks a
real step moves exactly those), and their time on the profile's link.
measured: mtjax.quant's encode (an import's) and decode (the block's, on the device) of
one Llama-3-8B MLP kernel [4096, 14336] on this machine's CPU backend, best of --reps.
The table goes to stdout and to this benchmark's section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import parts, quant
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import load_hf_config
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, StepShape, estimate
from mtjax.units import size

SECTION = "quant-base"
MODELS = ("llama-3-70b", "llama-175b", "gemma-3-27b", "phi-4")
BASE = ("block.*/*.kernel",)
KERNEL = (4096, 14336)


def _kernel_bytes(cfg) -> int:
    """The frozen kernels' bytes as the base format keeps them."""
    if cfg.base_format != "compute":
        return parts.quantized_bytes(cfg)[0]
    return sum(math.prod(leaf.shape) * 2 for p in parts.parts(cfg) for leaf in parts.leaves(cfg, p.name).values()
               if leaf.role == "frozen")


def planned() -> list[str]:
    hw, shape, tx = BUILTIN["h200"], StepShape(1, 4096, 1), make_optimizer(OptimConfig())
    rows = ["| model | base | frozen kernels | host->device / step | vs bf16 | link time (h200 profile) |",
            "|---|---|---|---|---|---|"]
    for name in MODELS:
        cfg = load_hf_config(harness.ROOT / "experiments" / "hf_configs" / f"{name}.json", compute_dtype="bfloat16",
                             freeze=BASE)
        bf16 = None
        for fmt in ("compute", *quant.FORMATS):
            c = dataclasses.replace(cfg, base_format=fmt)
            h2d = estimate(c, StreamConfig(), StoreConfig(), shape, hw, tx=tx).traffic.h2d
            bf16 = bf16 or h2d
            rows.append(f"| {name} | {'bf16' if fmt == 'compute' else fmt} | {size(_kernel_bytes(c))} | {size(h2d)} | "
                        f"{bf16 / h2d:.2f}x | {h2d / hw.h2d_bytes_per_s:.2f} s |")
    return rows


def measured(reps: int) -> list[str]:
    w = np.random.default_rng(0).normal(0, 0.02, KERNEL).astype(np.float32)
    rows = ["| format | encode [4096, 14336] fp32 -> bytes | decode bytes -> bf16 | bytes |", "|---|---|---|---|"]
    for fmt in quant.FORMATS:
        encode = jax.jit(lambda x, f=fmt: quant.encode(f, x))
        decode = jax.jit(lambda b, f=fmt: quant.decode(f, b, KERNEL, jnp.bfloat16))
        x = jnp.asarray(w)
        packed = encode(x).block_until_ready()
        t_enc = harness.best_seconds(lambda: encode(x).block_until_ready(), reps, warmup=1)
        t_dec = harness.best_seconds(lambda: decode(packed).block_until_ready(), reps, warmup=1)
        n = math.prod(KERNEL)
        rows.append(f"| {fmt} | {t_enc * 1e3:.0f} ms ({n / t_enc / 1e6:.0f} M weights/s) | "
                    f"{t_dec * 1e3:.0f} ms ({n / t_dec / 1e6:.0f} M weights/s) | {size(packed.size)} "
                    f"(bf16 {size(2 * n)}) |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    body = "\n".join([
        "Planned (the schedule's byte counts; every block's kernels frozen, batch 1 x seq 4096, bf16 compute; "
        "the embedding, head and norms stay bf16):", "", *planned(), "",
        f"Measured on this CPU ({harness.cpu_name()}, {os.cpu_count()} cores, {jax.device_count()} JAX CPU device, best of "
        f"{args.reps}; the cores may be shared with other work, so these are upper bounds):", "",
        *measured(args.reps), "",
        "nf4 without double quantization is 4.5 bits a weight (3.56x fewer bytes than bf16); int8 is 8 bits "
        "plus an fp32 scale per output channel (2.0x). On the device the decode runs inside the block's "
        "programs, fused by XLA; its cost there is not measured here (no GPU run yet)."])
    harness.publish(SECTION, "A quantized frozen base (experiments/bench/quant_base.py)", body,
                    "experiments/bench/quant_base.py", write=not args.no_doc)


if __name__ == "__main__":
    main()
