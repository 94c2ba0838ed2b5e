"""Raw text in, token shards out: `prepare(inputs, out_dir, tokenizer)`.

Inputs are plain-text files (one document per file), JSONL files (one document per
line, its text under `text_field`), optionally gzipped, or tables: Parquet files and
Hugging Face `datasets` directories (one document per row, mtjax.data.tables). Each
document is followed by EOS, and starts with BOS where the tokenizer adds one
(`Tokenizer.bos_id`: Llama 3, Gemma). Chat and prompt-completion records (`format`)
become rows of `seq_len` tokens with a loss mask and document ids instead
(`mtjax.data.supervised`, `mtjax.data.pack`; the chat template writes its own BOS). The
dataset is written to a temporary directory and renamed into place at the end, so a
failure never leaves a half-written dataset where a good one was.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Iterator

import numpy as np

from mtjax import terminal, writable
from mtjax.bounds import FRACTION, SEQ_LEN
from mtjax.data import chat, pack, supervised, tables
from mtjax.data import format as fmt
from mtjax.data import tokenizer as toklib
from mtjax.data.format import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
CHUNK_CHARS = 1 << 20  # plain text is tokenized in ~1 MiB pieces cut at line ends
BUILTIN = "builtin:"
LOCAL_TOKENIZER = "./" + toklib.TOKENIZER_FILE  # meta.json's name for the copy in the dataset dir


def builtin_path(name: str) -> Path:
    """The corpus shipped inside the package as mtjax/assets/NAME.txt.gz."""
    file = resources.files("mtjax") / "assets" / f"{name}.txt.gz"
    if not file.is_file():
        shipped = sorted(p.name.split(".")[0] for p in (resources.files("mtjax") / "assets").iterdir()
                         if p.name.endswith(".txt.gz"))
        raise DataError(f"no built-in corpus {name!r}; built-in: {', '.join(shipped)}")
    return Path(str(file))


def expand_inputs(inputs) -> list[Path]:
    """Files named directly, the Arrow files of a `datasets` directory, files of known
    suffixes inside other named dirs, builtin:NAME."""
    files = []
    for item in [inputs] if isinstance(inputs, (str, Path)) else inputs:
        if str(item).startswith(BUILTIN):
            files.append(builtin_path(str(item)[len(BUILTIN):]))
            continue
        if not str(item).strip():  # Path("") is the working directory: every text file under it
            raise DataError("an input is empty (''); name files or directories, or builtin:shakespeare")
        path = Path(item)
        if path.is_dir():
            saved = tables.datasets_files(path)
            # Arrow files are read only as a saved dataset lists them (a DatasetDict's other splits are beside them).
            found = saved or sorted(p for p in path.rglob("*") if p.is_file() and _kind(p) not in (None, "arrow"))
            held = [p.parent for p in found if p.name == fmt.META_FILE and (p.parent / fmt.shard_name(0)).is_file()]
            if held:  # e.g. a run directory, whose data/ is its prepared cache: its meta.json is no JSONL input
                raise DataError(f"{path} holds the prepared dataset {held[0]}: name that directory, not {path}")
            if (path / "config.json").is_file() and any(path.glob("*.safetensors")):  # its JSON files are no data
                raise DataError(f"{path} is a model checkpoint (config.json and safetensors weights), not data: "
                                "name the text, JSONL or Parquet files to train on")
            if not found:
                raise DataError(f"{path} holds no .txt, .md, .jsonl (optionally .gz) or .parquet files and is not a "
                                "`datasets` directory (save_to_disk)")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist")
    if not files:
        raise DataError("no input files given")
    return files


def _kind(path: Path) -> str | None:
    """"jsonl", "text", or a table's kind ("parquet", "arrow"); None: not an input."""
    table = tables.kind(path)
    if table:
        return table
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _open_text(path: Path, raw) -> io.TextIOBase:
    """A text stream over `raw` (gunzipped when the file starts with the gzip magic)."""
    head = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    stream = gzip.GzipFile(fileobj=raw) if head == b"\x1f\x8b" else raw
    return io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline=None)


