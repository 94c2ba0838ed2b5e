"""A run's checkpoint: the last commit of its layer store, <run.dir>/store unless
store.path is set. Every run checkpoints this one way, whichever engine and tiers it uses.

    store, state, created = checkpoint.open_run_store(exp, cfg)  # the writer lock, held
    store.commit(step, checkpoint.train_state(exp, step, loader.cursor))
    checkpoint.write_model(store, params, opt_state, tx)        # whole-model state -> parts
    params, opt_state = checkpoint.read_model(store, tx)
    checkpoint.export_final(exp, run_dir / "final", tokenizer, step)   # HF export, not a resume format
    cfg, params = checkpoint.load_weights(path)   # a store's last commit, or an HF checkpoint (eval, generate)

`open_run_store` refuses, in one line each and before anything is written: a second
trainer (the store's lock), a store holding a trained run without `run.resume`, a resume
whose fixed settings (data, tokenizer, batch shape, optimizer) differ from the commit's,
a resume to a run.steps before its last commit, `run.resume=true` with nothing to resume,
and records in the run directory that are not this run's (mtjax.rundir). A multi-process run
(`hosts`) opens this process's shard store under the store root (mtjax.store.shards),
after the processes have brought their shards to the run's last commit; a shard of a run
with another process count, or of another run, is refused on every process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
from pathlib import Path

import numpy as np

import mtjax.store
from mtjax import data, distributed, hf, partid, parts, rundir, textfile, treepath
from mtjax.config import ConfigError, ExperimentConfig
from mtjax.data import chat
from mtjax.model_config import ModelConfig, load_hf_config
from mtjax.optim import make_optimizer
from mtjax.partid import EMBED, HEAD
from mtjax.store import fill, hf_export, layout, lock, manifest, shards
from mtjax.store import store as store_mod
from mtjax.store.errors import StoreError
from mtjax.stream.update import full_opt_state, split_opt_state

EXPORT_NOTE = "mtjax-state.json"  # in final/: the step it holds and its tokenizer (for eval and generate)

# What `mtjax.store.create` writes before its manifest: a directory holding only these is
# the leftover of a run killed while creating its store.
_PARTIAL_STORE = {"parts", "train_state", "pending", "schema.json", "schema.json.tmp", "STORE_ID", "STORE_ID.tmp",
                  "LOCK", "manifest.json.tmp"}


def store_path(exp: ExperimentConfig) -> Path:
    return Path(exp.store.path or Path(exp.run.dir) / "store")


def train_state(exp: ExperimentConfig, step: int, cursor: dict) -> dict:
    """What a commit records beside the weights so that a resume continues exactly: the
    step, the data cursor, the seed, and the settings that must not change (the LR
    schedule's position is the optimizer state's step count, which the store holds)."""
    return {"step": step, "loader": dict(cursor), "seed": exp.run.seed, "fixed": fixed_settings(exp)}


def fixed_settings(exp: ExperimentConfig) -> dict:
    d = exp.data
    fixed = {"optim": dataclasses.asdict(exp.optim), "data": dict(dataset=d.dataset, tokenizer=d.tokenizer,
             seq_len=d.seq_len, batch_size=d.batch_size, grad_accum=d.grad_accum, seed=d.seed)}
    return json.loads(json.dumps(fixed))  # as the store gives it back (tuples become lists)


def open_run_store(exp: ExperimentConfig, cfg: ModelConfig, hosts=None):
    """(store open for writing, train state of its last commit or None, created).

    created: the run found no store and made an empty one (the caller fills it and
    commits step 0, or `discard`s it if the run fails before). A store without train
    state was filled by `mtjax import` or `mtjax init`: the run trains from its weights.
    `hosts` (mtjax.stream.hosts.Hosts): this process's shard of a multi-process run.
    The records in this process's run directory (mtjax.rundir) must be the store's run's.
    """
    if hosts is None:
        return _open_at(store_path(exp), exp, cfg, None, rundir.records_dir(exp.run.dir))
    root, shard = store_path(exp), hosts.shard
    distributed.agree(hosts, _refusal(lambda: shards.check_count(root, hosts.count)))
    table = hosts.gather_ints(shards.generations(root, shard))
    distributed.agree(hosts, _refusal(lambda: shards.resolve(root, shard, table)))
    # The run id every shard records: process 0's random pick.
    run = "".join(f"{int(x):08x}" for x in hosts.gather_ints([secrets.randbelow(2**31) for _ in range(2)])[0])
    opened, records = [], rundir.records_dir(exp.run.dir, hosts.index)
    refused = _refusal(lambda: opened.append(_open_at(
        shards.shard_root(root, shard), exp, cfg, {"index": shard.index, "count": shard.count, "run": run}, records)))
    if refused is not None:
        distributed.agree(hosts, refused)
    store, state, created = opened[0]
    try:
        distributed.agree(hosts, None)  # another process's shard may have been refused
        mine = store.hosts["run"] if store.hosts else ""
        ids = hosts.gather_ints(distributed.digest(mine))
        foreign = None if np.array_equal(ids[shard.index], ids[0]) else StoreError(
            f"store shard {store.root} belongs to another run (run id {mine}) than process 0's shard; "
            f"put back this run's own {shard.name}, or start a new run.dir")
        distributed.agree(hosts, foreign)
        # This process's records, once its shard is the run's (a new shard's were checked before it was made).
        distributed.agree(hosts, None if created else _refusal(
            lambda: rundir.check(records, store.run_id, store.root, trained=state is not None)))
    except BaseException:
        discard(store) if created else store.close()
        raise
    return store, state, created


def _refusal(check) -> Exception | None:
    """The one-line error `check()` raises (a store or config refusal), or None."""
    try:
        check()
    except (StoreError, ConfigError) as e:
        return e
    return None


def _open_at(path: Path, exp: ExperimentConfig, cfg: ModelConfig, hosts: dict | None, records: Path):
    if (path / "manifest.json").exists():
        # Every refusal comes before the writer lock is taken, so it changes no byte there.
        lock.check_free(path)
        with mtjax.store.open(path, config=cfg) as reader:
            if not reader.never_written:
                state = _check(exp, reader, reader.load_train_state())
                if hosts is None:  # (a shard's records: once its run is agreed, in open_run_store)
                    rundir.check(records, reader.run_id, path, trained=state is not None)
        store = mtjax.store.open(path, writable=True, config=cfg)  # the writer lock: one trainer per store
        if not store.never_written:
            try:
                state = _check(exp, store, store.load_train_state())
                if hosts is None:
                    rundir.check(records, store.run_id, path, trained=state is not None)  # (as the lock found it)
                return store, state, False
            except BaseException:
                store.close()
                raise
        store.close()  # created by a run killed before its first commit: start over
    elif path.is_dir() and layout.data_held(path):  # a store whose manifest is gone: never removed
        raise StoreError(manifest.lost(path))
    elif path.exists() and (not path.is_dir() or set(os.listdir(path)) - _PARTIAL_STORE):
        raise ConfigError(f"store.path {path} exists but holds no mtjax store; choose another store.path")
    rundir.check(records, None, path)  # a store made now: records here are of a run whose store is gone
    if path.exists():
        _remove_unlocked(path)
    elif exp.run.resume is True:
        raise ConfigError(f"run.resume: {exp.run.dir} has no checkpoint to resume from; drop --run.resume "
                          "(or pass --run.resume=auto to resume only when there is one)")
    store = mtjax.store.create(path, cfg, make_optimizer(exp.optim), copies=exp.store.copies, hosts=hosts)
    return store, None, True


def _remove_unlocked(path: Path) -> None:
    """Delete the leftover of a killed run's store creation, unless a live run holds it."""
    held = lock.WriterLock(path)  # refused in one line while its creator is still at work
    try:
        shutil.rmtree(path)
    finally:
        held.release()


