"""The on-disk layout of a prepared dataset, and the error its readers and writers raise.

    DIR/meta.json             tokenizer spec, vocabulary, EOS id, dtype, shards, splits
    DIR/tokens-00000.bin      raw little-endian token ids (uint16, or uint32 for vocab > 65536)
    DIR/tokenizer.json        a copy of the tokenizer, when it is not `bytes`

A text dataset's shards hold one stream of documents, each followed by EOS. A chat or
prompt-completion dataset (format version 2, meta "seq_len") holds rows of seq_len
tokens, and beside each token shard, with the same length:

    DIR/loss_mask-00000.bin   uint8, 1 where the token is a target of the loss
    DIR/segments-00000.bin    document number of each token within its row (1, 2, ...; 0: padding)

The splits are token ranges of the stream (whole rows for version 2): validation is its
tail, so the two never share a window.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mtjax import textfile
from mtjax.errors import MtjaxError

META_FILE = "meta.json"
ROW_FORMATS = ("chat", "prompt-completion")  # stored as rows with a loss mask and segment ids
FORMATS = ("text",) + ROW_FORMATS
TRAIN_ON = ("answers", "all")  # which tokens of a row format count in the loss
PACKING = ("pack", "pad")  # several documents to a row, or one
FORMAT_VERSION = 1  # a text stream
ROWS_FORMAT_VERSION = 2  # rows with a loss mask and segment ids (mtjax before it refuses them)


class DataError(MtjaxError, ValueError):
    """Input data mtjax cannot use; the message says which file and what to do."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_name(index: int, stream: str = "tokens") -> str:
    return f"{stream}-{index:05d}.bin"


def read_meta(path: Path) -> dict:
    file = Path(path) / META_FILE
    if not file.exists():
        raise DataError(f"{path} is not a prepared dataset (no {META_FILE}); "
                        f"run `mtjax data prepare INPUT --out {path}` first")
    try:
        meta = json.loads(textfile.read(file))
    except (json.JSONDecodeError, textfile.TextError) as e:
        raise DataError(f"{file} is corrupt ({e}); prepare the dataset again") from None
    if meta.get("format_version") not in (FORMAT_VERSION, ROWS_FORMAT_VERSION):
        raise DataError(f"{file} has format version {meta.get('format_version')}, this mtjax reads "
                        f"{FORMAT_VERSION} and {ROWS_FORMAT_VERSION}; prepare the dataset again")
    return meta


def write_meta(path: Path, meta: dict) -> None:
    (Path(path) / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
