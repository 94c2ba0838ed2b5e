"""The device plan's price of one attention block whose row is split over devices
(stream.split: sequence) against XLA's per-device temporaries, on this CPU.

For a gated softmax-attention block of a small Qwen3.5 model (width 128, 4 query heads
of 32 over 2 key/value heads, intermediate 384; and wider variants), compiled as the
engine runs it (blockfns._grad, memory_analysis: nothing runs) over one row split over
2 to 16 CPU devices, prints XLA's temporaries over the plan's price for one device's
share (traced residuals + the mixer's working bytes + block_bytes.promoted_bytes below
fp32), and the same ratio without the promoted term. docs/planner.md quotes it.

    .venv/bin/python experiments/bench/split_memory.py    # ~2 minutes on 2 cores
"""

from __future__ import annotations

import os

DEVICES = 16
os.environ["JAX_NUM_CPU_DEVICES"] = str(DEVICES)  # before JAX starts: its device count is fixed then
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"

import harness  # noqa: E402,F401  (first: the checkout on sys.path, JAX on the CPU)

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtjax import parts  # noqa: E402
from mtjax.attention_chunked import SEQUENCE  # noqa: E402
from mtjax.layers import registry  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.stream import block_bytes, blockfns  # noqa: E402

BASE = ModelConfig(model_type="qwen3_5_text", vocab_size=256, hidden_size=128, intermediate_size=384,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   rms_norm_offset=True, qk_norm=True, partial_rotary_factor=0.25, delta_net_layers=(0,),
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32, max_position_embeddings=8192)
CASES = [  # (name, fields over BASE, tokens a row, device counts, compute dtype)
    ("base", {}, 8192, (2, 4, 8, 16), "bfloat16"),
    ("base", {}, 4096, (2, 4, 8), "bfloat16"),
    ("intermediate 768", dict(intermediate_size=768), 8192, (2, 8), "bfloat16"),
    ("width 256, 8 heads", dict(hidden_size=256, num_attention_heads=8, intermediate_size=768), 8192, (2, 8),
     "bfloat16"),
    ("head dim 64, 4 kv heads", dict(head_dim=64, num_key_value_heads=4), 8192, (2, 8), "bfloat16"),
    ("base", {}, 8192, (2, 4, 8, 16), "float32"),
]


def ratios(cfg: ModelConfig, seq: int, devices: int) -> tuple[float, float]:
    """(XLA's temporaries / the price, / the price without promoted_bytes) for block 1."""
    spec, share = cfg.layer_specs[1], seq // devices
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (SEQUENCE,))
    on = lambda *axes: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))  # noqa: E731
    split = cfg.split_over("sequence", devices)
    w = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=on())
         for n, v in parts.schema(split, "block.1", "compute").items()}
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype), sharding=on(None, SEQUENCE))
    grad = jax.jit(lambda w, x, dy: blockfns._grad(split, spec, w, x, dy, {}))
    temp = grad.lower(w, x, x).compile().memory_analysis().temp_size_in_bytes
    base = (block_bytes.residual_bytes(cfg, spec, 1, share)
            + registry.mixer(spec).working(cfg, spec, 1, share, "cpu", devices))
    promoted = block_bytes.promoted_bytes(cfg, spec, 1, share) if np.dtype(cfg.compute_dtype).itemsize < 4 else 0
    return temp / (base + promoted), temp / base


def main() -> None:
    print(f"{'block':<26}{'dtype':<10}{'tokens':>7}{'devices':>8}{'XLA/plan':>10}{'without promoted':>18}")
    for name, fields, seq, counts, dtype in CASES:
        cfg = dataclasses.replace(BASE, compute_dtype=dtype, **fields)
        for devices in counts:
            with_, without = ratios(cfg, seq, devices)
            print(f"{name:<26}{dtype:<10}{seq:>7}{devices:>8}{with_:>10.3f}{without:>18.3f}", flush=True)


if __name__ == "__main__":
    main()