def discard(store) -> None:
    """Remove a store this run created and never committed (its start failed)."""
    root = store.root
    store.close()
    shutil.rmtree(root, ignore_errors=True)


def _check(exp: ExperimentConfig, store, state: dict | None) -> dict | None:
    path = store.root
    if store.copies != exp.store.copies:
        raise ConfigError(f"store {path} keeps {store.copies} cop{'y' if store.copies == 1 else 'ies'} of the "
                          f"state; set --store.copies={store.copies} to train it")
    if state is None:
        return None
    if exp.run.resume is False:
        where = "store.path" if exp.store.path else "run.dir"
        raise ConfigError(f"{path} holds a run trained to step {state['step']}; pass --run.resume=true to "
                          f"continue it, or choose another {where}")
    if state["step"] > exp.run.steps:  # its commits would name a step behind its weights
        raise ConfigError(f"run.resume: {path} is trained to step {state['step']}, past run.steps={exp.run.steps}; "
                          f"pass --run.steps={state['step']} or more")
    saved, now = state.get("fixed", {}), fixed_settings(exp)
    diff = [f"{g}.{k} {saved.get(g, {}).get(k)!r} (now {now[g][k]!r})" for g in now for k in now[g]
            if saved.get(g, {}).get(k) != now[g][k]]
    if diff:
        raise ConfigError(f"run.resume: store {path} was trained with other settings: {', '.join(diff)}; "
                          "resume with the same ones, or use a new run.dir")
    return state


