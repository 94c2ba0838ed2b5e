"""`mtjax data prepare|info`: tokenize raw text into a dataset, or describe one."""

from __future__ import annotations

import json

from mtjax import writable
from mtjax.bounds import FRACTION, SEQ_LEN, flag
from mtjax.data import Dataset, prepare
from mtjax.data.format import FORMATS, PACKING, TRAIN_ON


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="prepare a tokenized dataset from text or JSONL, or describe one",
                              description=__doc__)
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize text/JSONL/Parquet files or datasets dirs into token shards",
                          description="Tokenize plain-text files (one document each), JSONL files (one "
                                      "document per line), Parquet files or Hugging Face `datasets` "
                                      "directories (save_to_disk; one document per row; needs pyarrow: "
                                      "pip install 'mtjax[data]') into memory-mapped token shards plus meta.json. "
                                      "--format chat / prompt-completion reads records, renders "
                                      "conversations with the tokenizer's chat template, and writes rows of "
                                      "--seq-len tokens with a loss mask and document ids.")
    prep.add_argument("inputs", nargs="+", help="files or directories (.txt, .md, .jsonl, optionally .gz; "
                                                ".parquet), a `datasets` save_to_disk directory (a DatasetDict: "
                                                "its train split), or builtin:shakespeare")
    prep.add_argument("--out", required=True, help="output dataset directory")
    prep.add_argument("--tokenizer", default="bytes",
                      help="bytes | bpe:VOCAB (trained on the input) | tokenizer.json or a checkpoint dir "
                           "(default: bytes)")
    prep.add_argument("--text-field", default="text",
                      help="JSONL field or table column holding the text (default: text)")
    prep.add_argument("--val-fraction", type=flag(float, FRACTION), default=0.01,
                      help="share of tokens held out for validation (default: 0.01)")
    prep.add_argument("--format", default="text", choices=FORMATS,
                      help="text: plain documents; chat: `messages` (role, content); prompt-completion: "
                           "`prompt` and `completion` (JSONL fields or table columns; default: text)")
    prep.add_argument("--seq-len", type=flag(int, SEQ_LEN), default=None,
                      help="tokens per row for chat / prompt-completion: the data.seq_len you train with; "
                           "longer conversations are dropped and counted")
    prep.add_argument("--packing", default="pack", choices=PACKING,
                      help="pack: several documents per row, each seeing only itself; pad: one per row "
                           "(default: pack)")
    prep.add_argument("--train-on", default="answers", choices=TRAIN_ON,
                      help="answers: the loss counts assistant turns / completions only; all: every token "
                           "(default: answers)")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --out")
    prep.set_defaults(func=run_prepare)
    info = sub.add_parser("info", help="print a prepared dataset's metadata",
                          description="Print the meta.json of a prepared dataset: tokenizer, vocabulary, token "
                                      "count, shards and the train/validation split.")
    info.add_argument("dataset", help="prepared dataset directory")
    info.set_defaults(func=run_info)


def run_prepare(args) -> int:

    writable.check(args.out, "--out")
    meta = prepare(args.inputs, args.out, args.tokenizer, args.text_field, args.val_fraction,
                   overwrite=args.overwrite, format=args.format, seq_len=args.seq_len, packing=args.packing,
                   train_on=args.train_on)
    train, val = (b - a for a, b in meta["splits"].values())
    print(f"{args.out}: {meta['num_tokens']:,} tokens ({train:,} train, {val:,} validation) from "
          f"{meta['num_documents']:,} documents; vocabulary {meta['vocab_size']:,} ({meta['dtype']})")
    if args.format != "text":
        skipped = meta["skipped"]
        print(f"{meta['num_rows']:,} rows of {meta['seq_len']} ({meta['packing']}, "
              f"{meta['num_padding'] / meta['num_tokens']:.1%} padding): "
              f"{meta['num_targets'] / meta['num_tokens']:.1%} of tokens are targets (--train-on "
              f"{meta['train_on']}); skipped {skipped['too_long']:,} longer than --seq-len and "
              f"{skipped['no_targets']:,} with nothing to train on")
    return 0


def run_info(args) -> int:

    print(json.dumps(Dataset(args.dataset).meta, indent=2))
    return 0
