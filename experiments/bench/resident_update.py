"""A resident part's update where the device is the host: the optax program (what an
accelerator runs) against the fused loop (what the CPU backend runs), on one block part,
alternating, medians. Prints one line; the cost model prices these as 46 and 28-30
bytes/param (mtjax.stream.memory_plan.update_bytes).

    .venv/bin/python experiments/bench/resident_update.py --dtype bfloat16 --width 1024
"""

from __future__ import annotations

import argparse
import statistics

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import numpy as np

from mtjax import model, parts, treepath
from mtjax.optim import OptimConfig
from mtjax.stream import resident
from mtjax.stream.staging import Placement
from mtjax.stream.update import PartUpdate, update_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    cfg = harness.llama(1, args.width, vocab=256, dtype=args.dtype)
    update = update_for(cfg, OptimConfig(lr=1e-4, clip_norm=1.0))
    part = "block.0"
    params = parts.part_params(model.init_params(cfg, seed=0), part)
    master = {n: np.array(a, np.float32) for n, a in treepath.flatten(params).items()}
    opt = {n: np.array(a) for n, a in update.init_state(master).items()}
    rng = np.random.default_rng(0)
    grads = jax.device_put({n: rng.standard_normal(a.shape, np.float32) for n, a in master.items()})
    ways = {}
    for fused in (False, True):  # the same AdamW; without `optim`, as its optax program
        ways[fused] = resident.Resident([part], update if fused else PartUpdate(cfg, update.tx), Placement())
        ways[fused].load(part, master, opt)

    def step(res):
        def run(_):
            res.add_grad(part, grads)
            res.update(0.5)
            jax.block_until_ready(res.weights(part))
        return run

    times = harness.alternating_times({fused: step(res) for fused, res in ways.items()}, range(args.steps + 2))
    # alternating_times leaves out the first round (it compiles); the second, left out here, faults pages in.
    n = sum(a.size for a in master.values())
    xla, loop = statistics.median(times[False][1:]), statistics.median(times[True][1:])
    print(f"{args.dtype}, {n / 1e6:.1f}M params: optax program {xla * 1e3:.1f} ms ({xla / n * 1e9:.2f} ns/param), "
          f"fused loop {loop * 1e3:.1f} ms ({loop / n * 1e9:.2f} ns/param): {xla / loop:.2f}x")


if __name__ == "__main__":
    main()
