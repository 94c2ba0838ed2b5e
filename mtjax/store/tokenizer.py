"""The tokenizer of a store's model: kept from the imported checkpoint, or the one a run
trained it with.

`mtjax import` copies the checkpoint's tokenizer files into STORE/tokenizer/, so `eval`
and `generate` on a fresh import tokenize as the checkpoint does, and `mtjax export`
writes them back, so `AutoTokenizer.from_pretrained` on the export gives the same ids.
Once `mtjax train` has trained the store, its train state names the data's tokenizer,
which wins: that is the tokenizer the weights now expect.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtjax.data import Dataset
from mtjax.data import format as fmt
from mtjax.data import tokenizer as toklib
from mtjax.store import layout


def keep(hf_dir: Path, store_root: Path) -> list[str]:
    """Copy the checkpoint's tokenizer files into the store; their names."""
    return toklib.copy_hf_files(hf_dir, Path(store_root) / layout.TOKENIZER_DIR)


def kept(store_root: Path) -> Path | None:
    """The store's kept tokenizer directory, if it holds a tokenizer.json."""
    folder = Path(store_root) / layout.TOKENIZER_DIR
    return folder if (folder / toklib.TOKENIZER_FILE).is_file() else None


def trained_spec(store) -> str | None:
    """The tokenizer spec of the data a run trained the (open) store on, else None."""
    data = ((store.load_train_state() or {}).get("fixed") or {}).get("data")
    if not data:
        return None
    dataset = Path(data["dataset"])
    if (dataset / fmt.META_FILE).exists():  # a prepared dataset names its own tokenizer
        return Dataset(dataset).tokenizer().spec
    return data["tokenizer"]


def spec(store) -> str | None:
    """A tokenizer spec (mtjax.data.load_tokenizer) for the (open) store's model, or None."""
    trained = trained_spec(store)
    if trained is not None:
        return trained
    folder = kept(store.root)
    return str(folder) if folder else None


def export_source(store) -> Path | None:
    """What `mtjax export` writes as the tokenizer: the kept directory (all its files) when
    the model still uses it, else the trained tokenizer.json; None for bytes or none."""
    trained, folder = trained_spec(store), kept(store.root)
    if trained is None:
        return folder
    if trained == "bytes" or trained.startswith("bpe:"):
        return None
    file = Path(trained)
    file = file / toklib.TOKENIZER_FILE if file.is_dir() else file
    if folder and file.is_file() and _same_tokenizer(file, folder / toklib.TOKENIZER_FILE):
        return folder
    return file if file.is_file() else None


def _same_tokenizer(a: Path, b: Path) -> bool:
    try:
        return json.loads(a.read_text()) == json.loads(b.read_text())
    except (ValueError, UnicodeDecodeError):
        return False  # e.g. a gzipped tokenizer.json: export it as it is
