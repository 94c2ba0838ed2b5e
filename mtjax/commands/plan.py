"""`mtjax plan CONFIG`: what one training step and the whole run cost; `mtjax probe`: measure this machine."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from mtjax import plan as planner
from mtjax import writable
from mtjax.bounds import AT_LEAST_0, AT_LEAST_1, EVERY, flag
from mtjax.errors import MtjaxError
from mtjax.plan import compute_dtype, fit, hosts, inputs, machine, probe, report, residency, wholerun
from mtjax.plan import longest as planner_longest
from mtjax.plan.hardware import choices
from mtjax.units import size
from mtjax.stream.hosts import share

PLAN_DESCRIPTION = (
    "Predict, before anything is allocated, the device memory, host RAM and disk a run needs, the bytes "
    "each link moves per step, the step time and what bounds it, and what the whole run costs (wall time, "
    "device-hours, price, bytes written to the store's drive). Every placement of the compute, master and "
    "optimizer state is priced in a table, marked where it does not fit; a placement, prefetch depth and "
    "checkpoint interval are recommended; with --longest, the longest row (sequence length) the machine trains with "
    "every part streamed is named. Exits with status 2 and one line when the configured run does not "
    "fit the machine's RAM, disk or device memory."
)


class PlanError(MtjaxError):
    """A plan request that cannot be answered, or a run that does not fit."""


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict memory, traffic, step time and run cost; recommend placement",
                              description=PLAN_DESCRIPTION)
    p.add_argument("config", help="HF config.json, checkpoint dir, or experiment YAML")
    p.add_argument("--hardware", metavar="NAME_OR_JSON",
                   help=f"a built-in profile: {choices()}; or a JSON from `mtjax probe --out`. Default: this "
                        "machine, measured by a quick probe on first use and cached in $XDG_CACHE_HOME/mtjax "
                        "(~/.cache/mtjax)")
    p.add_argument("--reprobe", action="store_true",
                   help="measure this machine again instead of using its cached profile")
    p.add_argument("--steps", type=flag(int, EVERY), metavar="N",
                   help="optimizer steps of the whole run (default: the config's run.steps)")
    p.add_argument("--price-per-hour", type=flag(float, AT_LEAST_0), metavar="USD",
                   help="price of the machine per hour, for the run's cost (default: the profile's typical price)")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    p.add_argument("--keep-every", type=int, help="keep every k-th block input on the device")
    p.add_argument("--prefetch-depth", type=int, help="parts fetched ahead of the one computing")
    p.add_argument("--devices", type=int, metavar="N",
                   help="devices the step runs on, data parallel (stream.devices; default: the profile's count)")
    p.add_argument("--resident", metavar="WHICH",
                   help="stream.resident: auto (the default: the planner's parts for the device budget, as a run "
                        "chooses them), none, all, a count, or part names (embed,block.0,...,head)")
    p.add_argument("--placement", help="e.g. compute=ram,master=ram,opt=disk (default: all ram)")
    p.add_argument("--store-copies", type=int, choices=(1, 2), help="copies of disk-tier state (store.copies)")
    p.add_argument("--processes", type=flag(int, AT_LEAST_1), default=1,
                   help="hosts of a multi-process run, one process each: RAM and disk per host, and the "
                        "network traffic per step against the profile's network_bytes_per_s (default: 1)")
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16", "float16", "auto"),
                   help="dtype of streamed weights and activations (default: the config's); auto: bfloat16 where "
                        "the hardware computes it faster, as a run chooses")
    p.add_argument("--longest", action="store_true",
                   help="also name the longest row (sequence length) this machine trains with every part streamed "
                        "and the run's other settings (a search over plans: seconds)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)

    q = subparsers.add_parser("probe", help="measure disk, memory, matmul and host<->device speed into a profile",
                              description="Measure this machine the way the streaming engine uses it (store-"
                                          "pattern disk writes and cold reads, memory copies, matmuls, the "
                                          "host<->device link, one Llama block) into a hardware profile for "
                                          "`mtjax plan --hardware`.")
    q.add_argument("--out", help="write the profile JSON here (for `mtjax plan --hardware`)")
    q.add_argument("--dir", default=".", help="directory on the disk the store will use (default: .)")
    q.add_argument("--quick", action="store_true", help="small sizes: a rough profile in seconds")
    q.set_defaults(func=run_probe)


def _placement(text: str) -> dict[str, str]:
    """{kind: tier} of `--placement compute=ram,...`; the tiers are checked by StoreConfig."""
    items = text.split(",")
    bare = [item for item in items if "=" not in item]
    pairs = dict(item.split("=", 1) for item in items if "=" in item)
    unknown = sorted(set(pairs) - {"compute", "master", "opt"})
    if bare or unknown:
        why = f"{bare[0]!r} is not kind=tier" if bare else f"unknown kind(s) {unknown}"
        raise PlanError(f"--placement {text!r} is not valid ({why}); write e.g. compute=ram,master=ram,opt=disk")
    return pairs


def _run_length(args) -> tuple[int, str]:
    """(steps, where the number comes from)."""
    if args.steps is not None:
        return args.steps, "--steps"
    steps = inputs.run_steps(args.config)
    if Path(args.config).suffix in (".yaml", ".yml"):
        return steps, f"run.steps of {args.config}; --steps sets another"
    return steps, "the default run.steps; --steps sets another"


def _check_context(cfg, seq_len: int, name: str) -> None:
    """Refuse rows longer than the model's context: no run of them can be meant (training
    refuses them too), and the planner's trace of a block grows with the row."""
    if seq_len > cfg.max_position_embeddings:
        raise PlanError(f"{name} ({seq_len}) exceeds the model's context (model.max_position_embeddings = "
                        f"{cfg.max_position_embeddings}): lower {name}, or extend the context in an experiment YAML "
                        f"(model.max_position_embeddings, with model.rope_scaling such as "
                        f"{{rope_type: yarn, factor: 4}})")