def documents(files: list[Path], text_field: str = "text", on_bytes=None) -> Iterator[tuple[str, bool]]:
    """(text piece, ends a document) pairs over all files; `on_bytes(n)` reports progress."""
    for path in files:
        kind = _kind(path)
        if kind in tables.KINDS.values():
            rows = tables.rows(path, (text_field,), "choose the column with --text-field", on_bytes)
            yield from _texts(rows, text_field)
        else:
            items = functools.partial(_jsonl, path, text_field=text_field) if kind == "jsonl" else _text
            yield from _read(path, items, on_bytes)


def records(files: list[Path], format: str, on_bytes=None) -> Iterator[tuple[str, dict]]:
    """("path:line", object) for every JSON object line of JSONL files, ("path, row N",
    record) for every row of tables (only the columns `format` reads)."""
    for path in files:
        kind = _kind(path)
        if kind in tables.KINDS.values():
            columns = supervised.COLUMNS[format]
            hint = f"--format {format} reads {' and '.join(f'`{c}`' for c in columns)}"
            yield from tables.rows(path, columns, hint, on_bytes)
        elif kind == "jsonl":
            yield from _read(path, functools.partial(_located, path), on_bytes)
        else:
            raise DataError(f"{path} is not JSONL; chat and prompt-completion data is one JSON object per line "
                            "in a .jsonl file, or a row of a Parquet file or `datasets` directory")


def _read(path: Path, items, on_bytes) -> Iterator:
    """What `items(text stream)` yields from `path`, with read errors as one DataError."""
    with open(path, "rb") as raw:
        stream = _open_text(path, io.BufferedReader(raw))
        last = 0
        try:
            for item in items(stream):
                yield item
                if on_bytes:
                    now = raw.tell()
                    on_bytes(now - last)
                    last = now
        except UnicodeDecodeError:
            raise DataError(f"{path} is not UTF-8 text; convert it or pass a .txt/.jsonl file") from None
        except (OSError, EOFError) as e:
            raise DataError(f"{path} could not be read ({e}); is it a truncated .gz?") from None


def _text(stream) -> Iterator[tuple[str, bool]]:
    buffer, size = [], 0
    for line in stream:
        if size >= CHUNK_CHARS and line[:1].strip():  # cut where pre-tokenizers split anyway
            yield "".join(buffer), False
            buffer, size = [], 0
        buffer.append(line)
        size += len(line)
    yield "".join(buffer), True


def _objects(path: Path, stream) -> Iterator[tuple[int, dict]]:
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number} is not a JSON object; JSONL needs one object per line")
        yield number, record


def _located(path: Path, stream) -> Iterator[tuple[str, dict]]:
    for number, record in _objects(path, stream):
        yield f"{path}:{number}", record


def _jsonl(path: Path, stream, text_field: str) -> Iterator[tuple[str, bool]]:
    return _texts(_located(path, stream), text_field)


def _texts(located, text_field: str) -> Iterator[tuple[str, bool]]:
    """(text, True) for each (where, record) of `located`: one document each."""
    for where, record in located:
        if text_field not in record:
            fields = ", ".join(list(record)[:8])
            raise DataError(f"{where} has no {text_field!r} field (has: {fields}); choose the field with --text-field")
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
        yield text, True


