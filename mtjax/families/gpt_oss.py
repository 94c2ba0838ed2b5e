"""gpt-oss (`gpt_oss`): OpenAI's 20B and 120B mixtures of experts.

Every layer is softmax attention with q/k/v/o biases and a learned sink logit per head
in its softmax denominator (mtjax.attention_chunked), sliding-window and full layers
alternating as `layer_types` says (sliding first where it says nothing), yarn RoPE; and
a mixture of `num_local_experts` experts (mtjax.layers.clamped_moe): a router with a
bias whose top-k logits' softmax weighs the chosen experts, experts with biases and the
clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`). As transformers computes them; the
load-balancing loss is added (times `router_aux_loss_coef`) as with output_router_logits.
Its checkpoints name the router `mlp.router` and keep each layer's experts stacked:
`experts.gate_up_proj` [E, d, 2f] with gate and up in alternate columns and
`gate_up_proj_bias` [E, 2f] alike, `down_proj` [E, f, d], `down_proj_bias` [E, d] (mtjax.hf);
the hub's keep the two kernels in MXFP4, dequantized on import (mtjax.mxfp4).
"""

from __future__ import annotations

import dataclasses

from mtjax.families import hf_config
from mtjax.families.hf_config import FULL, SLIDING, ConfigError
from mtjax.families.registry import Family, register
from mtjax.layers.spec import ClampedMoE

_KEYS = frozenset({"swiglu_alpha", "swiglu_limit", "layer_types", "sliding_window", "output_router_logits",
                   "quantization_config"})  # MXFP4 experts are dequantized on import (mtjax.mxfp4): an export is not


def _layer_types(hf: dict) -> tuple[str, ...]:
    """`layer_types` where written; else sliding and full alternating, sliding first
    (GptOssConfig's default)."""
    layers = int(hf["num_hidden_layers"])
    return tuple(hf.get("layer_types") or (SLIDING if i % 2 == 0 else FULL for i in range(layers)))


def from_hf(hf: dict) -> dict:
    quant = hf.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise ConfigError(f"quantization_config {quant} is not supported for gpt_oss; mtjax reads MXFP4 experts "
                          "(the hub's) or unquantized ones")
    fields = hf_config.read_common(hf, _layer_types(hf), known=hf_config.EXPERT_KEYS | _KEYS)
    biased = bool(hf.get("attention_bias", True))
    return dict(fields, attention_bias=biased, o_proj_bias=biased, num_experts=hf_config.experts_from_hf(hf),
                num_experts_per_tok=int(hf["num_experts_per_tok"]), moe_intermediate_size=int(hf["intermediate_size"]),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                moe_layers=tuple(range(fields["num_hidden_layers"])))


def to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), attention_bias=cfg.attention_bias, num_local_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok, intermediate_size=cfg.moe_intermediate_size,
                router_aux_loss_coef=cfg.router_aux_loss_coef, swiglu_alpha=cfg.swiglu_alpha,
                swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types))


def layer_specs(cfg) -> tuple:
    """Every layer softmax attention with sinks and gpt-oss's mixture of experts."""
    return tuple(dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, sinks=True), feed_forward=ClampedMoE())
                 for spec in cfg.derived_layer_specs())


def validate(cfg) -> None:
    if cfg.attention_bias != cfg.o_proj_bias:
        raise ConfigError("gpt_oss has biases on q, k, v and o alike; set attention_bias and o_proj_bias equal")
    if cfg.splits_rows:
        raise ConfigError("gpt_oss's attention sinks are not in the context-parallel kernel; split rows over "
                          "one device (stream.split other than sequence)")
    if set(cfg.moe_layers) != set(range(cfg.num_hidden_layers)):
        raise ConfigError("every gpt_oss layer is a mixture of experts; set moe_layers to all layers")


def checkpoint_names(module: list[str]) -> list[str]:
    """The router is `mlp.router`."""
    return ["mlp", "router", *module[2:]] if module[:2] == ["mlp", "gate"] else module


register(Family("gpt_oss", "GptOssForCausalLM", from_hf, to_hf, validate=validate, layer_specs=layer_specs,
                checkpoint_names=checkpoint_names, stacked_experts=True, interleaved_experts=True))
