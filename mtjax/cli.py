"""The `mtjax` command. Each subcommand lives in its own module under mtjax/commands/.

A command module defines `register(subparsers)`, which adds its parser and sets
`func=run` on it. Errors a user can fix print one line and exit non-zero; `--debug`
shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mtjax.errors import MtjaxError

# Order is the order of `mtjax --help`.
COMMAND_MODULES = [
    "mtjax.commands.train",
    "mtjax.commands.data",
    "mtjax.commands.generate",
    "mtjax.commands.eval",
    "mtjax.commands.plot",
    "mtjax.commands.plan",
    "mtjax.commands.store",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtjax", description="Train language models larger than accelerator memory, one block at a time."
    )
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--debug"):
        argv = ["train", *argv]  # bare `mtjax` runs the embedded default training run
    if argv == ["--debug"]:
        argv = ["--debug", "train"]
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "extra_args"):  # only commands that set extra_args take free-form options
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.extra_args = extra  # e.g. a mistyped --optim.lrr=1, which train reports with the nearest key
    if args.command is None:
        args = parser.parse_args([*argv, "train"])
    try:
        return int(args.func(args) or 0)
    except (MtjaxError, FileNotFoundError, PermissionError) as e:
        if args.debug:
            raise
        print(f"mtjax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mtjax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
