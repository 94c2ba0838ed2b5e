"""The GPU benchmark of issue 5, one command on one accelerator (run by bench.sh):

1. host<->device bandwidth: pageable numpy, pinned host arrays, and the engine's own
   staging path (host buffer -> pinned -> device), both directions, for one large array
   and for one block's compute weights as the engine stages them (each leaf on its own
   thread, mtjax.stream.staging);
2. streamed vs in-memory throughput on one model that fits on the device: the
   reference trainer (whole model resident) against the streaming engine;
3. MFU of that streamed run, whose engine is given a device budget of a quarter of the
   model's persistent training state (bf16 weights + fp32 master + AdamW m and v);
4. from that run's trace (last timed step): the effective host-to-device rate (weight
   bytes staged over the seconds from staging each part until its device copy was
   ready, the h2d lane) and the forward's wait per part (the training loop waiting for
   the next part to arrive).

MFU counts model FLOPs of real tokens only: 6 x params + 12 x layers x seq x width per
token (mtjax.progress.model_flops_per_token; the recompute's extra forward is not
counted), against the device's dense bf16 peak (mtjax.plan built-in profile). Each
section prints one JSON line as it finishes; `--out DIR` also writes bench.json and a
markdown section (bench.md) for docs/benchmarks.md. `--dry` runs tiny sizes (CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mtjax import model, parts  # noqa: E402
from mtjax.config import StreamConfig  # noqa: E402
from mtjax.hostmem import aligned_empty  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.optim import OptimConfig  # noqa: E402
from mtjax.progress import model_flops_per_token, peak_flops  # noqa: E402
from mtjax.reference import ReferenceTrainer  # noqa: E402
from mtjax.stream import StreamEngine  # noqa: E402
from mtjax.stream.staging import Placement  # noqa: E402

STATE_BYTES = 2 + 4 + 4 + 4  # bf16 weights, fp32 master, AdamW m and v, per parameter


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def part_bandwidth(place: Placement, cfg: ModelConfig, reps: int) -> float:
    """GB/s of the engine's staging of one block's compute weights (all leaves, to ready)."""
    buffers = {n: aligned_empty(s.shape, s.dtype) for n, s in parts.schema(cfg, "block.0", "compute").items()}
    for b in buffers.values():
        b.fill(1)  # touched: page faults are not a link cost
    nbytes = sum(b.nbytes for b in buffers.values())
    return nbytes / median_seconds(lambda: place.to_device(buffers), reps) / 1e9


def link_bandwidth(nbytes: int, reps: int, cfg: ModelConfig) -> dict:
    """GB/s of each transfer path for one array of `nbytes`, and for one block of `cfg`."""
    place = Placement()
    host = aligned_empty((nbytes // 4,), np.float32)
    host.fill(1.0)  # touched: page faults are not a link cost
    gbps = {"pinned_staging": place.pinned}
    gbps["h2d_pageable"] = nbytes / median_seconds(lambda: jax.device_put(host, place.on_device), reps) / 1e9
    gbps["h2d_engine_path"] = nbytes / median_seconds(lambda: place.to_device({"x": host})["x"], reps) / 1e9
    gbps["h2d_engine_block"] = part_bandwidth(place, cfg, reps)
    on_device = jax.block_until_ready(jax.device_put(host, place.on_device))
    if place.pinned:
        gbps["host_to_pinned"] = nbytes / median_seconds(lambda: jax.device_put(host, place.on_host), reps) / 1e9
        pinned = jax.block_until_ready(jax.device_put(host, place.on_host))
        gbps["h2d_pinned"] = nbytes / median_seconds(lambda: jax.device_put(pinned, place.on_device), reps) / 1e9
        gbps["d2h_pinned"] = nbytes / median_seconds(lambda: jax.device_put(on_device, place.on_host), reps) / 1e9
    # The engine's gradient path: device -> (pinned) host -> an array on the CPU backend.
    gbps["d2h_engine_path"] = nbytes / median_seconds(
        lambda: place.host_arrays(place.start_to_host({"x": on_device * 1.0}))["x"], reps) / 1e9
    times = []
    for _ in range(reps):  # a fresh device array each time: jax caches an array's host copy
        x = jax.block_until_ready(on_device * 1.0)
        t0 = time.perf_counter()
        np.asarray(x)
        times.append(time.perf_counter() - t0)
    gbps["d2h_pageable"] = nbytes / statistics.median(times) / 1e9
    place.close()
    return gbps


def trace_figures(eng) -> dict:
    """The effective host-to-device rate and the forward's wait per part, from the trace
    of the engine's last step."""
    step = eng.step_count - 1
    h2d = eng.tracer.per_part(step, "h2d")
    waits = eng.tracer.per_part(step, "wait")[:len(eng.schedule.forward)]  # the forward takes its parts first
    busy = sum(s for _, s in h2d)
    blocks = [s for p, s in waits if p.startswith("block.")]
    return {"h2d_weight_bytes": eng.schedule.traffic.h2d_weights, "h2d_lane_s": busy,
            "h2d_effective_gbps": eng.schedule.traffic.h2d_weights / busy / 1e9 if busy else None,
            "forward_wait_s": {p: round(s, 4) for p, s in waits},
            "forward_wait_per_block_s": statistics.mean(blocks) if blocks else None}


