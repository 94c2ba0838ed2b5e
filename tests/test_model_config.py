"""ModelConfig from and to Hugging Face ``config.json``: both dialects, errors, round trips."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

import hf_models
import mtjax
from mtjax import model
from mtjax.model_config import CHUNKED, FULL, SLIDING, SUPPORTED_MODEL_TYPES, ConfigError, ModelConfig, RopeScaling

LLAMA3_SCALING = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}

# What a Llama 3.1 config.json looks like in the wild (transformers 4.x).
OLD_STYLE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "hidden_act": "silu", "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": [2, 3],
    "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_SCALING), "torch_dtype": "bfloat16",
}


def new_style(old: dict) -> dict:
    """The same config as transformers 5.x writes it: rope_parameters and dtype."""
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new["rope_parameters"] = {"rope_theta": old["rope_theta"], **(old.get("rope_scaling") or {"rope_type": "default"})}
    new["dtype"] = old["torch_dtype"]
    return new


def test_old_and_new_config_dialects_give_equal_configs():
    old, new = mtjax.from_hf_dict(OLD_STYLE), mtjax.from_hf_dict(new_style(OLD_STYLE))
    assert old == new
    assert old.rope_theta == 500000.0 and old.param_dtype == "bfloat16"
    assert old.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert old.head_dim == 8 and old.tie_word_embeddings and old.num_key_value_heads == 2


def test_legacy_type_key_and_torch_prefixed_dtype():
    hf = dict(OLD_STYLE, rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype="torch.float16")
    cfg = mtjax.from_hf_dict(hf)
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0
    assert cfg.param_dtype == "float16"


def test_default_rope_in_either_dialect_means_no_scaling():
    old = dict(OLD_STYLE, rope_scaling=None, rope_theta=10000.0)
    for hf in (old, new_style(old)):
        cfg = mtjax.from_hf_dict(hf)
        assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


# transformers' Phi-3 takes no other scaling than longrope (and reads its factor from the contexts' ratio).
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [2.0, 3.0, 4.0, 6.0]}


@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_transformers_written_config_json_loads(family, tmp_path):
    scaling = {"rope_type": "linear", "factor": 3.0} if family != "phi3" else dict(PHI3_LONGROPE)
    extra = dict(original_max_position_embeddings=32, max_position_embeddings=96) if family == "phi3" else {}
    hf_cfg = hf_models.hf_config(family, rope_parameters={**scaling, "rope_theta": 1234.0}, **extra)
    hf_cfg.save_pretrained(tmp_path)
    cfg = mtjax.load_hf_config(tmp_path)
    assert cfg.model_type == hf_models.MODEL_TYPE[family]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 4, 2)
    assert cfg.head_dim == 8
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling.factor == 3.0
    assert cfg.rope_scaling.rope_type == scaling["rope_type"]
    assert cfg == mtjax.load_hf_config(tmp_path / "config.json")


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(OLD_STYLE, model_type="gpt2")))
    for build in (lambda: mtjax.load_hf_config(tmp_path), lambda: ModelConfig(model_type="gpt2")):
        with pytest.raises(ConfigError) as err:
            build()
        message = str(err.value)
        assert "gpt2" in message and "\n" not in message
        assert all(t in message for t in SUPPORTED_MODEL_TYPES)


def test_heads_not_divisible_by_kv_heads_is_a_config_error():
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        mtjax.from_hf_dict(dict(OLD_STYLE, num_attention_heads=8, num_key_value_heads=3))
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        ModelConfig(num_attention_heads=6, num_key_value_heads=4)


@pytest.mark.parametrize("change, match", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "dynamic"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, clip_qkv=8.0), "clip_qkv"),
    (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2), "moe_intermediate_size"),
    (dict(model_type="llama4_text", layer_types=["chunked_attention"] * 3, attention_chunk_size=0),
     "attention_chunk_size"),
    (dict(model_type="llama4_text", moe_layers=[0, 3]), "moe_layers"),
    (dict(model_type="llama4_text", floor_scale=0), "floor_scale must be positive"),
    (dict(model_type="llama4_text", router_jitter_noise=0.1), "router_jitter_noise"),
])
def test_unusable_config_json_is_one_clear_config_error(change, match):
    hf = {k: v for k, v in {**OLD_STYLE, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        mtjax.from_hf_dict(hf)


def test_missing_or_malformed_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        mtjax.load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        mtjax.load_hf_config(tmp_path)


def test_config_errors_are_mtjax_errors():
    assert issubclass(ConfigError, mtjax.errors.MtjaxError)


def test_sliding_window_layer_types_per_family():
    base = dict(OLD_STYLE, num_hidden_layers=4, sliding_window=16, tie_word_embeddings=False)
    assert mtjax.from_hf_dict(dict(base, model_type="mistral")).layer_types == (SLIDING,) * 4
    assert mtjax.from_hf_dict(dict(base, model_type="mistral", sliding_window=None)).layer_types == (FULL,) * 4
    # Qwen2 ignores the window unless use_sliding_window; then layers >= max_window_layers slide.
    off = mtjax.from_hf_dict(dict(base, model_type="qwen2"))
    assert off.layer_types == (FULL,) * 4 and off.sliding_window is None
    on = mtjax.from_hf_dict(dict(base, model_type="qwen2", use_sliding_window=True, max_window_layers=1))
    assert on.layer_types == (FULL, SLIDING, SLIDING, SLIDING) and on.sliding_window == 16


GEMMA = dict(hidden_act="gelu_pytorch_tanh", rms_norm_offset=True, embed_scale=True, sandwich_norms=True,
             rms_norm_eps=1e-6, tie_word_embeddings=True)

# Consistent configs of every family and feature (Qwen2 always has q/k/v biases and
# Qwen3 always q/k norm, so those flags are part of the family).
ROUND_TRIP = {
    "llama-default": ModelConfig(),
    "llama3-tied-bf16": ModelConfig(
        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        tie_word_embeddings=True, param_dtype="bfloat16", num_key_value_heads=1),
    "llama-linear-biases": ModelConfig(
        rope_scaling=RopeScaling("linear", 2.0), attention_bias=True, o_proj_bias=True, mlp_bias=True),
    "mistral-window": ModelConfig(model_type="mistral", sliding_window=7, layer_types=(SLIDING, SLIDING)),
    "mistral-no-window": ModelConfig(model_type="mistral"),
    "qwen2": ModelConfig(model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen2-mixed-sliding": ModelConfig(
        model_type="qwen2", attention_bias=True, num_hidden_layers=3, sliding_window=5,
        layer_types=(FULL, SLIDING, SLIDING)),
    "qwen3": ModelConfig(model_type="qwen3", qk_norm=True, head_dim=32),
    "qwen3-biases": ModelConfig(model_type="qwen3", qk_norm=True, attention_bias=True, o_proj_bias=True),
    "qwen2-yarn": ModelConfig(model_type="qwen2", attention_bias=True, rope_scaling=RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=512, truncate=False, mscale=1.1, mscale_all_dim=0.9)),
    "phi3-tied": ModelConfig(model_type="phi3", tie_word_embeddings=True),
    "phi3-window": ModelConfig(model_type="phi3", sliding_window=7, layer_types=(SLIDING, SLIDING)),
    "phi4-mini-longrope-partial": ModelConfig(
        model_type="phi3", partial_rotary_factor=0.75, rope_scaling=RopeScaling(
            "longrope", 32.0, original_max_position_embeddings=64, short_factor=(1.0, 1.5, 2.0, 2.5, 3.0, 4.0),
            long_factor=(2.0, 3.0, 4.0, 6.0, 8.0, 9.0))),
    "mixtral": ModelConfig(model_type="mixtral", intermediate_size=24, num_experts=5, num_experts_per_tok=2,
                           moe_intermediate_size=24, norm_topk_prob=True, router_aux_loss_coef=0.02, moe_layers=(0, 1)),
    "qwen2-moe-shared": ModelConfig(model_type="qwen2_moe", attention_bias=True, num_experts=6, num_experts_per_tok=2,
                                    moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                    router_aux_loss_coef=0.001, moe_layers=(0, 1)),
    "qwen3-moe-dense-1": ModelConfig(model_type="qwen3_moe", qk_norm=True, num_hidden_layers=3, num_experts=6,
                                     num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                                     router_aux_loss_coef=0.001, moe_layers=(0, 2)),
    "olmoe": ModelConfig(model_type="olmoe", qk_norm_full=True, intermediate_size=24, num_experts=6,
                         num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.01, moe_layers=(0, 1)),
    "llama4-text": ModelConfig(model_type="llama4_text", intermediate_size=40, num_hidden_layers=3, num_experts=5,
                               num_experts_per_tok=1, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                               moe_layers=(0, 2), no_rope_layers=(2,), layer_types=(CHUNKED, CHUNKED, FULL),
                               attention_chunk_size=7, qk_l2_norm=True, attn_temperature_tuning=True,
                               floor_scale=3.0, temperature_scale=0.25, rope_theta=500000.0),
    "gemma2": ModelConfig(model_type="gemma2", **GEMMA, query_pre_attn_scalar=5.0, attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0, sliding_window=4, layer_types=(SLIDING, FULL)),
    "gemma2-no-caps-all-global": ModelConfig(model_type="gemma2", **GEMMA, query_pre_attn_scalar=16.0),
    "gemma3": ModelConfig(model_type="gemma3_text", **GEMMA, qk_norm=True, query_pre_attn_scalar=16.0,
                          rope_theta=1e6, rope_scaling=RopeScaling("linear", 8.0), local_rope_theta=1e4,
                          num_hidden_layers=6, sliding_window=512, layer_types=(SLIDING,) * 5 + (FULL,)),
}


@pytest.mark.parametrize("cfg", list(ROUND_TRIP.values()), ids=list(ROUND_TRIP))
def test_to_hf_dict_round_trips(cfg):
    hf = mtjax.to_hf_dict(cfg)
    assert mtjax.from_hf_dict(json.loads(json.dumps(hf))) == cfg


@pytest.mark.parametrize("cfg", list(ROUND_TRIP.values()), ids=list(ROUND_TRIP))
def test_transformers_reads_to_hf_dict_as_mtjax_does(cfg):
    """transformers' own parse of our config.json describes the same architecture."""
    hf_cfg = transformers.AutoConfig.for_model(**mtjax.to_hf_dict(cfg))
    assert type(hf_cfg).__name__.lower().startswith(cfg.model_type.replace("_", ""))  # qwen2_moe: Qwen2MoeConfig
    back = mtjax.from_hf_dict(hf_cfg.to_dict())
    assert dataclasses.replace(back, extra_hf=()) == dataclasses.replace(cfg, extra_hf=())
    assert hf_cfg.head_dim == cfg.head_dim
    assert (getattr(hf_cfg, "sliding_window", None) or None) == cfg.sliding_window  # Qwen2-MoE says 0 for none


