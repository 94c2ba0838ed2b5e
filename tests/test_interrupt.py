"""Ctrl-C reaches `mtjax`'s main() even when something drops the first KeyboardInterrupt
(mtjax.cli._on_sigint), and does not cut short the cleanup it sets off."""

from __future__ import annotations

import subprocess
import sys

import multidevice

PRELUDE = """
import os, signal, time
from mtjax import cli
signal.signal(signal.SIGINT, cli._on_sigint)
"""

DROPPED = PRELUDE + """try:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    except KeyboardInterrupt:
        pass  # dropped, as a C extension or a garbage-collector callback may drop it
    time.sleep(5)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted again")
"""

CLEANUP = PRELUDE + """try:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    except BaseException:
        time.sleep(1.5)  # cleanup that outlasts the handler's check
        print("cleaned up")
        raise
except KeyboardInterrupt:
    cli._handled.set()
    time.sleep(1)
    print("caught once")
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=multidevice.env(1), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_a_dropped_interrupt_is_raised_again():
    assert _run(DROPPED) == ["interrupted", "again"]


def test_an_interrupt_being_handled_is_not_raised_twice():
    assert _run(CLEANUP) == ["cleaned", "up", "caught", "once"]
