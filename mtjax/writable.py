"""Whether an output path can be written, asked before a command starts writing there.

Every command that creates a directory (train's run.dir and store.path, `data prepare
--out`, `import`, `export`, `init`) calls `check` first, so a read-only disk or a parent
that is a file is one line naming the path and what to do, not an OSError halfway
through. `describe` words an OSError met while writing (a full disk) the same way.

Writers in other libraries report a full or read-only disk in their own way: tokenizers
and safetensors raise their own exception types with the OS error as "(os error 28)" in
the text, matplotlib and others an OSError without the file's name. `os_error` turns any
of these back into an OSError, and `writing(path)`, around such a call, makes it one that
names the path, so the command line prints it as one line (mtjax.cli). `write_text`
writes a small file (a run's config.yaml, summary.json) whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
from pathlib import Path

from mtjax.errors import MtjaxError


class OutputError(MtjaxError):
    """An output path that cannot be written; the message names it and what to do."""


_HINTS = {
    errno.ENOSPC: "free space on that disk or choose another location",
    errno.EDQUOT: "free space within your quota or choose another location",
    errno.EROFS: "choose a location on a writable disk",
    errno.EACCES: "choose a directory you may write to",
    errno.EPERM: "choose a directory you may write to",
    errno.ENOTDIR: "a parent of the path is a file; choose another path",
    errno.EEXIST: "something is already there; choose another path",
    errno.ENOENT: "check the path",
}


def describe(e: OSError) -> str:
    """'PATH: reason; what to do' for an OSError (one line)."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}; {_HINTS.get(e.errno, 'check the path and the disk')}"


_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error prints the errno


def os_error(e: BaseException) -> OSError | None:
    """`e` as an OSError: itself, or one rebuilt from the errno in a library's message; None
    when it is not about the operating system's files."""
    if isinstance(e, OSError):
        return e
    m = _OS_ERROR_TEXT.search(str(e))
    if m is None:
        return None
    number = int(m.group(1))
    return OSError(number, os.strerror(number))


@contextlib.contextmanager
def writing(path: str | Path):
    """Around a write to `path` by a library: its OSError (in whatever form) names `path`."""
    try:
        yield
    except Exception as e:
        err = os_error(e)
        if err is None:
            raise
        raise OSError(err.errno, err.strerror, err.filename or str(path)) from None


def write_text(path: str | Path, text: str) -> None:
    """Write a small file whole or not at all: a sibling temporary file renamed into place,
    removed again when the disk is full or read-only (the OSError then names `path`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # nothing there, or nowhere to remove it from
            tmp.unlink()
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror, str(path)) from None  # the user's file, not the temporary one
        raise


def check(path: str | Path, what: str, kind: str = "directory") -> Path:
    """Raise OutputError unless `path` (a `kind`: directory or file) can be created or
    written. `what` names the path for the user, e.g. "--out" or "run.dir"."""
    path = Path(path)
    if path.exists():
        if kind == "directory" and not path.is_dir():
            raise OutputError(f"{what} {path} is a file, not a directory; choose a directory")
        if kind == "file" and path.is_dir():
            raise OutputError(f"{what} {path} is a directory; name a file")
        where = path if path.is_dir() else path.parent
    else:
        where = next((p for p in path.parents if p.exists()), Path("."))
        if not where.is_dir():
            raise OutputError(f"{what} {path} cannot be created: {where} is a file, not a directory; "
                              "choose another path")
    try:
        with tempfile.TemporaryFile(dir=where):  # the one true test: permissions, read-only mounts, ACLs
            pass
    except OSError as e:
        hint = _HINTS.get(e.errno, "choose another location")
        raise OutputError(f"{what} {path} cannot be written: {where} is not writable ({e.strerror}); {hint}") from None
    return path