@pytest.mark.parametrize("family", sorted(hf_models.FAMILIES))
def test_round_trip_keeps_the_other_keys_of_a_transformers_config(family):
    hf = json.loads(hf_models.hf_config(family, tie_word_embeddings=True).to_json_string())
    cfg = mtjax.from_hf_dict(hf)
    again = mtjax.to_hf_dict(cfg)
    assert mtjax.from_hf_dict(again) == cfg
    if family in ("gemma3", "llama4", "qwen3_5"):  # multimodal: the other keys are its language model's
        hf = dict(hf["text_config"], transformers_version=hf["transformers_version"])
    for key in ("bos_token_id", "eos_token_id", "hidden_act", "transformers_version"):
        assert again.get(key) == hf.get(key), key


def test_mixed_sliding_config_also_states_max_window_layers():
    """Readers that predate `layer_types` derive the sliding layers from max_window_layers."""
    hf = mtjax.to_hf_dict(ROUND_TRIP["qwen2-mixed-sliding"])
    assert hf["max_window_layers"] == 1 and hf["use_sliding_window"]
    legacy = {k: v for k, v in hf.items() if k != "layer_types"}
    assert mtjax.from_hf_dict(legacy) == ROUND_TRIP["qwen2-mixed-sliding"]


GEMMA3_OLD = {  # a gemma-3 text config.json as transformers 4.x wrote it
    "model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
    "query_pre_attn_scalar": 32, "sliding_window": 512, "sliding_window_pattern": 6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


def test_gemma3_old_and_per_layer_type_rope_dialects_agree():
    new = {k: v for k, v in GEMMA3_OLD.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling",
                                                             "sliding_window_pattern")}
    new["rope_parameters"] = {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                              SLIDING: {"rope_type": "default", "rope_theta": 10000.0}}
    new["layer_types"] = ([SLIDING] * 5 + [FULL]) * 2
    old_cfg, new_cfg = mtjax.from_hf_dict(GEMMA3_OLD), mtjax.from_hf_dict(new)
    assert old_cfg == dataclasses.replace(new_cfg, extra_hf=old_cfg.extra_hf)
    assert old_cfg.layer_types == ((SLIDING,) * 5 + (FULL,)) * 2  # five sliding to one global
    assert (old_cfg.rope_theta, old_cfg.rope_scaling) == (1e6, RopeScaling("linear", 8.0))
    assert (old_cfg.local_rope_theta, old_cfg.local_rope_scaling) == (1e4, None)
    assert old_cfg.qk_norm and old_cfg.attn_scale == 32**-0.5 and old_cfg.final_logit_softcapping is None
    # What transformers 5 makes of the old dialect is what mtjax makes of it.
    hf5 = transformers.Gemma3TextConfig(**GEMMA3_OLD).to_dict()
    assert dataclasses.replace(mtjax.from_hf_dict(hf5), extra_hf=()) == dataclasses.replace(old_cfg, extra_hf=())


