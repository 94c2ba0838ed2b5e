"""Bad input through the real command line, as a user types it (`python -m mtjax ...`).

For every case: a non-zero exit, exactly one line on stderr that names the problem and
what to do, no traceback, and nothing lost or left behind: every file of the working
directory (a finished run, a prepared dataset, a store, a checkpoint) is byte-identical
afterwards and no new file appeared, temporary ones included (TMPDIR points inside it).
The cases of one class run side by side (most of their time is interpreter start-up).
docs/reliability.md has the table of classes and cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hf_models
import small_disk
from conftest import TINY_MODEL_ARGS
from mtjax import cli

TINY = [*TINY_MODEL_ARGS,
        "--data.seq_len=32", "--data.batch_size=4", "--optim.warmup_steps=0", "--run.steps=2",
        "--run.eval_every=0", "--run.sample_tokens=0"]
QWEN_TOKENIZER = str(Path(__file__).parent / "data" / "qwen2" / "tokenizer.json.gz")


def start(cwd: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(cwd / "tmp"), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "mtjax", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def snapshot(root: Path) -> dict[str, str]:
    """{path: sha256 (or 'dir')} of everything under `root`."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run_cases(cwd: Path, cases: list[tuple[list[str], str]], parallel: int = 4,
              env: dict[str, str] | None = None) -> None:
    """Run each (args, expected text) case, with `env` added to the environment; check its
    one error line and that the working directory is exactly as before."""
    before = snapshot(cwd)
    results = []
    for i in range(0, len(cases), parallel):
        batch = [(args, expect, start(cwd, args, env)) for args, expect in cases[i:i + parallel]]
        for args, expect, p in batch:
            out, err = p.communicate(timeout=300)
            results.append((args, expect, p.returncode, out, err))
    for args, expect, rc, out, err in results:
        lines = err.strip().splitlines()
        assert rc not in (0, None) and "Traceback" not in err + out, (args, rc, err)
        assert len(lines) == 1 and expect in lines[0], (args, err)
        # A nested command is named whole, as argparse names it: "mtjax data prepare: error: ..."
        command = " ".join(args[:2]) if args[0] in ("data", "store") else args[0]
        assert lines[0].startswith(f"mtjax {command}: error: "), (args, err)
    after = snapshot(cwd)
    assert after == before, {k for k in set(before) | set(after) if before.get(k) != after.get(k)}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A user's directory: a finished run, a text file and its dataset, an HF checkpoint,
    a store imported from it and one made by init, a plain file, a read-only directory."""
    cwd = tmp_path_factory.mktemp("bad-input")
    (cwd / "tmp").mkdir()
    (cwd / "text.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    (cwd / "FILE").write_text("a file, not a directory\n")
    (cwd / "empty").mkdir()
    ckpt, _ = hf_models.checkpoint(cwd, "llama")
    ckpt.rename(cwd / "ckpt")
    assert cli.main(["import", str(cwd / "ckpt"), str(cwd / "store"), "--compute-dtype", "float32"]) == 0
    assert cli.main(["init", str(cwd / "ckpt"), str(cwd / "fresh")]) == 0
    assert cli.main(["data", "prepare", str(cwd / "text.txt"), "--out", str(cwd / "ds")]) == 0
    assert cli.main(["train", *TINY, f"--run.dir={cwd / 'run'}", "--data.dataset=builtin:shakespeare"]) == 0
    with small_disk.read_only(cwd / "RO") as ro:
        yield cwd
        assert ro.is_dir()


def test_outputs_that_cannot_be_written(work):
    ro = "" if os.geteuid() == 0 else "Permission denied"
    run_cases(work, [
        (["train", *TINY, "--run.dir=RO/r"], f"run.dir RO/r cannot be written: RO is not writable ({ro or 'Read-only'}"),
        (["train", *TINY, "--run.dir=FILE"], "run.dir FILE is a file, not a directory"),
        (["train", *TINY, "--run.dir=FILE/r"], "run.dir FILE/r cannot be created: FILE is a file"),
        (["train", *TINY, "--run.dir=r2", "--store.master=disk", "--store.path=FILE/s"],
         "store.path FILE/s cannot be created: FILE is a file"),
        (["data", "prepare", "text.txt", "--out", "RO/d"], "--out RO/d cannot be written"),
        (["data", "prepare", "text.txt", "--out", "FILE/d"], "--out FILE/d cannot be created: FILE is a file"),
        (["data", "prepare", "text.txt", "--out", "FILE"], "--out FILE is a file"),
        (["import", "ckpt", "RO/s"], "store directory RO/s cannot be written"),
        (["import", "ckpt", "FILE/s"], "store directory FILE/s cannot be created: FILE is a file"),
        (["export", "store", "RO/x"], "output directory RO/x cannot be written"),
        (["export", "store", "FILE/x"], "output directory FILE/x cannot be created: FILE is a file"),
        (["init", "ckpt", "FILE/s"], "store directory FILE/s cannot be created: FILE is a file"),
        (["store", "reshard", "run/store", "RO/s", "--processes", "2"], "output directory RO/s cannot be written"),
        (["store", "reshard", "run/store", "FILE/s", "--processes", "2"],
         "output directory FILE/s cannot be created: FILE is a file"),
    ])


def test_numbers_out_of_range(work):
    run_cases(work, [
        (["train", *TINY, "--run.dir=r2", "--optim.lr=nan"], "optim.lr must be a finite number, got 'nan'"),
        (["train", *TINY, "--run.dir=r2", "--optim.lr=inf"], "optim.lr must be a finite number, got 'inf'"),
        (["train", *TINY, "--run.dir=r2", "--optim.eps=-inf"], "optim.eps must be a finite number"),
        (["train", *TINY, "--run.dir=r2", "--model.rope_theta=nan"], "model.rope_theta must be a finite number"),
        (["train", *TINY, "--run.dir=r2", "--data.val_fraction=nan"], "data.val_fraction must be a finite number"),
        (["generate", "run/final", "--top-k", "-5"],
         "argument --top-k: must be >= 0 (0: sample from the whole vocabulary), got -5"),
        (["generate", "run/final", "--tokens", "-3"], "argument --tokens: must be >= 1, got -3"),
        (["generate", "run/final", "--temperature", "-1"], "argument --temperature: must be >= 0 (0: greedy), got -1.0"),
        (["generate", "run/final", "--temperature", "nan"], "argument --temperature: must be a finite number, got 'nan'"),
        (["generate", "run/final", "--tokens", "many"], "argument --tokens: invalid int value: 'many'"),
        (["eval", "run/final", "ds", "--batches", "0"], "argument --batches: must be >= 1, got 0"),
        (["eval", "run/final", "ds", "--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
        (["eval", "run/final", "ds", "--seq-len", "1"], "--seq-len must be >= 2, got 1"),
        (["eval", "run/final", "ds", "--seq-len", "5000"],
         "--seq-len (5000) exceeds the model's context (model.max_position_embeddings = 1024); lower --seq-len"),
        (["eval", "store", "ds", "--seq-len", "129"], "--seq-len (129) exceeds the model's context"),
        (["plan", "run/final", "--hardware", "h200", "--steps", "0"], "argument --steps: must be in [1, 2147483647]"),
        (["plan", "run/final", "--hardware", "h200", "--price-per-hour", "-1"],
         "argument --price-per-hour: must be >= 0, got -1.0"),
        (["plan", "run/final", "--hardware", "h200", "--reprobe"], "pass one of them"),
        (["plan", "run/final", "--hardware", "h200", "--processes", "0"], "argument --processes: must be >= 1, got 0"),
        (["plan", "run/final", "--hardware", "h200", "--devices", "0"], "stream.devices must be all or a device count >= 1"),
        (["plan", "run/final", "--hardware", "h200", "--resident", "-2"], "stream.resident must be auto, none, all, a count >= 0"),
        (["plan", "run/final", "--hardware", "h200", "--resident", "bogus"], "stream.resident names ['bogus'], which this model"),
        (["train", *TINY, "--run.dir=r2", "--run.resume=sometimes"], "run.resume must be true, false or auto"),
    ])


def test_command_flags_checked_by_the_parser(work):
    """A command's numeric flag is read against its range by the parser (mtjax.bounds.flag), in
    the config checks' words. Once unchecked: a seed of 2^32 or more seeded as its low 32 bits
    did, and 2^64 ended in a traceback; `init` took a negative seed; `plan` priced a run longer
    than the optimizer's int32 step count."""
    seed = "argument --seed: must be in [0, 4294967295] (JAX keeps a seed's low 32 bits)"
    run_cases(work, [
        (["init", "ckpt", "s", "--seed", "-1"], f"{seed}, got -1"),
        (["init", "ckpt", "s", "--seed", str(2**64)], f"{seed}, got {2**64}"),
        (["generate", "run/final", "--seed", str(2**32)], f"{seed}, got {2**32}"),
        (["plan", "run/final", "--hardware", "h200", "--steps", str(2**31)],
         "argument --steps: must be in [1, 2147483647] (the optimizer counts steps in int32), got 2147483648"),
        (["plan", "run/final", "--hardware", "h200", "--price-per-hour", "inf"],
         "argument --price-per-hour: must be a finite number, got 'inf'"),
        (["generate", "run/final", "--temperature", "inf"], "argument --temperature: must be a finite number, got 'inf'"),
        (["data", "prepare", "text.txt", "--out", "d", "--val-fraction", "nan"],
         "argument --val-fraction: must be a finite number, got 'nan'"),
        (["data", "prepare", "text.txt", "--out", "d", "--format", "chat", "--seq-len", "1"],
         "argument --seq-len: must be >= 2, got 1"),
    ])


