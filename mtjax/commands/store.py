"""`mtjax import`, `mtjax export`, `mtjax init`: fill a layer store or turn it back into a checkpoint;
`mtjax store reshard`: a run's store for another number of processes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mtjax import config as experiment
from mtjax import writable
from mtjax.bounds import AT_LEAST_1, SEED, flag
from mtjax.errors import MtjaxError
from mtjax.model_config import BASE_FORMATS, load_hf_config
from mtjax.plan import compute_dtype
from mtjax.store import fresh, hf_export, hf_import, reshard

DTYPES = ("bfloat16", "float32", "float16")
QUANTIZED_BASE = "block.*/*.kernel"  # what --base-format freezes (and quantizes) unless --freeze says otherwise
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20 (the units Hugging Face accepts)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise MtjaxError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "import", help="convert a Hugging Face checkpoint into a new layer store",
        description="Convert a Hugging Face checkpoint (config.json and safetensors) into a new layer store, one "
                    "tensor at a time, so a model larger than host memory imports too. The store holds fp32 master "
                    "weights, compute weights in --compute-dtype and fresh AdamW state, plus the checkpoint's "
                    "tokenizer files; train it with `mtjax train --store.path=STORE`.")
    p.add_argument("hf_dir", help="checkpoint directory (config.json + safetensors, single or sharded)")
    p.add_argument("store_dir", help="new store directory (must not exist or be empty)")
    p.add_argument("--compute-dtype", choices=(*DTYPES, compute_dtype.AUTO), default="bfloat16",
                   help="dtype of the streamed weights (default bfloat16; auto: as a run on this machine chooses)")
    p.add_argument("--copies", type=int, choices=(1, 2), default=2,
                   help="copies of the state on disk: 2 (default) or 1 (train it with --store.copies=1)")
    p.add_argument("--adapter", metavar="DIR",
                   help="a PEFT LoRA adapter directory trained on this checkpoint: imported with it, to continue "
                        "training the adapter (the store's model has its lora: settings)")
    p.add_argument("--freeze", metavar="PATTERNS",
                   help="model.freeze: leaves kept as they are, comma-separated PART or PART/LEAF patterns "
                        f"(e.g. embed,block.0-15); with --base-format, default {QUANTIZED_BASE}")
    p.add_argument("--base-format", choices=BASE_FORMATS, default="compute",
                   help="how the frozen 2-D kernels of blocks are stored and streamed: compute (the compute "
                        "dtype, default), int8 (per output channel) or nf4 (QLoRA's 4-bit NormalFloat)")
    p.set_defaults(func=run_import)

    e = subparsers.add_parser(
        "export", help="write a store's weights as a Hugging Face checkpoint",
        description="Write a store's last committed master weights as a Hugging Face checkpoint (config.json, "
                    "safetensors shards in the checkpoint's dtype) with the tokenizer files of its model, so "
                    "transformers' from_pretrained loads both. A store with LoRA adapters is written as a PEFT "
                    "adapter directory (adapter_config.json, adapter_model.safetensors), or merged with --merge.")
    e.add_argument("store_dir")
    e.add_argument("out_dir", help="new output directory (must not exist or be empty)")
    e.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    e.add_argument("--merge", action="store_true",
                   help="a store with LoRA adapters: write the merged model (base + adapters) instead of the "
                        "PEFT adapter directory")
    e.set_defaults(func=run_export)

    i = subparsers.add_parser(
        "init", help="create a store with freshly initialised weights",
        description="Create a layer store holding freshly initialised weights for an architecture (an HF "
                    "config.json, a checkpoint directory or an experiment YAML), one part at a time, so a model "
                    "larger than host memory can start from scratch. It has no tokenizer: train it with a "
                    "dataset's, or pass --tokenizer to eval and generate.")
    i.add_argument("config", help="HF config.json, a checkpoint dir holding one, or an experiment YAML")
    i.add_argument("store_dir", help="new store directory (must not exist or be empty)")
    i.add_argument("--compute-dtype", choices=(*DTYPES, compute_dtype.AUTO),
                   help="dtype of the streamed weights (default: bfloat16, or the experiment's; auto: as a run on "
                        "this machine chooses)")
    i.add_argument("--seed", type=flag(int, SEED), default=0, help="parameter initialisation seed")
    i.add_argument("--copies", type=int, choices=(1, 2), default=2,
                   help="copies of the state on disk: 2 (default) or 1 (train it with --store.copies=1)")
    i.set_defaults(func=run_init)

    s = subparsers.add_parser("store", help="rewrite a run's store (reshard: for another number of processes)",
                              description="Rewrite a run's layer store: `reshard` writes it for another number of "
                                          "processes, to continue a run on another number of hosts.")
    actions = s.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    r = actions.add_parser(
        "reshard", help="rewrite a run's store for another number of processes",
        description="Rewrite the last commit of a run's store for a run of --processes processes, to continue "
                    "the run on another number of hosts: part by part (host memory: about one part), the source "
                    "left as it was. SRC is a multi-process run's store root with every process's "
                    "shard-<p>-of-<N>/ gathered in it (on one filesystem: copy them from hosts that do not share "
                    "one), or a one-process store. DST gets the store of a one-process run (--processes 1) or "
                    "shard-<p>-of-<M>/, keeping the run's id, so the run resumes from it with its own run.dir: "
                    "`mtjax train ... --run.resume=true --store.path=DST` on M processes.")
    r.add_argument("src", metavar="SRC", help="the run's store root (<run.dir>/store, or its store.path)")
    r.add_argument("dst", metavar="DST", help="new store directory (must not exist or be empty)")
    r.add_argument("--processes", type=flag(int, AT_LEAST_1), required=True, metavar="M",
                   help="the process count of the new store")
    r.set_defaults(func=run_reshard)


def _progress(total: int, live: bool):
    """A callback printing each imported part: in place on a terminal (`live`), else one
    plain line per part (a log file gets no carriage returns)."""
    done = [0]

    def step(part: str) -> None:
        done[0] += 1
        text = f"{done[0]}/{total} parts ({part})"
        print(f"\r{text}" if live else text, end="" if live else "\n", flush=True)

    return step


def run_import(args) -> int:

    writable.check(args.store_dir, "store directory")
    total = load_hf_config(args.hf_dir).num_hidden_layers + 2
    live = sys.stdout.isatty()
    freeze = args.freeze.split(",") if args.freeze else [QUANTIZED_BASE] if args.base_format != "compute" else []
    dtype = _chosen(args.compute_dtype)
    out = hf_import.import_hf(args.hf_dir, args.store_dir, compute_dtype=dtype, progress=_progress(total, live),
                              copies=args.copies, adapter=args.adapter, freeze=tuple(p.strip() for p in freeze),
                              base_format=args.base_format)
    if live:
        print()  # ends the line the progress rewrote
    kept = f" (frozen {','.join(freeze)}; base format {args.base_format})" if freeze else ""
    print(f"imported {args.hf_dir} into {out}{kept}")
    return 0


def run_export(args) -> int:

    writable.check(args.out_dir, "output directory")
    notes = []  # a byte-level model's: it has no tokenizer
    out = hf_export.export_hf(args.store_dir, args.out_dir, parse_size(args.max_shard_size), say=notes.append,
                              merge=args.merge)
    print(f"exported {args.store_dir} to {out}")
    for line in notes:
        print(line)
    return 0


def _chosen(dtype: str | None) -> str | None:
    """`dtype`, or for `auto` the one a run on this machine resolves it to (compute_dtype.here),
    said in one line: what `import` and `init` store."""
    if dtype != compute_dtype.AUTO:
        return dtype
    dtype, why = compute_dtype.here()
    print(f"mtjax: {compute_dtype.describe(dtype, why)}")
    return dtype


def _init_dtype(path: Path, given: str | None) -> str | None:
    """The compute dtype `mtjax init` stores: the one given, else the file's (None); `auto`,
    given or an experiment's `model.compute_dtype`, resolved as a run on this machine
    resolves it (`_chosen`)."""
    asks = given is None and path.suffix in (".yaml", ".yml") and compute_dtype.asks_auto(
        experiment.load(path).model.overrides)
    return _chosen(compute_dtype.AUTO if asks else given)


def run_init(args) -> int:

    writable.check(args.store_dir, "store directory")
    cfg, tx = fresh.load_config(Path(args.config), _init_dtype(Path(args.config), args.compute_dtype))
    out = fresh.init_store(cfg, args.store_dir, seed=args.seed, tx=tx, copies=args.copies)
    print(f"initialised {out}")
    return 0


def run_reshard(args) -> int:
    writable.check(args.dst, "output directory")
    out = reshard.reshard(args.src, args.dst, args.processes)
    what = "one process" if args.processes == 1 else f"{args.processes} processes"
    print(f"resharded {args.src} for {what} into {out}; resume the run with --store.path={out}")
    return 0
