"""A small tmpfs mounted for a test, and a ballast file that fills it (needs root, as on
the project machines and in CI; elsewhere the tests using it are skipped, saying why);
and a read-only directory (a read-only tmpfs as root, a mode-555 directory otherwise)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(where: Path, size: str):
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def make_readonly(mnt: Path) -> None:
    """Remount a `mounted` tmpfs read-only (EROFS for every write, root's too)."""
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


def fill(mnt: Path, leave: int = 0) -> Path:
    """Write a ballast file until the disk is full, then free `leave` bytes of it."""
    ballast = mnt / "ballast"
    with open(ballast, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    os.truncate(ballast, max(0, ballast.stat().st_size - leave))
    return ballast


@contextlib.contextmanager
def read_only(where: Path):
    """`where` as a directory nobody can write to (root ignores file modes: it gets a
    read-only mount instead)."""
    where.mkdir()
    if os.geteuid() != 0:
        where.chmod(0o555)
        try:
            yield where
        finally:
            where.chmod(0o755)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