def test_residency_document_and_chat_choices(work):
    """The settings this stop added: device residency, the device count, the raw data's format, --chat,
    Llama 4's attention fields."""
    stream = ["train", *TINY, "--run.dir=r2", "--stream.engine=stream"]
    run_cases(work, [
        ([*stream, "--stream.resident=bogus"], "stream.resident names ['bogus'], which this model does not have"),
        ([*stream, "--stream.resident=-2"], "stream.resident must be auto, none, all, a count >= 0"),
        ([*stream, "--stream.remat=most"], "stream.remat must be one of auto, full, dots, none, got 'most'"),
        ([*stream, "--stream.devices=0"], "stream.devices must be all or a device count >= 1, got 0"),
        ([*stream, "--stream.devices=4"], "stream.devices is 4 but this process has 1 cpu device(s)"),
        ([*stream, "--stream.devices=2", "--data.batch_size=3"], "data.batch_size 3 does not split over 2 devices"),
        ([*stream, "--stream.expert_group_size=0"], "stream.expert_group_size must be a whole number of experts >= 1"),
        (["train", *TINY, "--run.dir=r2", "--data.format=yaml"], "data.format must be one of text, chat"),
        (["generate", "run/final", "--chat", "--prompt", "hi"], "has none"),
        # Llama 4's model fields set by hand (these three fill the last batch of four).
        (["train", *TINY, "--run.dir=r2", "--model.no_rope_layers=5"], "no_rope_layers [5] name layers outside 0..1"),
        (["train", *TINY, "--run.dir=r2", "--model.layer_types=chunked_attention,full_attention"],
         "chunked_attention layers need a positive attention_chunk_size"),
        (["train", *TINY, "--run.dir=r2", "--model.attn_temperature_tuning=true", "--model.floor_scale=0"],
         "model.floor_scale must be positive, got 0.0"),
    ])


