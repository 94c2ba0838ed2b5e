"""`mtjax train [EXPERIMENT.yaml] [--group.key=value ...]`: run a training experiment.

With no arguments it runs the embedded default: a small byte-level Llama trained on the
Shakespeare slice shipped in the package, on the CPU, in a few minutes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from mtjax import checkpoint, config, writable
from mtjax import run as run_lib

_GROUP_TITLES = {
    "model": "model (a preset, an HF config.json or checkpoint, and inline architecture overrides)",
    "store": "store (where model state lives between steps)",
    "stream": "stream (the engine and its streaming knobs)",
    "optim": "optim (AdamW, schedule, clipping)",
    "data": "data (dataset, tokenizer, batching)",
    "run": "run (length, logging, evaluation, checkpoints, sample)",
    "distributed": "distributed (one process per host: coordinator, process count and id)",
    "lora": "lora (LoRA adapters over a frozen base: rank, alpha, target modules)",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model (no arguments: the embedded default run)",
        description="Run a training experiment. Settings come from the typed defaults (the embedded "
                    "default run), then EXPERIMENT.yaml, then --group.key=value options (the last of a key "
                    "given twice counts).",
        usage="mtjax train [-h] [--print-config] [EXPERIMENT.yaml] [--group.key=VALUE ...]", allow_abbrev=False,
    )
    p.add_argument("experiment", nargs="?", help="YAML experiment file (see experiments/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved experiment as YAML and exit")
    groups = {}
    for key, (hint, default, help_text) in config.valid_keys().items():
        group = key.split(".")[0]
        if group not in groups:
            groups[group] = p.add_argument_group(_GROUP_TITLES[group])
        groups[group].add_argument(f"--{key}", dest=key, default=argparse.SUPPRESS, metavar=_metavar(hint),
                                   help=f"{help_text} (default: {default!r})".replace("%", "%%"))
    p.set_defaults(func=run, extra_args=[])


def _metavar(hint) -> str:
    text = str(getattr(hint, "__name__", hint)).replace("typing.", "")
    if len([kind for kind in text.split("|") if kind.strip() != "None"]) > 1:
        return "VALUE"  # e.g. stream.devices: all or a count
    for name, shown in (("bool", "BOOL"), ("int", "INT"), ("float", "FLOAT"), ("tuple", "LIST"), ("str", "STR")):
        if name in text:
            return shown
    return "VALUE"


def overrides_of(args) -> list[str]:
    """The --group.key=value settings given on the command line, as key=value strings."""
    unknown = [a for a in args.extra_args if a.startswith("-")]
    if unknown:
        config.load(None, [unknown[0] if "=" in unknown[0] else unknown[0] + "="])  # raises naming the key
    if args.extra_args:
        raise config.ConfigError(f"unexpected argument {args.extra_args[0]!r}; settings look like --optim.lr=3e-4")
    return [f"{k}={v}" for k, v in vars(args).items() if "." in k]


def check_outputs(exp: config.ExperimentConfig, store: Path | None) -> None:
    """Refuse, before anything is made, a run directory or store path that cannot be written."""
    writable.check(exp.run.dir, "run.dir")
    if store is None:
        return
    if (store / "config.json").exists() and not (store / "manifest.json").exists():
        raise config.ConfigError(
            f"store.path {store} is a Hugging Face checkpoint, not a layer store; convert it with "
            f"`mtjax import {store} STORE` and pass --store.path=STORE, or train from its weights with "
            f"--model.checkpoint={store}")
    writable.check(store, "store.path")


def run(args) -> int:
    exp = config.load(args.experiment, overrides_of(args))
    if args.print_config:
        print(config.to_yaml(exp), end="")
        return 0

    check_outputs(exp, checkpoint.store_path(exp))
    run_dir = Path(exp.run.dir)
    new = not run_dir.exists()
    try:
        summary = run_lib.train(exp)
    except BaseException:
        if new and not (run_dir / "config.yaml").exists():  # refused before it started: leave no run dir
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    print(run_lib.describe(summary), file=sys.stdout, flush=True)
    return 0