class _ShardWriter:
    """Appends values of one stream (token ids, loss mask, segment ids) to fixed-size shard files."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, stream: str = "tokens"):
        self.out, self.dtype, self.shard_tokens, self.stream = out, dtype, shard_tokens, stream
        self.shards: list[dict] = []
        self._file, self._in_shard, self.total = None, 0, 0

    def write(self, ids) -> None:
        array = np.asarray(ids, dtype=np.int64)
        while array.size:
            if self._file is None or self._in_shard == self.shard_tokens:
                self._next_shard()
            take = min(array.size, self.shard_tokens - self._in_shard)
            self._file.write(array[:take].astype(self.dtype.newbyteorder("<")).tobytes())
            self._in_shard += take
            self.total += take
            self.shards[-1]["tokens"] = self._in_shard
            array = array[take:]

    def _next_shard(self) -> None:
        self.close()
        name = fmt.shard_name(len(self.shards), self.stream)
        self._file, self._in_shard = open(self.out / name, "wb"), 0
        self.shards.append({"file": name, "tokens": 0})

    def abort(self) -> None:
        """Close the open shard without flushing (its directory is about to be removed)."""
        if self._file is not None:
            try:
                self._file.close()  # a full disk fails the flush inside close too
            except OSError:
                pass
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def prepare(inputs, out_dir, tokenizer: str = "bytes", text_field: str = "text",
            val_fraction: float = 0.01, shard_tokens: int = 1 << 28, overwrite: bool = False,
            format: str = "text", seq_len: int | None = None, packing: str = "pack",
            train_on: str = "answers", extra: dict[str, str] | None = None) -> dict:
    """Tokenize `inputs` into a dataset at `out_dir`; returns its metadata.

    format="text": one stream of documents, each followed by EOS. "chat" /
    "prompt-completion" (JSONL records, see mtjax.data.supervised): rows of `seq_len`
    tokens with a loss mask (`train_on` "answers" or "all") and segment ids, documents
    packed several to a row (`packing="pack"`) or one to a row (`"pad"`); a document longer
    than `seq_len`, or with no target token, is skipped and counted in meta["skipped"].
    `extra`: {file name: text} written beside the shards, in place as soon as they are
    (data.resolve's stamp of a run's cache).
    """
    for name, value, allowed in (("--val-fraction", val_fraction, FRACTION), ("--seq-len", seq_len, SEQ_LEN)):
        if value is not None and value not in allowed:  # the command's parser refuses these first
            raise DataError(f"{name} must be {allowed}, got {value!r}")
    files = expand_inputs(inputs)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file; choose a directory for the dataset")
    held = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if held and not overwrite:
        raise DataError(f"{out} already exists and is not empty; choose another output or pass --overwrite")
    if held and fmt.META_FILE not in held:  # --overwrite replaces a dataset, not a run, a store or the user's files
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise DataError(f"{out} is not a prepared dataset (no {fmt.META_FILE}; it holds {shown}) and --overwrite "
                        "replaces only a dataset; choose another output, or empty it yourself")
    if format == "text":
        if seq_len is not None:
            raise DataError("--seq-len cuts chat or prompt-completion data into rows; text is cut at training time")
    else:
        _check_rows(format, seq_len, packing, train_on, tokenizer)
    total_bytes = sum(f.stat().st_size for f in files)
    if tokenizer.startswith("bpe:"):
        with terminal.bar(total_bytes, "training the tokenizer", unit="B", unit_scale=True) as bar:
            tok = toklib.train_bpe(tokenizer, (text for text, _ in documents(files, text_field, bar.update)))
    else:
        tok = toklib.load(tokenizer)
    template = None if tok.spec == "bytes" else chat.find(tokenizer)
    if format == "chat" and template is None:
        raise DataError(f"--format chat renders conversations with the tokenizer's chat template, and {tokenizer!r} "
                        f"has none (no {chat.TEMPLATE_FILE}, no chat_template in {chat.CONFIG_FILE}); pass "
                        "--tokenizer a checkpoint directory that has one")
    dtype = fmt.token_dtype(tok.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    bar = terminal.bar(total_bytes, "tokenizing", unit="B", unit_scale=True)
    try:
        tmp.mkdir()
        with bar:
            if format == "text":
                meta = _write_text(tmp, files, tok, dtype, text_field, val_fraction, shard_tokens, bar.update)
            else:
                encode = supervised.Encoder(tok, template, format, train_on)
                meta = _write_rows(tmp, files, encode, dtype, seq_len, packing, val_fraction, shard_tokens, bar.update)
        meta = {
            "format_version": fmt.FORMAT_VERSION if format == "text" else fmt.ROWS_FORMAT_VERSION,
            "format": format,
            # A non-byte tokenizer is read back from the copy saved next to the shards.
            "tokenizer": "bytes" if tok.spec == "bytes" else LOCAL_TOKENIZER,
            "tokenizer_source": tok.spec,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id,
            "dtype": dtype.name,
            **meta,
            "inputs": [str(f) for f in files],
        }
        if format == "text":
            meta["text_field"] = text_field
        if template is not None:
            meta["chat_template"] = template.to_json()
        tok.save(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        fmt.write_meta(tmp, meta)
        _replace(tmp, out)
    except OSError as e:  # e.g. a full disk: nothing of this attempt stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"cannot write the dataset {out}: {writable.describe(e)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _check_rows(format: str, seq_len: int | None, packing: str, train_on: str, tokenizer: str) -> None:
    if format not in fmt.ROW_FORMATS:
        raise DataError(f"--format {format!r} is not one of {', '.join(fmt.FORMATS)}")
    if seq_len is None:
        raise DataError(f"--format {format} writes rows of --seq-len tokens (the data.seq_len you train with); "
                        "give --seq-len")
    if packing not in fmt.PACKING:
        raise DataError(f"--packing {packing!r} is not one of {', '.join(fmt.PACKING)}")
    if train_on not in fmt.TRAIN_ON:
        raise DataError(f"--train-on {train_on!r} is not one of {', '.join(fmt.TRAIN_ON)}")
    if tokenizer.startswith("bpe:"):
        raise DataError(f"--format {format} needs the model's tokenizer; a {tokenizer} would be trained on the "
                        "rendered text: prepare with --tokenizer CHECKPOINT_DIR")


def _write_text(tmp: Path, files, tok, dtype, text_field, val_fraction, shard_tokens, on_bytes) -> dict:
    writer = _ShardWriter(tmp, dtype, shard_tokens)
    try:
        docs, max_id = 0, -1
        starts = True  # the next piece begins a document
        for text, end in documents(files, text_field, on_bytes=on_bytes):
            ids = tok.encode(text) if text else []
            if starts and tok.bos_id is not None:
                ids.insert(0, tok.bos_id)
            starts = end
            if end:
                ids.append(tok.eos_id)
                docs += 1
            if ids:
                max_id = max(max_id, max(ids))
            writer.write(ids)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    if writer.total <= docs * (1 if tok.bos_id is None else 2):  # nothing but EOS (and BOS) tokens
        raise DataError(f"no text found in {', '.join(str(f) for f in files[:3])}; the input is empty")
    n_val = int(round(writer.total * val_fraction))
    return {
        "num_tokens": writer.total,
        "num_documents": docs,
        "max_token_id": int(max_id),
        "shards": writer.shards,
        "splits": {"train": [0, writer.total - n_val], "val": [writer.total - n_val, writer.total]},
    }


def _write_rows(tmp: Path, files, encode, dtype, seq_len, packing, val_fraction, shard_tokens, on_bytes) -> dict:
    streams = {"loss_mask": np.dtype(np.uint8), "segments": pack.segment_dtype(seq_len)}
    writers = {"tokens": _ShardWriter(tmp, dtype, shard_tokens),
               **{name: _ShardWriter(tmp, d, shard_tokens, name) for name, d in streams.items()}}
    packer = pack.Packer(seq_len, encode.tok.eos_id, one_per_row=packing == "pad")
    docs, used, targets, max_id, skipped = 0, 0, 0, -1, {"too_long": 0, "no_targets": 0}

    def write(rows):
        for row in rows:
            for writer, values in zip(writers.values(), row):
                writer.write(values)

    try:
        for where, record in records(files, encode.format, on_bytes=on_bytes):
            try:
                ids, mask = encode(record)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if not mask.any():
                skipped["no_targets"] += 1
            elif ids.size > seq_len:
                skipped["too_long"] += 1
            else:
                docs, used, targets = docs + 1, used + ids.size, targets + int(mask.sum())
                max_id = max(max_id, int(ids.max()))
                write(packer.add(ids, mask))
        write(packer.finish())
        for writer in writers.values():
            writer.close()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    if not docs:
        raise DataError(f"no {encode.format} record of {', '.join(str(f) for f in files[:3])} is usable: "
                        f"{skipped['no_targets']} have no token to train on (--train-on {encode.train_on}), "
                        f"{skipped['too_long']} are longer than --seq-len {seq_len}")
    total = writers["tokens"].total
    rows = total // seq_len
    n_val = int(round(rows * val_fraction)) * seq_len
    shards = [{**shard, **{name: w.shards[i]["file"] for name, w in writers.items() if name != "tokens"}}
              for i, shard in enumerate(writers["tokens"].shards)]
    return {
        "num_tokens": total,
        "num_documents": docs,
        "max_token_id": max_id,
        "seq_len": seq_len,
        "num_rows": rows,
        "num_targets": targets,
        "num_padding": total - used,
        "packing": packing,
        "train_on": encode.train_on,
        "skipped": skipped,
        "streams": {name: d.name for name, d in streams.items()},
        "shards": shards,
        "splits": {"train": [0, total - n_val], "val": [total - n_val, total]},
    }


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished dataset into place; the old one is removed only after that."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