# --- whole-model state in and out of a store (the reference engine keeps it whole) --------


def write_model(store, params, opt_state, tx) -> None:
    """Write every part's master weights, compute copy and optimizer state (not committed)."""
    opt = split_opt_state(store.config, tx, opt_state)
    for p in parts.parts(store.config):
        master = {n: np.asarray(a, np.float32) for n, a in treepath.flatten(parts.part_params(params, p.name)).items()}
        fill.write_part(store, p.name, master, opt=opt[p.name])


def read_params(store):
    """The fp32 params pytree of the store's committed master weights (a frozen leaf's:
    its compute copy, mtjax.store.store.weights)."""
    cfg = store.config
    named = {p.name: store_mod.weights(store, p.name) for p in parts.parts(cfg)}
    tree = {name: treepath.unflatten(parts.abstract_part(cfg, name), named[name]) for name in named}
    return parts.whole_params(cfg, tree)


def read_model(store, tx):
    """(params, opt_state) of the store's commit, shaped as the reference trainer holds them."""
    opt = {p: store.read(p, "opt").result() for p in store.parts}
    return read_params(store), full_opt_state(store.config, tx, opt)


def export_final(exp: ExperimentConfig, out: Path, tokenizer, step: int, chat_template: dict | None = None,
                 store_dir: Path | None = None, params=None, say=None) -> Path:
    """The run's last commit as a Hugging Face checkpoint in `out`, with its tokenizer, and
    the chat template its data was rendered with ({"source", "special_tokens"} of a chat
    dataset's meta.json), so that transformers and `mtjax generate --chat` prompt it alike.
    A multi-process run passes its shard's `store_dir` and the whole `params` (gathered).
    `say(line)`: where a byte-level model's export says that it has no tokenizer."""

    def extra(tmp: Path) -> None:
        tokenizer.save(tmp)
        if chat_template:
            (tmp / chat.TEMPLATE_FILE).write_text(chat_template["source"])
            if chat_template.get("special_tokens"):
                (tmp / chat.CONFIG_FILE).write_text(json.dumps(chat_template["special_tokens"], indent=2))
        spec = tokenizer.spec if tokenizer.spec == "bytes" else "tokenizer.json"
        (tmp / EXPORT_NOTE).write_text(json.dumps({"step": step, "tokenizer": spec, "eos_id": tokenizer.eos_id},
                                                  indent=2))

    names = [] if params is None else [EMBED, *map(partid.block, range(len(params["blocks"]))), HEAD]
    masters = None if params is None else {
        name: {n: np.asarray(a) for n, a in treepath.flatten(parts.part_params(params, name)).items()} for name in names}
    return hf_export.export_hf(store_dir or store_path(exp), out, replace=True, extra=extra, masters=masters,
                               say=say)


# --- a saved checkpoint read back (eval, generate, the tokenizer check of a run's start) ---


def weights_config(path: str | Path) -> ModelConfig:
    """The model config of a layer store or an HF checkpoint directory (no weights read)."""
    if layout.is_store(path):
        with mtjax.store.open(path) as store:
            return store.config
    return load_hf_config(path)


def load_weights(path: str | Path):
    """(model config, fp32 params) of an HF checkpoint dir or of a layer store (its last
    committed master weights, read without taking the writer lock)."""
    path = Path(path)
    if not layout.is_store(path):
        return hf.load_params(path)
    with mtjax.store.open(path) as store:
        store.check_complete("read its weights")
        return store.config, read_params(store)


def checkpoint_tokenizer(ckpt_dir: str | Path, spec: str | None = None):
    """The tokenizer saved with a checkpoint (or the one `spec` names)."""
    spec = spec or tokenizer_spec(ckpt_dir)
    if spec is None:
        raise data.DataError(f"{ckpt_dir} holds no tokenizer; pass --tokenizer bytes or a tokenizer.json")
    return data.load_tokenizer(spec)


def tokenizer_spec(folder: str | Path) -> str | None:
    """The spec of the tokenizer saved in a checkpoint (or store tokenizer) directory: its
    tokenizer.json (gzipped too), or bytes where its export note says so; None: none there."""
    folder = Path(folder)
    for name in ("tokenizer.json", "tokenizer.json.gz"):
        if (folder / name).is_file():
            return str((folder / name).resolve())
    state = folder / EXPORT_NOTE
    if state.exists() and json.loads(textfile.read(state)).get("tokenizer") == "bytes":
        return "bytes"
    return None
