"""Every supported family: a tiny model's streamed step against its reference step.

Each family's model is built from transformers' own config class (so its defaults are the
family's: Gemma's soft-caps and norms, Phi's fused projections, the MoE routers), shrunk
to the same small shape, and read with `mtjax.model_config.from_hf_dict`. Both engines
train it from the same initial weights with AdamW; their steps alternate, so drift in the
machine's load hits both alike. A family mtjax does not read yet is listed as skipped.
Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/families.py            # ~3-6 minutes on 2 cores
    .venv/bin/python experiments/bench/families.py --quick --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import numpy as np
import transformers

from mtjax import model
from mtjax.config import StreamConfig
from mtjax.model_config import ConfigError, from_hf_dict
from mtjax.optim import OptimConfig
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

SECTION = "families"
MOE = dict(num_local_experts=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
FAMILIES = {  # family -> (transformers config class, what differs from the shared shape)
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=128)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", dict(sliding_window=128, query_pre_attn_scalar=64)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=128, query_pre_attn_scalar=64)),
    "phi3": ("Phi3Config", {}),
    "mixtral": ("MixtralConfig", MOE),
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, shared_expert_intermediate_size=256)),
    "qwen3_moe": ("Qwen3MoeConfig", MOE),
    "olmoe": ("OlmoeConfig", MOE),
    # Llama 4: its experts' width is intermediate_size, its dense layers' intermediate_size_mlp.
    "llama4_text": ("Llama4TextConfig", dict(num_local_experts=8, num_experts_per_tok=1, attention_chunk_size=128,
                                             intermediate_size_mlp=704, interleave_moe_layer_step=2)),
    # Qwen3-Next / Qwen3.5: three delta-net layers to one gated attention layer (their default interval).
    "qwen3_next": ("Qwen3NextConfig", dict(MOE, shared_expert_intermediate_size=256, **LINEAR)),
    "qwen3_5_text": ("Qwen3_5TextConfig", LINEAR),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(MOE, shared_expert_intermediate_size=256, **LINEAR)),
}
# Rows beyond one per family: (label, family, stream settings).
EXTRA_ROWS = [("qwen3_moe, expert groups of 2 (forced)", "qwen3_moe", dict(expert_group_size=2))]


def hf_dict(family: str, layers: int, width: int) -> dict:
    cls, extra = FAMILIES[family]
    shape = dict(vocab_size=8192, hidden_size=width, intermediate_size=int(width * 2.75), num_hidden_layers=layers,
                 num_attention_heads=width // 64, num_key_value_heads=max(1, width // 128), head_dim=64,
                 max_position_embeddings=4096, tie_word_embeddings=False)
    if family == "llama4_text":
        shape["intermediate_size"] = 128  # its experts' width, as MOE's moe_intermediate_size
    return getattr(transformers, cls)(**{**shape, **extra}).to_dict()


def measure(cfg, batch: int, seq: int, steps: int, stream_settings: dict) -> tuple[float, float]:
    """(reference, streamed) median step seconds, engines alternating."""
    params = model.init_params(cfg, seed=0)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0)
    ref = ReferenceTrainer(cfg, params, opt)
    stream = StreamEngine(cfg, params, opt, StreamConfig(keep_every=1, prefetch_depth=2, **stream_settings))
    del params
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, (1, batch, seq), dtype=np.int32) for _ in range(steps + 1)]
    # A step returns floats: it has finished when it returns.
    med = harness.alternating_medians({"reference": ref.step, "stream": stream.step}, data)
    stream.close()
    return med["reference"], med["stream"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per engine (after one warm-up)")
    ap.add_argument("--quick", action="store_true", help="two blocks of width 128, seq 64, one timed step")
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()  # the shrunk vocabulary no longer holds some special-token ids
    if args.quick:
        args.layers, args.width, args.seq, args.steps = 2, 128, 64, 1

    rows, skipped = [], []
    for label, family, settings in [(f, f, {}) for f in FAMILIES] + EXTRA_ROWS:
        try:
            cfg = from_hf_dict(hf_dict(family, args.layers, args.width))
        except ConfigError as e:
            skipped.append(label)
            print(f"{label}: skipped: {e}", flush=True)
            continue
        ref_s, stream_s = measure(cfg, args.batch, args.seq, args.steps, settings)
        rows.append((label, model.num_params(cfg), ref_s, stream_s))
        print(f"{label}: reference {ref_s:.3f} s, streamed {stream_s:.3f} s, ratio {stream_s / ref_s:.2f}", flush=True)

    tokens = args.batch * args.seq
    lines = [
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores), jax {jax.__version__} on the CPU. Each "
        f"family's transformers config class with its own defaults, shrunk to {args.layers} blocks of width "
        f"{args.width} (head_dim 64, vocab 8192; sliding windows of 128 where the family has them; MoE: 8 experts, "
        f"top 2, Llama 4 top 1 with every other layer dense; a forced expert-group row streams each MoE "
        f"layer as its router part and 4 groups of 2 experts); fp32, batch {args.batch} x seq {args.seq}, AdamW with clipping; reference: the whole model "
        f"in memory, remat per block; stream: RAM tier, k = 1, prefetch depth 2; median of {args.steps} steps "
        "after one warm-up, the two engines alternating.",
        "",
        "| family | params | reference step (s) | streamed step (s) | streamed / reference | streamed tokens/s |",
        "|---|---|---|---|---|---|",
        *(f"| {f} | {n / 1e6:.1f}M | {r:.3f} | {s:.3f} | {s / r:.2f} | {tokens / s:.0f} |" for f, n, r, s in rows),
    ]
    if skipped:
        lines += ["", "Not read by mtjax yet: " + ", ".join(skipped) + "."]
    harness.publish(SECTION, "Every family, streamed against the reference (experiments/bench/families.py)",
                    "\n".join(lines), "experiments/bench/families.py", write=not args.no_doc)


if __name__ == "__main__":
    main()
