"""A gated delta-net block against a softmax attention block of the same width on the CPU.

Both are Qwen3.5 blocks (mtjax.families.qwen3_5) of one width: the attention block's gated
softmax attention (4 query heads of 64 over 2 key-value heads), the delta-net block's
linear attention (2 key heads and 4 value heads of 64, a convolution of 4), the same
dense MLP. For each sequence length: one block's forward + backward (jit of the gradient
of its summed output w.r.t. its parameters and input), median of 3 after a warm-up, the
two blocks alternating; and the compiled program's temporary bytes
(`memory_analysis().temp_size_in_bytes`). Prints a table and writes its section of
docs/benchmarks.md.

    .venv/bin/python experiments/bench/delta_net.py                        # 1k, 4k, 16k
    .venv/bin/python experiments/bench/delta_net.py --seq 512 1024 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import jax.numpy as jnp
from flax import nnx

from mtjax import model
from mtjax.model_config import ModelConfig

SECTION = "delta-net"


def config(width: int, seq: int) -> ModelConfig:
    return ModelConfig(model_type="qwen3_5_text", vocab_size=1024, hidden_size=width, intermediate_size=3 * width,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       rms_norm_offset=True, qk_norm=True, partial_rotary_factor=0.25, delta_net_layers=(0,),
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                       linear_value_head_dim=64, max_position_embeddings=max(seq, 2048))


def measure(cfg: ModelConfig, seq: int, repeats: int) -> dict:
    """{kind: (median seconds, temporary bytes)} of one block's forward + backward."""
    x = jax.random.normal(jax.random.key(0), (1, seq, cfg.hidden_size), jnp.float32)
    steps, temp = {}, {}
    for i, spec in enumerate(cfg.layer_specs):
        block = model.init_part(cfg, spec, nnx.Rngs(i))
        fn = jax.jit(jax.grad(lambda b, x, spec=spec: jnp.sum(model.block_forward(cfg, spec, b, x)), argnums=(0, 1)))
        compiled = fn.lower(block, x).compile()
        temp[spec.mixer.kind] = compiled.memory_analysis().temp_size_in_bytes
        jax.block_until_ready(compiled(block, x))  # warm-up
        steps[spec.mixer.kind] = (compiled, block)
    times = {kind: [] for kind in steps}
    for _ in range(repeats):
        for kind, (compiled, block) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(block, x))
            times[kind].append(time.perf_counter() - t0)
    return {kind: (statistics.median(ts), temp[kind]) for kind, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    rows, faster = [], []
    for seq in args.seq:
        r = measure(config(args.width, seq), seq, args.repeats)
        (ta, ma), (td, md) = r["softmax_attention"], r["gated_delta_net"]
        rows.append(f"| {seq} | {ta:.3f} | {td:.3f} | {td / ta:.2f} | {ma / 2**20:.0f} | {md / 2**20:.0f} |")
        faster += [seq] if td < ta else []
        print(rows[-1], flush=True)
    crossover = (f"The delta-net block is the faster from {faster[0]} tokens on (the crossover lies below it, "
                 "above the longest row where attention still wins); its time and memory grow linearly, "
                 "attention's quadratically." if faster else "Attention is the faster at every length measured.")
    load = os.getloadavg()[0]
    body = "\n".join([
        f"{datetime.date.today()}, AMD EPYC (lscpu), "
        f"{os.cpu_count()} cores, load average {load:.1f} at the end (other jobs shared the machine), "
        f"jax {jax.__version__} on the CPU. One Qwen3.5 block of width {args.width}, fp32, batch 1: gated softmax "
        "attention (4 heads of 64 over 2) against the gated delta-net (2 key and 4 value heads of 64, chunks of "
        "64), the same MLP; forward + backward, median of "
        f"{args.repeats} after a warm-up, the blocks alternating; memory: the compiled program's temporaries.",
        "",
        "| seq | attention block (s) | delta-net block (s) | delta-net / attention | attention temp (MiB) "
        "| delta-net temp (MiB) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        crossover,
    ])
    harness.publish(SECTION, "A delta-net block against an attention block (experiments/bench/delta_net.py)", body,
                    "experiments/bench/delta_net.py " + " ".join(["--seq", *map(str, args.seq)]),
                    write=not args.no_doc)


if __name__ == "__main__":
    main()
