"""Experiment configuration: small frozen dataclasses, one per concern.

An `ExperimentConfig` groups model, store, stream, optim, data and run settings. The
typed defaults below are the embedded default run (`mtjax train` with no arguments);
a YAML experiment file overrides some of them, and dotted command-line overrides
(`--optim.lr=3e-4`) override both. Every value is checked against its field's type and
an unknown key names the closest valid one (mtjax.config_values turns the text into values).
`load` is the one reader of experiment files.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from mtjax import parts, writable
from mtjax.bounds import AT_LEAST_0, AT_LEAST_1, EVERY, FRACTION, POSITIVE, SEED, SEQ_LEN, STEPS, Range, out_of_range
from mtjax.config_values import (FALSE, TRUE, coerce, construct, field_comments, plain, read_yaml, split_override,
                                 suggest, type_hints)
from mtjax.data.format import FORMATS, PACKING, TRAIN_ON
from mtjax.model_config import ConfigError, ModelConfig, load_hf_config
from mtjax.lora import LoraConfig
from mtjax.optim import OptimConfig

__all__ = [
    "ConfigError", "DataConfig", "DistributedConfig", "ExperimentConfig", "ModelSection", "PRESETS", "RunConfig",
    "StoreConfig", "StreamConfig", "dump", "load", "to_yaml", "model_config", "valid_keys",
]


# Used by the dataclasses' own checks, so defined before them.
def check_batch_split(batch_size: int, devices: int) -> None:
    """One line when a micro-batch of `batch_size` rows does not split evenly over `devices`."""
    if batch_size % devices:
        raise ConfigError(f"data.batch_size {batch_size} does not split over {devices} devices (stream.devices): "
                          f"use a multiple of {devices}, or set stream.devices to a divisor of {batch_size}")


def check_sequence_split(seq_len: int, devices: int) -> None:
    """One line when a row of `seq_len` tokens does not split evenly over `devices` (stream.split: sequence)."""
    if seq_len % devices:
        raise ConfigError(f"data.seq_len {seq_len} does not split over {devices} devices (stream.split: sequence): "
                          f"use a multiple of {devices}, or set stream.devices to a divisor of {seq_len}")


def check_split(split: str, batch_size: int, seq_len: int, devices: int) -> None:
    """What `split` (stream.split) cuts over `devices`, rows or tokens, must split evenly."""
    if split == "sequence":
        check_sequence_split(seq_len, devices)
    else:
        check_batch_split(batch_size, devices)


def _check_numbers(group: str, obj, table: dict[str, Range]) -> None:
    """One line for the first field of `obj` outside its range (mtjax.bounds)."""
    problem = out_of_range(group, obj, table)
    if problem:
        raise ConfigError(problem)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")


# Named architectures; inline `model.*` fields override them.
PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: a 4-block Llama-style byte-level model that trains on 2 CPU cores.
    "tiny": dict(model_type="llama", vocab_size=257, hidden_size=192, intermediate_size=512,
                 num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=1024, tie_word_embeddings=False),
    # GPT-2-small-sized Llama (~125M parameters with an 8k vocabulary).
    "llama-125m": dict(model_type="llama", vocab_size=8192, hidden_size=768, intermediate_size=3072,
                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                       max_position_embeddings=2048),
}


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Where the architecture and the starting weights come from."""

    preset: str | None = "tiny"  # named architecture (tiny, llama-125m); ignored when hf_config or checkpoint is given alone
    hf_config: str | None = None  # config.json, or a checkpoint dir, to read the architecture from
    checkpoint: str | None = None  # Hugging Face checkpoint dir whose weights start the run
    overrides: tuple[tuple[str, Any], ...] = ()  # inline ModelConfig fields, e.g. (("hidden_size", 256),)

    def __post_init__(self):
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"model.preset {self.preset!r} is unknown{suggest(self.preset, PRESETS)}; "
                              f"presets: {', '.join(PRESETS)}")
        if self.preset is not None and self.hf_config is not None:
            raise ConfigError("model.preset and model.hf_config both name an architecture; set one to null")


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Where the model state lives between steps (used by the streaming engine)."""

    path: str | None = None  # store directory; None means <run.dir>/store
    compute: str = "ram"  # tier of the compute-dtype weights: ram | disk
    master: str = "ram"  # tier of the fp32 master weights: ram | disk
    opt: str = "ram"  # tier of the optimizer state: ram | disk
    copies: int = 2  # copies of the state on disk: 2 (A/B slots) or 1 (half the disk; all kinds on disk, commit every step)

    def __post_init__(self):
        for kind in ("compute", "master", "opt"):
            _check_choice(f"store.{kind}", getattr(self, kind), ("ram", "disk"))
        if self.copies not in (1, 2):
            raise ConfigError(f"store.copies must be 1 or 2, got {self.copies!r}")
        if self.copies == 1 and "ram" in self.tiers.values():
            raise ConfigError("store.copies=1 keeps every kind of state on disk: set store.compute, store.master "
                              "and store.opt to disk, or use store.copies=2")

    @property
    def tiers(self) -> dict[str, str]:
        return {"compute": self.compute, "master": self.master, "opt": self.opt}


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """How a step runs: the engine and its streaming knobs."""

    engine: str = "stream"  # stream (one block at a time through the device) | reference (whole model in device memory)
    prefetch_depth: int = 2  # parts (embedding, blocks, head) staged on the device ahead of the one computing
    keep_every: int = 1  # keep block inputs every k blocks; 0 keeps only the embedding output
    activations: str = "device"  # where kept block inputs wait for the backward: device | host
    device_budget_bytes: int | None = None  # cap on device memory use, checked before step 1; None: no cap
    # auto: the planner's choice for the device budget, made when a run starts and by
    # `mtjax plan` for its profile (an engine built directly takes auto as none); a count: the parts whose
    # streaming costs most (step_parts.residency_order); a list: those parts.
    resident: int | str | tuple[str, ...] = "auto"  # parts whose whole state stays on the device, updated there: auto | none | all | N | embed,block.0,...
    # What the backward keeps of a recompute group whose blocks are all resident: full
    # (recompute each block from the group's input, as streamed ones are), dots (keep the
    # forward's projections, model.REMAT_POLICIES) or none (keep every residual: no
    # recompute). auto: the planner's choice with stream.resident (an engine built directly: full).
    remat: str = "auto"  # what resident blocks keep for the backward: auto | full | dots | none
    # LoRA adapters (a `lora:` section) of the streamed parts: resident keeps them on the
    # device with their AdamW state, updated there, while their frozen base streams (no
    # gradient leaves, no host update; a commit brings them to the store); streamed moves
    # them with the base and updates them on the host like any trained leaf. MoE blocks
    # that may split into expert groups (stream.expert_group_size or device_budget_bytes
    # set), and a multi-process run, stream them.
    adapters: str = "resident"  # LoRA adapters of streamed parts: resident | streamed
    # Data parallel over this process's devices (mtjax.stream.mesh): weights on every one,
    # each micro-batch's rows split over them, gradients summed there, one update on the host.
    devices: int | str = "all"  # devices the step runs on: all (every local device) | N (the first N)
    # What the devices split: each micro-batch's rows (data parallel), or each row's tokens
    # (context parallel: a device holds its share of the row, attention gathers the row's
    # keys and values; mtjax.attention_chunked.split_attention). Weights on every device either way.
    split: str = "batch"  # batch | sequence
    # A MoE block streamed as sub-parts: its router part (attention, router, shared
    # expert), then groups of this many experts, one after another (docs/moe.md,
    # "Expert groups"). Unset: only when the step does not fit device_budget_bytes whole.
    expert_group_size: int | None = None  # experts per streamed group of a MoE block: unset (as the budget needs) | N >= 1

    def __post_init__(self):
        _check_choice("stream.engine", self.engine, ("reference", "stream"))
        _check_choice("stream.activations", self.activations, ("device", "host"))
        _check_choice("stream.remat", self.remat, ("auto", "full", "dots", "none"))
        _check_choice("stream.split", self.split, ("batch", "sequence"))
        _check_choice("stream.adapters", self.adapters, ("resident", "streamed"))
        _check_numbers("stream", self, {"prefetch_depth": AT_LEAST_1, "keep_every": AT_LEAST_0,
                                        "device_budget_bytes": POSITIVE})
        d = self.devices
        if d != "all" and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ConfigError(f"stream.devices must be all or a device count >= 1, got {d!r}")
        if self.engine == "reference" and (self.split == "sequence" or isinstance(d, int) and d > 1):
            raise ConfigError("stream.devices / stream.split spread a step over several devices of the streamed "
                              "engine; the reference engine runs on one device: set stream.engine=stream, or drop them")
        g = self.expert_group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ConfigError(f"stream.expert_group_size must be a whole number of experts >= 1, or unset to split "
                              f"MoE blocks only as the device budget needs; got {g!r}")
        r = self.resident
        if isinstance(r, str) and r not in ("auto", "none", "all"):
            r = tuple(p.strip() for p in r.split(",") if p.strip())  # "embed,block.0" from a command line
        if isinstance(r, list):
            r = tuple(r)  # hashable, as a frozen config must be
        object.__setattr__(self, "resident", r)
        ok = (r in ("auto", "none", "all") if isinstance(r, str) else
              isinstance(r, int) and not isinstance(r, bool) and r >= 0 if not isinstance(r, tuple) else
              all(isinstance(p, str) for p in r))
        if not ok:
            raise ConfigError(f"stream.resident must be auto, none, all, a count >= 0 or a list of part names "
                              f"(embed, block.N, head), got {self.resident!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data: what to read, how to tokenize it, and how to batch it."""

    dataset: str = "builtin:shakespeare"  # prepared dataset dir, raw text/JSONL/Parquet file, `datasets` dir, or builtin:NAME
    tokenizer: str = "bytes"  # bytes | bpe:VOCAB | tokenizer.json | checkpoint dir (raw text; datasets bring their own)
    text_field: str = "text"  # JSONL field or table column holding the text
    format: str = "text"  # raw input: text | chat (JSONL messages) | prompt-completion (see docs/data.md)
    train_on: str = "answers"  # chat / prompt-completion: answers (assistant turns, completions) | all tokens
    packing: str = "pack"  # chat / prompt-completion: pack documents into rows of seq_len | pad (one per row)
    val_fraction: float = 0.01  # share of tokens held out for validation when preparing
    seq_len: int = 128  # tokens per row; position t predicts t + 1 within the row
    batch_size: int = 16  # rows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0  # seed of the shuffle over sequence windows
    other_tokenizer: bool = False  # train on data tokenized otherwise than the model's tokenizer (refused unless set)

    def __post_init__(self):
        if not str(self.dataset).strip():  # as a path it would mean the working directory: every text file under it
            raise ConfigError("data.dataset is empty; name a prepared dataset, a text, JSONL or Parquet file or "
                              "directory, or builtin:shakespeare")
        _check_numbers("data", self, {"seq_len": SEQ_LEN, "batch_size": AT_LEAST_1, "grad_accum": AT_LEAST_1,
                                      "val_fraction": FRACTION, "seed": AT_LEAST_0})
        _check_choice("data.format", self.format, FORMATS)
        _check_choice("data.train_on", self.train_on, TRAIN_ON)
        _check_choice("data.packing", self.packing, PACKING)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The training loop: length, logging, evaluation, checkpoints, the closing sample."""

    dir: str = "runs/default"  # run directory (metrics.jsonl, checkpoints), relative to cwd
    steps: int = 300  # optimizer steps
    log_every: int = 10  # steps between log lines when not on a terminal
    eval_every: int = 100  # steps between validation losses; 0 disables
    eval_batches: int = 4  # micro-batches per validation loss
    checkpoint_every: int = 0  # steps between commits of the run's store; 0 commits only at the start and the end
    seed: int = 0  # seed of parameter initialisation and sampling
    sample_prompt: str = "CLEOPATRA.\n"  # closing sample's prompt ("" skips); on non-Shakespeare data: its first words
    sample_tokens: int = 200  # tokens generated for that sample
    tensorboard: bool = False  # also write TensorBoard events (needs tensorboardX: the tensorboard extra)
    wandb: str | None = None  # also log to this Weights & Biases project (pip install 'mtjax[wandb]'); unset: off
    resume: bool | str = False  # true: continue the last commit; auto: only if there is one; false: start
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient: stop (naming the block) | skip (the step, no state change)

    def __post_init__(self):
        if not str(self.dir).strip():  # it would mean the working directory, holding the user's own files
            raise ConfigError("run.dir is empty; name the run's own directory, e.g. --run.dir=runs/NAME")
        _check_choice("run.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        if self.resume not in (True, False, "auto"):
            raise ConfigError(f"run.resume must be true, false or auto, got {self.resume!r}")
        _check_numbers("run", self, {"steps": STEPS, "log_every": EVERY, "eval_every": STEPS,
                                     "eval_batches": AT_LEAST_1, "checkpoint_every": STEPS, "sample_tokens": AT_LEAST_0,
                                     "seed": SEED})
        if self.wandb is not None and (not self.wandb.strip() or self.wandb.strip().lower() in TRUE + FALSE):
            raise ConfigError(f"run.wandb names the Weights & Biases project to log to (--run.wandb=my-project), "
                              f"got {self.wandb!r}; leave it unset to log nothing there")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """A run of several processes, one per host (mtjax.distributed; unset: the environment's
    MTJAX_COORDINATOR/MTJAX_NUM_PROCESSES/MTJAX_PROCESS_ID, a SLURM job's tasks, or one process)."""

    coordinator: str | None = None  # host:port of process 0, which every process connects to
    num_processes: int | None = None  # processes in the run (with coordinator)
    process_id: int | None = None  # this process's index, 0 .. num_processes - 1 (with coordinator)
    timeout_s: float = 120.0  # seconds for every process to join and pass the start-up checks

    def __post_init__(self):
        c, n, i = self.coordinator, self.num_processes, self.process_id
        if self.timeout_s <= 0:
            raise ConfigError(f"distributed.timeout_s must be > 0, got {self.timeout_s}")
        if c is None:
            if n is not None or i is not None:
                raise ConfigError("distributed.num_processes and process_id need distributed.coordinator "
                                  "(host:port of process 0)")
            return
        host, _, port = c.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"distributed.coordinator must be host:port (e.g. 10.0.0.1:7777), got {c!r}")
        if n is None or i is None or n < 1 or not 0 <= i < n:
            raise ConfigError(f"distributed.coordinator needs distributed.num_processes >= 1 and "
                              f"0 <= distributed.process_id < num_processes, got {n!r} and {i!r}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelSection = ModelSection()
    store: StoreConfig = StoreConfig()
    stream: StreamConfig = StreamConfig()
    optim: OptimConfig = OptimConfig(lr=4e-3, warmup_steps=20, decay_steps=280, weight_decay=0.1)
    data: DataConfig = DataConfig()
    run: RunConfig = RunConfig()
    distributed: DistributedConfig = DistributedConfig()
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        if isinstance(self.stream.devices, int):  # "all" is checked once the devices are known
            check_split(self.stream.split, self.data.batch_size, self.data.seq_len, self.stream.devices)

    def to_dict(self) -> dict:
        """Plain nested dict (YAML-ready); model overrides appear as model.<field>."""
        out = {}
        for f in dataclasses.fields(self):
            group = dataclasses.asdict(getattr(self, f.name))
            if f.name == "model":
                group.update(plain(dict(group.pop("overrides"))))
            out[f.name] = group
        return out


# --- model resolution -------------------------------------------------------------------


# The model fields an experiment may set beside model.hf_config (or a checkpoint naming the
# architecture): numerics, initialisation and loss weights, and the context, which rope
# scaling extends. Every other field is the architecture, which the HF config gives: a
# different value there is refused, not applied on top of it.
BESIDE_HF_CONFIG = ("compute_dtype", "base_format", "ffn_chunk_tokens", "head_chunk_tokens", "freeze", "param_dtype", "initializer_range",
                    "router_aux_loss_coef", "max_position_embeddings", "rope_scaling", "router_bias_update_rate")


def model_config(exp: ExperimentConfig) -> ModelConfig:
    """The ModelConfig an experiment describes: preset or hf_config, then inline overrides."""
    section = exp.model
    overrides = dict(section.overrides)
    if "sequence_devices" in overrides:  # the engine's, from its mesh
        raise ConfigError("model.sequence_devices is set by the engine: split each row's tokens over the devices with "
                          "stream.split: sequence (and stream.devices) instead")
    if overrides.get("compute_dtype") == "auto":  # mtjax.plan.compute_dtype resolves it for the hardware
        raise ConfigError("model.compute_dtype=auto is chosen when a run, `mtjax plan` or `mtjax init` starts; this "
                          "command needs it set: model.compute_dtype float32, bfloat16 or float16")
    adapters = dict(lora=exp.lora)  # the `lora:` section (mtjax.lora; no rank: none)
    try:
        if section.hf_config is not None:
            _refuse_architecture_beside(section, load_hf_config(section.hf_config), overrides)
            cfg = load_hf_config(section.hf_config, **overrides, **adapters)
        else:
            base = dict(PRESETS[section.preset]) if section.preset else {}
            cfg = ModelConfig(**{**base, **overrides, **adapters})
    except TypeError as e:  # a ModelConfig rejecting a field combination
        raise ConfigError(f"model: {e}") from None
    parts.check_roles(cfg)  # model.freeze names leaves of this model (mtjax.roles)
    # The reference engine holds the base decoded, and its commits would quantize it again.
    if cfg.base_format != "compute" and exp.stream.engine == "reference":
        raise ConfigError(f"model.base_format {cfg.base_format} needs stream.engine=stream: the reference engine holds "
                          "the whole model in device memory, its frozen base decoded")
    return cfg


def _refuse_architecture_beside(section: ModelSection, given: ModelConfig, overrides: dict) -> None:
    """One line naming the architecture fields the experiment sets to other values than
    the HF config `given` (read from section.hf_config) has."""
    changed = [f"{f.name} {getattr(given, f.name)!r} -> {overrides[f.name]!r}" for f in _model_fields()
               if f.name in overrides and f.name not in BESIDE_HF_CONFIG and overrides[f.name] != getattr(given, f.name)]
    if changed:
        source = "model.checkpoint" if section.hf_config == section.checkpoint else "model.hf_config"
        raise ConfigError(f"the architecture comes from {source} {section.hf_config}, and the experiment also sets "
                          f"{', '.join(changed)} (its -> yours); drop those model.* settings, or give the whole "
                          f"architecture inline (model.preset=null, no model.hf_config, every architecture field)")


# --- loading and overriding ----------------------------------------------------------------


def load(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> ExperimentConfig:
    """Typed defaults, then the YAML file at `path`, then `key=value` overrides."""
    tree: dict = {}
    if path is not None:
        tree = read_yaml(Path(path))
    for item in overrides:
        key, value = split_override(item)
        _set_dotted(tree, key, value)
    return from_dict(tree)


def to_yaml(exp: ExperimentConfig) -> str:
    """`exp` as a YAML experiment file that `load` reads back to an equal config."""
    return yaml.safe_dump(exp.to_dict(), sort_keys=False)


def dump(exp: ExperimentConfig, path: str | Path) -> None:
    writable.write_text(path, to_yaml(exp))


def from_dict(tree: dict) -> ExperimentConfig:
    """Build an ExperimentConfig from a nested mapping of overrides of the defaults."""
    if not isinstance(tree, dict):
        raise ConfigError(f"an experiment config must be a mapping of groups, got {type(tree).__name__}")
    groups = {}
    for name, value in tree.items():
        if name not in _GROUPS:
            raise ConfigError(f"unknown config group {name!r}{suggest(name, _GROUPS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"config group {name!r} must be a mapping of keys, got {value!r}")
        groups[name] = _model_section(value) if name == "model" else _build(name, value)
    return ExperimentConfig(**groups)


def valid_keys() -> dict[str, tuple[Any, Any, str]]:
    """{dotted key: (type, default, help)} for every settable key, in declaration order."""
    out = {}
    defaults = ExperimentConfig()
    for group, cls in _GROUPS.items():
        if group == "model":
            for name in ("preset", "hf_config", "checkpoint"):
                out[f"model.{name}"] = (type_hints(ModelSection)[name], getattr(defaults.model, name),
                                        field_comments(ModelSection).get(name, ""))
            preset = PRESETS[defaults.model.preset]
            for f in _model_fields():
                out[f"model.{f.name}"] = (type_hints(ModelConfig)[f.name], preset.get(f.name, f.default),
                                          field_comments(ModelConfig).get(f.name, "architecture override"))
            continue
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            key = f"{group}.{f.name}"
            out[key] = (type_hints(cls)[f.name], getattr(getattr(defaults, group), f.name),
                        comments.get(f.name, _HELP.get(key, "")))
    return out


_GROUPS = {"model": ModelSection, "store": StoreConfig, "stream": StreamConfig, "optim": OptimConfig,
           "data": DataConfig, "run": RunConfig, "distributed": DistributedConfig, "lora": LoraConfig}
_SOURCES = ("preset", "hf_config", "checkpoint")
_HELP = {  # help for fields whose class (OptimConfig) has no comment on them
    "optim.b1": "AdamW decay of the first moment",
    "optim.b2": "AdamW decay of the second moment",
    "optim.eps": "AdamW denominator epsilon",
}


def _model_fields():
    return [f for f in dataclasses.fields(ModelConfig) if f.name not in ("extra_hf", "lora")]  # lora: its own section


def _model_section(values: dict) -> ModelSection:
    values = dict(values)
    fields = {f.name: f for f in _model_fields()}
    overrides = []
    for key in [k for k in values if k not in _SOURCES]:
        if key not in fields:
            raise ConfigError(f"unknown config key 'model.{key}'"
                              f"{suggest(key, [*_SOURCES, *fields], prefix='model.')}")
        overrides.append((key, coerce(values.pop(key), type_hints(ModelConfig)[key], f"model.{key}")))
    # A checkpoint alone names the architecture too (its config.json); naming a config file
    # or checkpoint replaces the default preset unless a preset (possibly null) is named.
    if values.get("checkpoint") and "preset" not in values and "hf_config" not in values:
        values["hf_config"] = values["checkpoint"]
    if values.get("hf_config") and "preset" not in values:
        values["preset"] = None
    section = {k: coerce(v, type_hints(ModelSection)[k], f"model.{k}") for k, v in values.items()}
    return construct("model", ModelSection, dict(section, overrides=tuple(overrides)))


def _build(group: str, values: dict):
    """The experiment's default `group` with `values` replacing some of its fields."""
    default = getattr(ExperimentConfig(), group)
    cls = type(default)
    hints = type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown config key '{group}.{key}'{suggest(key, names, prefix=group + '.')}")
        kwargs[key] = coerce(value, hints[key], f"{group}.{key}")
    return construct(group, lambda **kw: dataclasses.replace(default, **kw), kwargs)


def _set_dotted(tree: dict, key: str, value) -> None:
    group, _, name = key.partition(".")
    if not name or "." in name:
        candidates = list(valid_keys())
        raise ConfigError(f"unknown config key {key!r}{suggest(key, candidates)}; keys look like optim.lr")
    tree.setdefault(group, {})
    if not isinstance(tree[group], dict):
        raise ConfigError(f"config group {group!r} must be a mapping")
    tree[group][name] = value

