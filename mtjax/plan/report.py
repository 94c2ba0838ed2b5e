"""A plan as text for people (`mtjax plan`) and as a dict for machines (`--json`)."""

from __future__ import annotations

import dataclasses

from mtjax.plan.cost import Plan
from mtjax.plan.fit import Advice


def size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def rate(bytes_: float, s: float) -> str:
    return f"{bytes_ / s / 1e9:.1f} GB/s" if s > 0 else "-"


def text(plan: Plan, advice: Advice | None = None) -> str:
    cfg, w, hw, t, tr = plan.cfg, plan.workload, plan.hardware, plan.times, plan.traffic
    lines = [
        f"model        {cfg.model_type}, {plan.num_params / 1e9:.2f}B params, {cfg.num_hidden_layers} blocks, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, compute dtype {cfg.compute_dtype}",
        f"step         batch {w.batch_size} x seq {w.seq_len} x accum {w.grad_accum} = {w.tokens_per_step} tokens; "
        f"keep_every {w.keep_every}, prefetch_depth {w.prefetch_depth}, placement {w.placement}",
        f"hardware     {hw.name} ({hw.source}): {hw.device}",
        "",
        "memory",
        f"  device peak    {size(plan.device.peak):>10}  (weights {size(plan.device.weights)}, "
        f"kept inputs {size(plan.device.kept_inputs)}, residuals {size(plan.device.residuals)}, "
        f"head {size(plan.device.head)}, working {size(plan.device.working)}) of {size(hw.device_memory_bytes)}",
        f"  host RAM       {size(plan.host.total):>10}  (state {size(plan.host.state)}, grads {size(plan.host.grads)}, "
        f"staging {size(plan.host.staging)}, activations {size(plan.host.activations)}, "
        f"runtime {size(plan.host.runtime)}) of {size(hw.host_ram_bytes)}",
        *([f"  RAM in all     {size(plan.ram_needed):>10}  (the device is the host: its peak is in RAM too)"]
          if hw.device_is_host else []),
        f"  disk           {size(plan.disk_bytes):>10}  ({_copies(plan)}) "
        f"of {size(hw.disk_bytes)}",
        f"  state          compute {size(plan.state.compute)}, master {size(plan.state.master)}, "
        f"opt {size(plan.state.opt)}",
        "",
        f"{'stage':<22}{'bytes/step':>12}{'time':>11}{'rate':>12}",
    ]
    h2d_t = tr.h2d / hw.h2d_bytes_per_s if hw.h2d_bytes_per_s else 0.0
    d2h_t = tr.d2h / hw.d2h_bytes_per_s if hw.d2h_bytes_per_s else 0.0
    rows = [
        ("device compute", f"{plan.flops / 1e12:.1f} TF", t.device, f"{plan.flops / t.device / 1e12:.1f} TF/s"),
        ("host->device", size(tr.h2d), h2d_t, rate(tr.h2d, h2d_t)),
        ("device->host", size(tr.d2h), d2h_t, rate(tr.d2h, d2h_t)),
        ("disk read+write", size(tr.disk_read + tr.disk_write), t.disk, rate(tr.disk_read + tr.disk_write, t.disk)),
        ("host memory", size(tr.host_memory), t.host_memory, rate(tr.host_memory, t.host_memory)),
        ("startup (serial)", "", t.startup, ""),
    ]
    lines += [f"  {name:<20}{b:>12}{seconds(s):>11}{r:>12}" for name, b, s, r in rows]
    overlap = "summed: one set of cores" if hw.device_is_host else "overlapped: max of stages + startup"
    lines += [
        "",
        f"step time    {seconds(t.step)} ({overlap}); bound by {t.bound}",
        f"throughput   {plan.tokens_per_s:,.0f} tokens/s, {plan.model_flops / t.step / 1e12:.2f} model TFLOP/s",
    ]
    if advice is not None:
        a = advice
        lines += [
            "",
            "recommended",
            f"  placement        {a.placement}  ({a.why})",
            f"  prefetch_depth   {a.prefetch_depth}",
            f"  keep_every       {a.plan.workload.keep_every}, activations on the {a.plan.workload.activations}",
            (f"  checkpoint_every {a.checkpoint_every} steps (one checkpoint writes "
             f"{size(a.plan.checkpoint_bytes)} in {seconds(a.checkpoint_seconds)})" if a.plan.checkpoint_bytes else
             "  checkpoint_every 1 step: master and opt live in the disk store, which commits every step"),
            f"  predicted        {seconds(a.plan.times.step)} per step, {a.plan.tokens_per_s:,.0f} tokens/s, "
            f"bound by {a.plan.times.bound}" + ("" if a.fits else "  -- DOES NOT FIT"),
        ]
    return "\n".join(lines)


def as_dict(plan: Plan, advice: Advice | None = None) -> dict:
    out = {
        "model": {"num_params": plan.num_params, "num_blocks": plan.cfg.num_hidden_layers,
                  "compute_dtype": plan.cfg.compute_dtype},
        "workload": dataclasses.asdict(plan.workload),
        "hardware": plan.hardware.name,
        "flops": plan.flops,
        "model_flops": plan.model_flops,
        "state_bytes": dataclasses.asdict(plan.state),
        "device_memory": dataclasses.asdict(plan.device),
        "host_memory": dataclasses.asdict(plan.host),
        "disk_bytes": plan.disk_bytes,
        "traffic": dataclasses.asdict(plan.traffic),
        "times": dataclasses.asdict(plan.times),
        "tokens_per_s": plan.tokens_per_s,
    }
    if advice is not None:
        out["recommended"] = {
            "placement": dataclasses.asdict(advice.placement), "prefetch_depth": advice.prefetch_depth,
            "keep_every": advice.plan.workload.keep_every, "activations": advice.plan.workload.activations,
            "checkpoint_every": advice.checkpoint_every, "step_s": advice.plan.times.step,
            "tokens_per_s": advice.plan.tokens_per_s, "fits": advice.fits, "why": advice.why,
        }
    return out


def _copies(plan) -> str:
    if plan.workload.store_copies == 2:
        return "two copies of disk-tier state and checkpoints"
    return "one copy of disk-tier state and checkpoints, plus the pending gradients"
