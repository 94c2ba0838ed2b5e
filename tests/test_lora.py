"""LoRA adapters over a frozen base (mtjax.lora): they train as PEFT trains them.

Tiny dense models (Llama, Qwen2 with biases, Phi-3 fused) with adapters trained 3 AdamW
steps by the streaming engine give PEFT + transformers' losses (1e-6) and adapter weights (1e-4 relative) from the same start, the
base bit-identical; streamed equals the in-memory reference for 5 steps of 2
micro-batches with the state in RAM and on disk (the base's compute copy too, and a
one-copy store); bad `lora:` settings are one line. A Qwen3-MoE with adapters on
attention, and with adapters on its routed experts (PEFT's target_parameters), equals PEFT
with whole blocks and with expert groups, and exports to / imports from PEFT; frozen
experts (LoRA, an NF4 base, freeze patterns) and adapted ones under expert groups equal
the reference; dropout on the adapters' input drops in the streamed engine what it drops
in the reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mtjax import config, hf, lora, model, parts, roles, treepath
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import ConfigError
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine, ops

from conftest import ONE_KV_HEAD, tiny_config, token_batches

# AdamW as torch.optim.AdamW runs it: constant lr, decoupled decay, no clipping.
OPT = OptimConfig(lr=1e-2, schedule="constant", warmup_steps=0, clip_norm=None, weight_decay=0.1)
BATCH, SEQ = 2, 8
# (target modules, rsLoRA, model fields): some layers of a Llama, and every linear layer with
# rank-stabilised scaling; a Qwen2's q/k/v with biases; a Phi-3's fused projections
ADAPTERS = {"some": (("q_proj", "v_proj", "down_proj"), False, {}), "all-linear": (("all-linear",), True, {}),
            "qwen2-biases": (("q_proj", "k_proj", "v_proj"), False, {"model_type": "qwen2", "attention_bias": True}),
            "phi3-fused": (("qkv_proj", "gate_up_proj"), False, {"model_type": "phi3", "extra_hf": (  # token ids in its vocabulary
                ("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", None))})}


def _config(targets=("all-linear",), rslora=False, **overrides):
    adapters = lora.LoraConfig(rank=4, alpha=8.0, rslora=rslora, target_modules=targets)
    return tiny_config(**{"num_hidden_layers": 2, **ONE_KV_HEAD, "lora": adapters, **overrides})


def _peft_model(cfg, params, tmp_path):
    """transformers' model of the base weights in `params`, PEFT's adapters on it holding
    the adapters of `params` (PEFT's lora_A [r, in] and lora_B [out, r]: ours transposed)."""
    import peft
    import torch
    import transformers

    hf.save_params(cfg, params, tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    adapters = cfg.lora
    modules = [t for t in adapters.target_modules if t != lora.EXPERTS]
    experts = [f"mlp.experts.{m}" for m in lora.EXPERT_MODULES] if adapters.adapts_experts else None
    peft_model = peft.get_peft_model(base, peft.LoraConfig(
        r=adapters.rank, lora_alpha=adapters.alpha, use_rslora=adapters.rslora, lora_dropout=0.0,
        target_modules=modules if lora.ALL_LINEAR not in modules else lora.ALL_LINEAR, target_parameters=experts))
    ours = treepath.flatten(params)
    found = 0
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name and ".experts." not in name:
                leaf = _our_name(name)
                p.copy_(torch.from_numpy(np.asarray(ours[leaf]).T.copy()))
                found += 1
        for (block, module), wrapper in _expert_wrappers(peft_model).items():
            stacked = [np.stack([ours[f"blocks.{block}.mlp.experts.{e}.{module}.{x}"] for e in range(cfg.num_experts)])
                       for x in (lora.A, lora.B)]
            for layer, weight in zip((wrapper.lora_A, wrapper.lora_B), lora.to_peft(*stacked)):
                layer["default"].weight.copy_(torch.from_numpy(weight))
            found += 2 * cfg.num_experts
    assert found == sum(lora.is_adapter(n) for n in ours)
    return peft_model


def _expert_wrappers(peft_model) -> dict:
    """{(block, fused expert tensor: gate_up_proj or down_proj): PEFT's ParamWrapper on it}."""
    from peft.tuners.lora.layer import ParamWrapper

    return {(int(name.split(".layers.")[1].split(".")[0]), m.parameter_name): m
            for name, m in peft_model.named_modules() if isinstance(m, ParamWrapper)}


def _peft_adapters(cfg, peft_model) -> dict:
    """PEFT's adapters by mtjax's names and orientation (the experts' per expert)."""
    theirs = {_our_name(n): p.detach().numpy().T for n, p in peft_model.named_parameters()
              if ".lora_" in n and ".experts." not in n}
    for (block, module), wrapper in _expert_wrappers(peft_model).items():
        a, b = lora.from_peft(*(layer["default"].weight.detach().numpy() for layer in (wrapper.lora_A, wrapper.lora_B)),
                              cfg.num_experts)
        for e in range(cfg.num_experts):
            theirs[f"blocks.{block}.mlp.experts.{e}.{module}.{lora.A}"] = a[e]
            theirs[f"blocks.{block}.mlp.experts.{e}.{module}.{lora.B}"] = b[e]
    return theirs


def _our_name(peft_name: str) -> str:
    """PEFT's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    mtjax's `blocks.0.self_attn.q_proj.lora_a`."""
    module, _, rest = peft_name.removeprefix("base_model.model.model.layers.").partition(".lora_")
    return f"blocks.{module}.lora_{rest[0].lower()}"


def _rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _steps_beside_peft(cfg, engine, peft_model, **forward) -> tuple[dict, dict]:
    """Three AdamW steps of `engine` and of `peft_model` (torch's AdamW with OPT's settings;
    `forward` goes to its forward) on the same batches, each step's losses within 1e-6.
    Returns the engine's weights and PEFT's adapters, by mtjax's names and orientation."""
    import torch

    trained = [p for p in peft_model.parameters() if p.requires_grad]
    torch_opt = torch.optim.AdamW(trained, lr=OPT.lr, betas=(OPT.b1, OPT.b2), eps=OPT.eps,
                                  weight_decay=OPT.weight_decay)
    for batch in token_batches(cfg.vocab_size, (BATCH, SEQ), 3):
        ids = torch.as_tensor(batch, dtype=torch.long)
        loss = peft_model(input_ids=ids, labels=ids, **forward).loss
        loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        assert engine.step(batch)["loss"] == pytest.approx(loss.item(), abs=1e-6)
    return treepath.flatten(engine.params()), _peft_adapters(cfg, peft_model)


@pytest.mark.slow
@pytest.mark.parametrize("adapters", ADAPTERS)
def test_training_equals_peft_and_the_base_stays(adapters, tmp_path):
    targets, rslora, fields = ADAPTERS[adapters]
    cfg = _config(targets, rslora, **fields)
    params = model.init_params(cfg, seed=0)
    peft_model = _peft_model(cfg, params, tmp_path)
    assert sum(p.requires_grad for p in peft_model.parameters()) == sum(
        leaf.role == roles.TRAINED for p in parts.parts(cfg) for leaf in parts.leaves(cfg, p.name).values())
    engine = StreamEngine(cfg, params, OPT, StreamConfig(keep_every=2), StoreConfig())
    ours, theirs = _steps_beside_peft(cfg, engine, peft_model)
    start = treepath.flatten(params)
    for name, w in ours.items():
        if lora.is_adapter(name):
            assert _rel_error(w, theirs[name]) <= 1e-4, name
            assert not np.array_equal(np.asarray(w), np.asarray(start[name])), name
        else:  # the base, bit for bit (fp32: the compute copy is the weight)
            np.testing.assert_array_equal(np.asarray(w), np.asarray(start[name]), err_msg=name)
    engine.close()


PLACEMENTS = {"ram": {}, "state-disk": {"master": "disk", "opt": "disk"},
              "all-disk": {"compute": "disk", "master": "disk", "opt": "disk"}}  # the base's copy read, never written


@pytest.mark.parametrize("adapters", ["resident", "streamed"])
@pytest.mark.parametrize("where", [pytest.param(w, marks=() if w == "ram" else pytest.mark.slow) for w in PLACEMENTS])
def test_streamed_equals_the_reference(make_store, where, adapters):
    """Adapters resident (stream.adapters, the default: on the device with their AdamW
    state while the base streams; no gradient leaves) or streamed with the base."""
    cfg = _config(("q_proj", "o_proj", "up_proj"), num_hidden_layers=3, tie_word_embeddings=True)
    opt = dataclasses.replace(OPT, clip_norm=1.0, lr=1e-3)
    params = model.init_params(cfg, seed=1)
    tiers = PLACEMENTS[where]
    store = make_store(cfg, make_optimizer(opt)) if tiers else None
    engine = StreamEngine(cfg, params, opt, StreamConfig(keep_every=2, adapters=adapters), StoreConfig(**tiers),
                          store=store, batch_shape=(BATCH, SEQ))
    s = engine.plan(BATCH, SEQ, accum=2)
    blocks = tuple(p.name for p in parts.parts(cfg) if p.name.is_block)  # the parts with adapters
    assert s.adapters == (blocks if adapters == "resident" else ()) and not s.resident
    gone = {op.part for op in s.operations if isinstance(op, ops.GradOut)}  # to the host
    assert gone.isdisjoint(s.adapters) and s.traffic.d2h_grads == sum(s.grad_bytes[p] for p in gone)
    reference = ReferenceTrainer(cfg, params, opt)
    for batch in token_batches(cfg.vocab_size, (2, BATCH, SEQ), 5):
        assert engine.step(batch)["loss"] == pytest.approx(reference.step(batch)["loss"], abs=1e-5)
    streamed, expected = treepath.flatten(engine.params()), treepath.flatten(reference.params)
    for name, w in streamed.items():
        assert _rel_error(w, expected[name]) <= 1e-5, name
    engine.close()
    if store is not None:
        store.close()


# Whole parts resident with frozen leaves (stream.resident): (roles, which parts,
# placement, the update as the optax program an accelerator runs instead of the fused loop).
RESIDENT = {"lora-all-ram": ("lora", "all", "ram", False), "lora-2-one-copy": ("lora", 2, "one-copy", False),
            "freeze-all-disk": ("freeze", "all", "all-disk", False), "lora-all-optax": ("lora", "all", "ram", True)}
STORES = {"ram": ({}, 2), "all-disk": (PLACEMENTS["all-disk"], 2), "one-copy": (PLACEMENTS["all-disk"], 1)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if i == 0 else pytest.mark.slow)
                                  for i, c in enumerate(RESIDENT)])
