"""Tokenizers, named by a spec string that the dataset metadata records.

    bytes                 UTF-8 bytes as ids 0-255, EOS = 256 (vocabulary 257; needs no file)
    PATH                  a Hugging Face tokenizer.json (gzipped accepted) or a dir holding one
    bpe:VOCAB             a byte-level BPE trained on the input by `tokenizers` (see `train_bpe`)
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Protocol

from mtjax import textfile, writable
from mtjax.data.format import DataError

# Names end-of-document tokens go by, most specific first, when no tokenizer_config.json says.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
TOKENIZER_FILE = "tokenizer.json"
# The files a Hugging Face checkpoint's tokenizer may consist of (AutoTokenizer reads them).
HF_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
            "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
# Line starts (after a newline, before a non-space): byte-level BPE pre-tokenizers (GPT-2,
# Llama 3, Qwen2) never merge across them, so pieces cut there encode to the same ids as
# the whole text, and `encode_batch` encodes them in parallel. Other tokenizers (e.g. ones
# that prefix every piece with a space marker) fail the one-time check and encode whole.
_PIECE_BREAK = re.compile(r"(?<=\n)(?=\S)")
_LONG_TEXT = 1 << 14


class Tokenizer(Protocol):
    spec: str  # how to rebuild it (recorded in the dataset metadata)
    vocab_size: int
    eos_id: int
    bos_id: int | None  # the token every document starts with, where the tokenizer adds one

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, out_dir: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes; decoding replaces invalid byte sequences rather than failing."""

    spec, vocab_size, eos_id, bos_id = "bytes", 257, 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` and, per id, the [start, end) characters it came from."""
        ids, offsets = [], []
        for i, char in enumerate(text):
            raw = char.encode("utf-8")
            ids += raw
            offsets += [(i, i + 1)] * len(raw)
        return ids, offsets

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, out_dir: Path) -> None:
        pass  # nothing to save: the spec says it all


class HFTokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE, WordPiece, ...) from a tokenizer.json."""

    def __init__(self, tok, spec: str, eos_id: int, bos_id: int | None = None):
        self._tok, self.spec, self.eos_id, self.bos_id = tok, spec, eos_id, bos_id
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), eos_id + 1)
        self._pieces_exact: bool | None = None  # does piecewise encoding equal whole-text encoding?

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; long texts are encoded as line pieces in parallel when that is exact."""
        if len(text) < _LONG_TEXT or self._pieces_exact is False:
            return self._tok.encode(text, add_special_tokens=False).ids
        ids = [i for piece in self.encode_batch(_PIECE_BREAK.split(text)) for i in piece]
        if self._pieces_exact is None:  # checked once, on the first long text
            whole = self._tok.encode(text, add_special_tokens=False).ids
            self._pieces_exact = ids == whole
            return whole
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` (encoded whole) and, per id, the [start, end) characters it came from."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, out_dir: Path) -> None:
        path = Path(out_dir) / TOKENIZER_FILE
        with writable.writing(path):  # tokenizers words a full disk as a bare Exception
            self._tok.save(str(path))


def same_ids(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether every id means the same token to `a` and `b`: what a model that learned one
    tokenizer's ids needs of data prepared with the other (how text is cut may differ)."""
    if isinstance(a, HFTokenizer) and isinstance(b, HFTokenizer):
        return a.eos_id == b.eos_id and (a._tok.get_vocab(with_added_tokens=True)
                                         == b._tok.get_vocab(with_added_tokens=True))
    return a.spec == b.spec == "bytes"


def copy_hf_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer files `src_dir` holds (of HF_FILES, each possibly gzipped as
    NAME.gz, which is written unzipped: transformers reads no .gz) into `dst_dir`; their names."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    found = {name: src for name in HF_FILES
             for src in (src_dir / f"{name}.gz", src_dir / name) if src.is_file()}  # plain wins
    if found:
        dst_dir.mkdir(parents=True, exist_ok=True)
    for name, src in found.items():
        if src.suffix == ".gz":
            (dst_dir / name).write_bytes(gzip.decompress(src.read_bytes()))
        else:
            shutil.copyfile(src, dst_dir / name)
    return list(found)


