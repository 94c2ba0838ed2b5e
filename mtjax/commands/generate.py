"""`mtjax generate CHECKPOINT`: sample text from a saved model (an HF checkpoint
directory or a layer store, whose master weights are used)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="sample text from a checkpoint", description=__doc__)
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/default/final) or layer store")
    p.add_argument("--prompt", default="", help="text to continue (default: empty)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0: all (default: 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer spec when the checkpoint has none (bytes or a tokenizer.json)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mtjax import generate
    from mtjax.run import checkpoint_tokenizer, load_weights

    tokenizer = checkpoint_tokenizer(args.checkpoint, args.tokenizer)
    cfg, params = load_weights(args.checkpoint)
    text = generate.complete(cfg, params, tokenizer, args.prompt, args.tokens, temperature=args.temperature,
                             top_k=args.top_k, seed=args.seed)
    print(args.prompt + text)
    return 0
