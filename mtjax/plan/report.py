"""A plan as text for people (`mtjax plan`) and as a dict for machines (`--json`).

Beside the step itself a report may hold the placement table (`fit.placements`), the
whole run's price (`wholerun.price`), the longest row the machine trains (`longest.search`)
and a line on where the hardware profile came from (`machine.LocalProfile.describe`).
"""

from __future__ import annotations

import dataclasses

from mtjax import parts
from mtjax.plan.cost import Plan
from mtjax.plan.fit import Advice, Option
from mtjax.plan.longest import Longest
from mtjax.plan.longest import describe as describe_longest
from mtjax.units import count, duration, flops, rate, seconds, size
from mtjax.plan.wholerun import RunCost


def placement(store) -> str:
    """The tiers of a `StoreConfig`, as `compute=ram,master=disk,opt=disk`."""
    return ",".join(f"{k}={v}" for k, v in store.tiers.items())


def text(plan: Plan, advice: Advice | None = None, options: list[Option] | None = None,
         run: RunCost | None = None, profile_from: str | None = None, longest: Longest | None = None,
         dtype_choice: str | None = None) -> str:
    """The plan as the terminal shows it; `dtype_choice`: what model.compute_dtype=auto chose and why."""
    cfg, st, sh, hw, t, tr = plan.cfg, plan.stream, plan.shape, plan.hardware, plan.times, plan.traffic
    lines = [
        f"model        {cfg.model_type}, {plan.num_params / 1e9:.2f}B params, {cfg.num_hidden_layers} blocks, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, compute dtype {cfg.compute_dtype}",
        *([f"dtype        {dtype_choice}"] if dtype_choice else []),
        f"step         batch {sh.batch} x seq {sh.seq} x accum {sh.accum} = {sh.tokens} tokens; "
        f"keep_every {st.keep_every}, prefetch_depth {st.prefetch_depth}, placement {placement(plan.store)}",
        f"resident     {_resident(plan)}",
        f"hardware     {hw.name} ({hw.source}): {hw.device}" + (f"; data parallel over {plan.schedule.devices} devices"
                                                                  if plan.schedule.devices > 1 else ""),
        *([f"profile      {profile_from}"] if profile_from else []),
        "",
        "memory",
        f"  device peak    {size(plan.device.total):>10}  (weights {size(plan.device.weights)}, "
        f"kept inputs {size(plan.device.activations)}, residuals {size(plan.device.residuals)}, "
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
        *([_base(plan.cfg)] if plan.cfg.base_format != "compute" else []),
        "",
        f"{'stage':<22}{'bytes/step':>12} {'time':>10} {'rate':>11}",
    ]
    n = plan.schedule.devices  # each device's link carries its share of the host->device bytes
    h2d_t = tr.h2d / n / hw.h2d_bytes_per_s if hw.h2d_bytes_per_s else 0.0
    d2h_t = tr.d2h / hw.d2h_bytes_per_s if hw.d2h_bytes_per_s else 0.0
    rows = [
        ("device compute", flops(plan.flops), t.device, f"{flops(plan.flops / t.device)}/s"),
        ("host->device", size(tr.h2d), h2d_t, rate(tr.h2d, h2d_t)),
        ("device->host", size(tr.d2h), d2h_t, rate(tr.d2h, d2h_t)),
        *([(f"all-reduce ({n} dev)", size(tr.allreduce), t.interconnect, rate(tr.allreduce, t.interconnect))]
          if n > 1 else []),
        ("disk read+write", size(tr.disk_read + tr.disk_write), t.disk, rate(tr.disk_read + tr.disk_write, t.disk)),
        ("host memory", size(tr.host_memory), t.host_memory, rate(tr.host_memory, t.host_memory)),
        ("startup (serial)", "", t.startup, ""),
    ]
    lines += [f"  {name:<20}{b:>12} {seconds(s):>10} {r:>11}" for name, b, s, r in rows]
    overlap = "summed: one set of cores" if hw.device_is_host else "overlapped: max of stages + startup"
    lines += [
        "",
        f"step time    {seconds(t.step)} ({overlap}); bound by {t.bound}",
        f"throughput   {count(plan.tokens_per_s)} tokens/s, {plan.model_flops / t.step / 1e12:.2f} model TFLOP/s",
    ]
    if longest is not None:
        lines.append(f"longest row  {describe_longest(longest)}")
    if options:
        lines += ["", *_placement_table(options, advice)]
    if run is not None:
        lines += ["", *_run_lines(run)]
    if advice is not None:
        a = advice
        lines += [
            "",
            "recommended",
            f"  placement        {placement(a.placement)}  ({a.why})",
            f"  prefetch_depth   {a.prefetch_depth}",
            f"  keep_every       {a.plan.stream.keep_every}, activations on the {a.plan.stream.activations}",
            (f"  checkpoint_every {a.checkpoint_every} steps (one checkpoint writes "
             f"{size(a.plan.checkpoint_bytes)} in {seconds(a.checkpoint_seconds)})" if a.plan.checkpoint_bytes else
             "  checkpoint_every 1 step: every kind of state lives in the disk store, so a commit writes nothing more"),
            f"  predicted        {seconds(a.plan.times.step)} per step, {count(a.plan.tokens_per_s)} tokens/s, "
            f"bound by {a.plan.times.bound}" + ("" if a.fits else "  -- DOES NOT FIT"),
        ]
    return "\n".join(lines)


