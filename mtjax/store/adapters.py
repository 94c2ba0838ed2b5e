"""PEFT adapter directories out of and into a store with LoRA adapters (mtjax.lora).

A directory holds `adapter_config.json` (PEFT's LoraConfig: r, lora_alpha, use_rslora,
target_modules) and `adapter_model.safetensors`, each adapter as PEFT names it on the
transformers model: `base_model.model.model.layers.{i}.{module}.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r], the module path in the family's checkpoint names
(mtjax.hf). `peft.PeftModel.from_pretrained(base, dir)` loads it onto the base model;
`mtjax import BASE STORE --adapter DIR` reads it back, to continue training it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtjax import hf, lora, partid, parts
from mtjax.jsonfile import loads
from mtjax.model_config import ModelConfig
from mtjax.store.errors import StoreError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
# PEFT LoraConfig settings that make an adapter more than plain LoRA on the blocks' linear layers.
UNSUPPORTED = ("use_dora", "bias", "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern")


def _names(cfg: ModelConfig, block: int) -> dict[str, str]:
    """{adapter leaf of block `block`: its PEFT tensor name}."""
    out = {}
    for leaf in parts.leaves(cfg, partid.block(block)):
        if lora.is_adapter(leaf):
            *module, ab = leaf.split(".")
            out[leaf] = f"{PREFIX}.{block}.{'.'.join(hf.hub_names(cfg, module))}.lora_{ab[-1].upper()}.weight"
    return out


def adapted_modules(cfg: ModelConfig) -> list[str]:
    """The module names (q_proj, down_proj, ...) that carry adapters, as PEFT's target_modules."""
    return sorted({name.split(".")[-3] for i in range(cfg.num_hidden_layers) for name in _names(cfg, i).values()})


def peft_config(cfg: ModelConfig) -> dict:
    """adapter_config.json's contents for `cfg`'s adapters."""
    adapters = cfg.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapters.rank, "lora_alpha": adapters.alpha,
            "use_rslora": adapters.rslora, "lora_dropout": adapters.dropout, "target_modules": adapted_modules(cfg),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": None}


def write(cfg: ModelConfig, weights_of, out: Path) -> None:
    """Write the adapter directory at `out` (an existing, empty directory); `weights_of(part)`
    gives a block's fp32 weights {leaf: array} (one block in memory at a time)."""
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        weights = weights_of(partid.block(i))
        for leaf, name in _names(cfg, i).items():
            tensors[name] = np.ascontiguousarray(np.asarray(weights[leaf], np.float32).T)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(peft_config(cfg), indent=2) + "\n")


def lora_config(adapter_dir: str | Path) -> lora.LoraConfig:
    """The LoraConfig of a PEFT adapter directory, or one line saying why it has none."""
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise StoreError(f"no {CONFIG_FILE} in {adapter_dir}: point --adapter at a PEFT adapter directory")
    peft = loads(path.read_text(), str(path))
    if peft.get("peft_type") != "LORA" or not isinstance(peft.get("target_modules"), (list, str)):
        raise StoreError(f"{path} is not a PEFT LoRA adapter's config (peft_type LORA, target_modules)")
    beyond = [k for k in UNSUPPORTED if peft.get(k) not in (None, False, "none", [], {})]
    if beyond:
        raise StoreError(f"{path} sets {', '.join(f'{k}={peft[k]!r}' for k in beyond)}: mtjax's adapters are plain "
                         "LoRA on the blocks' linear layers (no DoRA, bias training, saved modules or per-layer ranks)")
    return lora.LoraConfig(rank=peft.get("r"), alpha=float(peft.get("lora_alpha", 8)),
                           rslora=bool(peft.get("use_rslora", False)), target_modules=peft["target_modules"])


def read_all(cfg: ModelConfig, adapter_dir: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """Every block's adapter leaves {part: {leaf: array}} (`read`), refused in one line if
    the directory holds tensors this model's adapters do not take (other modules, layers)."""
    out = {partid.block(i): read(cfg, adapter_dir, i) for i in range(cfg.num_hidden_layers)}
    path = Path(adapter_dir) / WEIGHTS_FILE
    with safe_open(str(path), "np") as f:
        extra = sorted(set(f.keys()) - {n for i in range(cfg.num_hidden_layers) for n in _names(cfg, i).values()})
    if extra:
        raise StoreError(f"adapter {adapter_dir} holds {len(extra)} tensors this model's adapters do not take "
                         f"({extra[0]}, ...): it was trained on another model or other target modules")
    return out


def read(cfg: ModelConfig, adapter_dir: str | Path, block: int) -> dict[str, np.ndarray]:
    """Block `block`'s adapter leaves {leaf: fp32 array} from a PEFT adapter directory whose
    adapters must be `cfg`'s, tensor for tensor and shape for shape (one line if not)."""
    path = Path(adapter_dir) / WEIGHTS_FILE
    try:
        with safe_open(str(path), "np") as f:
            present = set(f.keys())
            out = {}
            for leaf, name in _names(cfg, block).items():
                expected = parts.leaves(cfg, partid.block(block))[leaf].shape[::-1]
                if name not in present:
                    raise StoreError(f"adapter {adapter_dir} has no {name}: it was trained on another model "
                                     "or other target modules")
                tensor = f.get_tensor(name)
                if tensor.shape != expected:
                    raise StoreError(f"adapter {adapter_dir}: {name} is {list(tensor.shape)}, this model's is "
                                     f"{list(expected)}: it was trained on a model of another shape")
                out[leaf] = np.ascontiguousarray(tensor.astype(np.float32).T)
            return out
    except (OSError, SafetensorError) as e:
        raise StoreError(f"cannot read {path}: {e}") from None
