"""A training run: config -> model, data and engine -> steps -> store commits, an export and a sample.

    summary = mtjax.run.train(mtjax.config.load("experiments/default.yaml"))

`mtjax train` is a thin wrapper around `train`. The engine that runs a step is the one
`stream.engine` names (mtjax.engines); the periodic validation loss evaluates the
validation split's first batches (mtjax.evaluate.eval_batches) with that engine.

A multi-process run (`distributed`, mtjax.distributed) runs this on every process: each
reads the same global batches and trains its rows of them; process 0 writes the run's
records (config.yaml, metrics.jsonl, summary.json) and logs to W&B (run.wandb), process
p > 0 its own metrics.jsonl under <run.dir>/process-<p>/.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from mtjax.store import fresh, hf_import, layout, shards
from mtjax.store import tokenizer as store_tokenizer
from mtjax import checkpoint, evaluate, writable
from mtjax import config as config_lib
from mtjax import data, distributed, documents, generate, hf, model, parts, preflight, rundir, wandb_log
from mtjax.batch import Batch
from mtjax.config import ConfigError, ExperimentConfig, RunConfig
from mtjax.engines import Engine, make_engine
from mtjax.errors import MtjaxError, NonFiniteStep
from mtjax.model_config import ModelConfig
from mtjax.optim import lr_at, make_optimizer, schedule_warnings
from mtjax.plan import compute_dtype, residency
from mtjax.plan.cost import mfu_flops_per_token
from mtjax.progress import Progress, peak_flops, require_tensorboard
from mtjax.stream import StreamEngine, staging
from mtjax.stream import hosts as stream_hosts
from mtjax.stream import sample as sample_mod
from mtjax.stream import step_parts
from mtjax.stream.budget import DeviceBudgetError


def _trained_text(cfg: ModelConfig) -> str:
    """', 12,288 of them trained (LoRA rank 8)' where a step trains only some parameters (mtjax.roles), else ''."""
    if not parts.frozen_any(cfg):
        return ""
    adapters = f" (LoRA rank {cfg.lora.rank})" if cfg.lora is not None else ""
    return f", {parts.trained_params(cfg):,} of them trained{adapters}"


def initial_params(exp: ExperimentConfig, cfg: ModelConfig):
    """Weights of the checkpoint the experiment starts from, else a fresh initialisation:
    the whole model, for a new run's reference engine or multi-process shards (a stream
    engine's run on one process fills its store part by part instead, `_fill_store`)."""
    if exp.model.checkpoint:
        return hf.load_params(exp.model.checkpoint, cfg, seed=exp.run.seed)[1]
    return model.init_params(cfg, exp.run.seed)


def _fills_store(exp: ExperimentConfig, hosts) -> bool:
    """Whether a new run's store is filled part by part before its engine starts (the
    stream engine's run on one process; a shard holds rows, the reference engine the model)."""
    return exp.stream.engine == "stream" and hosts is None


def _fill_store(exp: ExperimentConfig, store) -> None:
    """The starting weights (initial_params's values) and fresh optimizer state into every
    part of the run's new `store`, one part at a time (uncommitted)."""
    tx = make_optimizer(exp.optim)
    if exp.model.checkpoint:
        hf_import.fill_parts(store, exp.model.checkpoint, tx, exp.run.seed)
    else:
        fresh.fill_parts(store, exp.run.seed, tx)


def weights_provenance(exp: ExperimentConfig, resumed: Path | None = None, step: int = 0,
                       store: Path | None = None) -> list[str]:
    """The lines that say where a run's starting weights come from: a commit or checkpoint
    `resumed` at `step`, the untrained weights of a layer `store` (filled by `mtjax import`
    or `mtjax init`), model.checkpoint, or a random initialisation, which model.hf_config
    alone (an architecture, not its weights) gets a warning for."""
    if resumed is not None:
        return [f"mtjax: weights: resumed from {resumed} at step {step}"]
    if store is not None:
        return [f"mtjax: weights: the layer store {store} as imported (no training steps in it yet)"]
    if exp.model.checkpoint:
        return [f"mtjax: weights: the Hugging Face checkpoint {exp.model.checkpoint}"]
    lines = [f"mtjax: weights: a fresh random initialisation (run.seed {exp.run.seed})"]
    if exp.model.hf_config:
        where = f" and no layer store at {checkpoint.store_path(exp)}"
        lines.append(f"mtjax: warning: model.hf_config={exp.model.hf_config} gives the architecture only; no "
                     f"model.checkpoint{where}, so training starts from random weights; to fine-tune, pass "
                     f"--model.checkpoint={exp.model.hf_config} or `mtjax import` it into the store first")
    return lines


