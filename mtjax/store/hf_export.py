"""`mtjax export`: a store's committed master weights as a Hugging Face checkpoint.

Tensors are produced one part at a time in the checkpoint's own dtype and names
(mtjax.hf's table) and written by mtjax.hf.save_checkpoint, which holds one shard; the
tokenizer files of the store's model go beside them.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Iterator

import numpy as np

from mtjax import hf
from mtjax.data import tokenizer as toklib
from mtjax.store import store as store_mod
from mtjax.store import tokenizer
from mtjax.store.errors import StoreError
from mtjax.store.hf_import import by_part, locate


def hf_tensors(store) -> Iterator[tuple[str, np.ndarray]]:
    """(hf name, array) in checkpoint order, cast to the config's param dtype."""
    cfg = store.config
    dtype = hf.NP_DTYPES[cfg.param_dtype]
    grouped = by_part(hf.layout(cfg))
    for part in store.parts:
        master = store.read(part, "master").result()  # waits: one part in memory at a time
        for spec in grouped[part]:
            yield spec.hf_name, hf.to_hf(spec, master[locate(spec)[1]]).astype(dtype)
        del master


def _write_tokenizer(source: Path | None, out: Path) -> None:
    """The store's tokenizer files (a directory of them, or one tokenizer.json, gzipped or not)."""
    if source is None:
        return
    if source.is_dir():
        toklib.copy_hf_files(source, out)
        return
    raw = source.read_bytes()
    (out / toklib.TOKENIZER_FILE).write_bytes(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def export_hf(store_dir: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write the store's committed master weights, and its model's tokenizer (see
    mtjax.store.tokenizer; none for a byte-level one), as a checkpoint at `out_dir`."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(f"{out} already exists and is not empty; choose a new output directory")
    # Written in a hidden sibling and renamed into place: an export killed at any moment
    # leaves no partial checkpoint under `out`, and rerunning it starts afresh.
    tmp = out.with_name(f".{out.name}.export-tmp")
    store_mod.remove(tmp)
    with store_mod.open(store_dir) as store:
        store.check_complete("export it")
        try:
            hf.save_checkpoint(store.config, hf_tensors(store), tmp, max_shard_bytes)
            _write_tokenizer(tokenizer.export_source(store), tmp)
            if out.exists():
                out.rmdir()  # checked empty above
            tmp.rename(out)
        except BaseException as e:
            store_mod.remove(tmp)
            if isinstance(e, OSError):
                raise StoreError(f"cannot write the checkpoint to {out} ({e.strerror or e})") from None
            raise
    return out
