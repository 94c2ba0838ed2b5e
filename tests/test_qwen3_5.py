"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (mtjax.families.qwen3_5) against transformers.

Tiny random transformers models (odd linear_* sizes, two value heads per key head, a
convolution of 3, RoPE over half of each head; delta-net, gated attention, delta-net;
1-D parameters perturbed) are saved with `save_pretrained` and loaded by mtjax; in fp32,
over rows of 131 tokens (three chunks of the delta rule's 64, the last one partial) and
128 (two whole chunks): logits, the loss with the load-balancing term, every gradient,
and export bit for bit, reloaded by transformers. A multimodal Qwen3.5 checkpoint gives
its language model, the rest left out with one line. Packed rows equal their documents
run one by one in the reference and the engine (transformers' torch path leaks state
across documents, so the reference is mtjax's own document alone); five AdamW steps
streamed equal the reference; cached greedy decoding equals transformers' generate.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import hf_models
import mtjax
import parity
from mtjax import documents, hf, model, parts, treepath
from mtjax.batch import Batch
from mtjax.layers import registry
from mtjax.model_config import from_hf_dict
from mtjax.optim import OptimConfig
from mtjax.reference import loss_fn, loss_terms
from mtjax.stream import StreamEngine

from test_documents import alone, packed_row

BATCH = 2
MOE = dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
           router_aux_loss_coef=0.05)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    family: str
    overrides: dict
    seq: int
    moe_layers: tuple[int, ...] = ()


CASES = [
    Case("qwen3.5-131", "qwen3_5_text", dict(num_hidden_layers=3), 131),
    Case("qwen3.5-128", "qwen3_5_text", dict(num_hidden_layers=3, tie_word_embeddings=True), 128),
    Case("qwen3.5-moe-131", "qwen3_5_moe_text", dict(num_hidden_layers=3, **MOE), 131, (0, 1, 2)),
    # Qwen3-Next: fused per-key-head projections, layer 1 dense (mlp_only_layers).
    Case("qwen3-next-131", "qwen3_next", dict(num_hidden_layers=3, mlp_only_layers=[1], **MOE), 131, (0, 2)),
]


_RUNS: dict[str, parity.HfRun] = {}


@pytest.fixture(params=CASES, ids=[c.id for c in CASES])
def case(request, tmp_path_factory) -> tuple[Case, parity.HfRun]:
    c: Case = request.param
    if c.id not in _RUNS:
        _RUNS[c.id] = parity.hf_run(tmp_path_factory.mktemp(c.id), c.family, c.overrides, (BATCH, c.seq),
                                    router_logits=bool(c.moe_layers))
    return c, _RUNS[c.id]


@pytest.mark.slow
def test_the_checkpoint_is_the_case_asked_for(case):
    c, r = case
    kinds = [spec.mixer.kind for spec in r.cfg.layer_specs]
    assert kinds == ["gated_delta_net", "softmax_attention", "gated_delta_net"]
    assert r.cfg.moe_layers == c.moe_layers and r.cfg.rotary_dim == 4 and r.cfg.rms_norm_offset
    assert all(spec.mixer.grouped == (c.family == "qwen3_next") for spec in r.cfg.layer_specs if spec.mixer.kind ==
               "gated_delta_net")


@pytest.mark.slow
def test_logits_match(case):
    _, r = case
    logits = np.asarray(mtjax.forward(r.cfg, r.params, jnp.asarray(r.tokens)))
    scale = np.abs(r.hf_logits).max()
    assert np.abs(logits - r.hf_logits).max() <= 1e-5 * scale


@pytest.mark.slow
def test_loss_matches_with_the_load_balancing_term(case):
    c, r = case
    loss, aux = loss_terms(r.cfg, r.params, jnp.asarray(r.tokens), remat=False)
    assert abs(float(loss) - r.hf_loss) <= 1e-6 * abs(r.hf_loss), (float(loss), r.hf_loss)
    if c.moe_layers:
        assert r.cfg.router_aux_loss_coef * float(aux) > 1e-3 * r.hf_loss  # the term is not negligible here


@pytest.mark.slow
def test_every_gradient_matches(case):
    _, r = case
    checked = parity.assert_gradients_match(r.cfg, r.params, r.tokens, r.hf_grads)
    assert {"model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
            "model.layers.0.linear_attn.conv1d.weight", "model.layers.2.linear_attn.norm.weight"} <= set(checked)


@pytest.mark.slow
def test_export_is_bit_exact_and_reloads_in_transformers(case, tmp_path):
    _, r = case
    parity.assert_export_bit_exact(r, tmp_path, r.tokens[:, :70])


@pytest.mark.slow
def test_the_multimodal_release_gives_its_language_model(tmp_path, capsys):
    """Qwen3_5ForConditionalGeneration's checkpoint (language model under its prefix, a
    vision tower): the text model imported, one line on what was left out, exported as a
    Qwen3_5ForCausalLM with the language model's tensors bit for bit."""
    ckpt, torch_model = hf_models.checkpoint(tmp_path, "qwen3_5", num_hidden_layers=3)
    cfg, params = mtjax.load_params(ckpt)
    said = capsys.readouterr().out
    assert cfg.model_type == "qwen3_5_text" and "vision tower" in said and said.count("\n") == 1
    tokens = np.random.default_rng(1).integers(0, hf_models.BASE["vocab_size"], (1, 70))
    with torch.no_grad():
        want = torch_model(input_ids=torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(mtjax.forward(cfg, params, jnp.asarray(tokens)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    mtjax.save_params(cfg, params, tmp_path / "out")
    source = hf.SafetensorsReader(ckpt)
    ours = load_file(str(tmp_path / "out" / hf.SINGLE_FILE))
    assert set(ours) == set(source.names())
    assert all(ours[n].tobytes() == source.read(n).tobytes() for n in ours)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                                 dtype=torch.float32)
    assert type(reloaded).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        again = reloaded(input_ids=torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(again - want).max() <= 1e-6 * np.abs(want).max()  # another class around the same language model


@pytest.mark.slow
def test_the_multi_token_prediction_weights_are_left_out_with_one_line(tmp_path, capsys):
    from safetensors.numpy import save_file

    ckpt, _ = hf_models.checkpoint(tmp_path, "qwen3_next", num_hidden_layers=3, **MOE)
    tensors = load_file(str(ckpt / hf.SINGLE_FILE))
    tensors.update({"mtp.fc.weight": np.ones((32, 64), np.float32), "mtp.norm.weight": np.ones(32, np.float32)})
    save_file(tensors, str(ckpt / hf.SINGLE_FILE), metadata={"format": "pt"})
    cfg, params = mtjax.load_params(ckpt)
    said = capsys.readouterr().out
    assert "multi-token-prediction module (mtp.*, 2 tensors): left out" in said and said.count("\n") == 1
    assert cfg.model_type == "qwen3_next"


# --- packed documents, streaming, decoding: mtjax's own tiny models ------------------


def tiny(family: str, **overrides) -> mtjax.ModelConfig:
    return from_hf_dict(hf_models.hf_config(family, num_hidden_layers=3, linear_conv_kernel_dim=4,
                                            **overrides).to_dict())


DENSE = tiny("qwen3_5_text")
SEQ, LENGTHS = 160, (70, 5, 60, 20)  # documents across a chunk's end, inside one, at one's start
OPT = OptimConfig(lr=1e-3, clip_norm=0.05, weight_decay=0.1)


def _params(cfg, seed: int) -> dict:
    """Fresh parameters, the delta-nets' decay rates A in [0.05, 1] (see tests/hf_models.py)."""
    params = model.init_params(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for i in cfg.delta_net_layers:
        mixer = params["blocks"][i]["self_attn"]
        mixer["A_log"] = np.log(rng.uniform(0.05, 1.0, mixer["A_log"].shape)).astype(np.float32)
    return params


@pytest.fixture(scope="module")
def dense_params():
    return _params(DENSE, 1)


@pytest.mark.slow
def test_packed_documents_equal_each_document_alone(dense_params):
    """In the reference and the engine (its summed gradients as they leave the device):
    loss 1e-6, gradients 1e-5. And with the documents' starts ignored they would not."""
    fn = jax.jit(jax.value_and_grad(lambda p, i: loss_fn(DENSE, p, i.tokens, False, i.segments, i.targets)))
    tokens, segments, docs = packed_row(DENSE.vocab_size, LENGTHS, SEQ)
    for j, doc in enumerate(docs, start=1):
        want_loss, want_grads = fn(dense_params, documents.step_inputs(alone(doc, SEQ))[0].micro(0))
        packed = Batch(tokens, segments == j, segments)
        loss, grads = fn(dense_params, documents.step_inputs(packed)[0].micro(0))
        assert abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss)), j
        errors = {n: parity.rel(g, treepath.flatten(want_grads)[n]) for n, g in treepath.flatten(grads).items()}
        assert max(errors.values()) <= 1e-5, (j, max(errors.items(), key=lambda e: e[1]))
        if j == 3:  # the engine, on the document that starts inside a chunk after two others
            engine = StreamEngine(DENSE, dense_params, OPT)
            got, add = {}, engine.grads.add
            engine.grads.add = lambda part, g, *rest: (got.__setitem__(part, jax.device_get(g)), add(part, g, *rest))[1]
            try:
                assert abs(engine.step(packed)["loss"] - float(want_loss)) <= 1e-6 * abs(float(want_loss))
            finally:
                engine.close()
            for name, g in got.items():
                want = treepath.flatten(parts.part_params(want_grads, name))
                assert max(parity.rel(g[n], w) for n, w in want.items()) <= 1e-5, name
    leaky, _ = fn(dense_params, documents.step_inputs(Batch(tokens, segments == 3))[0].micro(0))
    assert abs(float(leaky) - float(loss)) > 1e-3 * abs(float(loss))  # one row, no starts: the state leaks


MOE_CFG = tiny("qwen3_5_moe_text", **dict(MOE, num_experts=8))


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_five_streamed_steps_equal_the_reference(make_store, tier):
    """Accumulating 2 micro-batches; on the disk tier the MoE blocks split into expert groups of 3."""
    run = parity.streamed_and_reference(make_store, MOE_CFG, _params(MOE_CFG, 2), OPT, tier)
    if tier == "disk":
        assert set(run.split) == {0, 1, 2}
    for name, w in run.streamed.items():
        assert parity.rel(w, run.expected[name]) <= 1e-5, name
        assert not np.array_equal(np.asarray(w), np.asarray(run.initial[name])), name


def test_the_decode_state_is_the_conv_window_and_the_rule_state():
    spec = DENSE.layer_specs[0]
    state = registry.mixer(spec).decode_state(DENSE, spec, 2, 999)
    assert {n: s.shape for n, s in state.items()} == {"conv": (2, 3, 2 * 2 * 6 + 4 * 5), "recurrent": (2, 4, 6, 5)}


def test_the_planner_prices_the_delta_net_by_its_own_linear_flops():
    """The planner's and MFU's FLOPs ask the mixer's registry entry: the delta-net's grow
    linearly with the row, softmax attention's quadratically."""
    from mtjax.plan import cost

    delta, attention = DENSE.layer_specs[0], DENSE.layer_specs[1]
    mixer = lambda spec, seq: cost.block_forward_flops(DENSE, spec, 0, 1, seq)  # no parameters: the mixer's own
    assert mixer(delta, 4096) == pytest.approx(4 * mixer(delta, 1024)) and mixer(delta, 1024) > 0
    assert mixer(attention, 4096) == pytest.approx(16 * mixer(attention, 1024))
    per_token = lambda seq: cost.mfu_flops_per_token(DENSE, seq)
    assert per_token(8192) - per_token(4096) == pytest.approx(3 * (mixer(attention, 8192) / 8192 - mixer(attention, 4096) / 4096))


def test_rows_split_over_devices_repeat_the_delta_rules_scan_on_every_device_in_the_plan():
    """With stream.split: sequence over N devices each runs its share of a block, but the
    delta rule's scan over the whole row (mtjax.layers.delta_net): the plan's FLOPs per
    device exceed those of the rows split over the same devices (1/N of one device's) by
    (N - 1) / N of the scan's, per token and value head the scores times u (2 c dv) and
    the state's reads and write (6 dk dv), in each of its 4 passes (forward, recompute,
    backward); softmax attention's and the useful work (model FLOPs) stay split."""
    from mtjax.config import StoreConfig, StreamConfig
    from mtjax.plan import BUILTIN, cost
    from mtjax.stream.step_bytes import StepShape

    n, shape = 4, StepShape(4, 1024, 1)
    by = {split: cost.estimate(DENSE, StreamConfig(devices=n, split=split, remat="full"), StoreConfig(), shape,
                               BUILTIN["h200"]) for split in ("batch", "sequence")}
    c, dk, dv = 64, DENSE.linear_key_head_dim, DENSE.linear_value_head_dim
    scan = shape.batch * shape.seq * DENSE.linear_num_value_heads * (2 * c * dv + 6 * dk * dv)
    deltas = sum(type(spec.mixer).__name__ == "GatedDeltaNet" for spec in DENSE.layer_specs)
    per_device = {split: plan.flops / n for split, plan in by.items()}
    assert per_device["sequence"] - per_device["batch"] == pytest.approx(4 * deltas * scan * (n - 1) / n)
    assert by["sequence"].model_flops == by["batch"].model_flops
    attention, split = DENSE.layer_specs[1], dataclasses.replace(DENSE, sequence_devices=n)
    assert cost.block_forward_flops(split, attention, 0, 2, 1024) == cost.block_forward_flops(DENSE, attention, 0, 2,
                                                                                              1024)


@pytest.mark.slow
@pytest.mark.parametrize("family, overrides", [("qwen3_5_text", {}), ("qwen3_next", dict(MOE, mlp_only_layers=[1]))])
def test_cached_greedy_decoding_equals_transformers_generate(family, overrides, tmp_path):
    ckpt, torch_model = hf_models.checkpoint(tmp_path, family, num_hidden_layers=3, initializer_range=0.2,
                                             **overrides)
    parity.assert_greedy_decoding_equals_generate(ckpt, torch_model, tmp_path)


@pytest.mark.slow
def test_shipped_chat_finetune_config_trains_two_steps(tmp_path, monkeypatch):
    """experiments/qwen3.5-small-chat-finetune.yaml through `mtjax train` as shipped, but for
    a narrower model of the same family (its hf config with the sizes cut), the repository's
    chat sample and the Qwen2 tokenizer (with its chat template) of tests/data: two steps of
    chat fine-tuning, packed documents and the loss mask included, give finite losses."""
    import json
    import math
    import shutil

    from mtjax import cli

    root = Path(__file__).parents[1]
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(root / "tests/data/qwen2", tokenizer)
    shipped = json.loads((root / "experiments/hf_configs/qwen3.5-small.json").read_text())
    small = dict(shipped, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, layer_types=shipped["layer_types"][:4])
    (tmp_path / "small.json").write_text(json.dumps(small))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", str(root / "experiments/qwen3.5-small-chat-finetune.yaml"),
                     f"--model.hf_config={tmp_path / 'small.json'}",
                     f"--data.dataset={root / 'tests/data/kjv-chat-24.jsonl'}", f"--data.tokenizer={tokenizer}",
                     "--data.seq_len=64", "--data.batch_size=2", "--data.grad_accum=1", "--run.steps=2",
                     "--run.dir=run", "--run.eval_every=0", "--run.checkpoint_every=2"]) == 0
    losses = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert set(losses) >= {1, 2} and all(math.isfinite(v) for v in losses.values()), losses
