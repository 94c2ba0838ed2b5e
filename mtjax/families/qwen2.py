"""Qwen2 and Qwen2.5: Llama-shaped with biases on q, k and v always (config.json has no
key for them), sliding layers by `layer_types` or from `max_window_layers` on."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.registry import Family, register


def from_hf(hf: dict) -> dict:
    fields = hf_config.read_common(hf, hf_config.per_layer_types(hf, int(hf["num_hidden_layers"])))
    return dict(fields, attention_bias=True)


def to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), **hf_config.window_to_hf(cfg))


register(Family("qwen2", "Qwen2ForCausalLM", from_hf, to_hf))
