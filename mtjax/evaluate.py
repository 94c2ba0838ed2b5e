"""A saved checkpoint's evaluation: its mean loss over the first batches of a dataset
split, the model streamed through the device one part at a time (`mtjax eval`).

`eval_batches` cuts those batches from the start of a split; a training run's periodic
validation loss (mtjax.run) evaluates the same kind of batches with its own engine.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import NamedTuple

import optax

import mtjax.store
from mtjax import data, documents, hf
from mtjax.batch import Batch, concat
from mtjax.checkpoint import checkpoint_tokenizer, weights_config
from mtjax.config import DataConfig, StoreConfig, StreamConfig
from mtjax.store import layout
from mtjax.stream import StreamEngine
from mtjax.terminal import bar as progress_bar


class Evaluation(NamedTuple):
    loss: float  # mean over the counted targets
    targets: int  # how many targets counted
    masked: bool  # whether the data's loss mask or documents left some out (chat data)
    batches: int  # batches evaluated: fewer than asked when the split holds fewer windows
    rows: int  # rows per batch: fewer than asked when the split holds less than one batch
    windows: int  # windows of seq_len tokens the split holds


def eval_engine(path: str | Path) -> StreamEngine:
    """An engine whose `eval_loss` streams the weights at `path` through the device one part
    at a time, as training does: a layer store's last committed compute copy, read from
    its disk (the store opened read-only; the engine closes it), or an HF checkpoint's
    weights, read into host RAM (with no optimizer state)."""
    one = StreamConfig(devices=1, resident="none")  # every part streamed, the batch on one device
    if not layout.is_store(path):
        cfg, params = hf.load_params(path)
        return StreamEngine(cfg, params, stream=one, tx=optax.identity())
    store = mtjax.store.open(path)
    try:
        store.check_complete("evaluate it")
        # A two-copy store's master weights are held in RAM (as eval always read them): with
        # them on disk the engine would make a scratch directory for gradients beside the
        # store, which a store on a read-only disk cannot have. A one-copy store's engine
        # keeps every kind on disk (its gradients' place is the store's own, unused here).
        tiers = dict(compute="disk", master="disk" if store.copies == 1 else "ram", opt="disk")
        return StreamEngine(store.config, stream=one, store_config=StoreConfig(**tiers, copies=store.copies),
                            store=store, owns_store=True)
    except BaseException:
        store.close()
        raise


def evaluate_checkpoint(ckpt_dir, data_cfg: DataConfig, split: str = "val", batches: int = 8,
                        tokenizer: str | None = None) -> Evaluation:
    """Mean loss of a saved checkpoint over the first `batches` batches of `data_cfg`'s
    dataset split (rows of its seq_len, batch_size at a time): over their counted targets
    (the answers of a chat dataset), as training counts them. Raw text is tokenized with
    the checkpoint's tokenizer, or `tokenizer`. The model is streamed through the device
    (`eval_engine`), never loaded whole."""
    tok = checkpoint_tokenizer(ckpt_dir, tokenizer)
    cfg = weights_config(ckpt_dir)
    seq_len, batch_size = data_cfg.seq_len, data_cfg.batch_size
    with tempfile.TemporaryDirectory(prefix="mtjax-eval-") as cache:
        ds = data.resolve(dataclasses.replace(data_cfg, tokenizer=_spec_file(tok, ckpt_dir, tokenizer)), cache)
        where = "bytes" if tok.spec == "bytes" else Path(tok.spec).parent
        ds.check_tokenizer(tok.spec, f"prepare it again with `mtjax data prepare ... --tokenizer {where}`, or pass "
                                     "--tokenizer naming the dataset's own to evaluate on it anyway")
        ds.check_vocab(cfg.vocab_size)
        ds.check_seq_len(seq_len)
        batch, used, rows, windows = eval_batches(ds, split, seq_len, batch_size, batches)
        engine = eval_engine(ckpt_dir)
        try:
            # One streamed pass over the weights for every batch: the bar moves once it is done.
            with progress_bar(used, "evaluating", unit="batch") as bar:
                loss = engine.eval_loss(batch)["loss"]
                bar.update(used)
        finally:
            engine.close()
        return Evaluation(loss, documents.trained_tokens(batch), not batch.plain, used, rows, windows)


def _spec_file(tok, ckpt_dir: Path, spec: str | None) -> str:
    """A tokenizer spec `data.resolve` can load again to tokenize raw text like the checkpoint."""
    if spec or tok.spec == "bytes":
        return spec or "bytes"
    return str(Path(ckpt_dir) / "tokenizer.json")


def eval_batches(dataset, split: str, seq_len: int, batch_size: int, batches: int) -> tuple[Batch, int, int, int]:
    """(up to `batches` batches of up to `batch_size` rows from the start of a split, how
    many batches and rows per batch that is, the split's windows): the rows there are,
    each once, when the split holds fewer windows than asked for."""
    start, stop = dataset.split(split)
    windows = (stop - start) // seq_len
    rows = min(batch_size, windows)
    if rows == 0:
        raise data.DataError(f"the {split} split of {dataset.path} has {stop - start} tokens, fewer than one row of "
                             f"data.seq_len {seq_len}; add data or lower data.seq_len")
    used = min(batches, windows // rows)
    loader = data.Loader(dataset, split, seq_len, rows, 1, shuffle=False)
    return concat(loader.next() for _ in range(used)), used, rows, windows
