"""`mtjax import` / `mtjax export` / `mtjax init`: HF checkpoints in and out of a store.

Import then export is bit-exact (fp32 and bf16 checkpoints, single and sharded files);
transformers loads the export and gives the original's logits; every bad input is one
StoreError (one line and exit code 2 on the command line) and creates no store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import hf_models
import mtjax.store
from mtjax import cli, hf, model, parts, treepath
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.store.errors import StoreError
from mtjax.store.hf_import import import_hf
from mtjax.store.hf_export import export_hf


def tensors(ckpt: Path) -> dict[str, tuple[str, bytes]]:
    """{name: (dtype, raw bytes)} of every tensor in a checkpoint dir, shards included."""
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (str(t.dtype), t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16
                             else t.numpy().tobytes())
    return out


def logits(torch_model, seed=0) -> np.ndarray:
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 97, (2, 11)))
    with torch.no_grad():
        return torch_model(ids).logits.float().numpy()


@pytest.mark.parametrize("family,dtype,sharded,tied", [
    ("llama", torch.float32, False, False),
    ("qwen2", torch.bfloat16, True, True),
    ("qwen3", torch.float32, True, False),
    ("mistral", torch.bfloat16, False, False),
    ("phi3", torch.bfloat16, True, False),
    ("gemma2", torch.bfloat16, False, True),
    ("gemma3_text", torch.float32, True, False),
])
def test_import_export_is_bit_exact_and_transformers_agrees(tmp_path, family, dtype, sharded, tied):
    import transformers

    torch_model = hf_models.build(family, tie_word_embeddings=tied).to(dtype)
    src = hf_models.save(torch_model, tmp_path / "src", "20KB" if sharded else None)
    import_hf(src, tmp_path / "store")
    with mtjax.store.open(tmp_path / "store") as store:
        cfg = store.config
        assert store.step == 0 and cfg.compute_dtype == "bfloat16"
        assert cfg.param_dtype == ("bfloat16" if dtype == torch.bfloat16 else "float32")
        _, params = hf.load_params(src)
        tx = make_optimizer(OptimConfig())
        for part in store.parts:
            master = store.read(part, "master").result()
            expected = treepath.flatten(parts.part_params(params, part))
            assert master.keys() == expected.keys()
            for leaf in master:
                np.testing.assert_array_equal(master[leaf], expected[leaf])
            compute = store.read(part, "compute").result()
            for leaf in compute:
                assert compute[leaf].tobytes() == master[leaf].astype(compute[leaf].dtype).tobytes()
            opt = store.read(part, "opt").result()
            assert opt.keys() == parts.schema(cfg, part, "opt", tx).keys()
            assert all(not np.any(v) for v in opt.values())  # AdamW's fresh state is all zeros
    out = export_hf(tmp_path / "store", tmp_path / "out", max_shard_bytes=30_000 if sharded else 5 * 10**9)
    assert tensors(out) == tensors(src)
    assert (out / hf.INDEX_FILE).exists() == sharded
    # both loaded the same way (a model cast with .to(bf16) also rounds its RoPE buffers)
    load = transformers.AutoModelForCausalLM.from_pretrained
    original, exported = (load(d, attn_implementation="eager", dtype=dtype) for d in (src, out))
    np.testing.assert_array_equal(logits(exported), logits(original))


MULTIMODAL = {  # family: (its text config's keys, the class transformers reloads the export as)
    "gemma3": (dict(tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"]),
               "Gemma3ForCausalLM"),
    "llama4": (dict(moe_layers=[1], no_rope_layers=[1, 0], num_experts_per_tok=1), "Llama4ForCausalLM"),
}


@pytest.mark.parametrize("family", sorted(MULTIMODAL))
def test_multimodal_imports_its_language_model_and_exports_a_text_model(family, tmp_path, capsys):
    """Gemma3ForConditionalGeneration (Llama4ForConditionalGeneration) in, Gemma3ForCausalLM
    (Llama4ForCausalLM) out: the language model's tensors bit for bit under text-only
    names, the vision tower left out with one line."""
    import transformers

    text_config, text_class = MULTIMODAL[family]
    torch_model = hf_models.build(family, **text_config)
    src = hf_models.save(torch_model, tmp_path / "src")
    import_hf(src, tmp_path / "store")
    said = [line for line in capsys.readouterr().out.splitlines() if "multimodal" in line]
    assert len(said) == 1 and "vision tower" in said[0] and "left out" in said[0]
    out = export_hf(tmp_path / "store", tmp_path / "out")
    exported, original = tensors(out), tensors(src)
    text = {}
    for name, value in original.items():
        prefix = next((p for p in hf.LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix:
            text[hf.LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix):]] = value
    assert "lm_head.weight" in text and len(text) < len(original)  # untied; the vision tower was there
    assert exported == text
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                  dtype=torch.float32)
    assert type(reloaded).__name__ == text_class
    # transformers' Llama4ForConditionalGeneration fails a text-only forward (5.24 reads the
    # absent image outputs): its language model, a Llama4ForCausalLM, is what it runs.
    original = torch_model.language_model if family == "llama4" else torch_model
    np.testing.assert_array_equal(logits(reloaded), logits(original))


def test_cli_import_export_init(tmp_path, capsys):
    src, torch_model = hf_models.checkpoint(tmp_path, "llama")
    assert cli.main(["import", str(src), str(tmp_path / "s"), "--compute-dtype", "float32"]) == 0
    assert mtjax.store.open(tmp_path / "s").config.compute_dtype == "float32"
    assert cli.main(["export", str(tmp_path / "s"), str(tmp_path / "o"), "--max-shard-size", "40KB"]) == 0
    assert tensors(tmp_path / "o") == tensors(src)
    assert len(list((tmp_path / "o").glob("*.safetensors"))) > 1
    # init: fresh weights exactly as mtjax.model.init_params makes them
    assert cli.main(["init", str(src / "config.json"), str(tmp_path / "fresh"), "--seed", "3"]) == 0
    with mtjax.store.open(tmp_path / "fresh") as store:
        params = model.init_params(store.config, 3)
        assert store.config.compute_dtype == "bfloat16"
        for part in store.parts:
            master = store.read(part, "master").result()
            for leaf, value in treepath.flatten(parts.part_params(params, part)).items():
                np.testing.assert_array_equal(master[leaf], np.asarray(value))
    capsys.readouterr()
    # errors a user can act on: one line, exit code 2
    assert cli.main(["export", str(tmp_path / "s"), str(tmp_path / "o2"), "--max-shard-size", "lots"]) == 2
    assert cli.main(["import", str(src), str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is not a size" in err[0] and "not empty" in err[1]


def _corrupt(tmp_path: Path, how: str) -> Path:
    """A checkpoint dir broken in one way."""
    src, _ = hf_models.checkpoint(tmp_path, "llama")
    file = src / "model.safetensors"
    with safe_open(str(file), framework="np") as f:
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    if how == "missing":
        del arrays["model.layers.1.mlp.up_proj.weight"]
    elif how == "extra":
        arrays["model.layers.1.mlp.extra.weight"] = np.zeros(3, np.float32)
    elif how == "shape":
        arrays["model.layers.0.self_attn.q_proj.weight"] = np.zeros((32, 31), np.float32)
    elif how == "dtype":
        arrays["model.norm.weight"] = arrays["model.norm.weight"].astype(np.float16)
    elif how == "arch":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    if how == "truncated":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) - 5000])
    else:
        save_file(arrays, str(file), metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("how,message", [
    ("missing", "missing: model.layers.1.mlp.up_proj.weight"),
    ("extra", "unexpected: model.layers.1.mlp.extra.weight"),
    ("shape", r"mis-shaped: model.layers.0.self_attn.q_proj.weight \(32, 31\)"),
    ("dtype", "model.norm.weight is F16"),
    ("truncated", "truncated"),
    ("arch", "model_type 'gpt2' is not supported"),
])
def test_bad_checkpoints_create_no_store(tmp_path, how, message):
    src = _corrupt(tmp_path, how)
    with pytest.raises(StoreError, match=message):
        import_hf(src, tmp_path / "store")
    assert not (tmp_path / "store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["llama-ckpt"]  # no partial store left anywhere


def test_failed_import_mid_way_leaves_nothing(tmp_path, monkeypatch):
    src, _ = hf_models.checkpoint(tmp_path, "llama")
    real = hf.SafetensorsReader.read
    calls = []

    def flaky(self, name):  # a read error after a few tensors, as a disk error would give
        calls.append(name)
        if len(calls) == 6:
            raise hf.CheckpointError(f"tensor {name} is unreadable")
        return real(self, name)

    monkeypatch.setattr(hf.SafetensorsReader, "read", flaky)
    with pytest.raises(StoreError, match="is unreadable"):
        import_hf(src, tmp_path / "store")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-ckpt"]


def test_export_refuses_a_non_empty_destination(tmp_path):
    src, _ = hf_models.checkpoint(tmp_path, "llama")
    import_hf(src, tmp_path / "store")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(StoreError, match="not empty"):
        export_hf(tmp_path / "store", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    with pytest.raises(StoreError, match="not empty"):
        import_hf(src, tmp_path / "out")


def test_init_from_an_experiment_yaml(tmp_path):
    """An experiment YAML gives the model (preset + overrides) and the optimizer of the store."""
    from mtjax import config as experiment

    yaml = tmp_path / "exp.yaml"
    yaml.write_text("model:\n  preset: tiny\n  num_hidden_layers: 2\n  compute_dtype: float32\n"
                    "optim:\n  lr: 0.001\n  b1: 0.8\n")
    assert cli.main(["init", str(yaml), str(tmp_path / "s")]) == 0
    exp = experiment.load(yaml)
    with mtjax.store.open(tmp_path / "s", config=experiment.model_config(exp)) as store:
        assert store.config.num_hidden_layers == 2 and store.config.compute_dtype == "float32"
        assert store.schema("head", "opt") == parts.schema(store.config, "head", "opt", make_optimizer(exp.optim))
        params = model.init_params(store.config, 0)
        np.testing.assert_array_equal(store.read("embed", "master").result()["embedding"],
                                      np.asarray(params["embed"]["embedding"]))


def test_leftovers_of_a_crashed_import_are_removed(tmp_path):
    src, _ = hf_models.checkpoint(tmp_path, "llama")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".store.partial-{dead.stdout.strip()}"  # a pid that has exited
    live = tmp_path / f".store.partial-{os.getpid()}x"  # not a pid: someone else's, left alone
    stale.mkdir()
    live.mkdir()
    import_hf(src, tmp_path / "store")
    assert not stale.exists() and live.exists()
    assert mtjax.store.open(tmp_path / "store").step == 0


def test_config_without_a_dtype_takes_the_tensors_dtype(tmp_path):
    torch_model = hf_models.build("llama").to(torch.bfloat16)
    src = hf_models.save(torch_model, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}))
    import_hf(src, tmp_path / "store")
    assert mtjax.store.open(tmp_path / "store").config.param_dtype == "bfloat16"
    assert tensors(export_hf(tmp_path / "store", tmp_path / "out")) == tensors(src)


def test_tokenizer_round_trip_through_import_and_export(tmp_path, capsys):
    """import keeps the checkpoint's tokenizer (the real Qwen2 one, gzipped as in tests/data),
    eval and generate use it with no --tokenizer, and AutoTokenizer on the export gives the
    source checkpoint's ids."""
    import gzip
    import shutil

    import transformers

    from mtjax import data

    src, _ = hf_models.checkpoint(tmp_path, "qwen2", vocab_size=151936, hidden_size=16, intermediate_size=32,
                                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    qwen = Path(__file__).parent / "data" / "qwen2"
    (src / "tokenizer.json").write_bytes(gzip.decompress((qwen / "tokenizer.json.gz").read_bytes()))
    shutil.copy(qwen / "tokenizer_config.json", src)
    assert cli.main(["import", str(src), str(tmp_path / "s"), "--compute-dtype", "float32"]) == 0
    assert sorted(p.name for p in (tmp_path / "s" / "tokenizer").iterdir()) == ["tokenizer.json",
                                                                                 "tokenizer_config.json"]
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40)
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "s"), "--prompt", "In the", "--tokens", "3",
                     "--temperature", "0"]) == 0
    assert cli.main(["eval", str(tmp_path / "s"), str(text), "--seq-len", "16", "--batch-size", "1",
                     "--batches", "1", "--split", "train"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("In the") and out[1].startswith("train loss ")
    for spec in (str(src), "bytes"):  # the same loss as with the checkpoint's tokenizer named, not as bytes
        assert cli.main(["eval", str(tmp_path / "s"), str(text), "--seq-len", "16", "--batch-size", "1",
                         "--batches", "1", "--split", "train", "--tokenizer", spec]) == 0
    named, as_bytes = capsys.readouterr().out.splitlines()
    assert out[1] == named != as_bytes
    assert cli.main(["export", str(tmp_path / "s"), str(tmp_path / "o")]) == 0
    assert "no tokenizer" not in capsys.readouterr().out and not (tmp_path / "o" / "README.md").exists()
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (tmp_path / "o", src))
    sample = "In the beginning <|endoftext|> Ünïcödé 123\n\tdone"
    assert ours(sample)["input_ids"] == theirs(sample)["input_ids"] == \
        data.load_tokenizer(str(src)).encode(sample)
    assert ours.eos_token == theirs.eos_token == "<|endoftext|>"
