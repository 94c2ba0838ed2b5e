"""Hugging Face checkpoints in and out: the tensor-name table, loading and saving.

`layout(cfg)` lists every tensor of a checkpoint with where it lives in mtjax's params
pytree and whether it is transposed (PyTorch Linear weights are [out, in], mtjax kernels
[in, out]). A block's tensors are named after its modules as the model's family names
them (`Family.checkpoint_names`, mtjax.families). Most tensors are one leaf each; the
stacked experts of a family with `stacked_experts` (Llama 4) are many:
`experts.gate_up_proj` [E, d, 2f] holds every expert's gate and up kernels side by side
(gpt-oss: in alternate columns, with `gate_up_proj_bias` and `down_proj_bias` beside),
`experts.down_proj` [E, f, d] their down kernels, which mtjax keeps one array each
(`to_mtjax` splits them, `to_hf` joins them back, bit for bit). The loader reads one
tensor at a time from memory-mapped safetensors files, so the store importer reuses it
with a peak memory of one tensor. FP8 weights (DeepSeek-V3 and R1 as the hub stores them,
mtjax.fp8) are dequantized as they are read, their `weight_scale_inv` tensors consumed;
so are MXFP4 ones (gpt-oss's experts, mtjax.mxfp4: `_blocks` and `_scales` tensors).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtjax import fp8, lora, model, mxfp4, partid, parts, textfile
from mtjax.errors import MtjaxError
from mtjax.model_config import ModelConfig, differences, load_hf_config, to_hf_dict

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# A multimodal checkpoint's language model (Gemma3ForConditionalGeneration,
# Llama4ForConditionalGeneration) under either naming in the wild: transformers 5 saves
# the first, its in-memory modules use the second.
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                           "language_model.lm_head.": "lm_head."}


class CheckpointError(MtjaxError, ValueError):
    """A checkpoint that does not match the model; the message lists what is wrong."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    # key paths into mtjax params of the leaves the tensor holds, e.g.
    # (("blocks", 3, "mlp", "up_proj", "kernel"),); several for fused experts (`stacked`)
    paths: tuple[tuple, ...]
    shape: tuple[int, ...]  # shape in the Hugging Face file
    transpose: bool
    stacked: int = 0  # >0: [E, ...], expert e the last-axis concatenation of paths[e * stacked:(e + 1) * stacked]
    interleaved: bool = False  # stacked: the leaves' columns alternate (gpt-oss's gate and up) instead


def _leaves(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, jax.ShapeDtypeStruct]]:
    for key, value in sorted(tree.items()):
        if isinstance(value, dict):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def hub_names(cfg: ModelConfig, module: list[str]) -> list[str]:
    """mtjax module names of a block -> the family's checkpoint names (its `checkpoint_names`)."""
    rename = cfg.family.checkpoint_names
    return rename(module) if rename else module


def _spec(cfg: ModelConfig, hf_prefix: str, path: tuple, leaf) -> TensorSpec:
    """A block's tensor: `path` is ("blocks", i, module names and expert numbers..., leaf name)."""
    *module, name = [str(p) for p in path[2:]]
    module = hub_names(cfg, module)
    transpose = name == "kernel"
    hf_name = ".".join([hf_prefix, *module, "weight" if transpose else name]).strip(".")
    shape = tuple(reversed(leaf.shape)) if transpose else tuple(leaf.shape)
    return TensorSpec(hf_name, (path,), shape, transpose)


