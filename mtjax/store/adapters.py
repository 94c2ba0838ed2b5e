"""PEFT adapter directories out of and into a store with LoRA adapters (mtjax.lora).

A directory holds `adapter_config.json` (PEFT's LoraConfig: r, lora_alpha, use_rslora,
target_modules) and `adapter_model.safetensors`, each adapter as PEFT names it on the
transformers model: `base_model.model.model.layers.{i}.{module}.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r], the module path in the family's checkpoint names
(mtjax.hf). The routed experts' adapters (mtjax.lora.EXPERTS) are PEFT's target_parameters
on transformers' fused expert tensors `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`:
PEFT nests down_proj's wrapper around gate_up_proj's, so it names gate_up_proj's tensors
`...mlp.experts.base_layer.lora_A.weight` [r E, d] / `lora_B` [2f, r E] and down_proj's
`...mlp.experts.lora_A.weight` [r E, f] / `lora_B` [d, r E] (mtjax.lora.to_peft lays the
experts out). `peft.PeftModel.from_pretrained(base, dir)` loads it onto the base model;
`mtjax import BASE STORE --adapter DIR` reads it back, to continue training it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtjax import expert_groups, hf, lora, partid, parts
from mtjax.jsonfile import loads
from mtjax.model_config import ModelConfig
from mtjax.store.errors import StoreError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
# PEFT LoraConfig settings that make an adapter more than plain LoRA on the blocks' linear layers.
# The experts' fused tensors PEFT adapts, with the module prefix of each one's tensors: PEFT
# wraps them in the experts module's order of parameters (gate_up_proj first, so innermost).
EXPERT_PARAMETERS = {f"mlp.experts.{m}": f"mlp.experts{nest}" for m, nest in zip(lora.EXPERT_MODULES, (".base_layer", ""))}
UNSUPPORTED = ("use_dora", "bias", "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern")


def _names(cfg: ModelConfig, block: int) -> dict[str, str]:
    """{adapter leaf of block `block`: its PEFT tensor name}."""
    out = {}
    for leaf in parts.leaves(cfg, partid.block(block)):
        if lora.is_adapter(leaf) and expert_groups.expert_of(leaf) is None:
            *module, ab = leaf.split(".")
            out[leaf] = f"{PREFIX}.{block}.{'.'.join(hf.hub_names(cfg, module))}.lora_{ab[-1].upper()}.weight"
    return out


def _expert_names(cfg: ModelConfig, block: int) -> dict[str, tuple[str, str]]:
    """{expert module (gate_up_proj, down_proj): its PEFT (lora_A, lora_B) tensor names} of
    block `block`, where its routed experts have adapters."""
    if f"{expert_groups.EXPERTS}0.{lora.EXPERT_MODULES[0]}.{lora.A}" not in parts.leaves(cfg, partid.block(block)):
        return {}
    return {m: tuple(f"{PREFIX}.{block}.{EXPERT_PARAMETERS[f'mlp.experts.{m}']}.lora_{x}.weight" for x in "AB")
            for m in lora.EXPERT_MODULES}


def _stacked(cfg: ModelConfig, weights: dict, module: str) -> list[np.ndarray]:
    """The experts' (a [E, in, r], b [E, r, out]) of `module` from a block's weights."""
    return [np.stack([np.asarray(weights[f"{expert_groups.EXPERTS}{e}.{module}.{x}"], np.float32)
                      for e in range(cfg.num_experts)]) for x in (lora.A, lora.B)]


def adapted_modules(cfg: ModelConfig) -> list[str]:
    """The module names (q_proj, down_proj, ...) that carry adapters, as PEFT's target_modules."""
    return sorted({name.split(".")[-3] for i in range(cfg.num_hidden_layers) for name in _names(cfg, i).values()})


def peft_config(cfg: ModelConfig) -> dict:
    """adapter_config.json's contents for `cfg`'s adapters."""
    adapters = cfg.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapters.rank, "lora_alpha": adapters.alpha,
            "use_rslora": adapters.rslora, "lora_dropout": adapters.dropout, "target_modules": adapted_modules(cfg),
            "target_parameters": list(EXPERT_PARAMETERS) if adapters.adapts_experts else None, "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": None}


def write(cfg: ModelConfig, weights_of, out: Path) -> None:
    """Write the adapter directory at `out` (an existing, empty directory); `weights_of(part)`
    gives a block's fp32 weights {leaf: array} (one block in memory at a time)."""
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        weights = weights_of(partid.block(i))
        for leaf, name in _names(cfg, i).items():
            tensors[name] = np.ascontiguousarray(np.asarray(weights[leaf], np.float32).T)
        for module, names in _expert_names(cfg, i).items():
            tensors.update(zip(names, lora.to_peft(*_stacked(cfg, weights, module))))
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
    experts = peft.get("target_parameters") or []
    if experts and sorted(experts) != sorted(EXPERT_PARAMETERS):  # PEFT saves them in its own order
        raise StoreError(f"{path} sets target_parameters={experts!r}: mtjax adapts the routed experts' fused "
                         f"tensors {', '.join(EXPERT_PARAMETERS)} together, or neither")
    targets = peft["target_modules"]
    targets = ([targets] if isinstance(targets, str) else list(targets)) + ([lora.EXPERTS] if experts else [])
    return lora.LoraConfig(rank=peft.get("r"), alpha=float(peft.get("lora_alpha", 8)),
                           rslora=bool(peft.get("use_rslora", False)), target_modules=targets)


def read_all(cfg: ModelConfig, adapter_dir: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """Every block's adapter leaves {part: {leaf: array}} (`read`), refused in one line if
    the directory holds tensors this model's adapters do not take (other modules, layers)."""
    out = {partid.block(i): read(cfg, adapter_dir, i) for i in range(cfg.num_hidden_layers)}
    path = Path(adapter_dir) / WEIGHTS_FILE
    with safe_open(str(path), "np") as f:
        taken = {n for i in range(cfg.num_hidden_layers) for n in _names(cfg, i).values()}
        taken |= {n for i in range(cfg.num_hidden_layers) for names in _expert_names(cfg, i).values() for n in names}
        extra = sorted(set(f.keys()) - taken)
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
            for module, names in _expert_names(cfg, block).items():
                first = f"{expert_groups.EXPERTS}0.{module}."
                shapes = [parts.leaves(cfg, partid.block(block))[first + x].shape for x in (lora.A, lora.B)]
                (d_in, rank), d_out = shapes[0], shapes[1][1]
                expected = ((rank * cfg.num_experts, d_in), (d_out, rank * cfg.num_experts))
                tensors = []
                for name, shape in zip(names, expected):
                    if name not in present:
                        raise StoreError(f"adapter {adapter_dir} has no {name}: it was trained on another model "
                                         "or other target modules")
                    tensors.append(f.get_tensor(name))
                    if tensors[-1].shape != shape:
                        raise StoreError(f"adapter {adapter_dir}: {name} is {list(tensors[-1].shape)}, this model's "
                                         f"is {list(shape)}: it was trained on a model of another shape")
                for x, stacked in zip((lora.A, lora.B), lora.from_peft(*tensors, cfg.num_experts)):
                    out.update({f"{expert_groups.EXPERTS}{e}.{module}.{x}": stacked[e] for e in range(cfg.num_experts)})
            return out
    except (OSError, SafetensorError) as e:
        raise StoreError(f"cannot read {path}: {e}") from None
