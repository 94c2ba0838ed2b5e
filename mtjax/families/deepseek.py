"""DeepSeek-V3 / R1 (`deepseek_v3`) and DeepSeek-V2 / V2-Lite / Coder-V2 (`deepseek_v2`).

Every layer's mixer is multi-head latent attention (mtjax.layers.latent); the first
`first_k_dense_replace` layers have a dense MLP, the others a mixture of
`n_routed_experts` experts with `n_shared_experts` ungated shared ones (one MLP of their
summed width, `shared_experts` in the checkpoint), routed group-limited
(mtjax.moe.route_grouped): V3 by sigmoid scores with a correction bias, V2 by softmax
(`topk_method` "greedy" is one group). As transformers computes them: no load-balancing
loss is added, V2 ignores `norm_topk_prob`, RoPE turns interleaved pairs (V3 where
`rope_interleave` says, V2 always), and the latents' norms use epsilon 1e-6.
V3 checkpoints' multi-token-prediction layer (model.layers.61 of the hub's V3 and R1) is
left out on import with one line (`Family.trailing_layers`).
`num_key_value_heads` is kept as written (transformers needs it equal to the heads) and
read by nothing: every head has its own keys and values, expanded from the latent.
"""

from __future__ import annotations

import dataclasses

from mtjax.families import hf_config
from mtjax.families.hf_config import FULL, ConfigError
from mtjax.families.registry import Family, register
from mtjax.layers.spec import LatentAttention

# The keys both read besides the Llama-shaped ones (`hf_config.COMMON_KEYS`).
_KEYS = frozenset({
    "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
    "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "n_group", "topk_group",
    "num_experts_per_tok", "first_k_dense_replace",
    "quantization_config",  # FP8 weights are dequantized on import (mtjax.fp8): an export is not quantized
})


def _fields(hf: dict, known: frozenset) -> dict:
    """The fields both families read alike."""
    quant = hf.get("quantization_config")
    if quant and (quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3"
                  or list(quant.get("weight_block_size") or ()) != [128, 128]):
        raise ConfigError(f"quantization_config {quant} is not supported; mtjax reads FP8 e4m3 weights in blocks "
                          "of 128 x 128 (DeepSeek-V3's) or unquantized ones")
    layers = int(hf["num_hidden_layers"])
    rope_dim = int(hf["qk_rope_head_dim"])
    fields = hf_config.read_common(hf, (FULL,) * layers, known=_KEYS | known, head_dim=rope_dim)
    experts = int(hf.get("n_routed_experts") or 0)
    width = int(hf["moe_intermediate_size"]) if experts else 0
    first_moe = int(hf.get("first_k_dense_replace") or 0)
    return dict(fields, head_dim=rope_dim,
                q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=int(hf["kv_lora_rank"]),
                qk_nope_head_dim=int(hf["qk_nope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
                moe_intermediate_size=width,
                shared_expert_intermediate_size=width * int(hf.get("n_shared_experts") or 0),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                moe_layers=tuple(range(first_moe, layers)) if experts else ())


def _to_hf(cfg) -> dict:
    width = cfg.moe_intermediate_size
    return dict(hf_config.write_common(cfg), attention_bias=cfg.attention_bias, qk_rope_head_dim=cfg.head_dim,
                q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
                n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=width,
                n_shared_experts=cfg.shared_expert_intermediate_size // width if width else 0,
                routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group, topk_group=cfg.topk_group,
                first_k_dense_replace=min(cfg.moe_layers) if cfg.moe_layers else cfg.num_hidden_layers)


def v3_from_hf(hf: dict) -> dict:
    return dict(_fields(hf, frozenset({"norm_topk_prob", "rope_interleave"})),
                n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                rope_interleaved=bool(hf.get("rope_interleave", True)))


def v3_to_hf(cfg) -> dict:
    return dict(_to_hf(cfg), norm_topk_prob=cfg.norm_topk_prob, rope_interleave=cfg.rope_interleaved)


def v2_from_hf(hf: dict) -> dict:
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"topk_method {method!r} is not supported for deepseek_v2; "
                          "use greedy or group_limited_greedy")
    grouped = method == "group_limited_greedy"
    # V2's router ignores norm_topk_prob: the key stays in extra_hf, read by nothing.
    return dict(_fields(hf, frozenset({"topk_method"})), n_group=int(hf["n_group"]) if grouped else 1,
                topk_group=int(hf["topk_group"]) if grouped else 1)


def v2_to_hf(cfg) -> dict:
    return dict(_to_hf(cfg), mlp_bias=cfg.mlp_bias,
                topk_method="group_limited_greedy" if cfg.n_group > 1 else "greedy")


def layer_specs(cfg) -> tuple:
    """Every layer latent attention; MoE or dense as `moe_layers` says (V3's and V2's router)."""
    return tuple(dataclasses.replace(spec, mixer=LatentAttention()) for spec in cfg.derived_layer_specs())


def validate(cfg) -> None:
    if cfg.kv_lora_rank <= 0 or cfg.v_head_dim <= 0:
        raise ConfigError(f"{cfg.model_type} needs a positive kv_lora_rank ({cfg.kv_lora_rank}) and v_head_dim "
                          f"({cfg.v_head_dim})")
    if cfg.mlp_bias:
        raise ConfigError(f"mlp_bias is not supported for {cfg.model_type} (its experts have none); set it to false")
    if cfg.moe_layers and cfg.moe_router == "sigmoid_group_topk" and cfg.num_experts // cfg.n_group < 2:
        raise ConfigError(f"n_group ({cfg.n_group}) leaves fewer than 2 of {cfg.num_experts} experts per group; "
                          "DeepSeek-V3's group score is the sum of a group's best two")


def checkpoint_names(module: list[str]) -> list[str]:
    """The shared experts are one MLP named `shared_experts`."""
    return ["mlp", "shared_experts", *module[2:]] if module[:2] == ["mlp", "shared_expert"] else module


register(Family("deepseek_v2", "DeepseekV2ForCausalLM", v2_from_hf, v2_to_hf,
                defaults={"moe_router": "softmax_group_topk", "rope_interleaved": True},
                validate=validate, layer_specs=layer_specs, checkpoint_names=checkpoint_names))
register(Family("deepseek_v3", "DeepseekV3ForCausalLM", v3_from_hf, v3_to_hf,
                defaults={"moe_router": "sigmoid_group_topk", "rope_interleaved": True},
                validate=validate, layer_specs=layer_specs, checkpoint_names=checkpoint_names,
                trailing_layers="multi-token-prediction module (num_nextn_predict_layers)"))
