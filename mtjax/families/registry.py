"""The registry of model families: each one says how its config.json maps to a
ModelConfig and back, which behaviour switches it sets, and how its checkpoints name
tensors. A family module registers one `Family` (mtjax.families registers the built-in
ones when imported); the rest of mtjax asks `get(cfg.model_type)` and never tests names.

`match` is the one place a config.json's `model_type` is compared: it picks the family
that reads the file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from mtjax.families.hf_config import ConfigError


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """One model family.

    model_type: the config.json `model_type` it reads and writes (ModelConfig.model_type).
    architecture: the `architectures` entry its exported config.json names.
    from_hf(hf) -> {field: value}: the ModelConfig fields (model_type aside) of a
        config.json of this family; a missing required key may raise KeyError.
    to_hf(cfg) -> {key: value}: the config.json keys of a ModelConfig of this family
        (beside model_type and architectures, and over the extra_hf it kept).
    defaults: the behaviour switches this family turns on (ModelConfig.SWITCHES), taken
        by every ModelConfig of this family that leaves the switch unset (None).
    multimodal: the model_type of a multimodal config.json whose `text_config` is a model
        of this family (the language model is imported, its vision tower left out).
    validate(cfg): raises ConfigError where the family cannot hold a setting.
    layer_specs(cfg) -> tuple[LayerSpec, ...]: one per layer, where the family builds its
        layers otherwise than ModelConfig's derivation from layer_types and moe_layers.
    checkpoint_names(module) -> module: a block's module path as mtjax names it (e.g.
        ["mlp", "experts", "0", "gate_proj"]) -> as this family's checkpoints name it.
    stacked_experts: the checkpoint holds each MoE block's experts as two stacked tensors,
        `experts.gate_up_proj` [E, d, 2f] and `experts.down_proj` [E, f, d] (mtjax.hf).
    interleaved_experts: with `stacked_experts`, gate and up in alternate columns of
        `gate_up_proj` (gpt-oss), and the experts' biases stacked beside their kernels
        (`gate_up_proj_bias` [E, 2f], interleaved alike, and `down_proj_bias` [E, d]).
    trailing_layers: what the checkpoint's layers past num_hidden_layers are, where it may
        have some (DeepSeek-V3's multi-token-prediction module): left out on import, with
        one line naming them (mtjax.hf.check); empty: such tensors are unexpected.
    left_out: {name prefix: what it is} of other tensors its checkpoints may hold beside the
        model (Qwen3-Next's multi-token-prediction module, `mtp.`): left out on import with
        one line.
    """

    model_type: str
    architecture: str
    from_hf: Callable[[dict], dict]
    to_hf: Callable[[Any], dict]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    multimodal: str | None = None
    validate: Callable[[Any], None] | None = None
    layer_specs: Callable[[Any], tuple] | None = None
    checkpoint_names: Callable[[list[str]], list[str]] | None = None
    stacked_experts: bool = False
    trailing_layers: str = ""
    interleaved_experts: bool = False
    left_out: Mapping[str, str] = dataclasses.field(default_factory=dict)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    """Make `family` the one that reads and writes its model_type (and its multimodal one)."""
    if FAMILIES.get(family.model_type, family) is not family:
        raise ValueError(f"a family of model_type {family.model_type!r} is registered already")
    FAMILIES[family.model_type] = family


def unregister(model_type: str) -> None:
    """Forget the family of `model_type` (tests that register one of their own)."""
    FAMILIES.pop(model_type, None)


def model_types() -> tuple[str, ...]:
    """The model_types of the registered families, in registration order."""
    return tuple(FAMILIES)


def get(model_type: str) -> Family:
    """The family of a ModelConfig's model_type."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}") from None


def match(hf: dict) -> tuple[Family, dict]:
    """The family that reads a config.json, and the config it reads: a multimodal
    config's `text_config`, with the top-level keys that govern it."""
    model_type = hf.get("model_type")
    wrapping = {f.multimodal: f for f in FAMILIES.values() if f.multimodal}
    if model_type in wrapping:
        family = wrapping[model_type]
        text = dict(hf.get("text_config") or {})
        for key in ("tie_word_embeddings", "dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
                    "transformers_version"):
            if key in hf:
                text[key] = hf[key]  # transformers ties and sets dtype by the top-level config
        return family, dict(text, model_type=family.model_type)
    if model_type is None:
        raise ConfigError("config.json has no model_type: point at a Hugging Face checkpoint's config.json")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}, "
                          f"{', '.join(wrapping)} (their language models)")
    return FAMILIES[model_type], hf
