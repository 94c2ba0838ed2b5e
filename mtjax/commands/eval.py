"""`mtjax eval CHECKPOINT DATASET`: mean next-token loss of a checkpoint (an HF checkpoint
directory or a layer store, whose master weights are used) on a dataset split."""

from __future__ import annotations

import math


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="loss and perplexity of a checkpoint on a dataset", description=__doc__)
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/default/final) or layer store")
    p.add_argument("dataset", help="prepared dataset dir, raw text/JSONL file, or builtin:shakespeare")
    p.add_argument("--split", default="val", help="train or val (default: val)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row (default: 128)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch (default: 8)")
    p.add_argument("--batches", type=int, default=8, help="batches to average over (default: 8)")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec when the checkpoint has none (a store "
                   "trained by `mtjax train` uses the tokenizer of its training data)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mtjax.commands.generate import is_store, store_tokenizer_spec
    from mtjax.run import evaluate_checkpoint

    spec = args.tokenizer
    if spec is None and is_store(args.checkpoint):
        spec = store_tokenizer_spec(args.checkpoint)  # the tokenizer of the data the store was trained on
    loss = evaluate_checkpoint(args.checkpoint, args.dataset, args.split, args.seq_len, args.batch_size,
                               args.batches, spec)
    print(f"{args.split} loss {loss:.4f}  perplexity {math.exp(min(loss, 50)):.2f}")
    return 0
