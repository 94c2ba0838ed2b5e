"""Reading a prepared dataset: memory-mapped shards and a resumable, shuffled loader.

A split is cut into non-overlapping windows of `seq_len` tokens; one row of a batch is
one window, and the loss predicts each token from those before it within the row. A chat
or prompt-completion dataset is stored as rows already (its meta `seq_len`): a window is
one of them, read with its loss mask and segment ids, and batches are mtjax.batch.Batch.
The loader visits the windows of each epoch in a seeded random order, so its whole state
is a cursor `{"epoch": e, "position": p}` that is saved with a checkpoint and restored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from mtjax.batch import Batch
from mtjax.data import format as fmt
from mtjax.data import prepare as prep
from mtjax.data import tokenizer as toklib
from mtjax.data.format import DataError


class Dataset:
    """A prepared dataset directory: its metadata and its token stream."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = fmt.read_meta(self.path)
        streams = {"tokens": self.meta["dtype"], **self.meta.get("streams", {})}
        self._shards = {name: [] for name in streams}  # stream -> its memory-mapped shards
        for shard in self.meta["shards"]:
            for name, dtype in streams.items():
                dtype = np.dtype(dtype).newbyteorder("<")
                file = self.path / shard["file" if name == "tokens" else name]
                expected = shard["tokens"] * dtype.itemsize
                if not file.exists() or file.stat().st_size != expected:
                    raise DataError(f"{file} is missing or truncated (expected {expected} bytes); "
                                    "prepare the dataset again")
                self._shards[name].append(np.memmap(file, dtype=dtype, mode="r", shape=(shard["tokens"],)))
        self._starts = np.cumsum([0] + [s["tokens"] for s in self.meta["shards"]])

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self.meta["eos_id"]

    @property
    def rows(self) -> int | None:
        """The length of the stored rows of a chat / prompt-completion dataset (None: a text stream)."""
        return self.meta.get("seq_len")

    def tokenizer(self) -> toklib.Tokenizer:
        spec = self.meta["tokenizer"]
        if spec == prep.LOCAL_TOKENIZER:
            spec = str(self.path / toklib.TOKENIZER_FILE)
        tok = toklib.load(spec)
        tok.bos_id = self.meta.get("bos_id")  # what its documents start with (older datasets: none)
        return tok

    def check_seq_len(self, seq_len: int) -> None:
        """Raise unless windows of `seq_len` are this dataset's rows (any length cuts a text stream)."""
        if self.rows is not None and seq_len != self.rows:
            raise DataError(f"dataset {self.path} holds rows of {self.rows} tokens; set data.seq_len to "
                            f"{self.rows}, or prepare the data again with --seq-len {seq_len}")

    def split(self, name: str) -> tuple[int, int]:
        """[start, stop) of a split in the token stream."""
        if name not in self.meta["splits"]:
            raise DataError(f"dataset {self.path} has no split {name!r}; it has {', '.join(self.meta['splits'])}")
        start, stop = self.meta["splits"][name]
        return start, stop

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream as int32, read across shard boundaries."""
        return self.read("tokens", start, stop)

    def read(self, stream: str, start: int, stop: int) -> np.ndarray:
        """Values [start, stop) of a stream (tokens, loss_mask, segments) as int32."""
        if stream not in self._shards:
            raise DataError(f"dataset {self.path} has no {stream} (it is a {self.meta.get('format', 'text')} dataset)")
        shards = self._shards[stream]
        out = np.empty(stop - start, np.int32)
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        for i in range(first, len(shards)):
            if done == out.size:
                break
            lo = start + done - self._starts[i]
            take = min(out.size - done, shards[i].size - lo)
            out[done:done + take] = shards[i][lo:lo + take]
            done += take
        return out

    def check_vocab(self, model_vocab: int) -> None:
        """Raise unless every stored token id is a row of the model's embedding."""
        top = max(self.meta["max_token_id"], self.eos_id)
        if top >= model_vocab:
            raise DataError(f"dataset {self.path} has token ids up to {top} but the model's vocabulary "
                            f"is {model_vocab}; set model.vocab_size >= {top + 1} or use a matching tokenizer")

    def check_tokenizer(self, spec: str, advice: str, name: str | None = None) -> None:
        """Raise unless the ids of this dataset mean the same tokens to the tokenizer `spec`
        names (the model's): `advice` says what to do instead; `name`: the dataset's, for
        the user (default: its path)."""
        source = self.meta.get("tokenizer_source", self.meta["tokenizer"])
        if source == spec or spec != "bytes" and source != "bytes" and Path(source).resolve() == Path(spec).resolve():
            return  # prepared with that very tokenizer
        if spec != "bytes" and source != "bytes" and toklib.same_ids(self.tokenizer(), toklib.load(spec)):
            return  # another copy of it
        raise DataError(f"{name or f'dataset {self.path}'} was tokenized with {_named(source)} but the model uses "
                        f"{_named(spec)}: the same ids mean other tokens to it; {advice}")