def test_multimodal_gemma3_config_gives_its_language_model_with_transformers_defaults():
    """The 4B-27B checkpoints' text_config lists only what differs from transformers' defaults."""
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
          "eos_token_id": [1, 106], "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                                                     "intermediate_size": 10240, "num_hidden_layers": 34,
                                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                                     "sliding_window": 1024},
          "vision_config": {"model_type": "siglip_vision_model"}}
    cfg = mtjax.from_hf_dict(hf)
    assert cfg.model_type == "gemma3_text" and cfg.param_dtype == "bfloat16"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert cfg.tie_word_embeddings and cfg.attn_scale == 256**-0.5
    assert cfg.layer_types.count(FULL) == 5 and cfg.layer_types[5] == FULL and cfg.sliding_window == 1024
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert dict(cfg.extra_hf)["eos_token_id"] == (1, 106)
    assert "vision_config" not in mtjax.to_hf_dict(cfg)


def test_gemma2_defaults_alternate_layers_and_cap_unless_null():
    hf = {"model_type": "gemma2", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
          "head_dim": 16, "vocab_size": 128, "intermediate_size": 96}
    cfg = mtjax.from_hf_dict(hf)
    assert cfg.layer_types == (SLIDING, FULL, SLIDING, FULL) and cfg.sliding_window == 4096
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    off = mtjax.from_hf_dict(dict(hf, attn_logit_softcapping=None, final_logit_softcapping=None))
    assert (off.attn_logit_softcapping, off.final_logit_softcapping) == (None, None)