def _stacked_experts(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """The stacked expert tensors of MoE block i, input-major as its kernels are (no
    transpose): the two kernels', and with `interleaved_experts` the two biases'."""
    d, f, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    prefix = ".".join([f"model.layers.{i}", *hub_names(cfg, ["mlp", "experts"])])
    experts = ("blocks", i, "mlp", "experts")
    interleaved = cfg.family.interleaved_experts

    def gate_up(leaf: str) -> tuple:
        return tuple(experts + (e, proj, leaf) for e in range(n) for proj in ("gate_proj", "up_proj"))

    def down(leaf: str) -> tuple:
        return tuple(experts + (e, "down_proj", leaf) for e in range(n))

    specs = [TensorSpec(f"{prefix}.gate_up_proj", gate_up("kernel"), (n, d, 2 * f), False, stacked=2,
                        interleaved=interleaved),
             TensorSpec(f"{prefix}.down_proj", down("kernel"), (n, f, d), False, stacked=1)]
    if interleaved:
        specs += [TensorSpec(f"{prefix}.gate_up_proj_bias", gate_up("bias"), (n, 2 * f), False, stacked=2,
                             interleaved=True),
                  TensorSpec(f"{prefix}.down_proj_bias", down("bias"), (n, d), False, stacked=1)]
    return specs


def layout(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a Hugging Face checkpoint of this architecture, in file order (the
    base model's: LoRA adapters are not in it)."""
    abstract = model.abstract_params(cfg)
    specs = [TensorSpec("model.embed_tokens.weight", (("embed", "embedding"),),
                        (cfg.vocab_size, cfg.hidden_size), False)]
    stacked = cfg.family.stacked_experts
    for i, block in enumerate(abstract["blocks"]):
        leaves = [(p, leaf) for p, leaf in _leaves(block) if not (stacked and p[:2] == ("mlp", "experts"))
                  and not lora.is_adapter(p[-1])]  # adapters are no checkpoint's (mtjax.lora: PEFT's own files)
        specs += [_spec(cfg, f"model.layers.{i}", ("blocks", i) + p, leaf) for p, leaf in leaves]
        specs += _stacked_experts(cfg, i) if stacked and i in cfg.moe_layers else []
    specs.append(TensorSpec("model.norm.weight", (("head", "norm", "weight"),), (cfg.hidden_size,), False))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (("head", "lm_head", "kernel"),),
                                (cfg.vocab_size, cfg.hidden_size), True))
    return specs


def to_mtjax(spec: TensorSpec, tensor: np.ndarray) -> list[np.ndarray]:
    """A checkpoint tensor -> the arrays of its leaves, in `spec.paths` order."""
    if spec.stacked and spec.interleaved:
        return [np.ascontiguousarray(expert[..., j::spec.stacked]) for expert in tensor for j in range(spec.stacked)]
    if spec.stacked:
        return [np.ascontiguousarray(a) for expert in tensor for a in np.split(expert, spec.stacked, axis=-1)]
    return [np.ascontiguousarray(tensor.T) if spec.transpose else tensor]


def to_hf(spec: TensorSpec, arrays: list) -> np.ndarray:
    """The arrays of a tensor's leaves, in `spec.paths` order -> the checkpoint tensor."""
    arrays = [np.asarray(a) for a in arrays]
    if spec.stacked:
        n = spec.stacked
        join = (lambda a: np.stack(a, axis=-1).reshape(*a[0].shape[:-1], -1)) if spec.interleaved else \
            (lambda a: np.concatenate(a, axis=-1))
        return np.stack([join(arrays[e:e + n]) for e in range(0, len(arrays), n)])
    return np.ascontiguousarray(arrays[0].T) if spec.transpose else arrays[0]


def from_tree(spec: TensorSpec, tree) -> np.ndarray:
    """The checkpoint tensor of `spec` from a params-shaped pytree (params, gradients)."""
    return to_hf(spec, [get_path(tree, p) for p in spec.paths])


class SafetensorsReader:
    """Memory-mapped access to the tensors of a (possibly sharded) checkpoint directory."""

    def __init__(self, ckpt_dir: str | Path):
        self.dir = Path(ckpt_dir)
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                files = sorted(set(json.loads(textfile.read(index))["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise CheckpointError(
                    f"{index} is not a safetensors index (no valid weight_map); re-download it"
                ) from None
        elif (self.dir / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            raise CheckpointError(f"{self.dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles, self._where = {}, {}  # _where: name -> (file, the tensor's name in it)
        for name in files:
            try:
                handle = safe_open(str(self.dir / name), framework="np")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{self.dir / name} is unreadable or truncated ({e}); re-download it") from None
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = (name, key)
        self.left_out = self._language_model_only()
        self._scales = self._fp8_scales()
        self._mxfp4 = self._mxfp4_pairs()

    def _language_model_only(self) -> list[str]:
        """In a multimodal checkpoint, name the language model's tensors as a text-only
        checkpoint does and set the others (vision tower, projector) aside; returns those."""
        if not any(n.startswith(tuple(LANGUAGE_MODEL_PREFIXES)) for n in self._where):
            return []
        text, left_out = {}, []
        for name, where in self._where.items():
            prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                text[LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix):]] = where
            elif name == "lm_head.weight":
                text[name] = where
            else:
                left_out.append(name)
        self._where = text
        return sorted(left_out)

    def _fp8_scales(self) -> dict[str, tuple[str, str]]:
        """{weight name: (file, key) of its weight_scale_inv} of the FP8 weights (mtjax.fp8),
        their scales taken out of the names: reading such a weight dequantizes it."""
        scales = {}
        for name in [n for n in self._where if n.endswith(fp8.SCALE_SUFFIX)]:
            weight = name.removesuffix(fp8.SCALE_SUFFIX)
            if weight in self._where and self._slice(weight).get_dtype() == fp8.DTYPE:
                scales[weight] = self._where.pop(name)
        return scales

    def _mxfp4_pairs(self) -> dict[str, tuple[tuple[str, str], tuple[str, str]]]:
        """{tensor name: ((file, key) of its blocks, of its scales)} of the MXFP4 tensors
        (mtjax.mxfp4), named without their suffixes: reading one dequantizes it."""
        pairs = {}
        for name in [n for n in self._where if n.endswith(mxfp4.BLOCKS)]:
            base = name.removesuffix(mxfp4.BLOCKS)
            if base + mxfp4.SCALES in self._where and self._slice(name).get_dtype() == "U8":
                pairs[base] = (self._where.pop(name), self._where.pop(base + mxfp4.SCALES))
        return pairs

    def names(self) -> list[str]:
        return [*self._where, *self._mxfp4]

    def _slice(self, name: str):
        file, key = self._where[name]
        return self._handles[file].get_slice(key)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mxfp4:
            file, key = self._mxfp4[name][0]
            return mxfp4.shape(tuple(self._handles[file].get_slice(key).get_shape()))
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The dtype `read` gives, as safetensors names it (an FP8 or MXFP4 tensor's: F32)."""
        return "F32" if name in self._scales or name in self._mxfp4 else self._slice(name).get_dtype()

    def read(self, name: str) -> np.ndarray:
        if name in self._mxfp4:  # e2m1 codes times their blocks' powers of 2
            (blocks_file, blocks_key), (scales_file, scales_key) = self._mxfp4[name]
            try:
                return mxfp4.dequantize(self._handles[blocks_file].get_tensor(blocks_key),
                                        self._handles[scales_file].get_tensor(scales_key))
            except (SafetensorError, ValueError) as e:
                raise CheckpointError(f"tensor {name} in {self.dir} is unreadable ({e})") from None
        file, key = self._where[name]
        try:
            if name in self._scales:  # e4m3 times its blocks' scales
                scale_file, scale_key = self._scales[name]
                scale = self._handles[scale_file].get_tensor(scale_key)
                return fp8.dequantize(fp8.raw(self.dir / file, key), scale)
            return self._handles[file].get_tensor(key)
        except (SafetensorError, ValueError) as e:
            raise CheckpointError(f"tensor {name} in {self.dir} is unreadable ({e}); the file may be truncated") from None


def say_left_out(reader: SafetensorsReader) -> None:
    """One line when a multimodal checkpoint's non-language tensors are not imported."""
    if reader.left_out:
        print(f"mtjax: {reader.dir} is multimodal: its language model is used, its vision tower and projector "
              f"({len(reader.left_out)} tensors) are left out")


def check(cfg: ModelConfig, reader: SafetensorsReader) -> list[TensorSpec]:
    """Match the checkpoint's tensors against the layout; raise listing every mismatch."""
    specs = layout(cfg)
    expected = {s.hf_name: s for s in specs}
    present = set(reader.names())
    # Tied checkpoints sometimes carry a redundant lm_head.weight: accept and ignore it.
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    trailing = sorted(n for n in present - set(expected) if _layer(n) >= cfg.num_hidden_layers) \
        if cfg.family.trailing_layers else []
    if trailing:
        layers = sorted({_layer(n) for n in trailing})
        print(f"mtjax: {reader.dir}: layers {', '.join(map(str, layers))} are its {cfg.family.trailing_layers} "
              f"({len(trailing)} tensors): left out")
    for prefix, what in cfg.family.left_out.items():
        extra = [n for n in present - set(expected) if n.startswith(prefix)]
        if extra:
            print(f"mtjax: {reader.dir}: its {what} ({prefix}*, {len(extra)} tensors): left out")
            ignorable |= set(extra)
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected) - ignorable - set(trailing))
    misshaped = sorted(
        f"{n} {reader.shape(n)} (expected {expected[n].shape})"
        for n in set(expected) & present if reader.shape(n) != expected[n].shape
    )
    problems = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{title}: {shown}")
    if problems:
        raise CheckpointError(f"checkpoint {reader.dir} does not match its config: " + "; ".join(problems))
    return specs


def _layer(name: str) -> int:
    """The layer index of a `model.layers.N.` tensor name; -1 for other names."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() else -1


def set_path(tree, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def get_path(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def load_params(ckpt_dir: str | Path, cfg: ModelConfig | None = None, dtype=np.float32, seed: int = 0):
    """(cfg, params) from a checkpoint directory, params as numpy arrays in `dtype`; LoRA
    adapters, which no checkpoint holds, fresh from `seed` (mtjax.lora.fresh, as a run's
    store gets them: mtjax.store.hf_import.fill_parts)."""
    cfg = cfg or load_hf_config(ckpt_dir)
    reader = SafetensorsReader(ckpt_dir)
    specs = checked_specs(ckpt_dir, cfg, reader)
    params = jax.tree.map(lambda _: None, model.abstract_params(cfg))
    for spec in specs:
        for path, array in zip(spec.paths, to_mtjax(spec, reader.read(spec.hf_name))):
            set_path(params, path, array.astype(dtype))
    for i, block in enumerate(params["blocks"] if cfg.lora is not None else ()):
        for name, array in lora.fresh(parts.leaves(cfg, partid.block(i)), seed, i + 1).items():
            set_path(block, tuple(name.split(".")), array.astype(dtype))
    return cfg, params


def checked_specs(ckpt_dir: str | Path, cfg: ModelConfig, reader: SafetensorsReader) -> list[TensorSpec]:
    """The tensors `cfg`'s model takes from the checkpoint in `reader` (those it leaves out
    said), or one line naming the settings in which the checkpoint's model differs."""
    say_left_out(reader)
    try:
        specs = check(cfg, reader)
    except CheckpointError:
        # Name the settings that differ rather than the tensors that follow from them.
        try:
            diff = differences(load_hf_config(ckpt_dir), cfg, ignore=("param_dtype", "compute_dtype", "base_format",
                                                                             "ffn_chunk_tokens", "head_chunk_tokens",
                                                                             "freeze", "lora",
                                                                             "extra_hf"))
        except MtjaxError:
            diff = []  # no readable config.json: the tensor list is all there is to say
        if not diff:
            raise
        raise CheckpointError(f"checkpoint {ckpt_dir} holds another model than this one ({', '.join(diff)}: the "
                              "checkpoint's -> this run's); use the checkpoint's settings, or another checkpoint "
                              "or run.dir") from None
    return specs


def hf_tensors(cfg: ModelConfig, params) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs in Hugging Face names, layout and the checkpoint dtype."""
    dtype = NP_DTYPES[cfg.param_dtype]
    for spec in layout(cfg):
        yield spec.hf_name, from_tree(spec, params).astype(dtype)


def save_checkpoint(cfg: ModelConfig, tensors, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> None:
    """Write config.json and safetensors shards (with an index when more than one).

    `tensors` is an iterable of (hf_name, array) such as `hf_tensors(cfg, params)`;
    at most one shard is held in memory at a time.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], {}, 0
    total = 0  # tensor bytes without headers: the index's total_size, as transformers writes it
    tmp_names = []

    def flush():
        nonlocal current, size
        if current:
            name = f"shard-{len(tmp_names):05d}.tmp"
            try:
                save_file(current, str(out / name), metadata={"format": "pt"})
            except SafetensorError as e:  # e.g. a full disk, reported as an I/O error
                raise CheckpointError(f"cannot write {out / name} ({e}); free space there or choose another "
                                      "output directory") from None
            tmp_names.append(name)
            shards.append(list(current))
        current, size = {}, 0

    for name, array in tensors:
        if current and size + array.nbytes > max_shard_bytes:
            flush()
        current[name] = np.ascontiguousarray(array)
        size += array.nbytes
        total += array.nbytes
    flush()
    # A stale file of the other layout would shadow the new one in some loaders: drop it.
    if len(tmp_names) == 1:
        (out / tmp_names[0]).rename(out / SINGLE_FILE)
        (out / INDEX_FILE).unlink(missing_ok=True)
    else:
        weight_map = {}
        for i, (tmp, names) in enumerate(zip(tmp_names, shards)):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (out / tmp).rename(out / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (out / SINGLE_FILE).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=2))


def save_params(cfg: ModelConfig, params, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> None:
    """Save an mtjax params pytree as a Hugging Face checkpoint."""
    save_checkpoint(cfg, hf_tensors(cfg, params), out_dir, max_shard_bytes)
