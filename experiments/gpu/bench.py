"""The GPU benchmark of issues 5 and 31, one command on one accelerator (run by bench.sh).

It prints one JSON line per figure, {"figure", "value", "unit", "dry", ...}, as each is
measured (details go to --out DIR: bench.jsonl as it goes, then bench.json, bench.md):

- link_pinned_gbps, link_mapped_gbps: host -> device GB/s of one large array from XLA's
  pinned pool, and from a numpy buffer mapped for the device's DMA (the client's
  `dma_map`; null with the client's refusal where it has none, e.g. the CPU); beside
  them the engine's own staging path and the pageable and device -> host rates;
- block_staging_s: one block's compute weights staged as the engine stages them
  (mtjax.stream.staging: mapped where the client maps, else each leaf on its own thread);
- stream_step_s, stream_tokens_per_s, stream_mfu, stream_compiles_after_step_1,
  stream_forward_wait_s (per part) and stream_forward_wait_share (the forward's wait
  for its next block over that block's compute, the largest): the streaming engine on a
  model whose state fits the device (>= 64k tokens per step, bf16), from the trace of
  its last step;
- reference_step_s, reference_tokens_per_s, reference_mfu, reference_compiles_after_step_1
  and stream_vs_reference: the whole model in device memory (mtjax.reference);
- first_resident_*: the streamed figures again with the first parts the forward needs
  (the embedding and the first blocks, --first-resident) resident on the device and
  updated there, first_resident_vs_reference: whether keeping them closes the step
  boundary (the clip needs the whole backward's norm, so a streamed step's first parts
  are updated on the host after its last gradient and the next forward waits for them);
- stream_planned_step_s, first_resident_planned_step_s: the planner's step time for the
  same runs (mtjax.plan.cost on this device's profile), beside the measured ones;
- capped_*: the same streamed figures in a process of its own whose device memory is
  really capped (XLA_PYTHON_CLIENT_MEM_FRACTION, read when its backend starts) at a
  quarter of the state, the engine's budget inside that cap; capped_vs_reference.

Parameters are created on the host (mtjax.stream.tiers.host_device). MFU counts model
FLOPs of real tokens only: 6 x params + 12 x layers x seq x width per token
(mtjax.plan.cost.mfu_flops_per_token, as `mtjax train` counts them; the recompute's extra
forward is not counted),
against the device's dense bf16 peak (mtjax.plan built-in profile). A full run writes
its section (gpu-path: date, machine, every figure) into docs/benchmarks.md; `--dry`
runs every path at tiny sizes on the CPU in seconds, marks each figure dry and writes
no docs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mtjax import model, partid, parts  # noqa: E402
from mtjax.config import StoreConfig, StreamConfig  # noqa: E402
from mtjax.hostmem import aligned_empty  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.optim import OptimConfig  # noqa: E402
from mtjax.plan import residency  # noqa: E402
from mtjax.plan.cost import estimate, mfu_flops_per_token  # noqa: E402
from mtjax.progress import peak_flops  # noqa: E402
from mtjax.reference import ReferenceTrainer  # noqa: E402
from mtjax.stream import StreamEngine  # noqa: E402
from mtjax.stream.step_bytes import StepShape  # noqa: E402
from mtjax.stream.staging import Placement  # noqa: E402
from mtjax.stream.tiers import host_device  # noqa: E402

STATE_BYTES = 2 + 4 + 4 + 4  # bf16 weights, fp32 master, AdamW m and v, per parameter
SECTION = "gpu-path"  # docs/benchmarks.md's section of this script

COMPILES = [0]  # programs this process compiled, or loaded from the persistent cache (bench.sh sets one)


def _count_compile(event: str, *_a, **_kw) -> None:
    if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
        COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)
jax.monitoring.register_event_listener(_count_compile)


class Figures:
    """Prints one JSON line per figure and keeps every record (for bench.json / bench.md)."""

    def __init__(self, dry: bool, out: str | None, prefix: str = ""):
        self.dry, self.out, self.prefix = dry, out, prefix
        self.records: list[dict] = []
        self.values: dict[str, object] = {}

    def _keep(self, rec: dict) -> None:
        self.records.append(rec)
        if self.out:  # as it goes: a run cut short still leaves what it measured
            Path(self.out).mkdir(parents=True, exist_ok=True)
            with open(Path(self.out) / "bench.jsonl", "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")

    def figure(self, name: str, value, unit: str, **context) -> None:
        name = self.prefix + name
        self.values[name] = value
        rec = {"figure": name, "value": value, "unit": unit, "dry": self.dry, **context}
        print(json.dumps(rec, default=str), flush=True)
        self._keep(rec)

    def section(self, rec: dict) -> None:
        """A section's details: kept in the files, not printed."""
        self._keep(rec)


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def link_bandwidth(nbytes: int, reps: int, cfg: ModelConfig) -> dict:
    """GB/s of each transfer path for one array of `nbytes`, and one block's staging time."""
    place = Placement()
    host = aligned_empty((nbytes // 4,), np.float32)
    host.fill(1.0)  # touched: page faults are not a link cost
    out = {"pinned_staging": place.pinned, "mapped_staging": place.mapped, "mapped_error": place.mapped_error}
    out["h2d_pageable"] = nbytes / median_seconds(lambda: jax.device_put(host, place.on_device), reps) / 1e9
    out["h2d_engine_path"] = nbytes / median_seconds(lambda: place.to_device({"x": host})["x"], reps) / 1e9
    on_device = jax.block_until_ready(jax.device_put(host, place.on_device))
    out["h2d_pinned"] = None
    if place.pinned:
        out["host_to_pinned"] = nbytes / median_seconds(lambda: jax.device_put(host, place.on_host), reps) / 1e9
        pinned = jax.block_until_ready(jax.device_put(host, place.on_host))
        out["h2d_pinned"] = nbytes / median_seconds(lambda: jax.device_put(pinned, place.on_device), reps) / 1e9
        out["d2h_pinned"] = nbytes / median_seconds(lambda: jax.device_put(on_device, place.on_host), reps) / 1e9
    out["h2d_mapped"] = None
    mapped = aligned_empty((nbytes // 4,), np.float32)
    mapped.fill(1.0)
    place.register({"x": mapped})
    if place.is_mapped(mapped):  # the client DMAs straight out of it
        out["h2d_mapped"] = nbytes / median_seconds(lambda: jax.device_put(mapped, place.on_device), reps) / 1e9
    # One block's compute weights as the engine stages them (mapped where the client maps).
    buffers = {n: aligned_empty(s.shape, s.dtype) for n, s in parts.schema(cfg, "block.0", "compute").items()}
    for b in buffers.values():
        b.fill(1)
    place.register(buffers)
    out["block_bytes"] = sum(b.nbytes for b in buffers.values())
    out["block_staging_s"] = median_seconds(lambda: place.to_device(buffers), reps)
    # The engine's gradient path: device -> (pinned) host -> an array on the CPU backend.
    out["d2h_engine_path"] = nbytes / median_seconds(
        lambda: place.host_arrays(place.start_to_host({"x": on_device * 1.0}))["x"], reps) / 1e9
    times = []
    for _ in range(reps):  # a fresh device array each time: jax caches an array's host copy
        x = jax.block_until_ready(on_device * 1.0)
        t0 = time.perf_counter()
        np.asarray(x)
        times.append(time.perf_counter() - t0)
    out["d2h_pageable"] = nbytes / statistics.median(times) / 1e9
    place.close()
    return out


def trace_figures(eng) -> dict:
    """From the trace of the engine's last step: the forward's wait for each part, that
    wait over the part's forward compute, and the h2d lane's effective rate."""
    step = eng.step_count - 1
    forward = len(eng.schedule.forward)
    waits = eng.tracer.per_part(step, "wait")[:forward]  # the forward takes its parts first
    computes = {}
    for p, s in eng.tracer.per_part(step, "compute"):
        computes.setdefault(p, s)  # a part's first compute in the step is its forward
    shares = [w / computes[p] for p, w in waits if p.startswith("block.") and computes.get(p)]
    h2d = sum(s for _, s in eng.tracer.per_part(step, "h2d"))
    return {"forward_wait_s": {p: round(s, 5) for p, s in waits},
            "forward_wait_share": max(shares) if shares else None,
            "h2d_weight_bytes": eng.schedule.traffic.h2d_weights, "h2d_lane_s": h2d,
            "h2d_effective_gbps": eng.schedule.traffic.h2d_weights / h2d / 1e9 if h2d else None}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model (`model_config` reads them) and step-shape arguments, defaulting to the
    H200 run's sizes; experiments/gpu/aot_memory.py takes the same, to compile the
    engine's programs at the bench's shapes."""
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--accum", type=int, default=8, help="micro-batches per step (8 x 16 x 512 = 64k tokens)")


def model_config(a) -> ModelConfig:
    heads = max(a.width // a.head_dim, 1)
    return ModelConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                       num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=a.head_dim,
                       compute_dtype="bfloat16", max_position_embeddings=max(a.seq, 2048))


def host_params(cfg: ModelConfig):
    """Initial parameters made on the host CPU backend: none of them passes through the device."""
    with jax.default_device(host_device()):
        return model.init_params(cfg, seed=0)


def timed_steps(engine, batches) -> tuple[list[float], int]:
    """Seconds of each step, and the XLA compiles after the first step."""
    times, after_first = [], None
    for i, tokens in enumerate(batches):
        t0 = time.perf_counter()
        out = engine.step(tokens)  # returns floats: a host sync per step
        times.append(time.perf_counter() - t0)
        if i == 0:
            after_first = COMPILES[0]
        print(f"step {i}: {times[-1]:.3f} s, loss {float(out['loss']):.4f}", file=sys.stderr, flush=True)
    return times, COMPILES[0] - after_first


def batches_of(a, cfg: ModelConfig) -> list[np.ndarray]:
    # Two untimed steps: the first compiles the step, the second runs the deferred update's first pass.
    rng = np.random.default_rng(0)
    return [rng.integers(0, cfg.vocab_size, (a.accum, a.batch, a.seq), dtype=np.int32) for _ in range(a.steps + 2)]


def device_memory_at_peak(eng, tokens) -> dict:
    """One more step with an observer on the engine's runner: at each gradient and kept
    activation, the device's bytes in use (XLA's allocator, where it reports) and the live
    arrays on it; returns the moment with the most in use and the largest arrays then, so
    that a device peak above the plan names what holds it."""
    device = jax.devices()[0]
    seen = {"bytes_in_use": -1}

    def observe(event, _value):
        used = (device.memory_stats() or {}).get("bytes_in_use", 0)
        # In device memory (not pinned host copies), each buffer once: copy_to_host_async
        # makes a second live array, a view, over the buffer it copies.
        live = list({(x.unsafe_buffer_pointer() if len(x.devices()) == 1 else id(x)): x for x in jax.live_arrays()
                     if device in x.devices()
                     and getattr(x.sharding, "memory_kind", None) in (None, "device")}.values())
        total = sum(x.nbytes for x in live)
        if max(used, total) > seen["bytes_in_use"]:
            groups = {}
            for x in live:
                key = f"{x.dtype}{list(x.shape)}"
                groups[key] = groups.get(key, 0) + x.nbytes
            top = sorted(groups.items(), key=lambda kv: -kv[1])[:12]
            seen.update(bytes_in_use=max(used, total), allocator=used, live_arrays=total, at=event,
                        largest={k: v for k, v in top})

    eng.runner.observe(observe)
    eng.step(tokens)
    return seen


def measure(figs: Figures, a, cfg: ModelConfig, name: str, make) -> dict:
    """Step time, tokens/s, MFU and compiles after step 1 of the engine `make()` builds."""
    tokens = a.accum * a.batch * a.seq
    flops = mfu_flops_per_token(cfg, a.seq)
    peak, _ = peak_flops(jax.devices()[0], "bfloat16")
    eng = make()
    times, compiles = timed_steps(eng, batches_of(a, cfg))
    step_s = statistics.median(times[2:])
    rec = {"step_s": step_s, "tokens_per_s": tokens / step_s, "mfu": tokens / step_s * flops / peak if peak else None,
           "compiles_after_step_1": compiles}
    rec["allocator_peak_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    if isinstance(eng, StreamEngine):
        rec.update(trace_figures(eng), device_peak=eng.ledger.peak, planned=eng.schedule.device.total,
                   stages_s=eng.stage_seconds())
        if a.out:
            eng.write_trace(Path(a.out) / f"{name}_trace.json")
        rec["memory_at_peak"] = device_memory_at_peak(eng, batches_of(a, cfg)[0])  # after the timed steps
        eng.close()
    del eng
    figs.figure(f"{name}_step_s", rec["step_s"], "s", tokens_per_step=tokens, micro_batch=[a.batch, a.seq])
    figs.figure(f"{name}_tokens_per_s", rec["tokens_per_s"], "tokens/s")
    figs.figure(f"{name}_mfu", rec["mfu"], "of bf16 peak", target=">= 0.45")
    figs.figure(f"{name}_compiles_after_step_1", compiles, "compiles", target="0")
    figs.figure(f"{name}_allocator_peak_bytes", rec["allocator_peak_bytes"], "bytes",
                ledger_peak=rec.get("device_peak"), planned=rec.get("planned"))
    if "memory_at_peak" in rec:
        figs.figure(f"{name}_device_bytes_at_peak", rec["memory_at_peak"]["bytes_in_use"], "bytes",
                    **{k: v for k, v in rec["memory_at_peak"].items() if k != "bytes_in_use"})
    if "forward_wait_s" in rec:
        figs.figure(f"{name}_forward_wait_s", rec["forward_wait_s"], "s per part")
        figs.figure(f"{name}_forward_wait_share", rec["forward_wait_share"], "of the block's compute",
                    target="< 0.05")
    figs.section({"section": name, **rec})
    return rec


def stream_config(a, budget: int | None = None, resident: tuple[str, ...] = ()) -> StreamConfig:
    return StreamConfig(prefetch_depth=a.prefetch, keep_every=1, activations=a.activations,
                        device_budget_bytes=budget, resident=resident or "none")


def stream_engine(a, cfg: ModelConfig, params, budget: int | None, resident: tuple[str, ...] = ()):
    return StreamEngine(cfg, params, OptimConfig(), stream_config(a, budget, resident), batch_shape=(a.batch, a.seq))


def first_parts(a, cfg: ModelConfig) -> tuple[str, ...]:
    """The embedding and the first --first-resident - 1 blocks: the parts the next forward needs first."""
    return (partid.EMBED, *(partid.block(i) for i in range(min(a.first_resident - 1, cfg.num_hidden_layers))))


def planned_step_s(a, cfg: ModelConfig, resident: tuple[str, ...] = ()) -> float:
    """The planner's step time for the streamed run on this device's profile (RAM tier)."""
    shape = StepShape(a.batch, a.seq, a.accum)
    hw = residency.profile_of(jax.devices()[0])
    return estimate(cfg, stream_config(a, resident=resident), StoreConfig(), shape, hw).times.step


def capped(a, cfg: ModelConfig, figs: Figures) -> dict:
    """The streamed run with the state 4x over the device memory, in a process of its own
    (the cap is read when a backend starts). Returns the child's records."""
    state = model.num_params(cfg) * STATE_BYTES
    cap = state // 4
    env = dict(os.environ)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit:  # XLA_PYTHON_CLIENT_MEM_FRACTION caps the device allocator (the CPU has none)
        total = limit / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))  # this process's share: JAX's default
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{cap / total:.4f}"
    child_out = Path(a.out or os.environ.get("TMPDIR", "/tmp")) / "capped.json"
    sizes = ("layers", "width", "ffn", "vocab", "head_dim", "seq", "steps", "prefetch", "activations")
    # The same tokens per step in smaller micro-batches: a quarter of the state leaves less
    # room for one micro-batch's residuals and logits than the whole device did.
    batch = min(a.capped_batch, a.batch)
    args_shape = (f"--batch={batch}", f"--accum={a.accum * a.batch // batch}")
    args = [sys.executable, __file__, "--capped-child", str(child_out), *(["--dry"] if a.dry else []),
            *(f"--{k.replace('_', '-')}={getattr(a, k)}" for k in sizes), *args_shape]
    r = subprocess.run(args, env=env)
    if r.returncode:
        raise RuntimeError(f"the capped run's process failed (exit {r.returncode})")
    child = json.loads(child_out.read_text())
    for rec in child["records"]:
        figs._keep(rec)  # the child printed its figures itself
        if "figure" in rec:
            figs.values[rec["figure"]] = rec["value"]
    figs.values["capped_memory_fraction"] = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return child


def capped_child(a, cfg: ModelConfig, path: str) -> int:
    figs = Figures(a.dry, None, prefix="capped_")
    state = model.num_params(cfg) * STATE_BYTES
    # The engine's ledger a little inside the allocator's cap (its own pools and programs).
    budget = None if a.dry else int(state / 4 * 0.9)
    params = host_params(cfg)
    rec = measure(figs, a, cfg, "stream", lambda: stream_engine(a, cfg, params, budget))
    figs.figure("stream_state_over_cap", 4.0 if not a.dry else None, "x",
                memory_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), device_budget=budget)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"records": figs.records, "stream": rec}, default=str))
    return 0