@pytest.mark.parametrize("change, match", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "gelu"),
    (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
])
def test_unusable_gemma_config_is_one_clear_config_error(change, match):
    with pytest.raises(ConfigError, match=match) as err:
        mtjax.from_hf_dict({**GEMMA3_OLD, **change})
    assert "\n" not in str(err.value)


def test_llama4_layers_follow_transformers_rules():
    """Unlisted, NoPE every no_rope_layer_interval-th layer, chunked RoPE layers, MoE every
    interleave_moe_layer_step-th; a listed moe_layers wins over the step; Llama 4 trains
    without a load-balancing term (as Llama4ForCausalLM), its coefficient kept for export."""
    hf = dict(model_type="llama4_text", vocab_size=64, hidden_size=32, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=24, intermediate_size_mlp=40,
              num_local_experts=4, interleave_moe_layer_step=2, no_rope_layer_interval=3, attention_chunk_size=16,
              router_aux_loss_coef=0.01)
    cfg = mtjax.from_hf_dict(hf)
    assert cfg.no_rope_layers == (2, 5) and cfg.moe_layers == (1, 3, 5, 7)
    assert cfg.layer_types == tuple(FULL if i in (2, 5) else CHUNKED for i in range(8))
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (40, 24, 24)
    assert cfg.router_aux_loss_coef == 0 and mtjax.to_hf_dict(cfg)["router_aux_loss_coef"] == 0.01
    assert mtjax.from_hf_dict(dict(hf, moe_layers=[0, 6])).moe_layers == (0, 6)
    assert set(mtjax.from_hf_dict(dict(hf, attention_chunk_size=None)).layer_types) == {FULL}
    theirs = transformers.Llama4TextConfig(**hf)
    assert tuple(theirs.moe_layers) == cfg.moe_layers and tuple(theirs.layer_types) == cfg.layer_types
    assert tuple(i for i, rope in enumerate(theirs.no_rope_layers) if not rope) == cfg.no_rope_layers


HF_CONFIGS = sorted((Path(__file__).parent.parent / "experiments" / "hf_configs").glob("*.json"))


@pytest.mark.parametrize("path", HF_CONFIGS, ids=lambda p: p.stem)
def test_shipped_hf_configs_count_the_parameters_transformers_does(path):
    """Every shipped config.json: mtjax's parameter count (what MFU and the planner use) is
    transformers' own, counted on the meta device (nothing allocated); a multimodal config
    counts its language model. The active count (what a token computes with) is the total
    less (E - k) / E of each of transformers' fused expert modules."""
    hf_cfg = transformers.AutoConfig.from_pretrained(path).get_text_config()
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = mtjax.load_hf_config(path)
    total = sum(p.numel() for p in theirs.parameters())
    assert model.num_params(cfg) == total
    experts = [m for name, m in theirs.named_modules() if name.endswith(("mlp.experts", "feed_forward.experts"))]
    k = getattr(hf_cfg, "num_experts_per_tok", 0)
    unused = sum(sum(p.numel() for p in m.parameters()) // m.num_experts * (m.num_experts - k) for m in experts)
    assert len(experts) == len(cfg.moe_layers) and model.num_active_params(cfg) == total - unused
