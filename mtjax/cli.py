"""The `mtjax` command. Each subcommand lives in its own module under mtjax/commands/.

A command module defines `register(subparsers)`, which adds its parser and sets
`func=run` on it. Errors a user can fix print one line and exit non-zero (2; 130 for
Ctrl-C); `--debug` shows the traceback.
"""

from __future__ import annotations

import _thread
import argparse
import importlib
import sys
import threading

from mtjax import writable
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


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (argparse prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mtjax",
                    description="Train language models larger than accelerator memory, one block at a time. "
                                "`mtjax train` with no options runs a small default training run on the CPU; "
                                "`mtjax COMMAND --help` describes each command.")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # subparsers are Parsers too
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _unraisable(unraisable) -> None:
    """sys.unraisablehook of the `mtjax` process. A Ctrl-C that arrives while the main
    thread runs a garbage-collector callback (JAX installs one) raises KeyboardInterrupt
    inside it, where Python would print "Exception ignored in ..." and carry on: raise it
    again in the main thread instead."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        # From another thread, a moment later: raised here (or still inside the callback)
        # it would be swallowed again.
        timer = threading.Timer(0.05, _thread.interrupt_main)
        timer.daemon = True
        timer.start()
    else:
        sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `mtjax` process itself (tests call main(argv) in theirs)
        sys.unraisablehook = _unraisable
        argv = sys.argv[1:]
    debug, command = "--debug" in argv[:1], "mtjax"
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and not hasattr(args, "extra_args"):  # only commands that set extra_args take free-form options
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:  # bare `mtjax`: what there is to do, not a surprise training run
            parser.print_help()
            return 0
        command = f"mtjax {args.command}"
        if extra:
            args.extra_args = extra  # e.g. a mistyped --optim.lrr=1, which train reports with the nearest key
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except (MtjaxError, OSError) as e:
        if debug:
            raise
        message = writable.describe(e) if isinstance(e, OSError) else e
        print(f"{command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