def load(spec: str) -> Tokenizer:
    """The tokenizer a spec names (`bpe:VOCAB` needs training: use `train_bpe`)."""
    if spec == "bytes":
        return ByteTokenizer()
    if not spec.strip():  # as a path it would mean the working directory
        raise DataError("the tokenizer is empty (''); name 'bytes', 'bpe:VOCAB', a tokenizer.json or a checkpoint "
                        "directory holding one")
    if spec.startswith("bpe:"):
        raise DataError(f"tokenizer {spec!r} is trained while preparing a dataset; "
                        "pass the prepared dataset's tokenizer.json instead")
    return _load_file(spec)


def _load_file(spec: str) -> HFTokenizer:
    from tokenizers import Tokenizer as HFTok

    path = Path(spec)
    if path.is_dir():
        found = [path / n for n in (TOKENIZER_FILE, TOKENIZER_FILE + ".gz") if (path / n).exists()]
        if not found:
            raise DataError(f"tokenizer {spec!r} is a directory without a {TOKENIZER_FILE}; name 'bytes', a "
                            f"{TOKENIZER_FILE} or a checkpoint directory holding one")
        path = found[0]
    if not path.is_file():
        raise DataError(f"tokenizer {spec!r} is neither 'bytes', 'bpe:VOCAB' nor an existing tokenizer.json; "
                        "name one of those")
    raw = path.read_bytes()
    try:
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
        tok = HFTok.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None
    config = _tokenizer_config(path.parent)
    return HFTokenizer(tok, str(path.resolve()), _eos_id(tok, config), _bos_id(tok, config))


def _tokenizer_config(folder: Path) -> dict:
    """The neighbouring tokenizer_config.json, or {} when there is none (or it is unreadable)."""
    try:
        config = json.loads(textfile.read(folder / "tokenizer_config.json"))
    except (OSError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _token_name(config: dict, key: str) -> str | None:
    name = config.get(key)
    name = name.get("content") if isinstance(name, dict) else name
    return name if isinstance(name, str) else None


def _bos_id(tok, config: dict) -> int | None:
    """The BOS a document starts with, as the tokenizer's own configuration says: an explicit
    `add_bos_token` in tokenizer_config.json (what the Llama and Gemma tokenizer classes of
    transformers follow) with its `bos_token`; otherwise the one token the tokenizer.json's
    post-processor puts before a text (Llama 3's and Gemma's templates), if any."""
    if config.get("add_bos_token") is False:
        return None
    if config.get("add_bos_token") is True and _token_name(config, "bos_token"):
        token_id = tok.token_to_id(_token_name(config, "bos_token"))
        if token_id is not None:
            return token_id
    plain = tok.encode("a", add_special_tokens=False).ids
    special = tok.encode("a", add_special_tokens=True).ids
    before = next((special[:i] for i in range(len(special) - len(plain) + 1) if special[i:i + len(plain)] == plain), [])
    return before[0] if len(before) == 1 else None


def _eos_id(tok, config: dict) -> int:
    """EOS from a neighbouring tokenizer_config.json, else a well-known name, else a new id."""
    names = list(_EOS_NAMES)
    if _token_name(config, "eos_token"):
        names.insert(0, _token_name(config, "eos_token"))
    for name in names:
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    # No end-of-document token: one past the vocabulary (the model vocab must cover it).
    return tok.get_vocab_size(with_added_tokens=True)


def train_bpe(spec: str, texts: Iterable[str]) -> HFTokenizer:
    """Train a byte-level BPE of `bpe:VOCAB` size on `texts`, with <|endoftext|> as EOS."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    try:
        vocab = int(spec.split(":", 1)[1])
    except ValueError:
        raise DataError(f"tokenizer {spec!r} must look like bpe:8192") from None
    if vocab < 257 + 1:
        raise DataError(f"tokenizer {spec!r}: a byte-level BPE needs a vocabulary of at least 258")
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[_EOS_NAMES[0]], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, spec, tok.token_to_id(_EOS_NAMES[0]))