def test_whole_parts_resident_with_frozen_leaves_equal_the_reference(make_store, case):
    """5 steps of 2 micro-batches with whole parts resident: the frozen leaves (LoRA's base,
    a freeze pattern) held as their compute copy, never updated or committed, equal the
    reference (the base bit for bit); a fresh engine on the committed store holds the same."""
    from test_roles import FREEZE

    which, resident, where, optax_update = RESIDENT[case]
    cfg = (_config(("q_proj", "o_proj", "up_proj"), num_hidden_layers=3, tie_word_embeddings=True)
           if which == "lora" else tiny_config(num_hidden_layers=3, **ONE_KV_HEAD, freeze=FREEZE))
    opt = dataclasses.replace(OPT, clip_norm=1.0, lr=1e-3)
    params = model.init_params(cfg, seed=1)
    tiers, copies = STORES[where]
    store = make_store(cfg, make_optimizer(opt), copies=copies) if tiers else None
    engine = StreamEngine(cfg, params, opt, StreamConfig(keep_every=2, resident=resident), StoreConfig(**tiers),
                          store=store, tx=make_optimizer(opt) if optax_update else None, batch_shape=(BATCH, SEQ))
    assert len(engine.schedule.resident) == (2 if resident == 2 else len(parts.parts(cfg)))
    assert engine.resident.on_host != optax_update
    if copies == 1:
        engine.commit(0)
    reference = ReferenceTrainer(cfg, params, opt)
    for batch in token_batches(cfg.vocab_size, (2, BATCH, SEQ), 5):
        assert engine.step(batch)["loss"] == pytest.approx(reference.step(batch)["loss"], abs=1e-5)
    _assert_trained_as(cfg, engine.params(), reference.params, params)
    if copies == 2 and store is not None:
        engine.commit(5)
    engine.close()
    if store is not None:  # the commit wrote the trained leaves; the base is the one the store began with
        again = StreamEngine(cfg, None, opt, StreamConfig(resident="none"), StoreConfig(**tiers), store=store)
        _assert_trained_as(cfg, again.params(), reference.params, params)
        again.close()
        store.close()


