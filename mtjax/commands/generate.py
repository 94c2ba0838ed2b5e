"""`mtjax generate CHECKPOINT`: sample text from a saved model. A layer store is sampled
one part at a time, its compute weights streamed through the device as in training (the
whole model never needs to fit); an HF checkpoint directory is loaded whole."""

from __future__ import annotations

from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="sample text from a checkpoint or layer store", description=__doc__)
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/default/final) or layer store")
    p.add_argument("--prompt", default="", help="text to continue (default: empty)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0: all (default: 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer spec (bytes or a tokenizer.json) when the checkpoint has none; a store "
                        "trained by `mtjax train` uses the tokenizer of its training data")
    p.set_defaults(func=run)


def is_store(path) -> bool:
    return (Path(path) / "manifest.json").exists()


def store_tokenizer_spec(path) -> str | None:
    """The tokenizer of the data a store was trained on (from its committed train state),
    or None for a store that no run has trained (made by `mtjax import` or `mtjax init`)."""
    import mtjax.store
    from mtjax.data import format as fmt

    with mtjax.store.open(path) as store:
        state = store.load_train_state()
    data = (state or {}).get("fixed", {}).get("data")
    if not data:
        return None
    dataset = Path(data["dataset"])
    if (dataset / fmt.META_FILE).exists():  # a prepared dataset names its own tokenizer
        from mtjax.data import Dataset

        return Dataset(dataset).tokenizer().spec
    return data["tokenizer"]


def tokenizer_of(path, spec: str | None):
    """The tokenizer to use with the checkpoint or store at `path` (`spec` wins)."""
    from mtjax import data
    from mtjax.run import checkpoint_tokenizer

    if spec is None and is_store(path):
        spec = store_tokenizer_spec(path)
    return data.load_tokenizer(spec) if spec else checkpoint_tokenizer(path)


def run(args) -> int:
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    tokenizer = tokenizer_of(args.checkpoint, args.tokenizer)
    if is_store(args.checkpoint):
        import mtjax.store
        from mtjax.stream.sample import StreamSampler

        with mtjax.store.open(args.checkpoint) as store:  # read-only: a trainer may hold the writer lock
            text = StreamSampler(store).complete(tokenizer, args.prompt, args.tokens, **kwargs)
    else:
        from mtjax import generate
        from mtjax.run import load_weights

        cfg, params = load_weights(args.checkpoint)
        text = generate.complete(cfg, params, tokenizer, args.prompt, args.tokens, **kwargs)
    print(args.prompt + text)
    return 0
