"""Parquet files and Hugging Face `datasets` directories as `data prepare` inputs.

The same records as JSONL, as a Parquet file, as a saved `Dataset` (two Arrow shards)
and as the train split of a saved `DatasetDict` (beside a test split that must not be
read) prepare to byte-identical datasets, for text, chat and prompt-completion. The
tables are written by the real `datasets` library, as a user would write them. The
command line's one-line errors for tables are in tests/test_bad_input.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mtjax.data import DataError, prepare, tables
from mtjax.errors import MissingPackage

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

DATA = Path(__file__).parent / "data"
QWEN2 = str(DATA / "qwen2")
GENESIS = (DATA / "kjv-genesis.txt").read_text().splitlines()[:60]  # one verse a document
CHAT = [json.loads(line) for line in (DATA / "kjv-chat-24.jsonl").read_text().splitlines()][:10]
CHAT[1]["messages"][0]["name"] = "Sarah"  # a key only one message has: Arrow fills it with None in the others
PROMPT_COMPLETION = [{"prompt": f"Verse {i}:", "completion": f" {text}"} for i, text in enumerate(GENESIS[:12])]

CASES = {  # format: (records, prepare's settings)
    "text": ([{"id": i, "text": t} for i, t in enumerate(GENESIS)], dict(tokenizer="bytes")),
    "chat": (CHAT, dict(tokenizer=QWEN2, format="chat", seq_len=160)),
    "prompt-completion": (PROMPT_COMPLETION, dict(tokenizer="bytes", format="prompt-completion", seq_len=128)),  # some too long
}


def write_inputs(root: Path, records: list[dict]) -> dict[str, Path]:
    """The records as JSONL, Parquet, a saved Dataset and a saved DatasetDict's train split."""
    root.mkdir()
    (root / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(root / "r.parquet"))
    table.save_to_disk(str(root / "saved"), num_shards=2)
    other = datasets.Dataset.from_list(records[::-1][:3])  # another split: never read
    datasets.DatasetDict({"test": other, "train": table}).save_to_disk(str(root / "dict"))
    return {"jsonl": root / "r.jsonl", "parquet": root / "r.parquet", "saved": root / "saved",
            "dict": root / "dict"}


def contents(out: Path) -> dict[str, bytes]:
    """Every file of a prepared dataset, meta.json without the input paths."""
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    meta = json.loads(files.pop("meta.json"))
    files["meta.json"] = json.dumps({k: v for k, v in meta.items() if k != "inputs"}, sort_keys=True).encode()
    return files


@pytest.mark.parametrize("format", ["text", pytest.param("chat", marks=pytest.mark.slow), "prompt-completion"])  # chat: the Qwen2 tokenizer 4 times
def test_jsonl_parquet_and_datasets_dirs_prepare_to_the_same_bytes(tmp_path, format):
    records, settings = CASES[format]
    inputs = write_inputs(tmp_path / "in", records)
    prepared = {}
    for name, source in inputs.items():
        meta = prepare([source], tmp_path / name, val_fraction=0.1, shard_tokens=320, **settings)
        prepared[name] = contents(tmp_path / name)
        if name == "saved":
            assert [Path(f).name for f in meta["inputs"]] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
        if name == "dict":
            assert [Path(f).parent.name for f in meta["inputs"]] == ["train"]
    assert meta["num_documents"] + sum(meta.get("skipped", {}).values()) == len(records)
    assert any(name.startswith("tokens-00001") for name in prepared["jsonl"])  # several shards compared
    for name in ("parquet", "saved", "dict"):
        assert prepared[name] == prepared["jsonl"], name


def test_table_rows_read_as_the_json_objects_they_were_written_from(tmp_path):
    inputs = write_inputs(tmp_path / "in", CHAT)
    arrow = tables.datasets_files(inputs["saved"])
    assert datasets.load_from_disk(str(inputs["saved"]))[1]["messages"][1]["name"] is None  # Arrow's filler
    read = [r for _, r in tables.rows(inputs["parquet"], ("messages",), "")]
    assert read == [{"messages": c["messages"]} for c in CHAT]
    read = [r for f in arrow for _, r in tables.rows(f, ("messages",), "")]
    assert read == [{"messages": c["messages"]} for c in CHAT]
    where = [w for w, _ in tables.rows(arrow[1], ("messages",), "")]
    assert where[0] == f"{arrow[1]}, row 0"


def test_table_mistakes_are_one_line_and_write_nothing(tmp_path, monkeypatch):
    inputs = write_inputs(tmp_path / "in", CASES["text"][0])
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(DataError, match=r"r\.parquet has no column 'body' \(has: id, text\); choose the column "
                                        "with --text-field"):
        prepare([inputs["parquet"]], tmp_path / "out", text_field="body")
    with pytest.raises(DataError, match=r"r\.parquet has no column 'messages' \(has: id, text\); --format chat "
                                        "reads `messages`"):
        prepare([inputs["parquet"]], tmp_path / "out", QWEN2, format="chat", seq_len=64)
    with pytest.raises(DataError, match="has no column 'prompt', 'completion'"):
        prepare([inputs["saved"]], tmp_path / "out", format="prompt-completion", seq_len=64)
    corrupt = tmp_path / "in" / "cut.parquet"
    corrupt.write_bytes(inputs["parquet"].read_bytes()[:-100])
    with pytest.raises(DataError, match=r"cut\.parquet is not a readable Parquet file \(.*\); write it again"):
        prepare([corrupt], tmp_path / "out")
    arrow = tables.datasets_files(inputs["saved"])[1]
    arrow.rename(arrow.with_suffix(".moved"))
    with pytest.raises(DataError, match=r"saved/state\.json lists data-00001-of-00002\.arrow, which is missing"):
        prepare([inputs["saved"]], tmp_path / "out")
    (inputs["dict"] / "dataset_dict.json").write_text(json.dumps({"splits": ["test", "validation"]}))
    with pytest.raises(DataError, match="with splits test, validation and no 'train' split; name the split"):
        prepare([inputs["dict"]], tmp_path / "out")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    with pytest.raises(MissingPackage, match=r"needs the pyarrow package, which is not installed: pip install pyarrow \(or install mtjax with the \[data\] extra\)"):
        prepare([inputs["parquet"]], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert len(sorted(tmp_path.rglob("*"))) == len(before) + 1  # only the cut copy was added



def test_a_directory_is_a_saved_dataset_only_with_the_files_datasets_writes(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "state.json").write_text("{}")  # another program's
    assert tables.datasets_files(corpus) is None  # its files are read as any directory's are
    (corpus / "dataset_info.json").write_text("{}")
    with pytest.raises(DataError, match=r"corpus/state\.json lists no data files"):
        tables.datasets_files(corpus)