def model_tokenizer(exp: ExperimentConfig) -> tuple[str, Path] | None:
    """(spec, directory) of the tokenizer whose ids the starting weights learned:
    model.checkpoint's, else the one `mtjax import` kept in the run's store; None for
    weights that are new (or a checkpoint that has no tokenizer)."""
    if exp.model.checkpoint:
        folder = Path(exp.model.checkpoint)
    else:
        store = checkpoint.store_path(exp)
        folder = store_tokenizer.kept(store) if (store / layout.MANIFEST).exists() else None
    spec = None if folder is None else checkpoint.tokenizer_spec(folder)
    return None if spec is None else (spec, folder)


def check_tokenizer(exp: ExperimentConfig, dataset, run_dir: Path) -> None:
    """Refuse data whose ids mean other tokens to the model than those its weights learned
    (unless data.other_tokenizer says to train on it anyway)."""
    found = None if exp.data.other_tokenizer else model_tokenizer(exp)
    if found is None:
        return
    spec, folder = found
    if dataset.path.resolve() == (run_dir / "data").resolve():  # raw text, tokenized by data.tokenizer
        name, fix = f"data.dataset {exp.data.dataset}", f"pass --data.tokenizer={folder}"
    else:
        name, fix = None, f"prepare it again with `mtjax data prepare ... --tokenizer {folder}`"
    dataset.check_tokenizer(spec, f"{fix}, or set --data.other_tokenizer=true to train on it anyway", name)


def _eval_batches(dataset, exp: ExperimentConfig) -> Batch | None:
    """The same validation micro-batches at every evaluation (None: split too small)."""
    start, stop = dataset.split("val")
    if (stop - start) // exp.data.seq_len == 0:
        return None
    return evaluate.eval_batches(dataset, "val", exp.data.seq_len, exp.data.batch_size, exp.run.eval_batches)[0]


