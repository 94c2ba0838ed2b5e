"""`mtjax eval CHECKPOINT DATASET`: mean next-token loss of a checkpoint (an HF checkpoint
directory or a layer store, whose last committed weights are used) on a dataset split; on
chat or prompt-completion data, over the tokens its loss mask keeps (the answers), as
training. The model is streamed through the device one part at a time, as training's
evaluation streams it (a store's weights read from its disk), so it never needs to fit."""

from __future__ import annotations

import math
import sys

from mtjax import data
from mtjax.bounds import AT_LEAST_1, flag
from mtjax.commands.generate import check_source, is_store, model_config, tokenizer_of
from mtjax.config import ConfigError, DataConfig
from mtjax.evaluate import evaluate_checkpoint


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="loss and perplexity of a checkpoint on a dataset", description=__doc__)
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/default/final) or layer store")
    p.add_argument("dataset", help="prepared dataset dir, raw text/JSONL file, or builtin:shakespeare")
    p.add_argument("--split", default="val", help="train or val (default: val)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default: 128)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch (default: 8)")
    p.add_argument("--batches", type=flag(int, AT_LEAST_1), default=8, help="batches to average over (default: 8)")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec when the checkpoint has none (a store "
                   "uses the tokenizer of its training data, or the one `mtjax import` kept)")
    p.set_defaults(func=run)


_FLAGS = {"data.seq_len / data.batch_size / data.grad_accum": "--seq-len / --batch-size",
          "--data.tokenizer": "--tokenizer", "data.seq_len": "--seq-len", "data.batch_size": "--batch-size",
          "data.dataset": "the dataset"}


def _in_flags(message: str) -> str:
    """A line about `mtjax train`'s data.* keys, in this command's arguments."""
    for key, ours in _FLAGS.items():
        message = message.replace(key, ours)
    return message


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def run(args) -> int:

    try:  # the dataset, --seq-len and --batch-size are checked as training checks its data.* keys
        data_cfg = DataConfig(dataset=args.dataset, seq_len=args.seq_len, batch_size=args.batch_size)
    except ConfigError as e:
        raise ConfigError(_in_flags(str(e))) from None
    check_source(args.checkpoint)
    model_config(args.checkpoint).check_context(args.seq_len, "--seq-len")
    spec = args.tokenizer
    if spec is None and is_store(args.checkpoint):
        spec = tokenizer_of(args.checkpoint, None).spec  # the data it was trained on, or the imported one
    try:
        result = evaluate_checkpoint(args.checkpoint, data_cfg, args.split, args.batches, spec)
    except data.DataError as e:  # mtjax.data words its advice in the keys of `mtjax train`
        raise data.DataError(_in_flags(str(e))) from None
    if (result.batches, result.rows) != (args.batches, args.batch_size):  # the split holds fewer windows
        print(f"mtjax eval: the {args.split} split holds {result.windows:,} rows of {args.seq_len} tokens: "
              f"evaluated {_count(result.batches, 'batch', 'batches')} of {_count(result.rows, 'row', 'rows')} "
              f"(asked for {_count(args.batches, 'batch', 'batches')} of {_count(args.batch_size, 'row', 'rows')})",
              file=sys.stderr)
    over = f"  over the {result.targets:,} tokens the loss mask keeps" if result.masked else ""
    print(f"{args.split} loss {result.loss:.4f}  perplexity {math.exp(min(result.loss, 50)):.2f}{over}")
    return 0
