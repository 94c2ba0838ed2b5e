"""The planner's longest row: the largest sequence that fits a profile, every part streamed.

For each model and hardware profile: the plan of one row of 4096 tokens (batch 1), the
placement `mtjax plan` recommends for it (the fastest that fits RAM and disk), then
`mtjax.plan.longest.search` under that placement. Prints a table and writes its section
of docs/benchmarks.md. Nothing runs on a device: these are the planner's figures
(experiments/bench/long_context.py measures the CPU).

    .venv/bin/python experiments/bench/longest_row.py          # a few minutes
"""

from __future__ import annotations

import argparse
import dataclasses

import harness  # first: the checkout on sys.path, JAX on the CPU

from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import load_hf_config
from mtjax.plan import BUILTIN, StepShape, estimate, fit, recommend
from mtjax.plan.longest import search
from mtjax.plan.report import placement

CASES = [  # (name, HF config or a harness model, hardware profile)
    ("Llama-3.1-8B", "llama-3.1-8b", "h200"),
    ("Qwen3-32B", "qwen3-32b", "h200"),
    ("Llama-3.1-8B", "llama-3.1-8b", "cpu-2core"),
    ("long_context.py's model", None, "cpu-2core"),
]


def model_of(config: str | None):
    if config is None:  # experiments/bench/long_context.py's
        return harness.llama(2, 128, vocab=8192)
    cfg = load_hf_config(harness.ROOT / "experiments" / "hf_configs" / f"{config}.json")
    return dataclasses.replace(cfg, compute_dtype="bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    lines = [
        "Batch 1, one micro-batch, keep_every 1, every part streamed (`stream.resident: none`), the placement "
        "`mtjax plan` recommends at 4096 tokens; the search picks kept inputs on the device or the host and the "
        "feed-forward whole or in chunks of 4096 tokens (`model.ffn_chunk_tokens`), whichever reaches further "
        "(`mtjax plan --longest`). Memory limits: 90% of device memory and RAM.",
        "",
        "| model | hardware | placement | longest row | kept inputs | ffn chunk | device peak | host RAM | "
        "tokens/s | model's context |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, config, hw_name in CASES:
        cfg, hw = model_of(config), BUILTIN[hw_name]
        plan = estimate(cfg, StreamConfig(resident=()), StoreConfig(), StepShape(1, 4096), hw)
        advice = recommend(plan)
        plan = estimate(cfg, StreamConfig(resident=()), advice.placement, StepShape(1, 4096), hw)
        found = search(plan, fit.limits(hw))
        p = found.plan
        if p is None:
            lines.append(f"| {name} | {hw_name} | {placement(advice.placement)} | none | | | | | | "
                         f"{found.context:,} |")
            continue
        device = "-" if hw.device_is_host else f"{p.device.total / 2**30:.1f} GiB"
        lines.append(f"| {name} | {hw_name} | {placement(advice.placement)} | **{found.seq:,}** | "
                     f"{p.stream.activations} | {p.cfg.ffn_chunk_tokens or 'whole'} | {device} | "
                     f"{p.ram_needed / 2**30:.1f} GiB | {p.tokens_per_s:,.0f} | {found.context:,} |")
        print(lines[-1], flush=True)
    lines += ["", "A row past the model's context needs an extended one (rope scaling) to be meant. On a GPU the "
              "residuals of attention are traced on the planning backend (here the CPU's chunked kernel); its "
              "working bytes are the GPU's fused kernels' (none), the head's the GPU's chunked head's."]
    harness.publish("longest-row", "The planner's longest row (experiments/bench/longest_row.py)", "\n".join(lines),
                    "experiments/bench/longest_row.py", write=not args.no_doc)


if __name__ == "__main__":
    main()