def train(exp: ExperimentConfig = ExperimentConfig(), stream=None) -> dict:
    """Run the experiment; returns a summary (losses, throughput, sample, paths).

    A run writes only what it made or proved its own, and nothing before its store's lock is
    held and every refusal that needs no data passed: the store's (mtjax.checkpoint), the
    run directory's records (mtjax.rundir) and its data cache (mtjax.data.check_cache). A
    resume of a finished run (its final/ and summary.json in place) writes nothing."""
    out = stream or sys.stderr
    run_dir = Path(exp.run.dir)
    if exp.stream.engine == "stream":  # XLA reads its pinned pool's cap when its GPU client starts: before any backend
        widest = config_lib.model_config(compute_dtype.widest(exp))  # auto is resolved on the backend, below
        staging.raise_host_memory_limit(staging.pinned_host_bytes(widest, exp.stream, exp.data.batch_size,
                                                                  exp.data.seq_len, exp.data.grad_accum))
    # model.compute_dtype=auto: this machine's choice, recorded resolved (store, config.yaml)
    exp, dtype_choice = compute_dtype.for_run(exp)
    cfg = config_lib.model_config(exp)
    cfg.check_context(exp.data.seq_len, "data.seq_len")
    if exp.run.wandb:
        wandb_log.require()  # a missing package stops the run before anything is made
    if exp.run.tensorboard:
        require_tensorboard()  # likewise: a run made first would need run.resume once it is installed
    hosts = _join(exp)
    if hosts is None:  # before anything is prepared: a multi-process run's shards need all of its processes
        shards.check_count(checkpoint.store_path(exp), 1)
    dataset = data.prepared(exp.data)  # a prepared dataset is used as it is, with its own tokenizer
    if dataset is not None:
        tokenizer = dataset.tokenizer()
        exp = replace(exp, data=dict(tokenizer=tokenizer.spec))  # (a commit's fixed settings record it)
    else:  # raw text, which the run prepares into <run.dir>/data: only into a cache a run made
        _agreed(hosts, lambda: data.check_cache(exp.data, run_dir / "data"))
    # The run's store: its writer lock, and its refusals (a trained run without run.resume,
    # other fixed settings, records of another run), before anything under run.dir is written.
    store, state, created = checkpoint.open_run_store(exp, cfg, hosts)
    lead = hosts is None or hosts.index == 0  # writes the run's records
    engine = None
    try:
        first, cursor = (int(state["step"]), state["loader"]) if state is not None else (0, None)
        if state is not None and first >= exp.run.steps:
            done = _finished(run_dir, first, hosts)
            if done is not None:
                print(f"mtjax: {run_dir} is already trained to step {first} (run.steps={exp.run.steps}); nothing "
                      "written (its closing lines follow)", file=out, flush=True)
                return done
        run_dir.mkdir(parents=True, exist_ok=True)
        if dataset is None:  # raw text: prepared into the run's own data cache
            if hosts is not None and hosts.index:
                hosts.barrier("mtjax data")  # process 0 prepares a shared run.dir's data first
            dataset = data.resolve(exp.data, run_dir / "data")  # prepared again when the inputs change
            if hosts is not None and not hosts.index:
                hosts.barrier("mtjax data")
            tokenizer = dataset.tokenizer()
        check_tokenizer(exp, dataset, run_dir)  # the cause of ids past the vocabulary, when it is one
        dataset.check_vocab(cfg.vocab_size)
        asked = exp.stream  # config.yaml keeps `auto`: another machine's memory resolves it anew
        processes = 1 if hosts is None else hosts.count
        # stream.resident=auto: the planner's parts for this device's memory; none for one of several processes
        exp = residency.for_run(exp, processes)
        preflight.check(exp, cfg, dataset, processes=processes)  # before any weight is made
        exp = _as_run(exp, dataset, tokenizer)
        positions = 0  # the closing sample's prompt and new tokens: refused now, not after the run
        if exp.run.sample_prompt and exp.run.sample_tokens:
            prompt = generate.prompt_ids(tokenizer, exp.run.sample_prompt)
            generate.check_fits(cfg, prompt, exp.run.sample_tokens, ("run.sample_prompt", "run.sample_tokens"))
            positions = max(len(prompt), 1) + exp.run.sample_tokens
            _check_sample_budget(exp, cfg, positions, _sample_budget(exp))
        val = _eval_batches(dataset, exp) if exp.run.eval_every else None
        loader = data.Loader(dataset, "train", exp.data.seq_len, exp.data.batch_size, exp.data.grad_accum,
                             exp.data.seed, cursor=cursor)
        if created and _fills_store(exp, hosts):
            # The new store is filled one part at a time, as `mtjax init` and `mtjax import`
            # fill theirs, and committed (resumable from the first moment); the engine then
            # starts from it: the whole model is never on the device nor in host memory.
            _fill_store(exp, store)
            store.commit(0, checkpoint.train_state(exp, 0, loader.cursor))
            engine = make_engine(exp, cfg, None, store=store, step=0, hosts=hosts)
            _check_sample_budget(exp, cfg, positions, _sample_budget(exp, engine))  # beside its resident parts
            created, origin = False, {}
        elif created:  # the reference engine (the whole model in memory by design), a multi-process run's shard
            engine = make_engine(exp, cfg, initial_params(exp, cfg), store=store, hosts=hosts)
            _check_sample_budget(exp, cfg, positions, _sample_budget(exp, engine))  # beside its resident parts
            engine.commit(0, checkpoint.train_state(exp, 0, loader.cursor))  # resumable from the first moment
            created, origin = False, {}
        else:  # the store's last commit (or the weights `mtjax import` put there) is the start
            engine = make_engine(exp, cfg, None, store=store, step=first, hosts=hosts)
            _check_sample_budget(exp, cfg, positions, _sample_budget(exp, engine))
            origin = dict(store=store.root) if state is None else dict(resumed=store.root, step=first)
        # Only now that everything checked out: a run that fails to start leaves the previous one.
        records = rundir.records_dir(run_dir, 0 if lead else hosts.index)
        rundir.claim(records, store.run_id)  # before any other record: they are this run's
        if lead:
            config_lib.dump(dataclasses.replace(exp, stream=asked), run_dir / "config.yaml")
        if state is None:
            (records / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run starts a fresh record
            wandb_log.forget(records)  # and a new W&B run
        tokens_per_step = exp.data.grad_accum * exp.data.batch_size * exp.data.seq_len
        print(f"mtjax: {model.num_params(cfg) / 1e6:.2f}M-parameter {cfg.model_type}{_trained_text(cfg)} "
              f"({cfg.num_hidden_layers} blocks, "
              f"width {cfg.hidden_size}), {exp.stream.engine} engine on {_devices_text(engine, hosts)}; "
              f"{dataset.meta['num_tokens']:,} tokens ({dataset.meta['tokenizer_source']}); "
              f"{_steps_text(first, exp.run.steps)} of {tokens_per_step:,} tokens; run dir {run_dir}",
              file=out, flush=True)
        if dtype_choice:
            print(f"mtjax: {dtype_choice}", file=out, flush=True)
        # what auto chose (a multi-process run's `none` is the rule's, residency.for_inputs)
        if exp.stream.resident not in ((), "none") and exp.stream.resident != asked.resident:
            print(f"mtjax: resident on the device (stream.resident={asked.resident}): "
                  f"{', '.join(exp.stream.resident)}; remat {exp.stream.remat}", file=out, flush=True)
        for line in weights_provenance(exp, **origin):
            print(line, file=out, flush=True)
        for warning in schedule_warnings(exp.optim, exp.run.steps):
            print(f"mtjax: warning: {warning}", file=out, flush=True)
        if exp.run.eval_every and val is None:
            start, stop = dataset.split("val")
            print(f"mtjax: warning: run.eval_every={exp.run.eval_every} asks for validation losses, but the val split "
                  f"of {exp.data.dataset} holds {stop - start:,} tokens, less than one row of data.seq_len "
                  f"{exp.data.seq_len}: none is computed; hold out more (data.val_fraction, or data prepare's "
                  "--val-fraction), or set run.eval_every=0", file=out, flush=True)
        if exp.stream.engine == "stream" and asked.resident not in ("auto", "none", (), 0) and \
                (buffered := step_parts.with_buffers(cfg)):
            print(f"mtjax: warning: stream.resident={asked.resident} leaves {', '.join(buffered)} streamed: their "
                  f"buffers are updated on the host only", file=out, flush=True)
        if hosts is not None:
            print(f"mtjax: process {hosts.index} of {hosts.count}: {len(jax.local_devices())} device(s) here; "
                  f"this process holds its rows of master and optimizer state in {store.root}", file=out, flush=True)
            if cfg.lora is not None:  # stream.adapters=resident is one process's
                print(f"mtjax: LoRA adapters stream with their base here: each of the {hosts.count} processes holds "
                      f"its rows of their state (stream.adapters=resident applies to one process)",
                      file=out, flush=True)
        return _loop(exp, cfg, engine, loader, val, tokenizer, first, tokens_per_step, out, records, lead,
                     kept=_summary_of(run_dir) if first >= exp.run.steps else None)
    finally:
        if engine is not None:
            engine.close()
        if created:  # the run failed before its first commit: leave no store behind
            checkpoint.discard(store)
        else:
            store.close()


def _join(exp: ExperimentConfig):
    """This process's place in a multi-process run (None: one process), once every process
    has joined and started with the same experiment config (mtjax.distributed)."""
    startup = distributed.start(exp.distributed)
    if startup is None:
        return None
    if exp.stream.engine != "stream":
        raise ConfigError("a multi-process run needs stream.engine=stream (the reference engine is one process)")
    stream_hosts.share(exp.data.batch_size, startup.hosts.count)  # a batch_size the processes cannot split: one line
    settings = exp.to_dict()
    settings["distributed"].pop("process_id")  # the one setting that differs between processes
    distributed.check_same(startup.hosts, "experiment config", json.dumps(settings, sort_keys=True, default=str))
    stream_hosts.check_resident(exp.stream.resident, startup.hosts.count)  # every process: their configs are the same
    startup.done()
    return startup.hosts


def _agreed(hosts, check) -> None:
    """Run the refusal `check` here; in a multi-process run every process stops if one refuses."""
    if hosts is None:
        return check()
    try:
        check()
    except MtjaxError as e:
        distributed.agree(hosts, e)
    distributed.agree(hosts, None)


# What summary.json holds (the closing lines `describe` prints).
SUMMARY_KEYS = ("steps", "resumed_from", "first_loss", "first_loss_step", "final_loss", "final_loss_steps", "val_loss",
                "tokens", "seconds", "run_dir", "checkpoint", "sample")


def _summary_of(run_dir: Path) -> dict | None:
    """The summary.json a run wrote in `run_dir`, or None (absent or unreadable)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and set(SUMMARY_KEYS) <= summary.keys() else None


def _finished(run_dir: Path, step: int, hosts) -> dict | None:
    """The summary of a run finished at `step` with its final/ (an export of that step) and
    summary.json in place, else None: the resume makes what is missing. Every process of a
    multi-process run follows process 0 (which writes them); one that cannot read them
    returns a summary that says no steps were left."""
    summary = None
    try:
        if json.loads((run_dir / "final" / checkpoint.EXPORT_NOTE).read_text()).get("step") == step:
            summary = _summary_of(run_dir)
    except (OSError, ValueError, AttributeError):
        pass  # no export of this step
    if hosts is None:
        return summary
    if not hosts.gather_ints([summary is not None])[0][0]:  # process 0's verdict
        return None
    return summary or dict(dict.fromkeys(SUMMARY_KEYS), steps=0, resumed_from=step, final_loss_steps=[], tokens=0,
                           seconds=0.0, run_dir=str(run_dir), checkpoint=str(run_dir / "final"), sample="")


def _as_run(exp: ExperimentConfig, dataset, tokenizer) -> ExperimentConfig:
    """`exp` as this run uses it, as config.yaml records it: on data other than the built-in
    Shakespeare the default sample prompt gives way to the data's first words (a prepared
    dataset's own tokenizer is data.tokenizer already)."""
    if exp.run.sample_prompt == RunConfig.sample_prompt and exp.data.dataset != "builtin:shakespeare":
        start, stop = dataset.split("train")
        text = tokenizer.decode(dataset.tokens(start, min(stop, start + 256)).tolist())
        return replace(exp, run=dict(sample_prompt=" ".join(text.strip().split("\n")[0].split()[:6])))
    return exp


def _sample_budget(exp: ExperimentConfig, engine: Engine | None = None) -> int | None:
    """The device bytes the closing sample may hold: stream.device_budget_bytes less what
    the engine keeps on the device between steps (its resident parts' state); None: no cap
    (none set, or the reference engine, which holds the whole model anyway)."""
    budget = exp.stream.device_budget_bytes
    if budget is None or exp.stream.engine != "stream":
        return None
    return budget - (engine.ledger.held_by_use["resident"] if isinstance(engine, StreamEngine) else 0)


def _check_sample_budget(exp: ExperimentConfig, cfg: ModelConfig, positions: int, budget: int | None) -> None:
    """Refuse a closing sample of `positions` (prompt + new tokens; 0: none) that could hold
    more than `budget` bytes on the device (mtjax.stream.sample.device_bytes)."""
    if not positions or budget is None:
        return
    need = sample_mod.device_bytes(cfg, positions)
    if need > budget:
        total = exp.stream.device_budget_bytes
        room = (f"stream.device_budget_bytes {total:,}" if budget == total else
                f"the {budget:,} that stream.device_budget_bytes {total:,} leaves beside the resident parts")
        raise DeviceBudgetError(f"the closing sample ({positions:,} positions) may hold {need:,} bytes on the device "
                                f"(two parts' weights and the KV caches), over {room}; lower run.sample_tokens, raise "
                                "the budget (or lower stream.resident), or pass --run.sample_prompt= to skip the sample")


def _closing_sample(exp: ExperimentConfig, engine: Engine, tokenizer) -> tuple[str, int]:
    """(the closing sample, the device bytes held at its peak, with what the engine keeps
    there): streamed part by part from the store as just committed, as `mtjax generate`
    samples a store, so the whole model is never on the device; within what
    stream.device_budget_bytes leaves beside the engine's resident parts."""
    kept = engine.ledger.held_by_use["resident"] if isinstance(engine, StreamEngine) else 0
    sampler = sample_mod.StreamSampler(engine.store, budget=_sample_budget(exp, engine))
    text = sampler.complete(tokenizer, exp.run.sample_prompt, exp.run.sample_tokens, seed=exp.run.seed)
    return text, kept + sampler.ledger.peak


def _devices_text(engine: Engine, hosts) -> str:
    """The devices a run's steps use, in words: "2 cpu devices" (a multi-process run: all of its processes')."""
    here = engine.placement.mesh.count if isinstance(engine, StreamEngine) else 1  # the reference: one device
    total = here * (1 if hosts is None else hosts.count)
    text = f"{total} {jax.local_devices()[0].platform} device{'s' if total > 1 else ''}"
    return text if hosts is None else f"{text} ({hosts.count} processes of {here})"


def _steps_text(first: int, steps: int) -> str:
    """The steps a run trains, from after step `first` to `steps`, in words."""
    if first >= steps:
        return f"no steps left (at step {first} of {steps})"
    todo = f"step {steps}" if steps == first + 1 else f"steps {first + 1}-{steps}"
    return todo if first else f"{steps} steps"


def _loop(exp, cfg, engine, loader, val, tokenizer, first, tokens_per_step, out, records: Path,
          lead: bool = True, kept: dict | None = None) -> dict:
    """The steps; `records`: where metrics.jsonl goes; `lead`: this process writes the run's
    export, sample and summary (one process of a multi-process run does). With no step left
    (a resume of a run killed after its last commit) nothing is committed again, and `kept`,
    the run's summary.json when there is one, stays."""
    run_dir = Path(exp.run.dir)
    losses, val_loss, start, trained = {}, None, time.perf_counter(), 0  # losses by step, tokens trained on

    def say(line: str) -> None:  # what the export of final/ has to say (a byte-level model has no tokenizer)
        print(f"mtjax: {line}", file=out, flush=True)

    peak, peak_note = peak_flops(jax.local_devices()[0], cfg.compute_dtype)
    print(f"mtjax: {peak_note}; per-step records in {records / 'metrics.jsonl'}", file=out, flush=True)
    flops = mfu_flops_per_token(cfg, exp.data.seq_len)
    tracker = wandb_log.start(exp, run_dir) if exp.run.wandb and lead else None  # process 0 logs for all
    with Progress(records, exp.run.steps, tokens_per_step, exp.run.log_every, first_step=first, stream=out,
                  tensorboard=exp.run.tensorboard, flops_per_token=flops, peak_flops=peak, wandb=tracker) as progress:
        for step in range(first + 1, exp.run.steps + 1):
            try:
                batch = loader.next()
                trained += documents.trained_tokens(batch)  # a skipped step's too, as it always was
                # A one-copy store's step commits itself, recording the data cursor past its batch.
                metrics = engine.step(batch, checkpoint.train_state(exp, step, loader.cursor))
                # Waits for the tracer's watchers; the step's own host sync already
                # finished its compute, so this costs little.
                metrics = {**metrics, **{f"stage_{k}_s": round(v, 4) for k, v in engine.stage_seconds().items()}}
            except NonFiniteStep:
                if exp.run.on_nonfinite == "stop":
                    raise
                metrics = None  # the engine changed no state; the data cursor moves on
                progress.record(step, {"skipped_nonfinite": 1.0})
            if metrics is not None:
                losses[step] = metrics["loss"]
                progress.update(step, {**metrics, "lr": lr_at(exp.optim, step)}, documents.trained_tokens(batch))
            if metrics is None and engine.commits_every_step:
                # A skipped step's commit did not run: the cursor past its batch is committed
                # here (the state is unchanged, nothing is pending).
                engine.commit(step, checkpoint.train_state(exp, step, loader.cursor))
            if val is not None and (step % exp.run.eval_every == 0 or step == exp.run.steps):
                terms = engine.eval_loss(val)  # the training objective; a MoE model's aux loss beside it
                val_loss = terms["loss"]
                progress.record(step, {f"val_{k}": v for k, v in terms.items()})
            if (exp.run.checkpoint_every and step % exp.run.checkpoint_every == 0 and step < exp.run.steps
                    and not engine.commits_every_step):
                engine.commit(step, checkpoint.train_state(exp, step, loader.cursor))
        seconds = time.perf_counter() - start
        # The last commit is this step already when none was left, unless that commit still
        # holds the step's update to apply (a one-copy run stopped right after it).
        if exp.run.steps > first or engine.store.pending is not None:
            engine.commit(exp.run.steps, checkpoint.train_state(exp, exp.run.steps, loader.cursor), flush=True)
        template = loader.ds.meta.get("chat_template")
        if getattr(engine, "hosts", None) is not None:
            # A shard holds its rows only: every process gathers the whole weights, one exports them.
            params = engine.params()
            final = checkpoint.export_final(exp, run_dir / "final", tokenizer, exp.run.steps, template,
                                            engine.store.root, params, say) if lead else run_dir / "final"
            del params  # the gathered weights, freed before the sample
        else:
            final = checkpoint.export_final(exp, run_dir / "final", tokenizer, exp.run.steps, template, say=say)
        sample, sample_peak = "", 0
        if exp.run.sample_prompt and exp.run.sample_tokens and lead:  # (a shard's compute copy is whole)
            sample, sample_peak = _closing_sample(exp, engine, tokenizer)
        device_peak = max(engine.ledger.peak, sample_peak) if isinstance(engine, StreamEngine) else None
    last = list(losses)[-10:]  # the final loss is the mean over (up to) the last 10 trained steps
    summary = {
        "steps": exp.run.steps - first,
        "resumed_from": first or None,
        "first_loss": losses[min(losses)] if losses else None,
        "first_loss_step": min(losses) if losses else None,
        "final_loss": float(np.mean([losses[s] for s in last])) if losses else None,
        "final_loss_steps": last,
        "val_loss": val_loss,
        "tokens": trained,
        "seconds": round(seconds, 2),
        "run_dir": str(run_dir),
        "checkpoint": str(final),
        "sample": sample,
        "device_peak_bytes": device_peak,  # the most the device ledger counted at once (the stream engine's)
    }
    if kept is not None:
        return kept
    if lead:
        writable.write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def describe(summary: dict) -> str:
    """The closing lines `mtjax train` prints."""
    lines, resumed = [], summary["resumed_from"]
    if summary["first_loss"] is not None:
        steps = summary["final_loss_steps"]
        mean = f"step {steps[0]}" if len(steps) == 1 else f"mean of steps {steps[0]}-{steps[-1]}"
        if len(steps) not in (1, steps[-1] - steps[0] + 1):
            mean += f", {len(steps)} of them trained"  # others were skipped as non-finite
        lines.append(f"{f'resumed from step {resumed}: ' if resumed else ''}loss {summary['first_loss']:.3f} "
                     f"at step {summary['first_loss_step']} -> {summary['final_loss']:.3f} ({mean}) "
                     f"in {summary['seconds']:.0f} s")
    elif resumed:
        lines.append(f"resumed from step {resumed}: no steps left to train")
    if summary["val_loss"] is not None:
        lines.append(f"validation loss {summary['val_loss']:.3f}")
    lines.append(f"checkpoint: {summary['checkpoint']}   metrics: {summary['run_dir']}/metrics.jsonl")
    if summary["sample"]:
        lines += ["--- sample ---", summary["sample"], "--------------"]
    return "\n".join(lines)


def replace(exp: ExperimentConfig, **groups) -> ExperimentConfig:
    """`exp` with some fields of some groups replaced: replace(exp, run=dict(steps=5))."""
    return dataclasses.replace(exp, **{g: dataclasses.replace(getattr(exp, g), **kw) for g, kw in groups.items()})