def _assert_trained_as(cfg, got, expected, start) -> None:
    """Trained leaves of `got` within 1e-5 of `expected` and moved from `start`; the others
    bit-identical to `start` (fp32: the compute copy is the weight)."""
    got, expected, start = (treepath.flatten(t) for t in (got, expected, start))
    trained = {f"{'blocks.' + str(p.name.block) if p.name.is_block else p.name}.{n}"
               for p in parts.parts(cfg) for n in parts.trained(cfg, p.name)}
    assert trained and set(got) - trained
    for name, w in got.items():
        if name in trained:
            assert _rel_error(w, expected[name]) <= 1e-5, name
            assert not np.array_equal(np.asarray(w), np.asarray(start[name])), name
        else:
            np.testing.assert_array_equal(np.asarray(w), np.asarray(start[name]), err_msg=name)


def test_a_step_with_adapters_resident_moves_what_its_description_says(make_store):
    """Every kind on disk, bf16, 2 micro-batches: the step stages the frozen base only, no
    gradient leaves the device and nothing is written to disk (the counting of
    tests/test_schedule.py over 2 real steps); the adapters still train."""
    from test_schedule import counted_steps

    cfg = _config(("q_proj", "o_proj", "up_proj"), num_hidden_layers=3, compute_dtype="bfloat16")
    opt = dataclasses.replace(OPT, clip_norm=1.0, lr=1e-3)
    store = make_store(cfg, make_optimizer(opt))
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), opt, StreamConfig(),
                          StoreConfig(**PLACEMENTS["all-disk"]), store=store, batch_shape=(BATCH, SEQ))
    s, accum = engine.plan(BATCH, SEQ, 2), 2
    t = s.traffic
    base = sum(parts.nbytes(parts.schema(cfg, p, "compute")) - s.part_bytes[p].trained for p in s.transfers)
    assert s.adapters and t.h2d_weights == base and t.d2h_grads == 0 and t.disk_write_bytes == 0
    assert t.disk_read == {"compute": base, "master": 0, "opt": 0, "grads": 0} and s.read_bytes == 0
    counts = counted_steps(engine, cfg.vocab_size, (accum, BATCH, SEQ), 2)
    assert {k: b for k, b in counts.bytes.items() if b} == {"h2d_weights": 2 * base, "h2d_tokens": 2 * t.h2d_tokens,
                                                             "disk_read.compute": 2 * base}
    start = treepath.flatten(model.init_params(cfg, seed=0))
    moved = [n for n, w in treepath.flatten(engine.params()).items() if lora.is_adapter(n) and n.endswith(lora.B)
             and not np.array_equal(np.asarray(w), np.asarray(start[n]))]
    assert len(moved) == 3 * 3  # every B (zero at the start) moved
    engine.close()
    store.close()


