"""`mtjax import`: a Hugging Face checkpoint into a new store, one tensor at a time.

Tensor names, shapes and transposes come from mtjax.hf (the one name table). Each part
reopens the memory-mapped safetensors files and drops them when done, so host memory
holds about one part (its master, compute and optimizer state), not the model.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from mtjax import hf, lora, partid, parts, textfile
from mtjax.errors import MtjaxError
from mtjax.model_config import load_hf_config
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.store import adapters, fill, tokenizer
from mtjax.store.errors import StoreError

SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def locate(path: tuple) -> tuple[partid.PartId, str]:
    """(part, leaf name) of a leaf, from its path in the params pytree."""
    if path[0] == "blocks":
        return partid.block(path[1]), ".".join(map(str, path[2:]))  # expert numbers are ints
    return partid.PartId(path[0]), ".".join(path[1:])


def leaf_names(spec: hf.TensorSpec) -> list[str]:
    """The leaf names, in its part, of every array a tensor holds (one but for fused experts)."""
    return [locate(p)[1] for p in spec.paths]


def by_part(specs: list[hf.TensorSpec]) -> dict[str, list[hf.TensorSpec]]:
    """Tensors grouped by the part that holds them (a tensor's leaves are all in one block)."""
    grouped = defaultdict(list)
    for spec in specs:
        grouped[locate(spec.paths[0])[0]].append(spec)
    return grouped


def _dtype_from_tensors(cfg, hf_dir: Path, reader: hf.SafetensorsReader, specs):
    """A config.json without `dtype`/`torch_dtype` takes the tensors' one dtype."""
    config = json.loads(textfile.read(hf_dir / "config.json"))
    if config.get("dtype") or config.get("torch_dtype"):
        return cfg
    found = {SAFETENSORS_DTYPES.get(reader.dtype(s.hf_name)) for s in specs}
    return dataclasses.replace(cfg, param_dtype=found.pop()) if len(found) == 1 and None not in found else cfg


def _check_dtypes(cfg, reader: hf.SafetensorsReader, specs) -> None:
    wrong = []
    for spec in specs:
        stored = reader.dtype(spec.hf_name)
        if SAFETENSORS_DTYPES.get(stored) != cfg.param_dtype:
            wrong.append(f"{spec.hf_name} is {stored}")
    if wrong:
        shown = ", ".join(wrong[:5]) + (f", ... ({len(wrong)} in all)" if len(wrong) > 5 else "")
        raise StoreError(f"checkpoint dtypes do not match its config.json dtype {cfg.param_dtype}: {shown}; "
                         "fix `torch_dtype` in config.json or re-save the checkpoint in one dtype")


def import_hf(hf_dir: str | Path, store_dir: str | Path, compute_dtype: str = "bfloat16", tx=None,
              progress=None, copies: int = 2, adapter: str | Path | None = None, freeze: tuple[str, ...] = (),
              base_format: str = "compute") -> Path:
    """Convert the checkpoint in `hf_dir` into a new store at `store_dir` (step 0).

    Master weights are the checkpoint's values in fp32 (exact for fp32/bf16/fp16 files),
    compute weights are cast to `compute_dtype`, optimizer state is `tx.init` (default
    AdamW). `freeze` (model.freeze patterns, mtjax.roles) freezes leaves: they keep their
    compute copy only, the frozen 2-D kernels of blocks quantized to `base_format` (int8,
    nf4: mtjax.quant) if it is not "compute". The checkpoint's tokenizer files are kept
    in the store (mtjax.store.tokenizer). `progress(part_name)` is called after each part.
    `adapter`: a PEFT LoRA adapter directory (mtjax.store.adapters) trained on this
    checkpoint, imported with it to train on: the store's model has its adapters
    (mtjax.lora), the checkpoint frozen under them.
    """
    hf_dir = Path(hf_dir)
    try:
        lora_config = adapters.lora_config(adapter) if adapter is not None else None
        cfg = load_hf_config(hf_dir, compute_dtype=compute_dtype, lora=lora_config, freeze=tuple(freeze),
                             base_format=base_format)
        parts.check_roles(cfg)
        # Every block's adapter read (and checked against this model) before anything is written.
        adapter_weights = adapters.read_all(cfg, adapter) if adapter is not None else {}
        reader = hf.SafetensorsReader(hf_dir)
        hf.say_left_out(reader)
        specs = hf.check(cfg, reader)
        cfg = _dtype_from_tensors(cfg, hf_dir, reader, specs)
        _check_dtypes(cfg, reader, specs)
        del reader
    except StoreError:
        raise
    except MtjaxError as e:
        raise StoreError(f"cannot import {hf_dir}: {e}") from None
    tx = tx or make_optimizer(OptimConfig())
    grouped = by_part(specs)
    with fill.staged(store_dir, cfg, tx, copies) as store:
        try:
            _fill(store, hf_dir, grouped, tx, progress, adapter_weights=adapter_weights)
        except StoreError:
            raise
        except MtjaxError as e:  # an unreadable tensor
            raise StoreError(f"cannot import {hf_dir}: {e}") from None
        tokenizer.keep(hf_dir, store.root)  # eval, generate and export then use the checkpoint's own
        store.commit(0)
    return Path(store_dir)


def fill_parts(store, hf_dir: str | Path, tx, seed: int = 0) -> None:
    """The checkpoint's weights (hf.load_params's values for the store's model config, which
    the checkpoint must hold) and tx.init state into every part of the new, writable
    `store`, one part at a time (uncommitted): a run's start from an HF checkpoint. LoRA
    adapters, which no checkpoint holds, start fresh (mtjax.lora.fresh, from `seed`)."""
    specs = hf.checked_specs(hf_dir, store.config, hf.SafetensorsReader(hf_dir))
    _fill(store, Path(hf_dir), by_part(specs), tx, seed=seed)


def _fill(store, hf_dir: Path, grouped: dict[str, list[hf.TensorSpec]], tx, progress=None, seed: int = 0,
          adapter_weights: dict | None = None) -> None:
    """Each part's weights from the checkpoint, its LoRA adapters from `adapter_weights`
    ({part: {leaf: array}}) or else fresh."""
    for index, part in enumerate(store.parts):
        reader = hf.SafetensorsReader(hf_dir)  # fresh mappings: the last part's pages leave RSS
        master = {}
        for spec in grouped[part]:
            tensor = reader.read(spec.hf_name)
            for leaf, array in zip(leaf_names(spec), hf.to_mtjax(spec, tensor)):
                master[leaf] = array.astype(np.float32, copy=False)
            del tensor
        del reader
        given = (adapter_weights or {}).get(part)
        master.update(given if given is not None else lora.fresh(parts.leaves(store.config, part), seed, index))
        fill.write_part(store, part, master, tx)
        del master
        if progress:
            progress(part)
