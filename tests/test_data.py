"""Data pipeline: tokenizers, token shards, the resumable loader, and bad-input errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from mtjax import data
from mtjax.config import DataConfig
from mtjax.data import DataError, Dataset, Loader, prepare
from mtjax.errors import MtjaxError

QWEN2 = Path(__file__).parent / "data" / "qwen2"
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. — ¡ñandú! 🎭\n"


def write(path: Path, text: str, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def corpus(tmp_path: Path, n: int = 60) -> Path:
    lines = [f"Line {i}: {'to be or not to be ' * (1 + i % 5)}\n" for i in range(n)]
    return write(tmp_path / "corpus.txt", "".join(lines))


def test_data_error_is_a_user_error():
    assert issubclass(DataError, MtjaxError)


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.eos_id == 256 and tok.vocab_size == 257
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [256]) == TEXT  # EOS decodes to nothing


def test_qwen2_tokenizer_round_trip_and_matches_the_tokenizers_library():
    from tokenizers import Tokenizer

    tok = data.load_tokenizer(str(QWEN2))
    reference = Tokenizer.from_str(gzip.open(QWEN2 / "tokenizer.json.gz").read().decode())
    ids = tok.encode(TEXT)
    assert ids == reference.encode(TEXT, add_special_tokens=False).ids
    assert tok.decode(ids) == TEXT
    assert tok.eos_id == reference.token_to_id("<|endoftext|>") == 151643
    assert tok.vocab_size > 1 << 16


def test_bytes_dataset_round_trip_with_eos_between_documents(tmp_path):
    write(tmp_path / "in" / "a.txt", "hello\nworld\n")
    write(tmp_path / "in" / "b.txt.gz", "second document", gz=True)
    jsonl = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(["x y", "", "zz"]))
    write(tmp_path / "in" / "c.jsonl.gz", jsonl, gz=True)
    meta = prepare([tmp_path / "in"], tmp_path / "ds", "bytes", val_fraction=0)
    ds = Dataset(tmp_path / "ds")
    assert meta["dtype"] == "uint16" and meta["num_documents"] == 5
    stored = ds.tokens(0, meta["num_tokens"])
    pieces = np.split(stored, np.flatnonzero(stored == 256) + 1)[:-1]  # each ends with EOS
    docs = [bytes(d[:-1].astype(np.uint8)).decode() for d in pieces]
    assert docs == ["hello\nworld\n", "second document", "x y", "", "zz"]
    assert (tmp_path / "ds" / "tokens-00000.bin").stat().st_size == 2 * meta["num_tokens"]


def test_hf_tokenizer_dataset_uses_uint32_and_keeps_the_tokenizer(tmp_path):
    write(tmp_path / "docs.jsonl", json.dumps({"body": TEXT}) + "\n" + json.dumps({"body": "more"}) + "\n")
    meta = prepare([tmp_path / "docs.jsonl"], tmp_path / "ds", str(QWEN2), text_field="body", val_fraction=0)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 1 << 16
    ds = Dataset(tmp_path / "ds")
    assert (tmp_path / "ds" / "tokenizer.json").exists()
    tok = ds.tokenizer()  # loaded from the dataset's own copy
    stored = ds.tokens(0, meta["num_tokens"]).tolist()
    assert stored == tok.encode(TEXT) + [tok.eos_id] + tok.encode("more") + [tok.eos_id]
    assert tok.decode(stored[:stored.index(tok.eos_id)]) == TEXT


def test_bpe_tokenizer_is_trained_saved_and_reloaded(tmp_path):
    meta = prepare([corpus(tmp_path)], tmp_path / "ds", "bpe:300", val_fraction=0.1)
    assert meta["vocab_size"] <= 300 and meta["dtype"] == "uint16"
    ds = Dataset(tmp_path / "ds")
    tok = ds.tokenizer()
    start, stop = ds.split("train")
    ids = ds.tokens(start, stop).tolist()
    text = (tmp_path / "corpus.txt").read_text()
    assert tok.decode(ids) == text[:len(tok.decode(ids))]
    assert len(ids) < len(text.encode()) / 2  # the merges compress the repetitive corpus


def test_validation_split_is_the_tail(tmp_path):
    meta = prepare([corpus(tmp_path)], tmp_path / "ds", val_fraction=0.25)
    (a, b), (c, d) = meta["splits"]["train"], meta["splits"]["val"]
    assert a == 0 and b == c and d == meta["num_tokens"] and abs((d - c) / d - 0.25) < 0.01


def test_tokens_read_across_shard_boundaries(tmp_path):
    src = corpus(tmp_path)
    one = Dataset(tmp_path / "one") if prepare([src], tmp_path / "one") else None
    many_meta = prepare([src], tmp_path / "many", shard_tokens=97)
    many = Dataset(tmp_path / "many")
    assert len(many_meta["shards"]) > 10
    n = many_meta["num_tokens"]
    np.testing.assert_array_equal(many.tokens(0, n), one.tokens(0, n))
    np.testing.assert_array_equal(many.tokens(90, 300), one.tokens(90, 300))
    a = next(iter(Loader(one, "train", 16, 4, 2, seed=3)))
    b = next(iter(Loader(many, "train", 16, 4, 2, seed=3)))
    np.testing.assert_array_equal(a, b)


@pytest.fixture
def dataset(tmp_path) -> Dataset:
    prepare([corpus(tmp_path, 40)], tmp_path / "ds", val_fraction=0.1)
    return Dataset(tmp_path / "ds")


def test_loader_rows_are_windows_of_the_train_split(dataset):
    loader = Loader(dataset, "train", seq_len=32, batch_size=4, grad_accum=3, seed=0)
    start, stop = dataset.split("train")
    stream = dataset.tokens(start, stop)
    windows = {tuple(stream[i * 32:(i + 1) * 32]) for i in range(len(stream) // 32)}
    seen = []
    for _ in range(loader.num_windows // 12 + 2):  # past the end of the first epoch
        batch = loader.next()
        assert batch.shape == (3, 4, 32) and batch.dtype == np.int32
        seen += [tuple(row) for row in batch.reshape(-1, 32)]
    assert set(seen) <= windows
    first_epoch = seen[:loader.num_windows]
    assert len(set(first_epoch)) == len(windows)  # every window once per epoch
    assert seen[:12] != sorted(seen[:12])  # shuffled
    assert loader.cursor["epoch"] == 1


def test_resumed_loader_yields_exactly_what_an_uninterrupted_one_would(dataset):
    kwargs = dict(seq_len=16, batch_size=5, grad_accum=2, seed=7)
    straight = Loader(dataset, "train", **kwargs)
    expected = [straight.next() for _ in range(40)]  # crosses several epoch boundaries
    assert straight.cursor["epoch"] >= 2
    interrupted = Loader(dataset, "train", **kwargs)
    got = [interrupted.next() for _ in range(13)]
    saved = json.loads(json.dumps(interrupted.cursor))  # as stored in a checkpoint
    resumed = Loader(dataset, "train", **kwargs, cursor=saved)
    got += [resumed.next() for _ in range(27)]
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)
    assert resumed.cursor == straight.cursor
    other = Loader(dataset, "train", **{**kwargs, "seed": 8})
    assert not np.array_equal(other.next(), expected[0])


def test_resolve_prepares_raw_text_once_and_reuses_it(tmp_path):
    src = corpus(tmp_path)
    cfg = DataConfig(dataset=str(src), val_fraction=0.1)
    ds = data.resolve(cfg, tmp_path / "cache")
    stamp = (tmp_path / "cache" / "meta.json").stat().st_mtime_ns
    again = data.resolve(cfg, tmp_path / "cache")
    assert (tmp_path / "cache" / "meta.json").stat().st_mtime_ns == stamp
    assert again.meta == ds.meta
    assert data.resolve(DataConfig(dataset=str(tmp_path / "cache")), tmp_path / "unused").meta == ds.meta
    builtin = data.resolve(DataConfig(), tmp_path / "builtin")
    assert builtin.meta["num_tokens"] > 500_000 and builtin.vocab_size == 257


# --- bad data: one clear line, nothing committed lost --------------------------------------


def test_empty_input(tmp_path):
    with pytest.raises(DataError, match="empty"):
        prepare([write(tmp_path / "empty.txt", "")], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\nnot json\n', r"docs.jsonl:2 is not a JSON object"),
    ('{"body": "x"}\n', r"has no 'text' field \(has: body\)"),
    ('{"text": 3}\n', "is int, not text"),
])
def test_malformed_jsonl(tmp_path, content, message):
    with pytest.raises(DataError, match=message):
        prepare([write(tmp_path / "docs.jsonl", content)], tmp_path / "ds")


@pytest.mark.parametrize("kwargs, message", [
    ({"val_fraction": 1.0}, r"--val-fraction must be in \[0, 1\), got 1.0"),
    ({"val_fraction": float("nan")}, r"--val-fraction must be in \[0, 1\), got nan"),
    ({"format": "chat", "seq_len": 1}, r"--seq-len must be >= 2, got 1"),
])
def test_a_library_call_with_a_setting_out_of_range_makes_nothing(tmp_path, kwargs, message):
    with pytest.raises(DataError, match=message):
        prepare([corpus(tmp_path)], tmp_path / "ds", **kwargs)
    assert not (tmp_path / "ds").exists()


def test_binary_input_and_missing_input(tmp_path):
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match="not UTF-8"):
        prepare([binary], tmp_path / "ds")
    with pytest.raises(DataError, match="does not exist"):
        prepare([tmp_path / "nope.txt"], tmp_path / "ds")
    with pytest.raises(DataError, match="tokenizer 'nope'"):
        prepare([corpus(tmp_path)], tmp_path / "ds", tokenizer="nope")


def test_dataset_shorter_than_one_batch(dataset):
    with pytest.raises(DataError, match="fewer than one batch"):
        Loader(dataset, "val", seq_len=64, batch_size=64)


def test_token_ids_beyond_the_model_vocabulary(tmp_path):
    prepare([write(tmp_path / "t.txt", TEXT)], tmp_path / "ds", str(QWEN2), val_fraction=0)
    with pytest.raises(DataError, match=r"model's vocabulary is 257; set model.vocab_size >= 15164[4-9]"):
        Dataset(tmp_path / "ds").check_vocab(257)
    Dataset(tmp_path / "ds").check_vocab(151936)  # Qwen2's real embedding size fits


@pytest.mark.slow  # loads the Qwen2 tokenizer several times
def test_a_dataset_knows_whether_its_ids_are_the_models(tmp_path):
    """Its ids mean the model's tokens when it was prepared with that tokenizer (the file
    itself or a copy elsewhere); byte-level data against a tokenizer.json, or two different
    tokenizer.json files, are refused in one line saying what to do."""
    text = write(tmp_path / "t.txt", TEXT)
    prepare([text], tmp_path / "qwen", str(QWEN2), val_fraction=0)
    prepare([text], tmp_path / "bytes", "bytes", val_fraction=0)
    prepare([corpus(tmp_path)], tmp_path / "bpe", "bpe:300", val_fraction=0)
    qwen, copy = str(QWEN2 / "tokenizer.json.gz"), str(tmp_path / "qwen" / "tokenizer.json")
    for name, spec in (("qwen", qwen), ("qwen", copy), ("bytes", "bytes"), ("bpe", str(tmp_path / "bpe"))):
        Dataset(tmp_path / name).check_tokenizer(spec, "never said")
    for name, spec, used in (("bytes", qwen, "bytes (no tokenizer)"), ("qwen", "bytes", qwen),
                             ("bpe", copy, "bpe:300")):
        with pytest.raises(DataError) as e:
            Dataset(tmp_path / name).check_tokenizer(spec, "prepare it again")
        want = (f"dataset {tmp_path / name} was tokenized with {used} but the model uses "
                f"{'bytes (no tokenizer)' if spec == 'bytes' else spec}: the same ids mean other tokens to it; "
                "prepare it again")
        assert str(e.value) == want


def test_bad_input_never_replaces_a_committed_dataset(tmp_path):
    meta = prepare([corpus(tmp_path)], tmp_path / "ds")
    with pytest.raises(DataError, match="already exists"):
        prepare([corpus(tmp_path)], tmp_path / "ds")
    with pytest.raises(DataError, match="empty"):
        prepare([write(tmp_path / "empty.txt", "")], tmp_path / "ds", overwrite=True)
    assert Dataset(tmp_path / "ds").meta == meta
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs left


def test_truncated_shard_and_missing_meta_are_reported(tmp_path, dataset):
    shard = dataset.path / "tokens-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="truncated"):
        Dataset(dataset.path)
    with pytest.raises(DataError, match="not a prepared dataset"):
        Dataset(tmp_path)


def test_long_texts_encode_exactly_as_a_whole(tmp_path):
    """Parallel line-piece encoding must give the whole-text ids, or not be used."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "".join(f"Line {i}:\n  indented {i}\n\nWORD{i} and more words\n" for i in range(1200))
    assert len(text) > 1 << 15
    qwen = data.load_tokenizer(str(QWEN2))
    whole = qwen._tok.encode(text, add_special_tokens=False).ids
    assert qwen.encode(text) == whole and qwen.encode(text) == whole  # first call checks, second uses pieces
    assert qwen._pieces_exact is True
    # A Metaspace tokenizer marks the start of every piece, so pieces would differ: it must encode whole.
    meta = Tokenizer(models.BPE(unk_token="[UNK]"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    meta.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", "</s>"]))
    tok = data.HFTokenizer(meta, "metaspace", meta.token_to_id("</s>"))
    whole = meta.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == whole and tok.encode(text) == whole
    assert tok._pieces_exact is False


DOCS = ["hello world, said the quick fox", "a second document\nover two lines", "zz"]


def _offline_tokenizer(folder: Path, bos_template: bool, tokenizer_config: dict | None) -> Path:
    """A real byte-level BPE tokenizer.json (Llama 3 and Gemma style when `bos_template`: its
    post-processor puts <bos> before every text), trained here, and an optional tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 5, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<bos>", "eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}))
    return folder


@pytest.mark.parametrize("bos_template, tokenizer_config, starts_with_bos", [
    (True, None, True),  # Llama 3 / Gemma tokenizer.json: the post-processor adds BOS
    (False, None, False),  # GPT-2 / Qwen2 style: nothing before a text
    (False, {"add_bos_token": True}, True),  # the config asks for BOS the file's template lacks
    (True, {"add_bos_token": False}, False),  # ... or turns the template's off
], ids=["template", "no-template", "config-adds", "config-removes"])
def test_documents_start_with_bos_where_the_tokenizer_adds_one(tmp_path, bos_template, tokenizer_config,
                                                              starts_with_bos):
    from tokenizers import Tokenizer

    folder = _offline_tokenizer(tmp_path / "tok", bos_template, tokenizer_config)
    jsonl = "".join(json.dumps({"text": t}) + "\n" for t in DOCS)
    meta = prepare([write(tmp_path / "docs.jsonl", jsonl)], tmp_path / "ds", str(folder), val_fraction=0)
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos, eos = reference.token_to_id("<bos>"), reference.token_to_id("<eos>")
    assert meta["eos_id"] == eos and meta["bos_id"] == (bos if starts_with_bos else None)
    expected = [i for t in DOCS for i in [bos] * starts_with_bos + reference.encode(t, add_special_tokens=False).ids + [eos]]
    assert Dataset(tmp_path / "ds").tokens(0, meta["num_tokens"]).tolist() == expected
    assert Dataset(tmp_path / "ds").tokenizer().bos_id == meta["bos_id"]  # generate's prompts start alike
    if tokenizer_config is None:  # transformers' own encoding, where its rule is the file's post-processor alone
        import transformers

        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        assert expected == [i for t in DOCS for i in hf(t)["input_ids"] + [eos]]


def test_prepare_shows_progress_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    prepare([corpus(tmp_path)], tmp_path / "ds", val_fraction=0)
    assert capsys.readouterr().err == ""  # not a terminal: nothing (a log gets no carriage returns)
    monkeypatch.setenv("MTJAX_PROGRESS", "always")  # as on a terminal, as if it had taken long
    prepare([corpus(tmp_path)], tmp_path / "ds", val_fraction=0, overwrite=True)
    assert "tokenizing" in capsys.readouterr().err
    prepare([corpus(tmp_path)], tmp_path / "bpe", "bpe:300", val_fraction=0)
    assert "training the tokenizer" in capsys.readouterr().err