def test_adapters_are_the_only_trained_leaves_and_start_as_peft_draws_them():
    cfg = _config(("q_proj", "down_proj"))
    for p in parts.parts(cfg):
        for name, leaf in parts.leaves(cfg, p.name).items():
            assert (leaf.role == roles.TRAINED) == lora.is_adapter(name), name
    block = parts.leaves(cfg, "block.0")
    assert {n for n in block if lora.is_adapter(n)} == {
        f"{m}.lora_{ab}" for m in ("self_attn.q_proj", "mlp.down_proj") for ab in "ab"}
    assert block["mlp.down_proj.lora_a"].shape == (cfg.intermediate_size, 4)
    assert block["mlp.down_proj.lora_b"].shape == (4, cfg.hidden_size)
    params = model.init_params(cfg, seed=0)["blocks"][0]["mlp"]["down_proj"]
    bound = 1 / np.sqrt(cfg.intermediate_size)  # kaiming-uniform, a = sqrt(5)
    assert np.abs(params["lora_a"]).max() <= bound and np.abs(params["lora_a"]).max() > 0.9 * bound
    assert not np.asarray(params["lora_b"]).any()
    assert _config(rslora=True).lora.scale == 4.0 and _config().lora.scale == 2.0


@pytest.mark.parametrize("setting,words", [
    ("lora.rank=0", "lora.rank must be a positive integer"),
    ("lora.target_modules=qkv", "names no linear layer"),
    ("lora.dropout=1", "lora.dropout must be at least 0 and below 1"),
    ("lora.alpha=0", "lora.alpha must be a positive number")])
def test_bad_settings_are_one_line(setting, words):
    extra = [] if setting.startswith("lora.rank") else ["lora.rank=4"]
    with pytest.raises(ConfigError, match=words) as e:
        config.model_config(config.load(None, [setting, *extra]))
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("adapted", ["dense", pytest.param("moe-experts", marks=pytest.mark.slow)])
def test_peft_export_reloads_merges_and_imports_to_continue(make_store, tmp_path, adapted):
    """3 streamed steps; after 2 the store's adapters go out as PEFT's directory (PEFT
    loads them onto transformers with mtjax's logits), merged (transformers alone gives
    them), and back in as PEFT saves it, with the base checkpoint: the imported store's
    next step has the uninterrupted run's loss. On a Llama, and on a Qwen3-MoE with
    adapters on its routed experts (PEFT's target_parameters)."""
    import peft
    import torch
    import transformers

    import mtjax
    import mtjax.store
    from mtjax.store.hf_export import export_hf
    from mtjax.store.hf_import import import_hf

    cfg = (_config(("q_proj", "v_proj", "down_proj")) if adapted == "dense"
           else _moe_config(lora=lora.LoraConfig(rank=4, alpha=8.0, target_modules=EXPERT_TARGETS)))
    start = model.init_params(cfg, seed=0)
    batches = token_batches(cfg.vocab_size, (BATCH, SEQ), 3)
    store = make_store(cfg, make_optimizer(OPT))
    engine = StreamEngine(cfg, start, OPT, StreamConfig(), StoreConfig(), store=store)
    for batch in batches[:2]:
        engine.step(batch)
    engine.commit(2)
    trained = engine.params()
    uninterrupted = engine.step(batches[2])["loss"]
    engine.close()
    store.close()

    export_hf(tmp_path / "store", tmp_path / "adapter")
    export_hf(tmp_path / "store", tmp_path / "merged", merge=True)
    hf.save_params(cfg, start, tmp_path / "base")  # the base is frozen: the start's is the trained one's
    ids = torch.as_tensor(batches[2], dtype=torch.long)
    ours = np.asarray(mtjax.forward(cfg, trained, batches[2]))
    scale = np.abs(ours).max()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    reloaded.save_pretrained(tmp_path / "resaved")  # PEFT's own files: what the import below reads
    with torch.no_grad():
        loaded = reloaded(input_ids=ids).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(
            input_ids=ids).logits.numpy()
    assert np.abs(loaded - ours).max() <= 1e-5 * scale
    assert np.abs(merged - ours).max() <= 1e-5 * scale

    import_hf(tmp_path / "base", tmp_path / "again", compute_dtype="float32", adapter=tmp_path / "resaved")
    with mtjax.store.open(tmp_path / "again", writable=True) as again:
        assert again.config.lora == cfg.lora
        resumed = StreamEngine(again.config, None, OPT, StreamConfig(), StoreConfig(), store=again)
        assert resumed.step(batches[2])["loss"] == pytest.approx(uninterrupted, abs=1e-6)
        resumed.close()


