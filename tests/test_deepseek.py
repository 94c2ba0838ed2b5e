"""DeepSeek-V3 and V2 (mtjax.families.deepseek) beyond the parity of tests/test_hf_moe.py.

- Routing: mtjax's group-limited routers pick the experts and weights transformers'
  routers pick, on rows where one group is never chosen by any token and where V3's
  correction bias changes the picks.
- The correction bias is a buffer: no gradient, no optimizer state; five streamed AdamW
  steps (RAM, and disk with the MoE blocks split into expert groups) equal the in-memory
  reference and leave it bit for bit as it was.
- With `router_bias_update_rate` it moves by DeepSeek's auxiliary-loss-free rule (a numpy
  reference over three steps), streamed as in the reference, and a resumed run as an
  unbroken one.
- Decoding caches the latent and the rotary key per token, and the streamed sampler's
  greedy tokens equal transformers' `generate`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import hf_models
import mtjax
import mtjax.store
import parity
from mtjax import model, parts, roles, treepath
from mtjax.config import StoreConfig, StreamConfig
from mtjax.layers import registry
from mtjax.model_config import ConfigError, ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

from conftest import token_batches

EXPERTS, GROUPS, KEPT_GROUPS, K = 16, 4, 2, 3
BIAS = "mlp.gate.e_score_correction_bias"


def _router_case(version: str):
    """(transformers router, hidden rows [T, d]) with group 3 never chosen: its experts'
    logits are about -8 on every row (a constant feature the other experts ignore), and
    V3's bias for them lower than the others'."""
    common = dict(hidden_size=24, num_attention_heads=4, n_routed_experts=EXPERTS, n_group=GROUPS,
                  topk_group=KEPT_GROUPS, num_experts_per_tok=K, routed_scaling_factor=1.7)
    torch.manual_seed(0)
    if version == "v3":
        router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(
            transformers.DeepseekV3Config(**common, norm_topk_prob=True))
    else:
        router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(
            transformers.DeepseekV2Config(**common, topk_method="group_limited_greedy"))
    hidden = torch.randn(40, 24)
    hidden[:, 0] = 1.0
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        router.weight[:, 0] = 0.0
        router.weight[12:, 0] = -8.0
        if version == "v3":
            router.e_score_correction_bias.copy_(0.3 * torch.randn(EXPERTS))
            router.e_score_correction_bias[12:] -= 1.0  # not enough to lift group 3
    return router, hidden


def _ours(version: str, router, hidden, bias: bool = True):
    cfg = ModelConfig(model_type=f"deepseek_{version}", hidden_size=24, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=4, kv_lora_rank=8, qk_nope_head_dim=4, v_head_dim=4, num_experts=EXPERTS,
                      num_experts_per_tok=K, moe_intermediate_size=8, moe_layers=(0,), n_group=GROUPS,
                      topk_group=KEPT_GROUPS, routed_scaling_factor=1.7, norm_topk_prob=version == "v3")
    logits = jnp.asarray(hidden.numpy() @ router.weight.detach().numpy().T)
    correction = router.e_score_correction_bias.numpy() if version == "v3" and bias else None
    return registry.router(cfg.layer_specs[0].feed_forward.router).route(cfg, logits, correction)


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_grouped_routing_picks_transformers_experts_and_weights(version):
    router, hidden = _router_case(version)
    with torch.no_grad():
        _, their_weights, their_chosen = router(hidden)
    weights, chosen, _ = _ours(version, router, hidden)
    order, their_order = np.argsort(np.asarray(chosen), -1), their_chosen.argsort(-1).numpy()
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(chosen), order, -1),
                                  np.take_along_axis(their_chosen.numpy(), their_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(their_weights.numpy(), their_order, -1), rtol=1e-6)
    groups = np.asarray(chosen) // (EXPERTS // GROUPS)
    assert 3 not in groups and all(len(set(row)) <= KEPT_GROUPS for row in groups)  # group-limited, one never
    assert len(np.unique(groups)) == GROUPS - 1
    if version == "v3":  # the bias chooses: without it other experts are picked
        assert not np.array_equal(np.asarray(_ours(version, router, hidden, bias=False)[1]), np.asarray(chosen))


def test_a_group_count_that_does_not_divide_the_experts_is_one_clear_error():
    with pytest.raises(ConfigError, match="n_group") as e:
        ModelConfig(model_type="deepseek_v3", head_dim=4, kv_lora_rank=8, v_head_dim=4, num_experts=10,
                    num_experts_per_tok=2, moe_intermediate_size=8, moe_layers=(0,), n_group=4, topk_group=2)
    assert "\n" not in str(e.value)


# A tiny DeepSeek-V3: block 0 dense, blocks 1 and 2 of 8 experts in 4 groups with a shared
# expert, queries through a bottleneck; its correction bias drawn at random.
TINY_V3 = ModelConfig(model_type="deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=4, q_lora_rank=12,
                      kv_lora_rank=10, qk_nope_head_dim=6, v_head_dim=6, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=16, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, norm_topk_prob=True, moe_layers=(1, 2))
K_V3 = 2  # TINY_V3's experts per token
OPT = OptimConfig(lr=1e-3, clip_norm=0.05, weight_decay=0.1)


def _params():
    params = model.init_params(TINY_V3, seed=1)
    rng = np.random.default_rng(2)
    for i in TINY_V3.moe_layers:
        params["blocks"][i]["mlp"]["gate"]["e_score_correction_bias"] = jnp.asarray(rng.normal(0, 0.3, 8), jnp.float32)
    return params


@pytest.mark.slow  # the whole model's gradient
def test_the_correction_bias_is_a_buffer_with_no_gradient_or_optimizer_state():
    part = "block.1"
    leaf = parts.leaves(TINY_V3, part)[BIAS]
    assert leaf.role == roles.BUFFER and leaf.shape == (8,)
    assert BIAS in parts.schema(TINY_V3, part, "master") and BIAS not in parts.trained(TINY_V3, part)
    assert not any(n.endswith(BIAS) for n in parts.schema(TINY_V3, part, "opt", make_optimizer(OPT)))
    params = _params()
    tokens = jnp.asarray(token_batches(64, (2, 12), 1)[0])
    grads = jax.grad(lambda p: mtjax.loss_fn(TINY_V3, p, tokens, remat=False))(params)
    assert not np.any(np.asarray(grads["blocks"][1]["mlp"]["gate"]["e_score_correction_bias"]))
    assert np.any(np.asarray(grads["blocks"][1]["mlp"]["gate"]["kernel"]))


RATE = 1e-2  # router_bias_update_rate of the tests of DeepSeek's bias update


@pytest.mark.slow
# Frozen on disk (split router parts too, which differentiate the bias to zeros); the rule
# in RAM (whole blocks) and on disk (the router part sends it).
@pytest.mark.parametrize("tier, rate", [("disk", 0.0), ("ram", RATE), ("disk", RATE)])
def test_five_streamed_steps_equal_the_reference_and_leave_the_bias_as_it_was(make_store, tier, rate):
    """On the disk tier the MoE blocks are split into expert groups of 3 (forced). With a
    rate the bias moves by the rule, step by step as the reference moves it; without, it
    stays bit for bit as it was."""
    cfg = dataclasses.replace(TINY_V3, router_bias_update_rate=rate)
    # No rule input in the gradient norm: it too equals the reference's.
    run = parity.streamed_and_reference(make_store, cfg, _params(), OPT, tier, metrics=("loss", "grad_norm"))
    if tier == "disk":
        assert run.split == {1: ((0, 1, 2), (3, 4, 5), (6, 7)), 2: ((0, 1, 2), (3, 4, 5), (6, 7))}
    for name, w in run.streamed.items():
        if name.endswith(BIAS) and not rate:
            np.testing.assert_array_equal(np.asarray(w), np.asarray(run.initial[name]), err_msg=name)
        elif name.endswith(BIAS):
            np.testing.assert_array_equal(np.asarray(w), np.asarray(run.expected[name]), err_msg=name)
            assert not np.array_equal(np.asarray(w), np.asarray(run.initial[name])), name
        else:
            assert parity.rel(w, run.expected[name]) <= 1e-5, name
            assert not np.array_equal(np.asarray(w), np.asarray(run.initial[name])), name


@pytest.mark.slow  # three reference steps and their router counts
def test_the_bias_update_is_deepseeks_rule_over_the_steps_expert_loads():
    """Three reference steps of two micro-batches: after each, bias += rate * sign(mean
    load - load) per MoE layer, the loads counted over both micro-batches (a numpy
    reference of the rule, from the router's picks before the step). Rate 0 (frozen): the
    streamed test above."""
    cfg = dataclasses.replace(TINY_V3, router_bias_update_rate=RATE)
    trainer = ReferenceTrainer(cfg, _params(), OPT)
    stats_of = jax.jit(lambda params, tokens: model.hidden_stats(cfg, params, tokens)[1])
    initial = {i: np.asarray(_params()["blocks"][i]["mlp"]["gate"]["e_score_correction_bias"]) for i in cfg.moe_layers}
    want = dict(initial)
    for batch in token_batches(64, (2, 2, 12), 3):
        loads = {i: np.zeros(8, np.int64) for i in cfg.moe_layers}
        for tokens in batch:
            for i, s in zip(cfg.moe_layers, stats_of(trainer.params, tokens)):
                loads[i] += np.asarray(s["counts"]).astype(np.int64)
        for i, load in loads.items():
            assert load.sum() == 2 * 2 * 12 * K_V3
            want[i] = want[i] + np.float32(RATE) * np.sign(load.mean() - load).astype(np.float32)
        trainer.step(batch)
    for i in cfg.moe_layers:
        got = np.asarray(trainer.params["blocks"][i]["mlp"]["gate"]["e_score_correction_bias"])
        np.testing.assert_array_equal(got, want[i])
        assert not np.array_equal(got, initial[i])


def test_a_bias_update_rate_on_a_model_without_the_bias_is_refused_in_one_line():
    v2 = dataclasses.replace(TINY_V3, model_type="deepseek_v2", moe_router="softmax_group_topk",
                             router_bias_update_rate=RATE)
    with pytest.raises(ConfigError, match="router_bias_update_rate") as e:
        parts.check_roles(v2)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # three stores' worth of streamed steps
def test_a_resumed_run_updates_the_bias_as_an_unbroken_one(tmp_path):
    """A one-copy store closed right after committing step 2, its update (with the bias's
    rule input) pending: a new engine on it applies that update and a third step exactly
    as an unbroken run of three steps."""
    cfg = dataclasses.replace(TINY_V3, router_bias_update_rate=RATE)
    disk = StoreConfig(compute="disk", master="disk", opt="disk")
    batches = token_batches(64, (2, 2, 12), 3)

    def train(name: str, steps: int):
        store = mtjax.store.create(tmp_path / name, cfg, make_optimizer(OPT), copies=1)
        engine = StreamEngine(cfg, _params(), OPT, StreamConfig(keep_every=1), disk, store=store)
        start = engine.updater.start
        engine.updater.start = lambda: None if engine.step_count == steps else start()  # dies after the commit
        engine.commit(0)
        for batch in batches[:steps]:
            engine.step(batch)
        return engine, store

    broken, store = train("broken", 2)
    broken.close()
    store.close()
    with mtjax.store.open(tmp_path / "broken", writable=True) as store:
        engine = StreamEngine(cfg, optim=OPT, store_config=disk, store=store, step=2)
        engine.step(batches[2])
        resumed = treepath.flatten(engine.params())
        engine.close()
    clean, store = train("clean", 3)
    unbroken = treepath.flatten(clean.params())
    clean.close()
    store.close()
    for name, w in unbroken.items():
        np.testing.assert_array_equal(np.asarray(resumed[name]), np.asarray(w), err_msg=name)
    initial = treepath.flatten(_params())
    assert all(not np.array_equal(np.asarray(unbroken[n]), np.asarray(initial[n])) for n in unbroken if n.endswith(BIAS))


def test_decoding_keeps_the_latent_and_the_rotary_key_per_token():
    spec = TINY_V3.layer_specs[0]
    state = registry.mixer(spec).decode_state(TINY_V3, spec, 2, 32)
    assert {n: s.shape for n, s in state.items()} == {"latent": (2, 32, 10), "rope_key": (2, 32, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("family, overrides", [
    ("deepseek_v3", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                              mscale=0.9, mscale_all_dim=0.7, rope_theta=10000.0))),
    ("deepseek_v2", dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
])
def test_cached_greedy_decoding_equals_transformers_generate(family, overrides, tmp_path):
    ckpt, torch_model = hf_models.checkpoint(tmp_path, family, num_hidden_layers=3, num_key_value_heads=4,
                                             initializer_range=0.2, **overrides)
    parity.assert_greedy_decoding_equals_generate(ckpt, torch_model, tmp_path)


@pytest.mark.slow  # two tiny transformers checkpoints
def test_the_multi_token_prediction_layer_is_left_out_with_one_line(tmp_path, capsys):
    """The hub's V3 and R1 hold a layer past num_hidden_layers (model.layers.61): mtjax
    leaves it out, saying so in one line; a V2 checkpoint with one is refused."""
    from safetensors.numpy import load_file, save_file

    from mtjax import hf

    for family in ("deepseek_v3", "deepseek_v2"):
        ckpt, _ = hf_models.checkpoint(tmp_path / family, family, num_key_value_heads=4)
        file = ckpt / hf.SINGLE_FILE
        tensors = load_file(str(file))
        _, plain = mtjax.load_params(ckpt)
        capsys.readouterr()
        mtp = {f"model.layers.2.{n}": np.ones((4, 4), np.float32) for n in ("eh_proj.weight", "enorm.weight")}
        save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
        if family == "deepseek_v2":
            with pytest.raises(hf.CheckpointError, match="unexpected: model.layers.2.eh_proj.weight"):
                mtjax.load_params(ckpt)
            continue
        _, params = mtjax.load_params(ckpt)
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1 and "layers 2 are its multi-token-prediction module" in lines[0]
        assert "(2 tensors): left out" in lines[0]
        for (name, a), b in zip(treepath.flatten(params).items(), treepath.flatten(plain).values()):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_the_planner_prices_latent_attention_by_its_own_widths():
    """Useful work: QK^T at qk_nope + rope (10) and AV at v (6) per head over the causal
    half; executed: both at the padded width (10) over every key."""
    spec = TINY_V3.layer_specs[0]
    entry = registry.mixer(spec)
    assert entry.flops(TINY_V3, spec, 2, 8, executed=False) == 2.0 * 2 * 8 * 4 * (10 + 6) * 4.5
    assert entry.flops(TINY_V3, spec, 2, 8, executed=True) == 2.0 * 2 * 8 * 4 * 20 * 8


def _quantized(weight: torch.Tensor):
    """(e4m3 weight, weight_scale_inv) of an fp32 weight in blocks of 128 x 128, as the
    hub's V3 stores it: each block scaled by its largest magnitude over e4m3's 448."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -cols % 128, 0, -rows % 128))
    blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [row blocks, col blocks]
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale


def test_fp8_weights_are_read_as_transformers_dequantizes_them(tmp_path):
    """An e4m3 weight of 300 x 260 (blocks cut short on both axes) beside its scales, and a
    bf16 one: the reader names the weights only and reads the FP8 one as transformers'
    own dequantization gives it, bit for bit."""
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from mtjax import hf

    torch.manual_seed(0)
    weight, scale = _quantized(torch.randn(300, 260))
    plain = torch.randn(5, 7).to(torch.bfloat16)
    save_file({"a.weight": weight, "a.weight_scale_inv": scale, "b.weight": plain}, str(tmp_path / hf.SINGLE_FILE))
    reader = hf.SafetensorsReader(tmp_path)
    assert sorted(reader.names()) == ["a.weight", "b.weight"] and reader.dtype("a.weight") == "F32"
    want = _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32).numpy()
    got = reader.read("a.weight")
    assert got.dtype == np.float32 and not np.array_equal(got, weight.float().numpy())  # the scales were applied
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(reader.read("b.weight").astype(np.float32), plain.float().numpy())


