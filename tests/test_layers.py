"""Layer specs (mtjax.layers.spec) and the registry of layer kinds (mtjax.layers.registry):
what a config's layers are made of, and that the planner, the MFU line and the sampler
take a layer's FLOPs and decode state from its mixer's entry."""

import dataclasses
from pathlib import Path

import pytest

from mtjax import model  # noqa: F401 - registers the built-in kinds
from mtjax.errors import MtjaxError
from mtjax.layers import registry
from mtjax.layers.spec import DenseMLP, LayerSpec, MoE, Rope, SoftmaxAttention
from mtjax.model_config import CHUNKED, FULL, SLIDING, RopeScaling, load_hf_config
from mtjax.plan.cost import block_forward_flops, mfu_flops_per_token

from conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent


def test_a_config_says_what_each_layer_is_made_of():
    """Gemma 3: sliding layers with their own rope base, soft-capped, sandwich norms; Llama 4:
    chunked RoPE MoE layers with a sigmoid router and L2 q/k norm, full NoPE layers with
    query temperature."""
    gemma = tiny_config(model_type="gemma3_text", num_hidden_layers=3, layer_types=(SLIDING, SLIDING, FULL),
                        sliding_window=4, rope_theta=1e6, rope_scaling=RopeScaling("linear", 8.0),
                        local_rope_theta=1e4, attn_logit_softcapping=50.0, sandwich_norms=True,
                        hidden_act="gelu_pytorch_tanh")
    local, full = gemma.block_specs
    assert gemma.layer_specs == (local, local, full)
    assert local.mixer == SoftmaxAttention(window=4, softcap=50.0) and local.rope == Rope(1e4, None)
    assert full.mixer == SoftmaxAttention(softcap=50.0) and full.rope == Rope(1e6, RopeScaling("linear", 8.0))
    assert local.norms.sandwich and local.feed_forward == DenseMLP()
    llama4 = tiny_config(model_type="llama4_text", num_hidden_layers=2, layer_types=(CHUNKED, FULL),
                         attention_chunk_size=8, no_rope_layers=(1,), moe_layers=(0,), num_experts=4,
                         num_experts_per_tok=1, moe_intermediate_size=16, qk_l2_norm=True,
                         attn_temperature_tuning=True)
    chunked, nope = llama4.layer_specs
    assert chunked == LayerSpec(SoftmaxAttention(chunk=8, qk_l2_norm=True), MoE(router="sigmoid_topk"),
                                Rope(10000.0))
    assert nope == LayerSpec(SoftmaxAttention(temperature=True), DenseMLP(), None)
    assert (chunked.label, nope.label) == ("attention_chunk8_moe", "attention_nope_dense")


def test_equal_layers_share_one_spec_and_specs_are_static_arguments():
    cfg = tiny_config(num_hidden_layers=4)
    assert len(cfg.block_specs) == 1 and len({hash(s) for s in cfg.layer_specs}) == 1
    assert dataclasses.replace(cfg).layer_specs == cfg.layer_specs  # a fresh config, equal specs


def test_the_planner_and_mfu_count_a_mixer_by_its_registry_entry(monkeypatch):
    """Pricing asks the mixer's entry: a changed entry changes the planner's block FLOPs and
    the MFU figure by exactly its own FLOPs; the built-in one equals the usual convention."""
    cfg = load_hf_config(ROOT / "experiments/hf_configs/gemma-2-27b.json")
    seq, spec = 4096, cfg.layer_specs[0]
    # The usual MFU convention: 6 per parameter, 12 x layers x seq x heads x head_dim.
    width = cfg.num_attention_heads * cfg.head_dim
    usual = 6.0 * model.num_active_params(cfg) + 12.0 * cfg.num_hidden_layers * seq * width
    assert mfu_flops_per_token(cfg, seq) == pytest.approx(usual, rel=1e-12)
    plain = block_forward_flops(cfg, spec, 1000, 2, seq)
    entry = registry.MIXERS[SoftmaxAttention.kind]
    monkeypatch.setitem(registry.MIXERS, SoftmaxAttention.kind,
                        dataclasses.replace(entry, flops=lambda cfg, spec, batch, seq, executed: 7.0 * batch * seq))
    assert block_forward_flops(cfg, spec, 1000, 2, seq) == 2.0 * 1000 * 2 * seq + 7.0 * 2 * seq != plain
    assert mfu_flops_per_token(cfg, seq) == pytest.approx(6.0 * model.num_active_params(cfg)
                                                          + 3 * 7.0 * cfg.num_hidden_layers)


def test_the_decode_state_is_the_mixers():
    cfg = tiny_config(num_hidden_layers=2, compute_dtype="bfloat16")
    state = registry.mixer(cfg.layer_specs[0]).decode_state(cfg, cfg.layer_specs[0], 1, 32)
    assert {n: (s.shape, str(s.dtype)) for n, s in state.items()} == {
        "k": ((1, 32, 2, 8), "bfloat16"), "v": ((1, 32, 2, 8), "bfloat16")}


def test_an_unregistered_kind_is_one_clear_error():
    @dataclasses.dataclass(frozen=True)
    class Unknown:
        kind = "no_such_mixer"

    with pytest.raises(MtjaxError, match="no mixer kind 'no_such_mixer' is registered; known: gated_delta_net, latent_attention, softmax_attention"):
        registry.mixer(LayerSpec(Unknown(), DenseMLP()))