def test_bad_exports_and_imports_are_one_line_and_write_nothing(make_store, tmp_path):
    import json

    from mtjax.store import adapters
    from mtjax.store.errors import StoreError
    from mtjax.store.hf_export import export_hf
    from mtjax.store.hf_import import import_hf

    plain = tiny_config(**ONE_KV_HEAD)
    make_store(plain).close()
    with pytest.raises(StoreError, match="has none") as e:  # --merge of a store without adapters
        export_hf(tmp_path / "store", tmp_path / "merged", merge=True)
    assert "\n" not in str(e.value) and not (tmp_path / "merged").exists()

    cfg = _config(("q_proj",))
    params = model.init_params(cfg)
    (tmp_path / "adapter").mkdir()
    adapters.write(cfg, lambda part: treepath.flatten(parts.part_params(params, part)), tmp_path / "adapter")
    wide = tiny_config(**{**ONE_KV_HEAD, "hidden_size": 48})
    hf.save_params(wide, model.init_params(wide), tmp_path / "wide")
    with pytest.raises(StoreError, match="another shape") as e:  # an adapter trained on another model
        import_hf(tmp_path / "wide", tmp_path / "imported", adapter=tmp_path / "adapter")
    assert "\n" not in str(e.value) and not (tmp_path / "imported").exists()
    peft_config = json.loads((tmp_path / "adapter" / adapters.CONFIG_FILE).read_text())
    (tmp_path / "adapter" / adapters.CONFIG_FILE).write_text(json.dumps({**peft_config, "target_modules": ["qkv"]}))
    with pytest.raises(StoreError, match="names no linear layer") as e:  # targets this model lacks
        import_hf(tmp_path / "wide", tmp_path / "imported", adapter=tmp_path / "adapter")
    assert "\n" not in str(e.value) and not (tmp_path / "imported").exists()

    from safetensors.numpy import load_file, save_file

    hf.save_params(plain, model.init_params(plain), tmp_path / "base")
    (tmp_path / "adapter" / adapters.CONFIG_FILE).write_text(json.dumps({**peft_config, "use_dora": True}))
    with pytest.raises(StoreError, match="use_dora=True") as e:  # more than plain LoRA
        import_hf(tmp_path / "base", tmp_path / "imported", adapter=tmp_path / "adapter")
    assert "\n" not in str(e.value) and not (tmp_path / "imported").exists()
    (tmp_path / "adapter" / adapters.CONFIG_FILE).write_text(json.dumps(peft_config))
    weights = tmp_path / "adapter" / adapters.WEIGHTS_FILE
    save_file({**load_file(weights), "base_model.model.lm_head.lora_A.weight": np.zeros((4, 32), np.float32)},
              weights)
    with pytest.raises(StoreError, match="tensors this model's adapters do not take") as e:  # an adapter on the head
        import_hf(tmp_path / "base", tmp_path / "imported", adapter=tmp_path / "adapter")
    assert "\n" not in str(e.value) and not (tmp_path / "imported").exists()


def test_the_progress_line_counts_the_trained_parameters():
    from mtjax import run

    cfg = _config(("q_proj",))  # per block A [32, 4] and B [4, 32]
    assert parts.trained_params(cfg) == 2 * (32 * 4 + 4 * 32)
    assert run._trained_text(cfg) == ", 512 of them trained (LoRA rank 4)"
    assert run._trained_text(tiny_config()) == ""


@pytest.mark.slow  # a training run in a subprocess
def test_a_run_with_adapters_ends_in_a_peft_directory(tmp_path):
    """`mtjax train --lora.rank=...`: the progress line counts the adapters, the run's
    final/ is PEFT's adapter directory, and `mtjax generate` samples base + adapters."""
    import json
    import os
    import subprocess
    import sys

    from conftest import TINY_MODEL_ARGS
    from mtjax.store import adapters

    def mtjax_cli(*args):
        return subprocess.run([sys.executable, "-m", "mtjax", *args], capture_output=True, text=True, cwd=tmp_path,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)

    run = mtjax_cli("train", *TINY_MODEL_ARGS, "--lora.rank=4", "--lora.target_modules=q_proj,v_proj",
                    "--data.seq_len=32", "--data.batch_size=2", "--run.steps=2", "--run.eval_every=0",
                    "--run.sample_tokens=4", "--run.dir=run")
    assert run.returncode == 0, run.stderr
    # per block q_proj: A [32, 4], B [4, 32]; v_proj: A [32, 4], B [4, 16]
    assert "of them trained (LoRA rank 4)" in run.stdout + run.stderr
    assert f"{2 * (256 + 128 + 64):,} of them trained" in run.stdout + run.stderr
    peft_config = json.loads((tmp_path / "run" / "final" / adapters.CONFIG_FILE).read_text())
    assert peft_config["r"] == 4 and peft_config["target_modules"] == ["q_proj", "v_proj"]
    assert (tmp_path / "run" / "final" / adapters.WEIGHTS_FILE).is_file()
    sample = mtjax_cli("generate", "run/store", "--tokenizer", "bytes", "--prompt", "Hi", "--tokens", "3")
    assert sample.returncode == 0, sample.stderr


# A Qwen3-MoE (tiny_moe_config: blocks 0 and 2 MoE, 7 experts, block 1 dense) with adapters
# on attention: the rest frozen (mtjax.lora: targets that PEFT would apply to the routed
# experts are refused).
MOE_TARGETS = ("q_proj", "v_proj", "o_proj")
# LoRA on the routed experts (target `experts`: PEFT's target_parameters on transformers'
# fused gate_up_proj and down_proj), beside attention's q_proj and o_proj.
EXPERT_TARGETS = ("q_proj", "o_proj", lora.EXPERTS)