def _named(spec: str) -> str:
    return "bytes (no tokenizer)" if spec == "bytes" else spec


class Loader:
    """[accum, batch, seq] batches over one split, resumable from a cursor: int32 token
    windows of a text dataset, mtjax.batch.Batch (tokens, loss_mask, segments) of a chat
    or prompt-completion one (mtjax.batch.as_batch takes either).

    >>> loader = Loader(ds, "train", seq_len=128, batch_size=16, grad_accum=2, seed=0)
    >>> tokens = loader.next()   # int32 [2, 16, 128]
    >>> saved = loader.cursor     # {"epoch": 0, "position": 32}
    >>> Loader(ds, "train", 128, 16, 2, seed=0, cursor=saved).next()  # the same as the next call
    """

    def __init__(self, dataset: Dataset, split: str, seq_len: int, batch_size: int, grad_accum: int = 1,
                 seed: int = 0, shuffle: bool = True, cursor: dict | None = None):
        dataset.check_seq_len(seq_len)
        self.ds, self.seq_len, self.seed, self.shuffle = dataset, seq_len, seed, shuffle
        self.shape = (grad_accum, batch_size, seq_len)
        self.start, stop = dataset.split(split)
        self.num_windows = (stop - self.start) // seq_len
        rows = grad_accum * batch_size
        if self.num_windows < rows:
            raise DataError(
                f"the {split} split of {dataset.path} has {stop - self.start} tokens: {self.num_windows} "
                f"windows of {seq_len}, fewer than one batch of {rows} rows; add data or lower "
                "data.seq_len / data.batch_size / data.grad_accum")
        cursor = cursor or {"epoch": 0, "position": 0}
        self.epoch, self.position = int(cursor["epoch"]), int(cursor["position"])
        if not 0 <= self.position <= self.num_windows:
            raise DataError(f"loader cursor {cursor} does not fit this dataset ({self.num_windows} windows)")
        self._order_epoch, self._order = None, None

    @property
    def cursor(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def _order_of(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                self._order = np.arange(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def next_windows(self, count: int) -> np.ndarray:
        """Indices of the next `count` windows, continuing into the next epoch as needed."""
        picked = []
        while count:
            if self.position == self.num_windows:
                self.epoch, self.position = self.epoch + 1, 0
            take = min(count, self.num_windows - self.position)
            picked.append(self._order_of(self.epoch)[self.position:self.position + take])
            self.position += take
            count -= take
        return np.concatenate(picked)

    def next(self) -> np.ndarray | Batch:
        accum, batch, seq = self.shape
        windows = self.next_windows(accum * batch)
        streams = ("tokens",) if self.ds.rows is None else ("tokens", "loss_mask", "segments")
        arrays = [np.stack([self.ds.read(name, self.start + w * seq, self.start + (w + 1) * seq) for w in windows])
                  .reshape(self.shape) for name in streams]
        if self.ds.rows is None:
            return arrays[0]
        tokens, mask, segments = arrays
        return Batch(tokens, mask.astype(bool), segments)

    def __iter__(self):
        while True:
            yield self.next()


CACHE_STAMP = "source.json"  # in a run's data cache: what it was prepared from (and that a run made it)


def prepared(data_cfg) -> Dataset | None:
    """The prepared dataset directory `data_cfg.dataset` names, used as it is; None when it
    names raw or built-in text, which `resolve` prepares into the run's cache."""
    source = data_cfg.dataset
    if not source.startswith(prep.BUILTIN) and (Path(source) / fmt.META_FILE).exists():
        return Dataset(source)
    return None


def check_cache(data_cfg, cache_dir: str | Path) -> None:
    """Refuse, before anything is written, raw inputs that are not there and a `cache_dir`
    that `resolve` may not replace: only a directory that is absent, empty, or holds the
    stamp `resolve` writes (a cache it prepared) is a run's data cache. Anything else there
    (a dataset `mtjax data prepare` wrote, the user's files) is theirs."""
    prep.expand_inputs([data_cfg.dataset])
    cache = Path(cache_dir)
    if not cache.exists() or (cache.is_dir() and not any(cache.iterdir())) or _stamp(cache) is not None:
        return
    if (cache / fmt.META_FILE).exists():
        raise DataError(f"{cache} is a prepared dataset, not a data cache a run made, and a run would replace it; "
                        f"train on it with --data.dataset={cache}, or choose another run.dir")
    raise DataError(f"{cache} is not a data cache a run made (a run prepares raw text into <run.dir>/data and would "
                    "replace what is there); choose another run.dir")


def _stamp(cache: Path) -> dict | None:
    """The stamp of a cache `resolve` prepared ({"key", "dataset"}), or None."""
    try:
        stamp = json.loads((cache / CACHE_STAMP).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(stamp, dict) and isinstance(stamp.get("key"), str) and isinstance(stamp.get("dataset"), str)
    return stamp if ok else None


def resolve(data_cfg, cache_dir: str | Path) -> Dataset:
    """The dataset `data_cfg.dataset` names, preparing raw or built-in text into `cache_dir`.

    A prepared dataset directory is used as it is. Raw files are tokenized once (as
    `data_cfg.format`; chat and prompt-completion into rows of data.seq_len); the cache is
    reused while the inputs, tokenizer, split and, for rows, their settings are unchanged.
    Only a run's own cache is replaced (`check_cache`): its stamp is written with the
    dataset, so a cache is never in place without it.
    """
    dataset = prepared(data_cfg)
    if dataset is not None:
        return dataset
    files = prep.expand_inputs([data_cfg.dataset])
    key = _fingerprint(files, data_cfg)
    cache = Path(cache_dir)
    check_cache(data_cfg, cache)
    stamp = _stamp(cache)
    if stamp is not None and stamp["key"] == key and (cache / fmt.META_FILE).exists():
        return Dataset(cache)
    rows = data_cfg.format != "text"
    stamp = {"key": key, "dataset": data_cfg.dataset, "made_by": "mtjax train: this run directory's data cache"}
    prep.prepare(files, cache, data_cfg.tokenizer, data_cfg.text_field, data_cfg.val_fraction, overwrite=True,
                 format=data_cfg.format, seq_len=data_cfg.seq_len if rows else None, packing=data_cfg.packing,
                 train_on=data_cfg.train_on, extra={CACHE_STAMP: json.dumps(stamp) + "\n"})
    return Dataset(cache)


def _fingerprint(files: list[Path], data_cfg) -> str:
    parts = [data_cfg.tokenizer, data_cfg.text_field, repr(data_cfg.val_fraction)]
    if data_cfg.format != "text":  # rows are cut, masked and packed while preparing
        parts += [data_cfg.format, str(data_cfg.seq_len), data_cfg.train_on, data_cfg.packing]
    for f in files:
        st = f.stat()
        parts += [str(f.resolve()), str(st.st_size), str(st.st_mtime_ns)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
