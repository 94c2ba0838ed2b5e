"""Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5_text`) and Qwen3.5-MoE (`qwen3_5_moe_text`),
and the last two's multimodal releases (`qwen3_5`, `qwen3_5_moe`: their language models).

Hybrids: the layers `layer_types` calls linear_attention (by default three of every
four, `full_attention_interval`) are gated delta-nets (mtjax.layers.delta_net; Qwen3-Next's
with its fused per-key-head projections), the others softmax attention whose q_proj also
yields a sigmoid output gate, with a per-head q/k norm and RoPE over the first
partial_rotary_factor of each head (0.25 unless written). Every RMSNorm but the
delta-net's gated one scales by (1 + weight) in fp32 (`rms_norm_offset`), as transformers'
Qwen3NextRMSNorm and Qwen3_5RMSNorm do. Qwen3-Next's MoE layers follow `mlp_only_layers`
and `decoder_sparse_step` (Qwen2-MoE's rule), Qwen3.5-MoE's are all of its layers; both
route softmax top-k with a sigmoid-gated shared expert and the load-balancing loss
transformers adds. Text positions only: Qwen3.5's multimodal RoPE sections turn text
tokens as plain RoPE does, so its `mrope_*` keys are read by nothing (and not written).
The delta-net's parameters live under `self_attn` in mtjax and `linear_attn` in checkpoints.
The releases' multi-token-prediction weights (`mtp.*`) are left out on import with one line.
"""

from __future__ import annotations

import dataclasses

from mtjax.families import hf_config
from mtjax.families.hf_config import FULL, ConfigError
from mtjax.families.registry import Family, register
from mtjax.layers.spec import GatedDeltaNet, SoftmaxAttention

LINEAR = "linear_attention"
_KEYS = frozenset({"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                   "linear_num_value_heads", "full_attention_interval", "attention_dropout", "hidden_act",
                   "output_router_logits"}) | hf_config.EXPERT_KEYS
# The delta-net's modules (beside its dt_bias and A_log, directly under it).
_DELTA_NET = frozenset({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "conv1d",
                        "norm", "out_proj"})


def _fields(hf: dict) -> dict:
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or [LINEAR if (i + 1) % int(hf.get("full_attention_interval", 4)) else FULL
                                      for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {LINEAR, FULL}:
        raise ConfigError(f"layer_types {kinds} must give {layers} entries of {LINEAR!r} or {FULL!r}")
    rope = dict(hf.get("rope_parameters") or {})
    partial = float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 0.25))
    hf = dict(hf, intermediate_size=hf.get("intermediate_size") or hf.get("shared_expert_intermediate_size") or 1)
    fields = hf_config.read_common(hf, (FULL,) * layers, known=_KEYS, head_dim=256)
    return dict(fields, qk_norm=True, o_proj_bias=fields["attention_bias"], rms_norm_offset=True,
                partial_rotary_factor=partial,
                delta_net_layers=tuple(i for i, kind in enumerate(kinds) if kind == LINEAR),
                linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
                linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
                linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)))


def _experts(hf: dict, moe_layers: tuple[int, ...], norm_topk_prob: bool) -> dict:
    return dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=norm_topk_prob,
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), moe_layers=moe_layers)


def next_from_hf(hf: dict) -> dict:
    fields = _fields(hf)
    layers, experts = fields["num_hidden_layers"], int(hf.get("num_experts") or 0)
    step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(fields, **_experts(hf, sparse, bool(hf.get("norm_topk_prob", True)))) if sparse else fields


def dense_from_hf(hf: dict) -> dict:
    return _fields(hf)


def moe_from_hf(hf: dict) -> dict:
    fields = _fields(hf)
    return dict(fields, **_experts(hf, tuple(range(fields["num_hidden_layers"])), True))


def _to_hf(cfg) -> dict:
    hf = hf_config.write_common(cfg)
    hf["rope_parameters"] = hf_config.rope_to_hf(cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor)
    hf["rope_parameters"].setdefault("partial_rotary_factor", cfg.partial_rotary_factor)
    return dict(hf, attention_bias=cfg.o_proj_bias, hidden_act=cfg.hidden_act,
                layer_types=[LINEAR if i in cfg.delta_net_layers else FULL for i in range(cfg.num_hidden_layers)],
                linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, linear_key_head_dim=cfg.linear_key_head_dim,
                linear_value_head_dim=cfg.linear_value_head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
                linear_num_value_heads=cfg.linear_num_value_heads)


def _experts_to_hf(cfg) -> dict:
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size,
                shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                router_aux_loss_coef=cfg.router_aux_loss_coef)


def next_to_hf(cfg) -> dict:
    moe = dict(_experts_to_hf(cfg), norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(cfg.num_hidden_layers) if i not in cfg.moe_layers]) \
        if cfg.moe_layers else dict(num_experts=0)
    return dict(_to_hf(cfg), **moe)


def dense_to_hf(cfg) -> dict:
    return _to_hf(cfg)


def moe_to_hf(cfg) -> dict:
    # intermediate_size is written as read (Qwen3.5-MoE's configs have none: every layer is
    # MoE; the shared expert's width stands in), so a config.json goes round unchanged.
    return dict(_to_hf(cfg), **_experts_to_hf(cfg))


def layer_specs(cfg) -> tuple:
    """Delta-net layers where `delta_net_layers` says, gated softmax attention elsewhere."""
    grouped = cfg.model_type == "qwen3_next"
    return tuple(dataclasses.replace(spec, mixer=GatedDeltaNet(grouped=grouped) if i in cfg.delta_net_layers
                                     else SoftmaxAttention(output_gate=True))
                 for i, spec in enumerate(cfg.derived_layer_specs()))


def validate(cfg) -> None:
    if not set(cfg.delta_net_layers) <= set(range(cfg.num_hidden_layers)):
        raise ConfigError(f"delta_net_layers {list(cfg.delta_net_layers)} name layers outside 0.."
                          f"{cfg.num_hidden_layers - 1}")
    if cfg.delta_net_layers and (min(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                     cfg.linear_value_head_dim) <= 0
                                 or cfg.linear_num_value_heads % cfg.linear_num_key_heads):
        raise ConfigError(f"delta-net layers need positive linear_* sizes with linear_num_value_heads "
                          f"({cfg.linear_num_value_heads}) a multiple of linear_num_key_heads "
                          f"({cfg.linear_num_key_heads})")


def checkpoint_names(module: list[str]) -> list[str]:
    """The delta-net's parameters are `linear_attn`'s in checkpoints."""
    if module[:1] == ["self_attn"] and (len(module) == 1 or module[1] in _DELTA_NET):
        return ["linear_attn", *module[1:]]
    return module


_COMMON = dict(defaults={"shared_expert_gated": True}, validate=validate, layer_specs=layer_specs,
               checkpoint_names=checkpoint_names, left_out={"mtp.": "multi-token-prediction module"})
register(Family("qwen3_next", "Qwen3NextForCausalLM", next_from_hf, next_to_hf, **_COMMON))
register(Family("qwen3_5_text", "Qwen3_5ForCausalLM", dense_from_hf, dense_to_hf, multimodal="qwen3_5", **_COMMON))
register(Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", moe_from_hf, moe_to_hf, multimodal="qwen3_5_moe",
                **_COMMON))