def _moe_config(**overrides):
    from conftest import TINY_MOE

    return _config(MOE_TARGETS, **{**TINY_MOE, **ONE_KV_HEAD, **overrides})


def _moe_trains_as_peft(cfg, stream: StreamConfig, tmp_path, tolerance: float = 1e-4, moved: bool = False):
    """3 AdamW steps of MoE `cfg`'s adapters, streamed under `stream` and in PEFT (its
    ParamWrappers on every MoE block's fused expert tensors where `experts` is a target),
    from the same weights: the same losses, with the load-balancing term where the model
    has one; PEFT's adapters, each of ours within `tolerance` of it (`moved`: and moved
    from its start); the base unchanged. Returns (the engine's split blocks, PEFT's adapters)."""
    params = model.init_params(cfg, seed=0)
    peft_model = _peft_model(cfg, params, tmp_path)
    if cfg.lora.adapts_experts:
        assert sorted(_expert_wrappers(peft_model)) == [(b, m) for b in cfg.moe_layers
                                                        for m in sorted(lora.EXPERT_MODULES)]
    engine = StreamEngine(cfg, params, OPT, stream, StoreConfig(), batch_shape=(BATCH, SEQ))
    ours, theirs = _steps_beside_peft(cfg, engine, peft_model, output_router_logits=cfg.router_aux_loss_coef > 0)
    start = treepath.flatten(params)
    assert {n for n in ours if lora.is_adapter(n)} == set(theirs)
    for name, w in ours.items():
        if lora.is_adapter(name):
            assert _rel_error(w, theirs[name]) <= tolerance, name
            assert not moved or not np.array_equal(np.asarray(w), np.asarray(start[name])), name
        else:
            np.testing.assert_array_equal(np.asarray(w), np.asarray(start[name]), err_msg=name)
    engine.close()
    return engine.schedule.split, theirs


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [None, 3])
def test_lora_on_a_moe_family_equals_peft_with_expert_groups_or_not(group_size, tmp_path):
    """3 AdamW steps, the whole MoE blocks or split into groups of 3 experts: PEFT's losses
    (with the load-balancing term, output_router_logits) and adapters; the base unchanged."""
    split, theirs = _moe_trains_as_peft(_moe_config(), StreamConfig(keep_every=2, expert_group_size=group_size),
                                        tmp_path)
    assert bool(split) == (group_size is not None) and len(theirs) == 3 * 3 * 2


# Frozen leaves of split MoE blocks: LoRA's base, and freeze patterns that freeze a whole
# group's experts (block 0's 0-2), one expert of a group (block 2's expert 4: the group
# is differentiated, its gradient dropped) and the router part's attention; LoRA over an
# NF4 base (experts and router decoded inside the sub-parts' programs); LoRA on the routed
# experts, each expert's adapters trained in its group.
MOE_FROZEN = {"lora": {}, "lora-nf4": {"base_format": "nf4"},
              "lora-experts": {"lora": lora.LoraConfig(rank=4, alpha=8.0, target_modules=EXPERT_TARGETS)}, "freeze": {"lora": None, "freeze": (
    "block.0/mlp.experts.[012].*", "block.2/mlp.experts.4.*", "block.2/self_attn.*", "embed")}}


@pytest.mark.slow
@pytest.mark.parametrize("frozen", MOE_FROZEN)
def test_streamed_moe_with_frozen_leaves_and_expert_groups_equals_the_reference(frozen):
    cfg = _moe_config(**MOE_FROZEN[frozen])
    opt = dataclasses.replace(OPT, clip_norm=1.0, lr=1e-3)
    params = model.init_params(cfg, seed=1)
    engine = StreamEngine(cfg, params, opt, StreamConfig(keep_every=2, expert_group_size=3), StoreConfig(),
                          batch_shape=(BATCH, SEQ))
    assert engine.schedule.split == {0: ((0, 1, 2), (3, 4, 5), (6,)), 2: ((0, 1, 2), (3, 4, 5), (6,))}
    reference = ReferenceTrainer(cfg, params, opt)
    start = treepath.flatten(engine.params())  # an NF4 base's: decoded
    for batch in token_batches(cfg.vocab_size, (2, BATCH, SEQ), 5):
        assert engine.step(batch)["loss"] == pytest.approx(reference.step(batch)["loss"], abs=1e-5)
    streamed, expected = (treepath.flatten(p) for p in (engine.params(), reference.params))
    moved = 0
    # An expert that few tokens reach has a tiny adapter gradient, which AdamW turns into a
    # full-size update, rounding and all: the worst such B differs by ~2e-5 (whole blocks ~7e-6).
    tolerance = 1e-4 if frozen == "lora-experts" else 1e-5
    for name, w in streamed.items():
        assert _rel_error(w, expected[name]) <= (tolerance if lora.is_adapter(name) else 1e-5), name
        moved += not np.array_equal(np.asarray(w), np.asarray(start[name]))
    roles_of = {f"{p.name}/{n}": leaf.role for p in parts.parts(cfg) for n, leaf in parts.leaves(cfg, p.name).items()}
    assert moved == sum(r == roles.TRAINED for r in roles_of.values())  # every trained leaf moved, no frozen one
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("group_size", [None, 3])
def test_lora_on_the_routed_experts_equals_peft_with_expert_groups_or_not(group_size, tmp_path):
    """3 AdamW steps, whole MoE blocks or groups of 3 experts (each expert's adapters in its
    group): PEFT's losses and adapters (its lora_A [r E, in], lora_B [out, r E] per fused
    tensor), the base unchanged."""
    cfg = _moe_config(lora=lora.LoraConfig(rank=4, alpha=8.0, target_modules=EXPERT_TARGETS))
    split, theirs = _moe_trains_as_peft(cfg, StreamConfig(keep_every=2, expert_group_size=group_size), tmp_path,
                                        moved=True)
    assert bool(split) == (group_size is not None) and len(theirs) == 3 * 2 * 2 + 2 * 7 * 4


