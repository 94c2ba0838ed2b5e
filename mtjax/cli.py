"""The `mtjax` command. Each subcommand lives in its own module under mtjax/commands/.

A command module defines `register(subparsers)`, which adds its parser and sets
`func=run` on it. Errors a user can fix print one line and exit non-zero (2; 130 for
Ctrl-C); `--debug` shows the traceback. Besides mtjax's own errors, three kinds raised
anywhere in a command are one line too (`_one_line`): an OSError (a full or read-only
disk, also as a library words it: mtjax.writable), text that is not UTF-8
(mtjax.textfile) and a JAX backend that cannot start (mtjax.environment, which also
checks the environment before any command module, and so JAX, is imported).

Ctrl-C: the handler below is installed before anything heavy is imported (`import mtjax`
imports nothing of JAX's: mtjax/__init__.py), so a Ctrl-C while JAX is imported, the
arguments are parsed or the config is loaded ends as any other, and once main() is done
a late one is ignored (it would otherwise print a traceback from interpreter shutdown).
"""

from __future__ import annotations

import _thread
import argparse
import importlib
import signal
import sys
import threading

from mtjax import environment, textfile, writable
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
    """argparse with one-line errors (argparse prints the whole usage block first), which
    names the command it parsed: `parsed_command` in the result, the innermost parser's
    name whole ("mtjax data prepare"), as argparse names a nested command in its refusals."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        if not hasattr(parsed, "parsed_command"):  # a sub-parser ran first, and set its own
            parsed.parsed_command = self.prog
        return parsed, extra

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


_handled = threading.Event()  # main() has caught a KeyboardInterrupt


def _on_sigint(signum, frame) -> None:
    """SIGINT handler of the `mtjax` process: KeyboardInterrupt, as Python's own handler
    raises, and again if that one is dropped before main() catches it: a C extension
    that checks for signals inside a long call can drop it, and a garbage-collector
    callback (JAX installs one) does. Dropped is when nothing but this handler refers to the exception any
    more: while it propagates, or while an except or finally block cleans up, the
    interpreter holds it, and no second one cuts that cleanup short."""
    exc = KeyboardInterrupt()

    def check():
        if _handled.is_set():
            return
        if sys.getrefcount(exc) <= 2:  # the closure's cell and this call's argument
            _thread.interrupt_main()  # runs this handler in the main thread once more
        else:
            _later(check)

    _later(check)
    raise exc


def _later(fn) -> None:
    timer = threading.Timer(0.5, fn)
    timer.daemon = True
    timer.start()


def _unraisable(unraisable) -> None:
    """sys.unraisablehook of the `mtjax` process: a KeyboardInterrupt dropped inside a
    callback is not printed; `_on_sigint` raises it again."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def _one_line(e: Exception) -> str | None:
    """The one line for an error a user can act on; None for a bug (shown with its traceback)."""
    if isinstance(e, MtjaxError):
        return str(e)
    if isinstance(e, UnicodeError):
        return textfile.describe(e)
    err = writable.os_error(e)
    return writable.describe(err) if err is not None else environment.backend_failure(e)


def main(argv: list[str] | None = None) -> int:
    process = argv is None  # the `mtjax` process itself (tests call main(argv) in theirs)
    if process:
        sys.unraisablehook = _unraisable
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when started with SIGINT ignored
            signal.signal(signal.SIGINT, _on_sigint)
        argv = sys.argv[1:]
    try:
        return _main(argv)
    finally:
        if process and signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command is over: only exiting is left


def _main(argv: list[str]) -> int:
    debug, command = "--debug" in argv[:1], "mtjax"
    try:
        environment.check()
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and not hasattr(args, "extra_args"):  # only commands that set extra_args take free-form options
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:  # bare `mtjax`: what there is to do, not a surprise training run
            parser.print_help()
            return 0
        command = args.parsed_command
        if extra:
            args.extra_args = extra  # e.g. a mistyped --optim.lrr=1, which train reports with the nearest key
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _handled.set()
        if debug:
            raise
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        message = _one_line(e)
        if debug or message is None:
            raise
        print(f"{command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