def _resident(plan: Plan) -> str:
    """The parts that stay on the device, as configured or as auto resolved."""
    s = plan.schedule
    count = len(s.part_bytes)
    adapters = f"; the LoRA adapters of {len(s.adapters)} streamed parts (stream.adapters)" if s.adapters else ""
    if not s.resident:
        return (f"none of {count} parts (every part streams){adapters}"
                + (f", {size(s.device.resident)} on the device" if adapters else ""))
    names = "all" if len(s.resident) == count else ", ".join(s.resident)
    saved = f"; {len(s.saved)} recompute groups keep their vjps (remat {s.remat})" if s.saved else ""
    return f"{names} of {count} parts{adapters}, {size(s.device.resident)} on the device{saved}"


def per_host(h, hw) -> str:
    """The lines of one host of a multi-process run (mtjax.plan.hosts.PerHost)."""
    c = h.collectives
    return (f"per host of {h.processes} (one process each; its rows of every micro-batch, of master and of "
            f"optimizer state): RAM {size(h.ram_bytes)}, disk {size(h.disk_bytes)}\n"
            f"network per step and host: reduce-scatter {size(c.reduce_scatter)} + all-gather {size(c.all_gather)} "
            f"at {hw.network_bytes_per_s / 1e9:.1f} GB/s = {h.network_s:.3g} s; step {h.step_s:.3g} s")


def _placement_table(options: list[Option], advice: Advice | None) -> list[str]:
    width = max(len(placement(o.placement)) for o in options)  # the widest, disk for every kind
    header = f"{'placement':<{width + 2}} {'step':>10} {'host RAM':>10} {'disk':>10}"
    lines = [f"{header}   (this run's other settings; fastest first)"]
    for o in options:
        place = o.placement
        marks = [m for m, on in (("configured", o.configured),
                                 ("recommended", advice is not None and place == advice.placement)) if on]
        if o.short:
            marks.append(f"DOES NOT FIT: {', '.join(o.short)}")
        lines.append(f"  {placement(place):<{width}} {seconds(o.plan.times.step):>10} {size(o.plan.ram_needed):>10} "
                     f"{size(o.plan.disk_bytes):>10}   {'; '.join(marks)}".rstrip())
    return lines