# The other families whose routed experts share the layer (transformers' fused gate_up_proj
# and down_proj), every block MoE: Mixtral (renormalised top-k), OLMoE (one norm over all
# of q's and k's heads), Qwen2-MoE (a gated shared expert, which `experts` leaves alone, as
# PEFT does); and DeepSeek-V3 (test_deepseek's: grouped routing with its correction bias,
# latent attention, block 0 dense), there with o_proj beside the experts.
EXPERT_FAMILIES = {
    "mixtral": dict(model_type="mixtral", qk_norm=False, norm_topk_prob=True, intermediate_size=24),
    "olmoe": dict(model_type="olmoe", qk_norm=False, qk_norm_full=True, intermediate_size=24),
    "qwen2_moe": dict(model_type="qwen2_moe", qk_norm=False, shared_expert_intermediate_size=40),
    "deepseek_v3": None,
}


@pytest.mark.slow
@pytest.mark.parametrize("family", EXPERT_FAMILIES)
def test_lora_on_the_routed_experts_of_other_moe_families_equals_peft(family, tmp_path):
    if family == "deepseek_v3":
        from test_deepseek import TINY_V3

        cfg = dataclasses.replace(TINY_V3, lora=lora.LoraConfig(rank=4, alpha=8.0, target_modules=("o_proj", lora.EXPERTS)))
    else:
        cfg = _moe_config(lora=lora.LoraConfig(rank=4, alpha=8.0, target_modules=EXPERT_TARGETS), num_hidden_layers=2,
                          moe_layers=(0, 1), **EXPERT_FAMILIES[family])
    # A rarely routed expert's tiny gradient, turned by AdamW into a full-size step:
    # Mixtral's worst A (block 0's expert 4) is 1.3e-4 off, every other leaf <= 7e-5.
    _, theirs = _moe_trains_as_peft(cfg, StreamConfig(keep_every=2), tmp_path, tolerance=2e-4)
    attention = len(cfg.lora.target_modules) - 1  # the targets beside `experts`, in every block
    experts = len(cfg.moe_layers) * cfg.num_experts * 2  # per MoE block: each expert's gate_up_proj and down_proj
    assert len(theirs) == 2 * (attention * cfg.num_hidden_layers + experts)


