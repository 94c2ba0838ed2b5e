"""One writer per store: an exclusive, non-blocking fcntl lock on STORE/LOCK.

The kernel drops the lock when the holder exits, however it exits, so a crashed writer
never leaves a stale lock behind. Readers take no lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from mtjax.store import layout
from mtjax.store.errors import StoreError


class WriterLock:
    def __init__(self, root: Path):
        self.path = root / layout.LOCK
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot open store {root} for writing ({e.strerror or e}); "
                             "check its permissions, or open it read-only") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fd, self._fd = self._fd, None
            _refuse(root, fd)
        try:  # the holder's pid, only for the message above; a full disk must not stop us
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, str(os.getpid()).encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


_SECOND_WRITER = "close that writer first, or open the store read-only"


def check_free(root: Path, what: str = _SECOND_WRITER) -> None:
    """Raise the StoreError a second writer gets if one holds the store now (ending with
    `what` to do); changes nothing."""
    try:
        fd = os.open(root / layout.LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return  # no writer ever opened it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _refuse(root, fd, what)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _refuse(root: Path, fd: int, what: str = _SECOND_WRITER) -> None:
    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    os.close(fd)
    raise StoreError(f"store {root} is already open for writing (by process {holder}); {what}") from None