def model_config(a) -> ModelConfig:
    heads = max(a.width // a.head_dim, 1)
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                       num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=a.head_dim,
                       compute_dtype="bfloat16", max_position_embeddings=max(a.seq, 2048))


def timed_steps(engine, batches) -> list[float]:
    times = []
    for tokens in batches:
        t0 = time.perf_counter()
        out = engine.step(tokens)  # returns floats: a host sync per step
        times.append(time.perf_counter() - t0)
        print(json.dumps({"step_s": round(times[-1], 3), "loss": round(float(out["loss"]), 4)}), flush=True)
    return times


def throughput(a, cfg: ModelConfig, emit) -> None:
    params = model.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    # Two untimed steps: the first compiles the step, the second the deferred optimizer update.
    batches = [rng.integers(0, cfg.vocab_size, (a.accum, a.batch, a.seq), dtype=np.int32) for _ in range(a.steps + 2)]
    tokens = a.accum * a.batch * a.seq
    flops = model_flops_per_token(model.num_params(cfg), cfg.num_hidden_layers, a.seq, cfg.hidden_size)
    peak, peak_note = peak_flops(jax.devices()[0], "bfloat16")
    state = model.num_params(cfg) * STATE_BYTES
    results = {"params": model.num_params(cfg), "tokens_per_step": tokens, "flops_per_token": flops, "peak": peak,
               "peak_note": peak_note, "state_bytes": state}

    def summarise(name, times, extra=None):
        s = statistics.median(times[2:])
        rec = {"engine": name, "step_s": s, "tokens_per_s": tokens / s, **(extra or {})}
        if peak:
            rec["mfu"] = tokens / s * flops / peak
        results[name] = rec
        emit({"section": "throughput", **rec})

    # The streamed run first: it leaves nothing on the device, the reference may.
    budget = int(state * a.budget_fraction) or None  # None: the engine's own plan
    try:
        eng = StreamEngine(cfg, params, OptimConfig(), StreamConfig(prefetch_depth=a.prefetch, keep_every=1,
                           activations=a.activations, device_budget_bytes=budget), batch_shape=(a.batch, a.seq))
        times = timed_steps(eng, batches)
        stages = {k: round(v, 3) for k, v in eng.stage_seconds().items()}
        summarise("stream", times, {"device_budget": budget, "device_peak": eng.ledger.peak, "stages_s": stages,
                                    "pinned": eng.placement.pinned, **trace_figures(eng)})
        if a.out:
            eng.write_trace(Path(a.out) / "stream_trace.json")
        eng.close()
        del eng
    except Exception:  # noqa: BLE001  report and go on to the reference run
        traceback.print_exc()
        results["stream"] = {"error": traceback.format_exc().splitlines()[-1]}
    if not a.skip_reference:
        try:
            ref = ReferenceTrainer(cfg, params, OptimConfig())
            del params
            summarise("reference", timed_steps(ref, batches))
            del ref
        except Exception:  # noqa: BLE001  report it in the table
            traceback.print_exc()
            results["reference"] = {"error": traceback.format_exc().splitlines()[-1]}
    ref = results.get("reference", {})
    if "step_s" in ref and "step_s" in results["stream"]:
        results["stream_vs_reference"] = ref["step_s"] / results["stream"]["step_s"]
    emit({"section": "summary", **{k: v for k, v in results.items() if k not in ("reference", "stream")},
          "stream_vs_reference": results.get("stream_vs_reference")})
    return results


