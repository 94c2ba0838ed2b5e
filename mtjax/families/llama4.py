"""Llama 4's text model (a multimodal Llama 4's language model too): mixture-of-experts
layers (`moe_layers`, else every `interleave_moe_layer_step`-th) whose router keeps the
top-k logits and scales each chosen expert's input by its sigmoid, beside an ungated
shared expert; dense layers `intermediate_size_mlp` wide; NoPE layers with query
temperature tuning, chunked attention on the RoPE layers, an L2 q/k norm after RoPE, and
RoPE over adjacent feature pairs. Its checkpoints name every MLP `feed_forward`, the
router `router`, and hold each MoE block's experts as two stacked tensors."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.hf_config import CHUNKED, FULL
from mtjax.families.registry import Family, register

# transformers' Llama4TextConfig defaults for the keys whose default is not the generic one.
_DEFAULTS = dict(rope_theta=500000.0, intermediate_size=8192, intermediate_size_mlp=16384,
                 num_local_experts=16, num_experts_per_tok=1, attention_chunk_size=8192, rms_norm_eps=1e-5)
_KEYS = {"intermediate_size_mlp", "moe_layers", "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers",
         "no_rope_layer_interval", "attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale"}


def _rope_flags(hf: dict, layers: int) -> list[bool]:
    """Whether each layer turns RoPE: `no_rope_layers` (1: RoPE, 0: NoPE), else NoPE every
    `no_rope_layer_interval`-th layer, as transformers derives it."""
    flags = hf.get("no_rope_layers")
    if flags:
        return [bool(f) for f in flags[:layers]]
    every = int(hf.get("no_rope_layer_interval", 4))
    return [(i + 1) % every != 0 for i in range(layers)]


def _layer_types(hf: dict, layers: int) -> tuple[str, ...]:
    """`layer_types` where written; else transformers' rule: RoPE layers chunked (when
    attention_chunk_size is set), NoPE layers full."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    chunked = hf.get("attention_chunk_size") is not None
    return tuple(CHUNKED if rope and chunked else FULL for rope in _rope_flags(hf, layers))


def from_hf(hf: dict) -> dict:
    """Its dense layers' MLP is intermediate_size_mlp wide; the experts' intermediate_size
    is moe_intermediate_size here. Its router_aux_loss_coef goes unused (Llama4ForCausalLM's
    loss has no load-balancing term, nor has mtjax's): kept in extra_hf as written."""
    hf = {**_DEFAULTS, **hf}
    layers = int(hf["num_hidden_layers"])
    known = (hf_config.EXPERT_KEYS | _KEYS) - {"router_aux_loss_coef"}
    fields = hf_config.read_common(hf, _layer_types(hf, layers), known=known)
    step, listed = int(hf.get("interleave_moe_layer_step", 1)), hf.get("moe_layers")  # moe_layers wins
    sparse = tuple(sorted(int(i) for i in listed)) if listed is not None else tuple(range(step - 1, layers, step))
    width, chunk = int(hf["intermediate_size"]), hf.get("attention_chunk_size")
    return dict(fields, num_experts=hf_config.experts_from_hf(hf), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=width, norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=width, router_aux_loss_coef=0.0, moe_layers=sparse,
                intermediate_size=int(hf["intermediate_size_mlp"]),
                no_rope_layers=tuple(i for i, rope in enumerate(_rope_flags(hf, layers)) if not rope),
                attention_chunk_size=int(chunk) if chunk is not None else None,
                qk_l2_norm=bool(hf.get("use_qk_norm", True)),
                attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
                floor_scale=float(hf.get("floor_scale", 8192)), temperature_scale=float(hf.get("attn_scale", 0.1)),
                o_proj_bias=bool(hf.get("attention_bias", False)))


def to_hf(cfg) -> dict:
    floor = cfg.floor_scale
    return dict(hf_config.write_common(cfg), attention_bias=cfg.o_proj_bias,
                num_experts_per_tok=cfg.num_experts_per_tok, intermediate_size=cfg.moe_intermediate_size,
                num_local_experts=cfg.num_experts,
                moe_layers=list(cfg.moe_layers), intermediate_size_mlp=cfg.intermediate_size,
                layer_types=list(cfg.layer_types),
                no_rope_layers=[int(i not in cfg.no_rope_layers) for i in range(cfg.num_hidden_layers)],
                attention_chunk_size=cfg.attention_chunk_size, use_qk_norm=cfg.qk_l2_norm,
                attn_temperature_tuning=cfg.attn_temperature_tuning,
                floor_scale=int(floor) if floor.is_integer() else floor, attn_scale=cfg.temperature_scale)


def checkpoint_names(module: list[str]) -> list[str]:
    if module[:1] != ["mlp"]:
        return module
    return ["feed_forward", *(("router" if m == "gate" else m) if i == 0 else m for i, m in enumerate(module[1:]))]


register(Family("llama4_text", "Llama4ForCausalLM", from_hf, to_hf, multimodal="llama4",
                defaults={"rope_interleaved": True, "moe_router": "sigmoid_topk"},
                checkpoint_names=checkpoint_names, stacked_experts=True))
