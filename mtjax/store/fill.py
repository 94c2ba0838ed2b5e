"""Filling a new store: all three kinds of state of a part from its fp32 master weights.

Used by `hf_import`, `fresh` and `reshard`. A new store (or a run's store root of shards) is
built in a hidden sibling directory and renamed into place only when complete, so a failed
or interrupted import never leaves a half-filled store at the destination.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import numpy as np

from mtjax import parts, precision, treepath, writable
from mtjax.store.durable import fsync_path
from mtjax.store import store as store_mod
from mtjax.store.errors import StoreError


def write_part(store, part: str, master: dict[str, np.ndarray], tx=None, opt: dict | None = None) -> None:
    """Write master, compute (master converted by the precision policy) and optimizer
    state: `opt` ({leaf: array}), else fresh state (tx.init).

    One kind at a time, waiting for each, so host memory holds about one part.
    """
    cfg = store.config
    # The leaves with a master, and below those with optimizer state (mtjax.roles: not the frozen ones).
    store.write(part, "master", {n: master[n] for n in parts.schema(cfg, part, "master")}).result()  # waits: the next kind reuses the memory
    compute = precision.policy(cfg).to_compute(master, part)  # a frozen kernel's quantized, as its base format says
    store.write(part, "compute", compute).result()  # waits: the writer reads `compute` until then
    del compute
    if opt is None:
        # numpy leaves: optax allocates its state (zeros_like) without a device copy of the weights
        trained = {n: master[n] for n in parts.trained(cfg, part)}
        opt = treepath.flatten(tx.init(trained)) if trained else {}
    store.write(part, "opt", {k: np.asarray(v) for k, v in opt.items()}).result()


def check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise StoreError(f"{dest} already exists and is not empty; choose a new store directory")


def _reason(e: BaseException) -> str:
    """Why writing a new store failed, and what to do: the OSError `e` is or was raised
    from (a store's write and commit errors keep it), else the one a tensorstore error
    names in its text (creating an array), else `e`'s own words."""
    cause = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        return writable.describe(OSError(cause.errno, cause.strerror or str(cause)))
    named = [code for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES) if os.strerror(code) in str(e)]
    return writable.describe(OSError(named[0], os.strerror(named[0]))) if named else str(e)


def _dead(pid: str) -> bool:
    """Whether `pid` names a process that no longer exists."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


@contextlib.contextmanager
def staged_dir(dest: str | Path):
    """Yield a new temporary sibling directory of `dest` to build a store (or a run's store
    root of shards) in; rename it to `dest` once the block ends without error."""
    given, dest = Path(dest), Path(dest).absolute()
    check_destination(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    for old in dest.parent.glob(f".{dest.name}.partial-*"):  # left by an import that crashed
        if _dead(old.name.rsplit("-", 1)[-1]):
            store_mod.remove(old)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    store_mod.remove(tmp)
    try:
        yield tmp
        fsync_path(tmp)  # its entries (a root's shards) are durable before its name
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(tmp, dest)
        fsync_path(dest.parent)  # the store's name is durable, not just its contents
    except (OSError, StoreError) as e:
        if isinstance(e, StoreError) and str(tmp) not in str(e):
            raise  # not about writing the new store (e.g. an unreadable checkpoint)
        # The staging directory is ours, not the user's: the error names the destination.
        reason = _reason(e).replace(str(tmp), str(given))
        raise StoreError(f"cannot write the store at {given}: {reason}; nothing was created there") from None
    finally:
        store_mod.remove(tmp)


@contextlib.contextmanager
def staged(dest: str | Path, cfg, tx, copies: int = 2):
    """Yield a writable store in a temporary sibling of `dest`; rename it to `dest` on success."""
    with staged_dir(dest) as tmp:
        store = store_mod.create(tmp, cfg, tx, copies=copies)
        try:
            yield store
        finally:
            store.close()
