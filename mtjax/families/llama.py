"""Llama 2 and 3 (3.1-3.3's rope scaling is `llama3`): the Llama-shaped config.json, whose
`attention_bias` puts a bias on all four attention projections and `mlp_bias` on the MLP's."""

from __future__ import annotations

from mtjax.families import hf_config
from mtjax.families.hf_config import FULL
from mtjax.families.registry import Family, register


def from_hf(hf: dict) -> dict:
    layer_types = tuple(hf.get("layer_types") or ()) or (FULL,) * int(hf["num_hidden_layers"])
    fields = hf_config.read_common(hf, layer_types)
    return dict(fields, o_proj_bias=fields["attention_bias"])


def to_hf(cfg) -> dict:
    return dict(hf_config.write_common(cfg), attention_bias=cfg.o_proj_bias, mlp_bias=cfg.mlp_bias,
                **hf_config.window_to_hf(cfg))


register(Family("llama", "LlamaForCausalLM", from_hf, to_hf))
