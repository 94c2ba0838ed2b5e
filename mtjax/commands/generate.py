"""`mtjax generate CHECKPOINT`: sample text from a saved model. A layer store is sampled
one part at a time, its compute weights streamed through the device as in training (the
whole model never needs to fit); an HF checkpoint directory is loaded whole. With --chat
the prompt is a user's message, rendered through the checkpoint's chat template (as the
model was fine-tuned on it), and the answer stops at the template's end of turn."""

from __future__ import annotations

from pathlib import Path

import mtjax.store
from mtjax import data, generate, textfile
from mtjax.bounds import AT_LEAST_1, SEED, Range, flag
from mtjax.checkpoint import checkpoint_tokenizer, load_weights
from mtjax.checkpoint import weights_config as model_config
from mtjax.data import chat
from mtjax.errors import MtjaxError
from mtjax.store import layout, tokenizer
from mtjax.stream.sample import StreamSampler


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="sample text from a checkpoint or layer store", description=__doc__)
    p.add_argument("checkpoint", help="checkpoint directory (e.g. runs/default/final) or layer store")
    p.add_argument("--prompt", default="", help="text to continue (default: empty)")
    p.add_argument("--tokens", type=flag(int, AT_LEAST_1), default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=flag(float, Range(0, note="0: greedy")), default=0.8,
                   help="0 for greedy decoding (default: 0.8)")
    p.add_argument("--top-k", type=flag(int, Range(0, note="0: sample from the whole vocabulary")), default=40,
                   help="sample among the k likeliest tokens; 0: all (default: 40)")
    p.add_argument("--seed", type=flag(int, SEED), default=0, help="sampling seed (default: 0)")
    p.add_argument("--chat", action="store_true",
                   help="--prompt is a user's message: render it through the checkpoint's chat template and "
                        "stop at the template's end of turn (e.g. <|im_end|>)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer spec (bytes or a tokenizer.json) when the checkpoint has none; a store "
                        "uses the tokenizer of its training data, or the one `mtjax import` kept")
    p.set_defaults(func=run)


def is_store(path) -> bool:
    """Whether `path` is a layer store (opening it refuses one missing an identity file)."""
    return layout.is_store(path)


def check_source(path) -> None:
    """Refuse a path that is neither a layer store nor a Hugging Face checkpoint directory."""
    if not is_store(path) and not (Path(path) / "config.json").is_file():
        what = "it does not exist" if not Path(path).exists() else "it has no manifest.json or config.json"
        raise MtjaxError(f"no store or checkpoint at {path} ({what}); pass a layer store, a run's final/ "
                         "directory or a Hugging Face checkpoint directory")


def tokenizer_of(path, spec: str | None):
    """The tokenizer to use with the checkpoint or store at `path` (`spec` wins)."""
    if spec is None and is_store(path):
        with mtjax.store.open(path) as store:
            spec = tokenizer.spec(store)
        if spec is None:
            raise data.DataError(f"store {path} holds no tokenizer (made by `mtjax init`, or imported from a "
                                 "checkpoint without tokenizer files); "
                                 "pass --tokenizer bytes or a tokenizer.json")
    return data.load_tokenizer(spec) if spec else checkpoint_tokenizer(path)


def chat_prompt(path, tok, message: str) -> tuple[str, int]:
    """(the text the model answers, the id its answer stops at): `message` as a user's turn
    under the chat template kept with the checkpoint (or store) at `path` or its tokenizer."""
    places = [tokenizer.kept(path) if is_store(path) else Path(path)]
    if tok.spec != "bytes":
        places.append(Path(tok.spec))
    template = next((t for t in (chat.find(p) for p in places if p is not None and p.exists()) if t), None)
    if template is None:
        raise MtjaxError(f"--chat renders the prompt through the model's chat template, and {path} has none (no "
                         f"{chat.TEMPLATE_FILE}, no chat_template in {chat.CONFIG_FILE}); drop --chat")
    stop = tok.encode(template.turn_end())
    if not stop:
        raise MtjaxError(f"the chat template of {path} ends a turn with nothing; drop --chat")
    return template.render([{"role": "user", "content": message}], add_generation_prompt=True), stop[0]


def run(args) -> int:
    textfile.argument(args.prompt, "--prompt")  # the numeric flags are checked by the parser (mtjax.bounds.flag)
    check_source(args.checkpoint)
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    tokenizer = tokenizer_of(args.checkpoint, args.tokenizer)
    prompt = args.prompt
    if args.chat:
        prompt, kwargs["eos_id"] = chat_prompt(args.checkpoint, tokenizer, args.prompt)
        kwargs["add_bos"] = False  # the template writes what the conversation starts with
    generate.check_fits(model_config(args.checkpoint), generate.prompt_ids(tokenizer, prompt, not args.chat),
                        args.tokens, ("the chat prompt" if args.chat else "--prompt", "--tokens"))
    if is_store(args.checkpoint):
        with mtjax.store.open(args.checkpoint) as store:  # read-only: a trainer may hold the writer lock
            text = StreamSampler(store).complete(tokenizer, prompt, args.tokens, **kwargs)
    else:
        cfg, params = load_weights(args.checkpoint)
        text = generate.complete(cfg, params, tokenizer, prompt, args.tokens, **kwargs)
    print(text if args.chat else args.prompt + text)  # a chat prints the answer alone
    return 0
