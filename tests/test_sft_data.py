"""Supervised fine-tuning data: chat templates, loss masks, packed rows, the Batch loader.

The transformers-side comparisons (rendered text, token ids and assistant mask equal to
`apply_chat_template`'s) are under the `slow` marker; the rest checks the stored rows
against the ChatML form written out by hand and against the input records.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mtjax.documents
from mtjax import data
from mtjax.batch import Batch
from mtjax.config import DataConfig
from mtjax.data import DataError, Dataset, Loader, chat, pack, prepare

DATA = Path(__file__).parent / "data"
QWEN2 = DATA / "qwen2"
KJV_CHAT = DATA / "kjv-chat-24.jsonl"
CONVERSATIONS = [json.loads(line)["messages"] for line in KJV_CHAT.read_text().splitlines()]
DEFAULT_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def chatml(messages: list[dict]) -> str:
    """The Qwen2 template's output, written out: a default system turn unless one leads."""
    if messages[0]["role"] != "system":
        messages = [DEFAULT_SYSTEM] + messages
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def documents(ds: Dataset, split: str = "train") -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, targets) of every document stored in a split's rows, checking each row's layout."""
    start, stop = ds.split(split)
    seq, out = ds.rows, []
    for lo in range(start, stop, seq):
        tokens, mask, segments = (ds.read(name, lo, lo + seq) for name in ("tokens", "loss_mask", "segments"))
        used = int(np.count_nonzero(segments))
        assert (segments[:used] > 0).all() and (segments[used:] == 0).all()  # padding only at the end
        assert (np.diff(segments[:used]) >= 0).all() and (np.diff(segments[:used]) <= 1).all()
        assert not mask[used:].any() and (tokens[used:] == ds.eos_id).all()
        positions = np.asarray(mtjax.documents.positions(segments))
        for s in range(1, int(segments.max()) + 1):
            where = segments == s
            np.testing.assert_array_equal(positions[where], np.arange(where.sum()))  # restart per document
            out.append((tokens[where], mask[where].astype(bool)))
    return out


@pytest.fixture(scope="module")
def qwen():
    return data.load_tokenizer(str(QWEN2))


@pytest.fixture(scope="module")
def chat_ds(tmp_path_factory) -> Dataset:
    out = tmp_path_factory.mktemp("chat") / "ds"
    prepare([KJV_CHAT], out, str(QWEN2), val_fraction=0.2, format="chat", seq_len=160)
    return Dataset(out)


def test_chat_rows_hold_each_conversation_once_with_only_its_answers_as_targets(chat_ds, qwen):
    meta = chat_ds.meta
    stored = documents(chat_ds, "train") + documents(chat_ds, "val")
    assert meta["num_documents"] == len(stored) == len(CONVERSATIONS) and meta["skipped"] == dict(
        too_long=0, no_targets=0)
    assert meta["num_rows"] * 160 == meta["num_tokens"] and meta["num_rows"] < len(CONVERSATIONS)  # packed
    assert meta["num_targets"] == sum(int(m.sum()) for _, m in stored)
    assert meta["num_padding"] == meta["num_tokens"] - sum(ids.size for ids, _ in stored)
    assert meta["splits"]["val"][1] - meta["splits"]["val"][0] == round(meta["num_rows"] * 0.2) * 160
    by_text = {qwen.decode(ids.tolist()): mask_ids for ids, mask_ids in ((i, i[m]) for i, m in stored)}
    for messages in CONVERSATIONS:
        text = chatml(messages)
        assert text in by_text
        answers = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert qwen.decode(by_text[text].tolist()) == answers
    for ids, mask in stored:
        assert ids.tolist() == qwen.encode(qwen.decode(ids.tolist())) and not mask[0]
    assert meta["chat_template"]["source"] == json.loads((QWEN2 / "tokenizer_config.json").read_text())[
        "chat_template"]


def test_loader_yields_batches_and_resumes_exactly(chat_ds):
    kwargs = dict(seq_len=160, batch_size=2, grad_accum=2, seed=5)
    straight = Loader(chat_ds, "train", **kwargs)
    expected = [straight.next() for _ in range(6)]  # past an epoch: a few rows only
    assert straight.cursor["epoch"] >= 1
    batch = expected[0]
    assert isinstance(batch, Batch) and batch.tokens.shape == (2, 2, 160) and batch.loss_mask.dtype == bool
    assert batch.segments.dtype == np.int32 and batch.tokens.dtype == np.int32
    start = chat_ds.split("train")[0]
    rows = {tuple(chat_ds.read("tokens", start + r * 160, start + (r + 1) * 160)):
            (tuple(chat_ds.read("loss_mask", start + r * 160, start + (r + 1) * 160)),
             tuple(chat_ds.read("segments", start + r * 160, start + (r + 1) * 160)))
            for r in range(straight.num_windows)}
    for b in expected:  # every row is a stored row, its mask and segments with it
        for t, m, s in zip(b.tokens.reshape(-1, 160), b.loss_mask.reshape(-1, 160), b.segments.reshape(-1, 160)):
            assert rows[tuple(t)] == (tuple(m.astype(int)), tuple(s))
    first = Loader(chat_ds, "train", **kwargs)
    got = [first.next() for _ in range(2)]
    resumed = Loader(chat_ds, "train", **kwargs, cursor=json.loads(json.dumps(first.cursor)))
    got += [resumed.next() for _ in range(4)]
    for a, b in zip(expected, got):
        for name in ("tokens", "loss_mask", "segments"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    with pytest.raises(DataError, match="rows of 160 tokens; set data.seq_len to 160"):
        Loader(chat_ds, "train", 128, 2)


def test_packer_fills_rows_first_fit_and_pads_one_per_row():
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 50, n), rng.random(n) < 0.5) for n in (5, 9, 3, 7, 2, 11, 4, 6, 8, 1)]
    for one_per_row in (False, True):
        packer = pack.Packer(12, pad_id=99, one_per_row=one_per_row)
        rows = [r for ids, m in docs for r in packer.add(ids, m)] + packer.finish()
        got = []
        for tokens, mask, segments in rows:
            assert tokens.shape == mask.shape == segments.shape == (12,)
            assert (tokens[segments == 0] == 99).all() and not mask[segments == 0].any()
            for s in range(1, segments.max() + 1):
                got.append((tokens[segments == s].tolist(), mask[segments == s].astype(bool).tolist()))
        assert sorted(got) == sorted((ids.tolist(), m.tolist()) for ids, m in docs)  # none split, none lost
        assert len(rows) == (len(docs) if one_per_row else 6)  # 66 tokens in rows of 12: 6 rows, first fit
    with pytest.raises(ValueError):
        pack.Packer(4, 0).add(np.arange(5), np.ones(5, bool))


def test_positions_restart_at_every_document():
    segments = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(mtjax.documents.positions(segments), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])


def test_prompt_completion_trains_on_the_completion_and_its_eos(tmp_path):
    records = [{"prompt": "Q: two and two?\nA:", "completion": " four"},
               {"prompt": "Say ñ:", "completion": " ñandú 🎭"},
               {"prompt": "x" * 40, "completion": "y" * 30}]  # 71 tokens: longer than a row
    meta = prepare([jsonl(tmp_path / "pc.jsonl", records)], tmp_path / "ds", "bytes", val_fraction=0,
                   format="prompt-completion", seq_len=64, packing="pad", shard_tokens=50)
    ds = Dataset(tmp_path / "ds")
    assert meta["skipped"] == {"too_long": 1, "no_targets": 0} and meta["num_rows"] == 2
    assert len(meta["shards"]) == 3 and all({"loss_mask", "segments"} <= set(s) for s in meta["shards"])
    stored = documents(ds)
    for (ids, mask), record in zip(stored, records):
        prompt, completion = (record[k].encode() for k in ("prompt", "completion"))
        assert ids.tolist() == list(prompt + completion) + [256]
        assert mask.tolist() == [False] * len(prompt) + [True] * (len(completion) + 1)
    everything = prepare([tmp_path / "pc.jsonl"], tmp_path / "all", "bytes", val_fraction=0,
                         format="prompt-completion", seq_len=64, train_on="all")
    assert everything["num_rows"] == 1  # both fit one packed row
    for ids, mask in documents(Dataset(tmp_path / "all")):
        assert mask.tolist() == [False] + [True] * (ids.size - 1)


def test_text_datasets_keep_yielding_token_arrays(tmp_path):
    (tmp_path / "t.txt").write_text("plain text, one document\n" * 20)
    prepare([tmp_path / "t.txt"], tmp_path / "ds", val_fraction=0)
    ds = Dataset(tmp_path / "ds")
    batch = Loader(ds, "train", 16, 2).next()
    assert isinstance(batch, np.ndarray) and batch.shape == (1, 2, 16) and ds.rows is None
    assert ds.meta["format_version"] == 1
    with pytest.raises(DataError, match="has no loss_mask"):
        ds.read("loss_mask", 0, 4)


BAD_RECORDS = [
    ({"messages": [{"role": "robot", "content": "beep"}]}, r"bad\.jsonl:2: message 0 has role 'robot'; roles are"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     r"bad\.jsonl:2: message 1 \(assistant\) has empty content"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": ["a", "list"]}]}, "has list content; it must be text"),
    ({"text": "not a chat"}, r"has no `messages` field \(has: text\)"),
]


@pytest.mark.parametrize("record, message", BAD_RECORDS)
def test_bad_chat_records_fail_with_their_line_and_write_nothing(tmp_path, record, message):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    src = jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DataError, match=message):
        prepare([src], tmp_path / "ds", str(QWEN2), format="chat", seq_len=64)
    assert list(tmp_path.iterdir()) == [src]


def test_conversations_without_answers_are_skipped_and_counted(tmp_path):
    answered = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    unanswered = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    src = jsonl(tmp_path / "c.jsonl", [unanswered, answered, unanswered])
    meta = prepare([src], tmp_path / "ds", str(QWEN2), val_fraction=0, format="chat", seq_len=64)
    assert meta["skipped"] == {"too_long": 0, "no_targets": 2} and meta["num_documents"] == 1
    only = jsonl(tmp_path / "none.jsonl", [unanswered])
    with pytest.raises(DataError, match="1 have no token to train on"):
        prepare([only], tmp_path / "none", str(QWEN2), format="chat", seq_len=64)
    assert not (tmp_path / "none").exists()
    too_long = jsonl(tmp_path / "long.jsonl", [answered])
    with pytest.raises(DataError, match="1 are longer than --seq-len 8"):
        prepare([too_long], tmp_path / "long", str(QWEN2), format="chat", seq_len=8)


def test_chat_needs_a_template_and_rows_need_a_length(tmp_path):
    src = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(QWEN2 / "tokenizer.json.gz", bare)
    config = json.loads((QWEN2 / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for tokenizer in (str(bare), "bytes"):
        with pytest.raises(DataError, match="chat template, and .* has none"):
            prepare([src], tmp_path / "ds", tokenizer, format="chat", seq_len=64)
    with pytest.raises(DataError, match="give --seq-len"):
        prepare([src], tmp_path / "ds", str(QWEN2), format="chat")
    with pytest.raises(DataError, match="is not JSONL"):
        prepare([jsonl(tmp_path / "c.txt", [])], tmp_path / "ds", str(QWEN2), format="chat", seq_len=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "c.jsonl", "c.txt"]


def test_template_refusals_and_non_incremental_templates_are_one_line_errors():
    strict = chat.Template("{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}{% endif %}"
                           "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match="refuses this conversation: users first"):
        strict.render([{"role": "assistant", "content": "x"}])
    # Drops every answer but the last: earlier answers are not where a prefix render puts them.
    last_only = chat.Template("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                              "{{ m['content'] }}|{% endif %}{% endfor %}")
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(DataError, match="renders message 1 differently"):
        last_only.answer_spans(turns)
    with pytest.raises(DataError, match="does not parse"):
        chat.Template("{% for %}").render(turns)


def test_template_of_a_checkpoint_and_its_turn_end(tmp_path):
    template = chat.find(QWEN2)
    assert template.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                       "pad_token": "<|endoftext|>"}
    assert template.turn_end() == "<|im_end|>\n"
    assert chat.find(QWEN2 / "tokenizer.json.gz") == template
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    shutil.copy(QWEN2 / "tokenizer_config.json", tmp_path)
    assert chat.find(tmp_path).render([{"role": "user", "content": "x"}]) == "<|endoftext|>x"  # the file wins
    assert chat.find(DATA) is None


# --- transformers' apply_chat_template renders and masks the same -------------------------

GENERATION_MARKED = (  # the Qwen2 template with its answers marked for return_assistant_tokens_mask
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

OPTIONS = (  # trim_blocks, lstrip_blocks, tojson, special tokens, loop controls, namespace
    "{{ bos_token }}{% set ns = namespace(n=0) %}\n"
    "    {% for m in messages %}\n"
    "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "{% set ns.n = ns.n + 1 %}[{{ ns.n }} {{ m.role }}] {{ m | tojson }}\n"
    "    {% endfor %}\n"
    "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("qwen2-hf")
    data.load_tokenizer(str(QWEN2)).save(folder)
    shutil.copy(QWEN2 / "tokenizer_config.json", folder)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


SAMPLES = CONVERSATIONS[:6] + [
    [{"role": "user", "content": "Quote <b>Genesis</b> 1:1 & \"more\"."}, {"role": "assistant", "content": "In the"},
     {"role": "user", "content": "Go on"}, {"role": "assistant", "content": "beginning — ñ\n\n", "name": None}],
]


@pytest.mark.slow
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_rendering_equals_apply_chat_template(hf_tokenizer, generation_prompt):
    template = chat.find(QWEN2)
    conversations = SAMPLES + [c[:-1] for c in SAMPLES]  # and ending on a user turn
    for source in (template.source, OPTIONS):
        for messages in conversations:
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, chat_template=source,
                                                        add_generation_prompt=generation_prompt)
            assert chat.render(source, messages, generation_prompt, template.special_tokens) == expected


@pytest.mark.slow
def test_ids_and_mask_equal_apply_chat_template_with_generation_markers(hf_tokenizer, qwen):
    encode = data.supervised.Encoder(qwen, chat.find(QWEN2), "chat")
    for messages in SAMPLES:
        ids, targets = encode({"messages": messages})
        out = hf_tokenizer.apply_chat_template(messages, chat_template=GENERATION_MARKED, return_dict=True,
                                               return_assistant_tokens_mask=True)
        assert ids.tolist() == out["input_ids"]
        assert targets.tolist() == [bool(a) for a in out["assistant_masks"]]  # its labels: -100 elsewhere


def test_resolve_prepares_raw_chat_into_rows_of_the_training_length(tmp_path):
    cfg = DataConfig(dataset=str(KJV_CHAT), tokenizer=str(QWEN2), format="chat", seq_len=160, val_fraction=0.2)
    ds = data.resolve(cfg, tmp_path / "cache")
    assert ds.rows == 160 and ds.meta["num_documents"] == len(CONVERSATIONS) and ds.meta["packing"] == "pack"
    again = data.resolve(cfg, tmp_path / "cache")
    assert again.meta == ds.meta
    padded = data.resolve(dataclasses.replace(cfg, packing="pad", seq_len=128), tmp_path / "cache")
    assert padded.rows == 128 and padded.meta["num_rows"] == padded.meta["num_documents"]


def test_conversational_prompt_completion_trains_on_the_completion_turns_only(qwen):
    encode = data.supervised.Encoder(qwen, chat.find(QWEN2), "prompt-completion")
    shot = [{"role": "user", "content": "Genesis 1:1?"}, {"role": "assistant", "content": "In the beginning"}]
    prompt = shot + [{"role": "user", "content": "Genesis 1:2?"}]
    completion = [{"role": "assistant", "content": "And the earth was without form"}]
    ids, targets = encode({"prompt": prompt, "completion": completion})
    assert qwen.decode(ids.tolist()) == chatml(prompt + completion)
    assert qwen.decode(ids[targets].tolist()) == "And the earth was without form<|im_end|>\n"  # not the shot
    with pytest.raises(DataError, match="both be text or both lists"):
        encode({"prompt": "text", "completion": completion})