def markdown(a, cfg, link, tp) -> str:
    dev = jax.devices()[0]
    lines = [f"{datetime.date.today()}, {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
             f"{os.cpu_count()} host cores. Command: `bash experiments/gpu/bench.sh`"
             + (" (dry run on the CPU: tiny sizes, figures mean nothing)" if a.dry else ""), ""]
    if link:
        lines += ["Host<->device bandwidth, one array of %d MiB, median of %d (GB/s):" % (a.link_mib, a.reps), "",
                  "| path | GB/s |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in link.items() if isinstance(v, float)]
        lines += ["", f"Pinned staging available: {link.get('pinned_staging')}", ""]
    if tp:
        n = tp["params"]
        lines += [f"Model: Llama {cfg.num_hidden_layers} blocks x width {cfg.hidden_size} (FFN {cfg.intermediate_size}, "
                  f"vocab {cfg.vocab_size}), {n / 1e9:.2f}B params, bf16 compute, fp32 master, AdamW; "
                  f"{a.accum} x {a.batch} x {a.seq} = {tp['tokens_per_step']:,} tokens per step; persistent state "
                  f"{tp['state_bytes'] / 1e9:.1f} GB; the streamed engine's device budget "
                  f"{(tp['stream'].get('device_budget') or 0) / 1e9:.1f} GB ({a.budget_fraction:.0%} of the state), its peak "
                  f"{tp['stream'].get('device_peak', 0) / 1e9:.1f} GB; state in host RAM.", "",
                  "| engine | step (s) | tokens/s | MFU |", "|---|---|---|---|"]
        for name in ("reference", "stream"):
            r = tp.get(name, {})
            if "step_s" in r:
                lines.append(f"| {name} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                             f"{r.get('mfu', float('nan')):.1%} |")
            else:
                lines.append(f"| {name} | {r.get('error', 'not run')} | | |")
        ratio = tp.get("stream_vs_reference")
        lines += ["", f"Streamed / in-memory throughput: {ratio:.2f}x (target >= 0.85x)" if ratio else "",
                  f"MFU formula: {tp['flops_per_token'] / 1e9:.1f} GFLOP per token (6 x params + 12 x layers x seq x "
                  f"width), real tokens only; {tp['peak_note']}; target >= 45%.",
                  f"Streamed stage seconds per step (summed over parts): {tp['stream'].get('stages_s')}"]
        st = tp["stream"]
        if st.get("h2d_effective_gbps"):
            lines += ["", f"From the streamed run's trace (last step): effective host-to-device rate "
                      f"{st['h2d_effective_gbps']:.1f} GB/s ({st['h2d_weight_bytes'] / 1e9:.2f} GB of weights over "
                      f"{st['h2d_lane_s']:.3f} s from staging each part until its device copy was ready); the "
                      f"forward's wait for its next part {st['forward_wait_per_block_s'] or 0:.4f} s per block "
                      f"(per part: {st['forward_wait_s']})."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny sizes, for the CPU (the test suite runs this)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--accum", type=int, default=16, help="micro-batches per step (their hidden states all "
                    "wait between parts, so with --activations host they live in pinned host memory)")
    ap.add_argument("--budget-fraction", type=float, default=0.25,
                    help="device budget of the streamed engine, as a share of the persistent state")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after two untimed ones")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--activations", default="host", choices=("device", "host"))
    ap.add_argument("--link-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--out", help="directory for bench.json, bench.md and the stream's Chrome trace")
    a = ap.parse_args()
    if a.dry:
        a.layers, a.width, a.ffn, a.vocab, a.head_dim = 2, 64, 128, 256, 16
        a.batch, a.seq, a.accum, a.steps, a.link_mib, a.reps = 2, 32, 2, 1, 4, 2
        a.budget_fraction = 0  # tiny blocks: the budget's fixed overheads exceed a quarter of the state
    records = []

    def emit(rec):
        print(json.dumps(rec, default=str), flush=True)
        records.append(rec)
        if a.out:  # as it goes: a run cut short still leaves what it measured
            Path(a.out).mkdir(parents=True, exist_ok=True)
            with open(Path(a.out) / "bench.jsonl", "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")

    dev = jax.devices()[0]
    emit({"section": "device", "kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__})
    cfg = model_config(a)
    link = tp = None
    failed = False
    try:
        link = link_bandwidth(a.link_mib << 20, a.reps, cfg)
        emit({"section": "link", **link})
    except Exception:  # noqa: BLE001  each section reports on its own
        traceback.print_exc()
        failed = True
    try:
        tp = throughput(a, cfg, emit)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        failed = True
    body = markdown(a, cfg, link, tp)
    print(body)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench.json").write_text(json.dumps(records, indent=1, default=str))
        (Path(a.out) / "bench.md").write_text(body + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
