"""Tiny random Hugging Face models of every supported family, built offline.

Every 1-D parameter (norm weights, biases) is perturbed away from its initial value so
that a missing bias or norm in mtjax shows up as a mismatch, and so is DeepSeek-V3's
routing bias (a buffer), so that routing without it picks other experts.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# A vision tower as small as SigLIP allows: the multimodal Gemma 3's import leaves it out.
TINY_VISION = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                   num_attention_heads=2, image_size=28, patch_size=14)


def _gemma3_multimodal(**text):
    """Gemma3ForConditionalGeneration's config: the text model's keys, a tiny vision tower;
    transformers ties the embeddings by the top-level flag."""
    return transformers.Gemma3Config(text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4,
                                     tie_word_embeddings=text.get("tie_word_embeddings", True))


# Llama 4's vision tower, as small: the multimodal Llama 4's import leaves it out.
TINY_LLAMA4_VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                          projector_output_dim=16)


def _llama4_multimodal(**text):
    """Llama4ForConditionalGeneration's config: the text model's keys, a tiny vision tower."""
    return transformers.Llama4Config(text_config=text, vision_config=TINY_LLAMA4_VISION,
                                     tie_word_embeddings=text.get("tie_word_embeddings", False))


# The linear_* sizes of a tiny Qwen3-Next / Qwen3.5 (odd on purpose) and RoPE over half
# of each head; its layers delta-net, gated attention, delta-net, ... (layer i % 3 == 1 attention).
TINY_DELTA_NET = dict(linear_key_head_dim=6, linear_value_head_dim=5, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_conv_kernel_dim=3, head_dim=8)


def _delta_net(config_class, **text):
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 0])
    kinds = ["full_attention" if i % 3 == 1 else "linear_attention" for i in range(text["num_hidden_layers"])]
    return config_class(**{**TINY_DELTA_NET, "rope_parameters": rope, "layer_types": kinds, **text})


def _qwen3_5_multimodal(**text):
    """Qwen3_5ForConditionalGeneration's config: the text model's keys, a tiny vision tower."""
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=2, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    return transformers.Qwen3_5Config(text_config=_delta_net(transformers.Qwen3_5TextConfig, **text).to_dict(),
                                      vision_config=vision,
                                      tie_word_embeddings=text.get("tie_word_embeddings", False))


FAMILIES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "phi3": transformers.Phi3Config,
    "mixtral": transformers.MixtralConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "olmoe": transformers.OlmoeConfig,
    "gemma2": transformers.Gemma2Config,
    "gemma3_text": transformers.Gemma3TextConfig,
    "gemma3": _gemma3_multimodal,
    "llama4_text": transformers.Llama4TextConfig,
    "llama4": _llama4_multimodal,
    "deepseek_v2": transformers.DeepseekV2Config,
    "deepseek_v3": transformers.DeepseekV3Config,
    "gpt_oss": transformers.GptOssConfig,
    "qwen3_next": lambda **kw: _delta_net(transformers.Qwen3NextConfig, **kw),
    "qwen3_5_text": lambda **kw: _delta_net(transformers.Qwen3_5TextConfig, **kw),
    "qwen3_5_moe_text": lambda **kw: _delta_net(transformers.Qwen3_5MoeTextConfig, **kw),
    "qwen3_5": _qwen3_5_multimodal,
}
# What mtjax calls each family's model (a multimodal checkpoint is imported as its text model).
MODEL_TYPE = {**{f: f for f in FAMILIES}, "gemma3": "gemma3_text", "llama4": "llama4_text", "qwen3_5": "qwen3_5_text"}
# The model classes of multimodal families (the others are AutoModelForCausalLM's).
MULTIMODAL = {"llama4": transformers.Llama4ForConditionalGeneration,
              "qwen3_5": transformers.Qwen3_5ForConditionalGeneration}

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA ratio 2
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def hub_names(family: str, tensors: dict) -> dict:
    """transformers 5's in-memory tensors (experts fused [E, ...]) under the names its
    save_pretrained writes: one tensor per expert, Mixtral's MoE as block_sparse_moe.w1/w2/w3
    (but Llama 4's, saved fused)."""
    if family.startswith("llama4") or family == "gpt_oss":  # saved fused, as they are in memory
        return dict(tensors)
    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix:
            out[name.replace(".mlp.", ".block_sparse_moe.") if family == "mixtral" else name] = t
            continue
        if family == "mixtral":
            prefix = prefix.replace(".mlp", ".block_sparse_moe")
        gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(t.shape[0]):
            if leaf == "gate_up_proj":
                half = t.shape[1] // 2
                out[f"{prefix}.experts.{e}.{gate}.weight"] = t[e, :half]
                out[f"{prefix}.experts.{e}.{up}.weight"] = t[e, half:]
            else:
                out[f"{prefix}.experts.{e}.{down}.weight"] = t[e]
    return out


def hf_config(family: str, **overrides):
    kwargs = {**BASE, **overrides}
    if family in ("qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gemma3", "llama4_text", "llama4"):
        kwargs.setdefault("head_dim", 8)  # transformers' defaults are 128 and 256
    if family.startswith("llama4"):  # its defaults are Scout's widths, 16 experts and chunks of 8192
        kwargs = dict(dict(intermediate_size_mlp=40, num_local_experts=5,
                           attention_chunk_size=5, floor_scale=3, attn_scale=0.3), **kwargs)
    if family.startswith("gemma"):
        # Odd on purpose: a scale of head_dim ** -0.5 or a window of 4096 would pass unseen.
        kwargs.setdefault("query_pre_attn_scalar", 5)
        kwargs.setdefault("sliding_window", 5)
    if family.startswith("deepseek"):  # latent attention: odd widths, the rotary part head_dim 8
        kwargs = dict(dict(kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10,
                           moe_intermediate_size=24, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
                           first_k_dense_replace=1, n_group=4, topk_group=2), **kwargs)
        if family == "deepseek_v3":
            kwargs.setdefault("q_lora_rank", 14)
    if family == "gpt_oss":  # its defaults: 128 experts, a window of 128, yarn over 4096 positions
        kwargs = dict(dict(head_dim=8, num_local_experts=16, sliding_window=3,
                           rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                                beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0)),
                      **kwargs)
    if family == "phi3":  # its defaults name token ids beyond this vocabulary
        kwargs = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None, **kwargs)
    return FAMILIES[family](**kwargs)


def build(family: str, seed: int = 0, **overrides):
    """A random fp32 transformers causal LM with perturbed 1-D parameters."""
    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    model_class = MULTIMODAL.get(family, transformers.AutoModelForCausalLM)
    model = model_class.from_config(cfg, attn_implementation="eager", dtype=torch.float32) \
        if model_class is transformers.AutoModelForCausalLM else \
        model_class._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            # Delta-net decay rates A in [0.05, 1] (transformers draws [0.01, 16]): faster decays
            # make A_log's gradient a sum that cancels to fp32 noise on both sides.
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: enough to change picks
            if name.endswith("e_score_correction_bias"):
                b.add_(0.3 * torch.randn_like(b))
    return model.eval()


def save(model, out_dir: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return Path(out_dir)


def checkpoint(tmp_path: Path, family: str = "llama", sharded: bool = False, seed: int = 0, **overrides):
    """(checkpoint dir, torch model) for a tiny random model of `family`."""
    model = build(family, seed=seed, **overrides)
    out = save(model, Path(tmp_path) / f"{family}-ckpt", "20KB" if sharded else None)
    return out, model