@pytest.mark.slow  # a tiny transformers checkpoint
def test_an_fp8_checkpoint_imports_dequantized_and_exports_unquantized(tmp_path):
    """A tiny V3 whose projections and experts are stored FP8 with quantization_config
    set, as the hub's: its params are the dequantized weights, and the export's
    config.json has no quantization_config."""
    import json

    from safetensors.torch import load_file, save_file

    from mtjax import hf

    ckpt, _ = hf_models.checkpoint(tmp_path, "deepseek_v3", num_key_value_heads=4)
    tensors = load_file(str(ckpt / hf.SINGLE_FILE))
    stored = {}
    for name, t in tensors.items():
        if t.ndim == 2 and (".self_attn." in name or ".experts." in name):
            stored[name], stored[name + "_scale_inv"] = _quantized(t)
        else:
            stored[name] = t
    save_file(stored, str(ckpt / hf.SINGLE_FILE), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(config))
    cfg, params = mtjax.load_params(ckpt)
    assert "quantization_config" not in dict(cfg.extra_hf)
    reader = hf.SafetensorsReader(ckpt)
    quantized = [n for n in stored if n.endswith("_scale_inv")]
    assert len(quantized) > 20
    for spec in hf.layout(cfg):
        np.testing.assert_array_equal(hf.from_tree(spec, params), reader.read(spec.hf_name), err_msg=spec.hf_name)
    mtjax.save_params(cfg, params, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
