"""Parquet files and Hugging Face `datasets` directories, read as records with pyarrow.

    tables.datasets_files(dir)   the Arrow files of a `save_to_disk` directory (None: not one)
    tables.rows(path, columns, hint)   ("PATH, row N", {column: value}) for each row of a
                                 .parquet or .arrow file, only `columns` read

`Dataset.save_to_disk` writes Arrow IPC stream files and a state.json that lists them;
`DatasetDict.save_to_disk` writes one such directory per split and a dataset_dict.json
naming the splits, of which the `train` split is read (name a split's own directory to
read another). pyarrow reads both, so the `datasets` package is not needed; pyarrow
itself is an optional dependency (`pip install 'mtjax[data]'`), imported only when a
table is read.

Arrow stores a list of structs (a conversation's messages) with every key any of them
has: a key that a message lacks reads back as None. Such None values inside a record are
dropped, so a message reads as the JSON object it was written from; a top-level column
that is null stays None.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from mtjax.data.format import DataError
from mtjax.errors import MissingPackage

KINDS = {".parquet": "parquet", ".arrow": "arrow"}  # suffix -> kind of table file
STATE_FILE = "state.json"  # a saved Dataset: its Arrow files
INFO_FILE = "dataset_info.json"  # beside it in every saved Dataset (features, description)
SPLITS_FILE = "dataset_dict.json"  # a saved DatasetDict: its splits, one directory each
TRAIN_SPLIT = "train"
BATCH_ROWS = 1024  # rows converted to Python objects at a time


def kind(path: Path) -> str | None:
    """"parquet" or "arrow" for a table file, else None."""
    return KINDS.get(Path(path).suffix.lower())


def datasets_files(path: Path) -> list[Path] | None:
    """The Arrow files of a `datasets` save_to_disk directory (a DatasetDict: its train
    split's); None when `path` is no such directory."""
    path = Path(path)
    if (path / SPLITS_FILE).is_file():
        splits = _json(path / SPLITS_FILE).get("splits")
        splits = splits if isinstance(splits, list) else []
        if TRAIN_SPLIT in splits or len(splits) == 1:
            split = TRAIN_SPLIT if TRAIN_SPLIT in splits else splits[0]
            files = datasets_files(path / split)
            if files is None:
                raise DataError(f"{path / SPLITS_FILE} names the split {split!r}, but {path / split} holds no saved "
                                f"dataset ({STATE_FILE}); copy the whole directory or save the dataset again")
            return files
        raise DataError(f"{path} is a DatasetDict with splits {', '.join(map(str, splits)) or '(none)'} and no "
                        f"{TRAIN_SPLIT!r} split; name the split to read: {path}/SPLIT")
    if not ((path / STATE_FILE).is_file() and (path / INFO_FILE).is_file()):
        return None  # (a state.json alone may be another program's)
    listed = _json(path / STATE_FILE).get("_data_files")
    if not isinstance(listed, list) or not listed:
        raise DataError(f"{path / STATE_FILE} lists no data files; save the dataset again (save_to_disk)")
    files = [path / str(entry.get("filename", "")) for entry in listed if isinstance(entry, dict)]
    for file in files:
        if not file.is_file():
            raise DataError(f"{path / STATE_FILE} lists {file.name}, which is missing from {path}; copy the whole "
                            "directory or save the dataset again (save_to_disk)")
    return files


def _json(file: Path) -> dict:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{file} is corrupt ({e}); save the dataset again (save_to_disk)") from None
    if not isinstance(value, dict):
        raise DataError(f"{file} is not a JSON object; save the dataset again (save_to_disk)")
    return value


def _pyarrow():
    """pyarrow and pyarrow.parquet, or one line saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise MissingPackage("reading Parquet files and `datasets` directories", "pyarrow", "data") from None
    return pyarrow, pyarrow.parquet


def rows(path: Path, columns: tuple[str, ...], hint: str, on_bytes=None) -> Iterator[tuple[str, dict]]:
    """("PATH, row N", record of `columns`) for every row of a table file (N counts from 0,
    as `dataset[N]` does); `hint` ends the line that names a missing column; `on_bytes(n)`
    reports progress in bytes of the file."""
    path = Path(path)
    pa, pq = _pyarrow()
    name = kind(path).capitalize()  # for messages
    size, done, seen = path.stat().st_size, 0, 0
    try:
        total, names, batches = _open(pa, pq, path, columns)
        missing = [c for c in columns if c not in names]
        if missing:
            raise DataError(f"{path} has no column {', '.join(map(repr, missing))} (has: {', '.join(names[:8])}); "
                            f"{hint}")
        for batch in batches():
            for record in batch.to_pylist():
                yield f"{path}, row {seen}", {k: _without_nulls(v) for k, v in record.items()}
                seen += 1
            if on_bytes and total:
                now = size * seen // total
                on_bytes(now - done)
                done = now
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path} is not a readable {name} file ({first[:200]}); write it again") from None


def _open(pa, pq, path: Path, columns: tuple[str, ...]):
    """(rows, column names, a function giving the record batches of `columns`)."""
    if kind(path) == "parquet":
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
        return table.metadata.num_rows, names, lambda: table.iter_batches(BATCH_ROWS, columns=list(columns))
    source = pa.memory_map(str(path))
    try:
        whole = pa.ipc.open_stream(source).read_all()  # what `datasets` writes; zero-copy from the map
    except pa.ArrowInvalid:
        source.seek(0)
        whole = pa.ipc.open_file(source).read_all()  # the Arrow file format (Feather v2)
    return whole.num_rows, whole.column_names, lambda: whole.select(list(columns)).to_batches(BATCH_ROWS)


def _without_nulls(value):
    """`value` with the None values of its objects dropped (Arrow's filler for absent keys)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
