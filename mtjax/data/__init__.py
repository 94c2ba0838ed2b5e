"""Training data: tokenizers, preparing token shards, and the resumable batch loader.

    prepare(inputs, out_dir, tokenizer)  raw text/JSONL (.gz ok) -> token shards + meta.json
                                         (format="chat" / "prompt-completion": rows with a loss
                                         mask and segment ids; docs/data.md)
    Dataset(dir)                         a prepared dataset (memory-mapped)
    Loader(dataset, split, ...)          [accum, batch, seq] int32 windows, or mtjax.batch.Batch
                                         for chat / prompt-completion rows; .cursor
    resolve(data_cfg, cache_dir)         the dataset a DataConfig names, prepared on demand into a
                                         run's data cache (check_cache: only one a run made is replaced)
    prepared(data_cfg)                   that dataset when it is a prepared directory (None: raw text)
    chat                                 a checkpoint's chat template, rendered as transformers does
"""

from mtjax.data.dataset import Dataset, Loader, check_cache, prepared, resolve
from mtjax.data.format import DataError
from mtjax.data.prepare import prepare
from mtjax.data.tokenizer import ByteTokenizer, HFTokenizer
from mtjax.data.tokenizer import load as load_tokenizer

__all__ = ["ByteTokenizer", "DataError", "Dataset", "HFTokenizer", "Loader", "check_cache", "load_tokenizer", "prepare",
           "prepared", "resolve"]
