"""Mistral: Llama-shaped, with one sliding window for every layer when `sliding_window` is set."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.registry import Family, register


def from_hf(hf: dict) -> dict:
    return hf_config.read_common(hf, hf_config.one_window_layer_types(hf))


def to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), **hf_config.window_to_hf(cfg, per_layer=False))


register(Family("mistral", "MistralForCausalLM", from_hf, to_hf))
