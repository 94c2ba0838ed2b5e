"""`mtjax plan CONFIG`: what one training step costs; `mtjax probe`: measure this machine."""

from __future__ import annotations

import dataclasses
import json

from mtjax.errors import MtjaxError


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict memory, traffic and step time of a run; recommend placement")
    p.add_argument("config", help="HF config.json, checkpoint dir, or experiment YAML")
    p.add_argument("--hardware", default="h200", help="built-in profile name or a JSON from `mtjax probe --out`")
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    p.add_argument("--keep-every", type=int, help="keep every k-th block input on the device")
    p.add_argument("--prefetch-depth", type=int, help="parts fetched ahead of the one computing")
    p.add_argument("--placement", help="e.g. compute=ram,master=ram,opt=disk (default: all ram)")
    p.add_argument("--store-copies", type=int, choices=(1, 2), help="copies of disk-tier state (store.copies)")
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16", "float16"),
                   help="dtype of streamed weights and activations (default: the config's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)

    q = subparsers.add_parser("probe", help="measure disk, memory, matmul and host<->device speed into a profile")
    q.add_argument("--out", help="write the profile JSON here (for `mtjax plan --hardware`)")
    q.add_argument("--dir", default=".", help="directory on the disk the store will use (default: .)")
    q.add_argument("--quick", action="store_true", help="small sizes: a rough profile in about a second")
    q.set_defaults(func=run_probe)


def _placement(text: str):
    from mtjax.plan import Placement

    try:
        pairs = dict(item.split("=", 1) for item in text.split(","))
        return Placement(**pairs)
    except (ValueError, TypeError) as e:
        raise MtjaxError(
            f"--placement {text!r} is not valid ({e}); write e.g. compute=ram,master=ram,opt=disk") from None


def run_plan(args) -> int:
    from mtjax import plan as planner
    from mtjax.plan import inputs, report

    overrides = {"compute_dtype": args.compute_dtype} if args.compute_dtype else {}
    cfg, workload, tx = inputs.load(args.config, **overrides)
    knobs = ("batch_size", "seq_len", "grad_accum", "keep_every", "prefetch_depth", "store_copies")
    changes = {name: getattr(args, name) for name in knobs if getattr(args, name) is not None}
    if args.placement:
        changes["placement"] = _placement(args.placement)
    try:
        workload = dataclasses.replace(workload, **changes)
    except ValueError as e:
        raise MtjaxError(str(e)) from None
    hw = planner.load(args.hardware)
    plan = planner.estimate(cfg, workload, hw, tx=tx)
    advice = planner.recommend(plan)
    print(json.dumps(report.as_dict(plan, advice), indent=2) if args.json else report.text(plan, advice))
    return 0


def run_probe(args) -> int:
    from mtjax.plan import probe, report

    profile = probe.run(args.dir, quick=args.quick)
    print(profile.to_json() if not args.out else "", end="")
    if args.out:
        profile.save(args.out)
        print(f"disk read {profile.disk_read_bytes_per_s / 1e9:.2f} GB/s, write "
              f"{profile.disk_write_bytes_per_s / 1e9:.2f} GB/s, memory {profile.host_memory_bytes_per_s / 1e9:.1f} "
              f"GB/s moved, matmul fp32 {profile.matmul_flops_fp32 / 1e9:.0f} / bf16 "
              f"{profile.matmul_flops_bf16 / 1e9:.0f} GFLOP/s, RAM {report.size(profile.host_ram_bytes)}")
        print(f"wrote {args.out}")
    return 0