def _run_lines(run: RunCost) -> list[str]:
    cost = (f"${run.cost:,.2f} at ${run.price_per_hour:,.2f}/h ({run.price_from})" if run.cost is not None
            else "no price in the hardware profile: pass --price-per-hour")
    lines = [
        f"whole run    {run.steps:,} steps" + (f" ({run.steps_from})" if run.steps_from else ""),
        f"  wall time        {duration(run.wall_s)} on one device: {_hours(run.device_hours)} device-hours",
        f"  cost             {cost}",
        f"  disk writes      {size(run.disk_write_per_step)} per step, {size(run.disk_write)} per run",
    ]
    if run.endurance_used is not None:
        lines.append(f"  drive endurance  the run writes {run.endurance_used:.1%} of the drive's rated "
                     f"{run.endurance_bytes / 1e12:,.0f} TB written ({run.endurance_from})")
    return lines


def _base(cfg) -> str:
    """The frozen base's quantized kernels: their bytes each pass streams, against the compute dtype's."""
    packed, plain = parts.quantized_bytes(cfg)
    return (f"  frozen base    {cfg.base_format}: its kernels stream {size(packed)} a pass, {plain / packed:.2f}x less "
            f"than {size(plain)} in {cfg.compute_dtype}")


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 10 else f"{h:.3g}"


def as_dict(plan: Plan, advice: Advice | None = None, options: list[Option] | None = None,
            run: RunCost | None = None, profile_from: str | None = None, longest: Longest | None = None,
            dtype_choice: str | None = None) -> dict:
    out = {
        "model": {"num_params": plan.num_params, "num_blocks": plan.cfg.num_hidden_layers,
                  "compute_dtype": plan.cfg.compute_dtype, "compute_dtype_choice": dtype_choice,
                  "base_format": plan.cfg.base_format,
                  "quantized_bytes": dict(zip(("stored", "in_compute_dtype"), parts.quantized_bytes(plan.cfg)))},
        "shape": dataclasses.asdict(plan.shape),
        "stream": dataclasses.asdict(plan.stream),
        "store": dataclasses.asdict(plan.store),
        "transfers": list(plan.schedule.transfers),
        "resident": list(plan.schedule.resident),
        "remat": plan.schedule.remat,
        "hardware": plan.hardware.name,
        "profile": profile_from,
        "flops": plan.flops,
        "model_flops": plan.model_flops,
        "state_bytes": dataclasses.asdict(plan.state),
        "device_memory": {**dataclasses.asdict(plan.device), "peak": plan.device.total},
        "host_memory": dataclasses.asdict(plan.host),
        "disk_bytes": plan.disk_bytes,
        "traffic": dataclasses.asdict(plan.traffic),
        "times": dataclasses.asdict(plan.times),
        "tokens_per_s": plan.tokens_per_s,
    }
    if options is not None:
        out["placements"] = [{"placement": o.placement.tiers, "copies": o.placement.copies, "configured": o.configured,
                              "step_s": o.plan.times.step, "ram_needed": o.plan.ram_needed,
                              "disk_bytes": o.plan.disk_bytes, "does_not_fit": list(o.short)} for o in options]
    if longest is not None:
        p = longest.plan
        out["longest_seq"] = {"seq": longest.seq, "context": longest.context,
                              "activations": None if p is None else p.stream.activations,
                              "ffn_chunk_tokens": None if p is None else p.cfg.ffn_chunk_tokens,
                              "device_peak": None if p is None else p.device.total,
                              "ram_needed": None if p is None else p.ram_needed,
                              "tokens_per_s": None if p is None else p.tokens_per_s}
    if run is not None:
        out["run"] = {**dataclasses.asdict(run), "endurance_used": run.endurance_used}
    if advice is not None:
        out["recommended"] = {
            "placement": advice.placement.tiers, "copies": advice.placement.copies,
            "prefetch_depth": advice.prefetch_depth,
            "keep_every": advice.plan.stream.keep_every, "activations": advice.plan.stream.activations,
            "checkpoint_every": advice.checkpoint_every, "step_s": advice.plan.times.step,
            "tokens_per_s": advice.plan.tokens_per_s, "fits": advice.fits, "why": advice.why,
        }
    return out


def _copies(plan) -> str:
    if plan.store.copies == 2:
        return "two copies of disk-tier state and checkpoints"
    return "one copy of disk-tier state and checkpoints, plus the pending gradients"