def test_sequence_split_and_chunk_settings(work):
    """The settings of context parallelism, LoRA dropout, router bias updates and chunked
    heads / FFNs, in a process with two CPU devices (as tests/test_sequence_split.py runs):
    a row that the devices do not divide (a count, and `all` found when the devices are
    known), the engine's own model.sequence_devices set by hand (command line and YAML)."""
    (work / "seqdev.yaml").write_text("model:\n  sequence_devices: 2\n")
    train = ["train", *TINY, "--run.dir=r2"]
    split = "data.seq_len 33 does not split over 2 devices (stream.split: sequence): use a multiple of 2, or set " \
            "stream.devices to a divisor of 33"
    engine = "model.sequence_devices is set by the engine: split"
    try:
        run_cases(work, [
            ([*train, "--stream.split=sequence", "--stream.devices=2", "--data.seq_len=33"], split),
            ([*train, "--stream.split=sequence", "--data.seq_len=33"], split),  # stream.devices: all
            ([*train, "--stream.split=tokens"], "stream.split must be one of batch, sequence, got 'tokens'"),
            ([*train, "--stream.engine=reference", "--stream.split=sequence"],
             "the reference engine runs on one device: set stream.engine=stream, or drop them"),
            ([*train, "--model.sequence_devices=2"], engine),
            (["train", "seqdev.yaml", *TINY, "--run.dir=r2"], engine),
            (["plan", "seqdev.yaml", "--hardware", "h200"], engine),
            ([*train, "--model.router_bias_update_rate=-1"], "model.router_bias_update_rate must be >= 0, got -1.0"),
            ([*train, "--lora.rank=4", "--lora.dropout=1"], "lora.dropout must be at least 0 and below 1, got 1.0"),
            ([*train, "--lora.rank=4", "--lora.dropout=-0.1"], "lora.dropout must be at least 0 and below 1, got -0.1"),
            ([*train, "--lora.dropout=2"], "lora.dropout must be at least 0 and below 1, got 2.0"),  # no adapters
            ([*train, "--lora.alpha=-1"], "lora.alpha must be a positive number, got -1.0"),  # no adapters
            ([*train, "--model.head_chunk_tokens=-1"], "model.head_chunk_tokens must be >= 0, got -1"),
            ([*train, "--model.ffn_chunk_tokens=-1"], "model.ffn_chunk_tokens must be >= 0, got -1"),
        ], env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    finally:
        (work / "seqdev.yaml").unlink()


def test_messages_point_the_right_way(work):
    run_cases(work, [
        (["eval", "/nonexistent", "ds"], "no store or checkpoint at /nonexistent (it does not exist)"),
        (["generate", "NOT_A_STORE"], "no store or checkpoint at NOT_A_STORE"),
        (["generate", "empty"], "no store or checkpoint at empty (it has no manifest.json or config.json)"),
        (["eval", "FILE", "ds"], "no store or checkpoint at FILE"),
        (["generate", "fresh"], "store fresh holds no tokenizer"),
        (["train", *TINY, "--run.dir=run", "--data.dataset=builtin:shakespeare", "--run.resume=true",
          "--run.steps=3", "--model.num_hidden_layers=3"], "(num_hidden_layers 2 -> 3: the store's -> yours)"),
        (["train", *TINY, "--run.dir=run", "--data.dataset=builtin:shakespeare", "--run.resume=true",
          "--run.steps=3", "--model.intermediate_size=96"], "(intermediate_size 64 -> 96: the store's"),
        (["train", "--model.checkpoint=ckpt", "--model.intermediate_size=96", "--model.vocab_size=257",
          "--run.dir=r2", "--data.dataset=ds", "--data.seq_len=32", "--run.sample_tokens=0"],
         "vocab_size 97 -> 257, intermediate_size 56 -> 96"),
        (["train", *TINY, "--run.dir=r2", "--store.master=disk", "--store.path=ckpt"],
         "store.path ckpt is a Hugging Face checkpoint, not a layer store; convert it with `mtjax import ckpt STORE`"),
        (["eval", "run/final", "ds", "--seq-len", "128", "--batch-size", "64"],
         "the val split of ds has 86 tokens, fewer than one row of --seq-len 128; add data or lower --seq-len"),
        (["eval", "run/final", "ds", "--tokenizer", "nothing.json"], "tokenizer 'nothing.json' is neither"),
        (["eval", "run/final", "ds", "--split", "test"], "has no split 'test'"),
        (["eval", "run/final", "run"], "run holds the prepared dataset run/data: name that directory, not run"),
    ])


def test_empty_paths_and_other_commands_flags(work):
    """An empty path (`--data.dataset=`, `data prepare ''`) once meant the working directory,
    every text and JSON file under it read as input; a tokenizer directory without a
    tokenizer.json, and --val-fraction, were named by train's keys in other commands; an
    experiment that is a directory was said not to exist."""
    run_cases(work, [
        (["train", *TINY, "--run.dir=r2", "--data.dataset="], "data.dataset is empty; name a prepared dataset"),
        (["train", *TINY, "--run.dir=r2", "--data.tokenizer="], "the tokenizer is empty (''); name 'bytes'"),
        (["data", "prepare", "", "--out", "d"], "an input is empty (''); name files or directories"),
        (["eval", "run/final", ""], "the dataset is empty; name a prepared dataset"),
        (["data", "prepare", "text.txt", "--out", "d", "--tokenizer", "empty"],
         "tokenizer 'empty' is a directory without a tokenizer.json; name 'bytes', a tokenizer.json or a checkpoint "
         "directory holding one"),
        (["generate", "run/final", "--tokenizer", "empty"], "tokenizer 'empty' is a directory without a tokenizer.json"),
        (["data", "prepare", "text.txt", "--out", "d", "--val-fraction", "2"],
         "argument --val-fraction: must be in [0, 1), got 2.0"),
        (["train", "empty"], "experiment file empty is a directory; name a YAML file"),
        (["data", "prepare", "ckpt", "--out", "d"],  # its config.json was read as JSONL: "not a JSON object"
         "ckpt is a model checkpoint (config.json and safetensors weights), not data: name the text"),
    ])


def test_overwrite_replaces_only_a_dataset(work):
    """`data prepare --overwrite` onto a finished run or a store once deleted it and left a
    dataset in its place; only a directory holding a dataset's meta.json is replaced."""
    run_cases(work, [
        (["data", "prepare", "text.txt", "--out", "run", "--overwrite"],
         "run is not a prepared dataset (no meta.json; it holds config.yaml, data, final, metrics.jsonl and 3 more) "
         "and --overwrite replaces only a dataset; choose another output, or empty it yourself"),
        (["data", "prepare", "text.txt", "--out", "store", "--overwrite"], "store is not a prepared dataset"),
    ])


def test_settings_that_cannot_be_meant(work):
    """A config that says one thing twice, numbers no run can mean, architecture fields
    beside the checkpoint that gives the architecture, a plan past the model's context.
    A setting given twice on the command line is not one of them: the last one counts
    (TINY's --run.steps=2 is replaced below)."""
    (work / "twice.yaml").write_text("optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    (work / "empty.yaml").write_text("# to fill in\n")
    train = ["train", *TINY, "--run.dir=r2"]
    empty = "empty.yaml is empty: write the settings to change, or leave out the file to run the embedded default"
    try:
        run_cases(work, [
            (["train", "empty.yaml", "--run.dir=r2"], empty),
            (["plan", "empty.yaml", "--hardware", "h200"], empty),
            (["init", "empty.yaml", "s3"], empty),
            (["train", "twice.yaml", *TINY, "--run.dir=r2"], "twice.yaml sets optim.lr twice (lines 2 and 3); keep one"),
            (["plan", "twice.yaml", "--hardware", "h200"], "twice.yaml sets optim.lr twice (lines 2 and 3)"),
            ([*train, "--run.checkpoint_every=-1"], "run.checkpoint_every must be in [0, 2147483647]"),
            ([*train, "--run.steps=1e12"], "run.steps must be in [0, 2147483647] (the optimizer counts steps in int32), "
                                           "got 1000000000000"),
            ([*train, "--model.rope_theta=-1"], "model.rope_theta must be positive, got -1.0"),
            ([*train, "--optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0, got -0.1"),
            ([*train, "--model.freeze=block.99"], "model.freeze pattern 'block.99' names no leaf of this model"),
            ([*train, "--model.freeze=*"], "model.freeze freezes every leaf: nothing is left to train"),
            ([*train, "--lora.rank=0"], "lora.rank must be a positive integer (or null: no adapters), got 0"),
            ([*train, "--lora.rank=4", "--lora.target_modules=qkv"], "lora.target_modules qkv names no linear layer"),
            (["export", "run/store", "merged", "--merge"], "has none; export it without --merge"),
            (["import", "ckpt", "s2", "--adapter", "nowhere"], "no adapter_config.json in nowhere"),
            ([*train, "--model.base_format=int4"], "model.base_format must be one of compute, int8, nf4, got 'int4'"),
            ([*train, "--model.base_format=nf4"], "model.base_format nf4 applies to frozen 2-D kernels of blocks, and "
                                                  "model.freeze freezes none"),
            ([*train, "--model.freeze=block.*/*.kernel", "--model.base_format=int8", "--stream.engine=reference"],
             "model.base_format int8 needs stream.engine=stream"),
            (["import", "ckpt", "q", "--base-format", "nf4", "--freeze", "embed"], "model.base_format nf4 applies to "
                                                                                   "frozen 2-D kernels of blocks"),
            (["train", "--model.checkpoint=ckpt", "--model.num_hidden_layers=3", "--run.dir=r2", "--data.dataset=ds",
              "--data.seq_len=32"], "the architecture comes from model.checkpoint ckpt, and the experiment also sets "
                                    "num_hidden_layers 2 -> 3 (its -> yours)"),
            (["plan", "run/final", "--hardware", "h200", "--seq-len", "1000000000"],
             "--seq-len (1000000000) exceeds the model's context (model.max_position_embeddings = 1024): lower"),
        ])
    finally:
        (work / "twice.yaml").unlink()
        (work / "empty.yaml").unlink()
@pytest.mark.parametrize("profile, dtype", [("FAST", "bfloat16"), ("SLOW", "float32")])
def test_init_resolves_compute_dtype_auto_for_an_hf_config_as_for_a_yaml(tmp_path, monkeypatch, capsys, profile,
                                                                         dtype):
    """`mtjax init --compute-dtype auto` (once refused for an HF config by the flag's
    choices) stores the dtype a run on this machine resolves auto to, and says why, for
    an HF checkpoint as for an experiment YAML asking auto; so does `mtjax import
    --compute-dtype auto` (refused by its choices before)."""
    import test_compute_dtype as auto
    from mtjax import store as store_lib

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # this machine's profile, not the user's
    auto.this_machine(tmp_path / "xdg" / "mtjax", getattr(auto, profile))
    ckpt, _ = hf_models.checkpoint(tmp_path, "llama")
    (tmp_path / "auto.yaml").write_text(f"model:\n  hf_config: {ckpt / 'config.json'}\n  compute_dtype: auto\n")
    for command, source, flags in (("init", ckpt, ["--compute-dtype", "auto"]),
                                   ("init", ckpt / "config.json", ["--compute-dtype", "auto"]),
                                   ("init", tmp_path / "auto.yaml", []), ("import", ckpt, ["--compute-dtype", "auto"])):
        out = tmp_path / f"store-{len(list(tmp_path.glob('store-*')))}"
        assert cli.main([command, str(source), str(out), *flags]) == 0
        said = [ln for ln in capsys.readouterr().out.splitlines() if "model.compute_dtype=auto" in ln]
        assert len(said) == 1 and f"compute dtype {dtype}" in said[0], said
        with store_lib.open(out) as store:
            assert store.config.compute_dtype == dtype


def test_broken_checkpoint_configs_and_probe_paths(work):
    """A checkpoint's config.json that is not an object, lacks its model_type or holds a value
    of the wrong type; `mtjax probe` paths that cannot be written (checked before it measures:
    no stray temporary file), a --placement item without '='."""
    broken = {"c-list": [1, 2], "c-notype": {"hidden_size": 32}, "c-str": None}
    for name, config in broken.items():
        shutil.copytree(work / "ckpt", work / name)
        if config is None:
            config = json.loads((work / "ckpt" / "config.json").read_text()) | {"hidden_size": "abc"}
        (work / name / "config.json").write_text(json.dumps(config))
    try:
        run_cases(work, [
            (["import", "c-list", "s2"], "c-list/config.json holds a JSON list, not an object of model settings"),
            (["train", *TINY, "--run.dir=r2", "--model.checkpoint=c-list"], "c-list/config.json holds a JSON list"),
            (["import", "c-notype", "s2"], "config.json has no model_type"),
            (["import", "c-str", "s2"], "config.json holds a value of the wrong type (invalid literal for int()"),
            (["probe", "--quick", "--out", "FILE/p.json"], "--out FILE/p.json cannot be created: FILE is a file"),
            (["probe", "--quick", "--out", "empty"], "--out empty is a directory; name a file"),
            (["probe", "--quick", "--dir", "FILE"], "--dir FILE is not a directory"),
            (["plan", "run/final", "--hardware", "h200", "--placement", "compute=ram,,opt=disk"],
             "--placement 'compute=ram,,opt=disk' is not valid ('' is not kind=tier)"),
        ])
    finally:
        for name in broken:
            shutil.rmtree(work / name)


@pytest.mark.slow  # mtjax processes
def test_data_tokenized_otherwise_than_the_model(work):
    """A dataset (or raw text) tokenized with another tokenizer than the one the model's
    weights learned is refused, unless data.other_tokenizer says to train on it anyway."""
    if not (work / "ckpt-tok").exists():
        shutil.copytree(work / "ckpt", work / "ckpt-tok")
        shutil.copy(QWEN_TOKENIZER, work / "ckpt-tok")
        assert cli.main(["data", "prepare", str(work / "text.txt"), "--out", str(work / "ds-qwen"),
                         "--tokenizer", QWEN_TOKENIZER]) == 0
    qwen = str((work / "ckpt-tok" / "tokenizer.json.gz").resolve())
    tuned = ["train", *TINY[6:-2], "--model.checkpoint=ckpt-tok"]  # the architecture is the checkpoint's
    run_cases(work, [
        ([*tuned, "--run.dir=r2", "--data.dataset=ds"],
         f"dataset ds was tokenized with bytes (no tokenizer) but the model uses {qwen}: the same ids mean other "
         "tokens to it; prepare it again with `mtjax data prepare ... --tokenizer ckpt-tok`, or set "
         "--data.other_tokenizer=true to train on it anyway"),
        ([*tuned, "--run.dir=r3", "--data.dataset=text.txt"],
         "data.dataset text.txt was tokenized with bytes (no tokenizer) but the model uses "
         f"{qwen}: the same ids mean other tokens to it; pass --data.tokenizer=ckpt-tok, or set"),
        ([*tuned, "--run.dir=r4", "--data.dataset=ds", "--data.other_tokenizer=true"],
         "dataset ds has token ids up to 256 but the model's vocabulary is 97"),  # past the check, as asked
        (["eval", "run/final", "ds-qwen", "--seq-len", "16", "--batch-size", "1", "--batches", "1"],
         f"dataset ds-qwen was tokenized with {QWEN_TOKENIZER} but the model uses bytes (no tokenizer): the same "
         "ids mean other tokens to it; prepare it again with `mtjax data prepare ... --tokenizer bytes`, or pass "
         "--tokenizer naming the dataset's own to evaluate on it anyway"),
    ])


@pytest.mark.slow  # mtjax processes
def test_a_store_missing_an_identity_file(work):
    """A store whose manifest.json (or STORE_ID) was deleted: every command that opens it
    says which file is missing and what to do, and nothing in it is deleted (a run used to
    take a trained store without its manifest for a stopped creation's leftover)."""
    for name, source, lost in (("lost-manifest", "store", "manifest.json"), ("lost-id", "store", "STORE_ID"),
                               ("run-lost", "run", "store/manifest.json")):
        if not (work / name).exists():
            shutil.copytree(work / source, work / name)
            (work / name / lost).unlink()
    manifest = "has lost its manifest.json (the commit point naming which of its files hold the last step)"
    run_cases(work, [
        (["generate", "lost-manifest"], f"store lost-manifest {manifest} but still holds data (parts/)"),
        (["eval", "lost-manifest", "ds"], f"store lost-manifest {manifest}"),
        (["export", "lost-manifest", "x"], f"store lost-manifest {manifest}"),
        (["generate", "lost-id", "--tokenizer", "bytes"], "store lost-id has lost its STORE_ID file"),
        (["train", *TINY, "--run.dir=run-lost", "--data.dataset=builtin:shakespeare", "--run.resume=auto"],
         f"store run-lost/store {manifest} but still holds data (parts/, train_state/): it cannot be opened, "
         "and nothing in it was changed; put back manifest.json from a backup of this store, or delete"),
    ])


@pytest.mark.slow  # mtjax processes
def test_samples_longer_than_the_context(work):
    """The closing sample of a run, and `generate`, refuse a prompt and a token count that
    together pass the model's context (1024 here), before training or sampling."""
    run_cases(work, [
        (["train", *TINY[:-1], "--run.dir=r2", "--run.sample_tokens=5000"],
         "run.sample_prompt (11 tokens) and run.sample_tokens 5000 need 5,011 positions, more than the model's "
         "context of 1024 (max_position_embeddings); lower run.sample_tokens to 1013 or less"),
        (["generate", "run/final", "--prompt", "x" * 1100, "--tokens", "5"],
         "--prompt (1100 tokens) and --tokens 5 need 1,105 positions, more than the model's context of 1024 "
         "(max_position_embeddings); shorten --prompt to fewer than 1024 tokens"),
        (["generate", "run/final", "--tokens", "100000000000"], "lower --tokens to 1023 or less"),
    ])


def test_chat_data_mistakes(work):
    """`data prepare --format chat / prompt-completion` refusals, and a run on rows of another length."""
    def chat_file(name, *conversations):
        lines = [json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) for conv in conversations]
        (work / name).write_text("".join(line + "\n" for line in lines))

    good = [("user", "hi"), ("assistant", "hello")]
    chat_file("robot.jsonl", good, [("robot", "beep")])
    chat_file("blank.jsonl", [("user", "hi"), ("assistant", "")])
    chat_file("unanswered.jsonl", [("user", "hi")], [("system", "terse"), ("user", "ok?")])
    (work / "notemplate").mkdir(exist_ok=True)
    shutil.copy(QWEN_TOKENIZER, work / "notemplate")
    (work / "pc.jsonl").write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    rows = ["data", "prepare", str(work / "pc.jsonl"), "--out", str(work / "pc"), "--format", "prompt-completion",
            "--seq-len", "64", "--val-fraction", "0"]
    if not (work / "pc").exists():
        assert cli.main(rows) == 0
    chat = ["--format", "chat", "--tokenizer", str(Path(QWEN_TOKENIZER).parent), "--seq-len", "64"]
    run_cases(work, [
        (["data", "prepare", "robot.jsonl", "--out", "d", *chat],
         "robot.jsonl:2: message 0 has role 'robot'; roles are system, user, assistant, tool"),
        (["data", "prepare", "blank.jsonl", "--out", "d", *chat],
         "blank.jsonl:1: message 1 (assistant) has empty content; remove the message or fill it"),
        (["data", "prepare", "unanswered.jsonl", "--out", "d", *chat], "2 have no token to train on"),
        (["data", "prepare", "robot.jsonl", "--out", "d", *chat[:2], "--tokenizer", "notemplate", "--seq-len", "64"],
         "renders conversations with the tokenizer's chat template, and 'notemplate' has none"),
        (["train", *TINY, "--run.dir=r3", "--data.dataset=pc"], "holds rows of 64 tokens; set data.seq_len to 64"),
    ], parallel=5)


def test_table_data_mistakes(work):
    """`data prepare` of a Parquet file without the column, a cut one, a `datasets` dir missing an Arrow file."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": [1, 2], "text": ["In the beginning", "And the earth"]})
    pq.write_table(table, work / "t.parquet")
    (work / "cut.parquet").write_bytes((work / "t.parquet").read_bytes()[:-64])
    (work / "saved").mkdir(exist_ok=True)
    with pa.ipc.new_stream(work / "saved" / "data-00000-of-00002.arrow", table.schema) as stream:
        stream.write_table(table)
    files = [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)]  # as save_to_disk lists its shards
    (work / "saved" / "state.json").write_text(json.dumps({"_data_files": files}))
    (work / "saved" / "dataset_info.json").write_text(json.dumps({"features": {}}))
    run_cases(work, [
        (["data", "prepare", "t.parquet", "--out", "d", "--text-field", "body"],
         "t.parquet has no column 'body' (has: id, text); choose the column with --text-field"),
        (["data", "prepare", "cut.parquet", "--out", "d"], "cut.parquet is not a readable Parquet file ("),
        (["data", "prepare", "saved", "--out", "d"],
         "saved/state.json lists data-00001-of-00002.arrow, which is missing from saved; copy the whole directory"),
    ])


def test_eval_errors_name_its_own_flags_only(work):
    """No error of `mtjax eval` speaks of train's data.* keys (the cases above that reach mtjax.data)."""
    p = start(work, ["eval", "run/final", "ds", "--seq-len", "128", "--batch-size", "64"])
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "--seq-len" in err and "data." not in err.replace("data.dataset", ""), err


@pytest.fixture
def disk(work):
    """A 6 MiB tmpfs inside the working directory holding a prepared dataset; mostly full."""
    with small_disk.mounted(work / "disk", "6m") as mnt:
        assert cli.main(["data", "prepare", str(work / "text.txt"), "--out", str(mnt / "ds")]) == 0
        small_disk.fill(mnt, leave=64 << 10)
        yield mnt
        (mnt / "ballast").unlink()
    (work / "disk").rmdir()


def test_a_full_disk_outside_the_store_step(work, disk):
    big = work / "tmp" / "big.txt"
    big.write_text("Whether 'tis nobler in the mind to suffer the slings and arrows\n" * 20000)  # 1.3 MB
    try:
        run_cases(work, [
            (["data", "prepare", "tmp/big.txt", "--out", "disk/new"], "No space left on device; free space"),
            (["data", "prepare", "tmp/big.txt", "--out", "disk/ds", "--overwrite"], "No space left on device"),
            (["import", "ckpt", "disk/s"], "cannot write the store at disk/s: No space left on device; free space"),
            (["export", "store", "disk/x"], "No space left on device"),
        ], parallel=1)  # one at a time: each must find the disk as full as the last left it
    finally:
        big.unlink()


def test_ctrl_c_stops_a_command_with_one_line_and_no_litter(work):
    """SIGINT at a few moments of a long `data prepare` (a 12 MB input through the Qwen2
    tokenizer): exit 130, one line, nothing swallowed, nothing left behind."""
    big = work / "tmp" / "long.txt"
    big.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200000)))
    before = snapshot(work)
    # The commands get SIGINT as a terminal's foreground command has it, whatever this
    # process was started with (an ignored SIGINT is inherited, and mtjax then leaves it so).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for delay in (0.0, 0.3, 0.7, 1.2):
            p = start(work, ["data", "prepare", "tmp/long.txt", "--out", "long", "--tokenizer", QWEN_TOKENIZER])
            deadline = time.monotonic() + 120
            while not list(work.glob(".long.tmp-*")) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)  # until it is writing shards
            time.sleep(delay)
            running = p.poll() is None
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=120)
            lines = [line for line in err.splitlines() if line.strip() and "tokenizing" not in line]
            # Once (in CI, under load) this saw exit 0 and no stderr at delay 0: say whether
            # the command had already ended and what it printed, if it happens again.
            assert p.returncode == 130, (delay, running, p.returncode, err[-2000:], out[-2000:])
            assert lines == ["mtjax data prepare: interrupted"], (delay, err[-2000:])
            assert snapshot(work) == before, delay
    finally:
        signal.signal(signal.SIGINT, inherited)
        big.unlink()