def markdown(a, cfg: ModelConfig, figs: Figures) -> str:
    dev = jax.devices()[0]
    v = figs.values
    lines = ["## GPU path: link, staging, streamed vs in-memory, 4x over a real cap (experiments/gpu/bench.sh)", "",
             f"{datetime.date.today()}, {dev.device_kind} ({dev.platform}), jax {jax.__version__}, host "
             f"{platform.node() or 'unnamed'} with {os.cpu_count()} cores. Command: `bash experiments/gpu/bench.sh`"
             + (" (dry run on the CPU: tiny sizes, figures mean nothing)" if a.dry else ""), "",
             f"Model: Llama {cfg.num_hidden_layers} blocks x width {cfg.hidden_size} (FFN {cfg.intermediate_size}, "
             f"vocab {cfg.vocab_size}), {model.num_params(cfg) / 1e9:.2f}B params, bf16 compute, fp32 master, AdamW; "
             f"{a.accum} x {a.batch} x {a.seq} = {a.accum * a.batch * a.seq:,} tokens per step; the capped run's "
             f"device memory fraction {v.get('capped_memory_fraction')}.", "",
             "| figure | value | target |", "|---|---|---|"]
    targets = {r["figure"]: r.get("target", "") for r in figs.records if "figure" in r}
    for name, value in v.items():
        if name in targets:
            shown = f"{value:.4g}" if isinstance(value, float) else json.dumps(value, default=str)
            lines.append(f"| {name} | {shown} | {targets[name]} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny sizes on the CPU: every path, figures marked dry, no docs")
    add_model_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after two untimed ones (their median counts)")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--first-resident", type=int, default=3,
                    help="parts kept resident in the first_resident run: the embedding and the first blocks (0 skips it)")
    ap.add_argument("--capped-batch", type=int, default=4, help="rows per micro-batch of the capped run (same tokens per step)")
    ap.add_argument("--activations", default="host", choices=("device", "host"))
    ap.add_argument("--link-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-capped", action="store_true", help="leave out the run 4x over a real memory cap")
    ap.add_argument("--out", help="directory for bench.jsonl, bench.json, bench.md and the streams' Chrome traces")
    ap.add_argument("--capped-child", help=argparse.SUPPRESS)  # the capped run's own process: its records file
    a = ap.parse_args()
    if a.dry:
        a.layers, a.width, a.ffn, a.vocab, a.head_dim = 2, 64, 128, 256, 16
        a.batch, a.seq, a.accum, a.steps, a.link_mib, a.reps = 2, 32, 2, 1, 4, 2
        a.first_resident = min(a.first_resident, 2)  # of 2 blocks, block.1 still streams
    cfg = model_config(a)
    if a.capped_child:
        return capped_child(a, cfg, a.capped_child)
    figs = Figures(a.dry, a.out)
    dev = jax.devices()[0]
    figs.section({"section": "device", "kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__})
    failed = False
    try:
        link = link_bandwidth(a.link_mib << 20, a.reps, cfg)
        figs.section({"section": "link", **link})
        figs.figure("link_pinned_gbps", link["h2d_pinned"], "GB/s", pinned_staging=link["pinned_staging"])
        figs.figure("link_mapped_gbps", link["h2d_mapped"], "GB/s", refused=link["mapped_error"])
        figs.figure("block_staging_s", link["block_staging_s"], "s", block_bytes=link["block_bytes"])
    except Exception:  # noqa: BLE001  each part reports on its own
        traceback.print_exc()
        failed = True
    params = host_params(cfg)
    runs = {"stream": ()}
    if a.first_resident:
        runs["first_resident"] = first_parts(a, cfg)
    for name, resident in runs.items():
        try:
            figs.figure(f"{name}_planned_step_s", planned_step_s(a, cfg, resident), "s", resident=list(resident))
            measure(figs, a, cfg, name, lambda: stream_engine(a, cfg, params, None, resident))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed = True
    try:
        measure(figs, a, cfg, "reference", lambda: ReferenceTrainer(cfg, params, OptimConfig()))
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        failed = True
    if not a.skip_capped:  # last: its own process, beside the device memory this one's allocator keeps
        try:
            capped(a, cfg, figs)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed = True
    ref = figs.values.get("reference_step_s")
    if ref and figs.values.get("stream_step_s"):
        figs.figure("stream_vs_reference", ref / figs.values["stream_step_s"], "x", target=">= 0.97")
    if ref and figs.values.get("first_resident_step_s"):
        figs.figure("first_resident_vs_reference", ref / figs.values["first_resident_step_s"], "x", target=">= 0.97")
    if ref and figs.values.get("capped_stream_step_s"):
        figs.figure("capped_vs_reference", ref / figs.values["capped_stream_step_s"], "x", target=">= 0.85")
    body = markdown(a, cfg, figs)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench.json").write_text(json.dumps(figs.records, indent=1, default=str))
        (Path(a.out) / "bench.md").write_text(body + "\n")
    if not a.dry:  # by the harness's own command: importing it would set JAX_PLATFORMS for the capped process
        section = Path(a.out or os.environ.get("TMPDIR", "/tmp")) / "bench.md"
        section.parent.mkdir(parents=True, exist_ok=True)
        section.write_text(body + "\n")
        subprocess.run([sys.executable, str(ROOT / "experiments/bench/harness.py"), "section", SECTION, str(section)],
                       stdout=sys.stderr, check=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