def test_peft_expert_factors_round_trip_and_give_peft_delta():
    """to_peft lays the experts' factors out as ParamWrapper reads them back (its
    get_delta_weight's einsum, written out here) and from_peft inverts it."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 6, 3)), rng.standard_normal((5, 3, 4))  # E 5, in 6, r 3, out 4
    lora_a, lora_b = lora.to_peft(a, b)
    per_a, per_b = lora_a.reshape(5, 3, 6), lora_b.reshape(4, 3, 5)  # PEFT's (E, r, in) and (out, r, E)
    np.testing.assert_allclose(np.einsum("ore,eri->eio", per_b, per_a), a @ b, rtol=1e-5)
    for got, want in zip(lora.from_peft(lora_a, lora_b, 5), (a, b)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("targets", [("q_proj", "up_proj"), ("all-linear",)])
def test_lora_refuses_ambiguous_targets_on_a_moe_model_in_one_line(targets):
    with pytest.raises(ConfigError, match="on this MoE model is ambiguous") as e:
        parts.check_roles(_moe_config(lora=lora.LoraConfig(rank=4, target_modules=targets)))
    assert "\n" not in str(e.value) and "o_proj" in str(e.value) and lora.EXPERTS in str(e.value)


def test_expert_targets_without_adaptable_experts_or_with_dropout_are_one_line():
    with pytest.raises(ConfigError, match="this model has none that take adapters") as e:
        parts.check_roles(_config((lora.EXPERTS,)))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="is not supported on llama4_text") as e:
        parts.check_roles(_moe_config(model_type="llama4_text", lora=lora.LoraConfig(rank=4, target_modules=EXPERT_TARGETS)))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="lora.dropout must be 0 with the target experts") as e:
        lora.LoraConfig(rank=4, dropout=0.1, target_modules=EXPERT_TARGETS)
    assert "\n" not in str(e.value)


# Dropout on the adapters' input (PEFT's lora_dropout), drawn from the run's seed.
DROPOUT = lora.LoraConfig(rank=4, alpha=8.0, dropout=0.25, target_modules=("q_proj", "o_proj", "up_proj"))


@pytest.mark.parametrize("keep_every", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_dropout_streamed_equals_the_reference_and_changes_the_update(keep_every):
    """5 steps of 2 micro-batches: the streamed engine (recompute groups of 2, or 1) drops
    what the reference drops (the same keys from seed, step, micro-batch and block), the
    updates differ from those without dropout, and another seed gives other updates."""
    cfg = _config(num_hidden_layers=3, lora=DROPOUT)
    opt = dataclasses.replace(OPT, clip_norm=1.0, lr=1e-3)
    params = model.init_params(cfg, seed=1)
    engine = StreamEngine(cfg, params, opt, StreamConfig(keep_every=keep_every), seed=7)
    reference = ReferenceTrainer(cfg, params, opt, seed=7)
    without = ReferenceTrainer(dataclasses.replace(cfg, lora=dataclasses.replace(DROPOUT, dropout=0.0)), params, opt)
    other = ReferenceTrainer(cfg, params, opt, seed=8)
    for batch in token_batches(cfg.vocab_size, (2, BATCH, SEQ), 5):
        assert engine.step(batch)["loss"] == pytest.approx(reference.step(batch)["loss"], abs=1e-5)
        without.step(batch), other.step(batch)
    streamed, expected = treepath.flatten(engine.params()), treepath.flatten(reference.params)
    plain, reseeded = treepath.flatten(without.params), treepath.flatten(other.params)
    for name, w in streamed.items():
        assert _rel_error(w, expected[name]) <= 1e-5, name
        if name.endswith(lora.B):  # B moves only by its gradient, which the dropped inputs change
            assert _rel_error(w, plain[name]) > 1e-3 and _rel_error(w, reseeded[name]) > 1e-3, name
    engine.close()


def test_dropout_leaves_evaluation_and_a_rate_of_0_as_they_were():
    cfg = _config(num_hidden_layers=2, lora=DROPOUT)
    params = model.init_params(cfg, seed=1)
    q_proj = params["blocks"][0]["self_attn"]["q_proj"]
    q_proj["lora_b"] = np.ones_like(q_proj["lora_b"])  # the adapter's output is not 0
    tokens = token_batches(cfg.vocab_size, (BATCH, SEQ), 1)[0]
    plain = dataclasses.replace(cfg, lora=dataclasses.replace(DROPOUT, dropout=0.0))
    np.testing.assert_array_equal(np.asarray(model.forward(cfg, params, tokens)),
                                  np.asarray(model.forward(plain, params, tokens)))  # no scope: nothing dropped
    x = np.ones((64, 32), np.float32)
    with lora.dropout_scope(lora.dropout_key(0, 0, 0, 0)):
        dropped = np.asarray(lora.dropped(x, 0.25))
        assert lora.dropped(x, 0.0) is x
    assert set(np.unique(dropped)) == {0.0, np.float32(1 / 0.75)} and 0.65 < (dropped > 0).mean() < 0.85


@pytest.mark.slow
@pytest.mark.parametrize("adapters", ["resident", "streamed"])
def test_a_one_copy_store_trains_and_resumes_adapters_over_a_base_on_disk(make_store, adapters):
    """Every kind on disk in one copy (each step commits itself, resident adapters brought
    from the device): 3 steps, reopen, 3 more equal the reference; the base's compute copy
    is carried, never rewritten."""
    import mtjax.store

    cfg = _config(("q_proj", "down_proj"))
    placement = StoreConfig(compute="disk", master="disk", opt="disk", copies=1)
    params = model.init_params(cfg, seed=0)
    store = make_store(cfg, make_optimizer(OPT), copies=1)
    engine = StreamEngine(cfg, params, OPT, StreamConfig(adapters=adapters), placement, store=store)
    reference = ReferenceTrainer(cfg, params, OPT)
    batches = token_batches(cfg.vocab_size, (BATCH, SEQ), 6)
    for batch in batches[:3]:
        assert engine.step(batch)["loss"] == pytest.approx(reference.step(batch)["loss"], abs=1e-6)
    root = store.root
    engine.close()
    store.close()
    with mtjax.store.open(root, writable=True) as again:
        resumed = StreamEngine(again.config, None, OPT, StreamConfig(adapters=adapters), placement, store=again,
                               step=3)
        for batch in batches[3:]:
            assert resumed.step(batch)["loss"] == pytest.approx(reference.step(batch)["loss"], abs=1e-6)
        streamed, expected = treepath.flatten(resumed.params()), treepath.flatten(reference.params)
        for name, w in streamed.items():
            assert _rel_error(w, expected[name]) <= 1e-5, name
        resumed.close()


def test_dropout_with_expert_groups_is_refused_in_one_line():
    from mtjax.errors import MtjaxError

    cfg = _moe_config(lora=dataclasses.replace(DROPOUT, target_modules=MOE_TARGETS))
    with pytest.raises(MtjaxError, match="lora.dropout > 0 does not run with MoE blocks split") as e:
        StreamEngine(cfg, model.init_params(cfg, seed=0), OPT, StreamConfig(expert_group_size=3),
                     batch_shape=(BATCH, SEQ))
    assert "\n" not in str(e.value)