def _hardware(args):
    """(the profile to plan for, where it came from: None for --hardware's)."""
    if args.hardware:
        return planner.load(args.hardware), None
    local = machine.profile(reprobe=args.reprobe)
    return local.profile, local.describe()


def run_plan(args) -> int:
    if args.reprobe and args.hardware:
        raise PlanError("--reprobe measures this machine, --hardware names another profile: pass one of them")
    hardware = functools.cache(lambda: _hardware(args))
    overrides = {"compute_dtype": args.compute_dtype} if args.compute_dtype else {}
    # compute_dtype=auto: chosen for the profile planned for, as a run on it chooses
    given_run = inputs.load(args.config, lambda: hardware()[0], **overrides)

    def given(*names):
        return {name: getattr(args, name) for name in names if getattr(args, name) is not None}

    store = dict(_placement(args.placement) if args.placement else {})
    if args.store_copies is not None:
        store["copies"] = args.store_copies
    try:  # the config dataclasses check every value
        data = dataclasses.replace(given_run.data, **given("batch_size", "seq_len", "grad_accum"))
        share(data.batch_size, args.processes)  # each process's rows of a micro-batch: equal, or one line
        resident = {} if args.resident is None else {"resident": int(args.resident) if args.resident.lstrip("-").isdigit()
                                                      else args.resident}
        stream = dataclasses.replace(given_run.stream, **given("keep_every", "prefetch_depth", "devices"), **resident)
        store = dataclasses.replace(given_run.store, **store)
    except ValueError as e:  # ConfigError included
        raise PlanError(str(e)) from None
    _check_context(given_run.cfg, data.seq_len, "--seq-len" if args.seq_len is not None else
                   f"data.seq_len of {args.config}")
    steps, steps_from = _run_length(args)
    hw, profile_from = hardware()

    # stream.resident=auto as a run on this hardware resolves it (device budget included); a
    # multi-process run's every part streamed, as it trains.
    stream = residency.for_inputs(dataclasses.replace(given_run, stream=stream, store=store, data=data), hw,
                                  args.processes)
    plan = planner.estimate(given_run.cfg, stream, store, planner.StepShape.of(data), hw, tx=given_run.tx)
    advice = planner.recommend(plan)
    room = fit.limits(hw)
    options = fit.placements(plan, room)
    run = wholerun.price(plan, steps, steps_from, args.price_per_hour)
    longest = planner_longest.search(plan, room) if args.longest else None
    mine = hosts.of_processes(plan, args.processes)  # one process's step, priced once for both uses below
    per_host = hosts.per_host(mine, args.processes, given_run.tx) if args.processes > 1 else None
    if args.json:
        shown = report.as_dict(plan, advice, options, run, profile_from, longest, given_run.dtype_choice)
        if per_host is not None:
            shown["per_host"] = {**per_host._asdict(), "collectives": per_host.collectives._asdict()}
        shown = json.dumps(shown, indent=2)
    else:
        shown = report.text(plan, advice, options, run, profile_from, longest, given_run.dtype_choice)
        if per_host is not None:
            shown += "\n" + report.per_host(per_host, hw)
    print(shown, flush=True)
    # Checked as the preflight checks it: one host's share when several processes train.
    problem = fit.check(hosts.host_plan(mine, args.processes, given_run.tx), room.ram, room.disk, room.device,
                        tx=given_run.tx)
    if problem:
        where = hw.name if args.processes == 1 else f"each host of {args.processes} ({hw.name})"
        raise PlanError(f"the configured run does not fit {where}: {problem}")
    return 0


def run_probe(args) -> int:
    # Both paths are checked before the probe spends its time measuring.
    if not Path(args.dir).is_dir():
        raise PlanError(f"--dir {args.dir} is not a directory; name an existing directory on the disk the store "
                        "will use")
    writable.check(args.dir, "--dir")
    if args.out:
        writable.check(args.out, "--out", kind="file")
    profile = probe.run(args.dir, quick=args.quick)
    print(profile.to_json() if not args.out else "", end="")
    if args.out:
        profile.save(args.out)
        print(f"disk read {profile.disk_read_bytes_per_s / 1e9:.2f} GB/s, write "
              f"{profile.disk_write_bytes_per_s / 1e9:.2f} GB/s, memory {profile.host_memory_bytes_per_s / 1e9:.1f} "
              f"GB/s moved, matmul fp32 {profile.matmul_flops_fp32 / 1e9:.0f} / bf16 "
              f"{profile.matmul_flops_bf16 / 1e9:.0f} GFLOP/s, RAM {size(profile.host_ram_bytes)}")
        print(f"model.compute_dtype=auto: {compute_dtype.describe(*compute_dtype.choose(profile))}")
        print(f"wrote {args.out}")
    return 0
