"""A training run: config -> model, data and engine -> steps -> store commits, an export and a sample.

    summary = mtjax.run.train(mtjax.config.load("experiments/default.yaml"))

`mtjax train` is a thin wrapper around `train`. The engine that runs a step is chosen
by `stream.engine` in `make_engine`; any object with the `Engine` protocol plugs in:

    engine.step(batch)    a mtjax.batch.Batch (or int32 tokens) [accum, batch, seq] -> {"loss", "grad_norm",
                          ...} (floats); the loss is the mean over the step's counted targets
    engine.params()       fp32 params pytree on the host, every pending update applied
    engine.opt_state()    optimizer state shaped as optax's init(params)
    engine.eval_loss(b)   {"loss", "aux_loss" (MoE)} over the counted targets of a batch [n, batch, seq], no update
    engine.stage_seconds()   seconds per stage of the last step (may be empty)
    engine.commits_every_step   whether each step must be committed before its update runs
    engine.commit(step, train_state, flush=False)   write the whole state into the run's
                          store and commit it (mtjax.checkpoint): `--run.resume=true`
                          continues from the last commit exactly
    engine.close()        release threads and files at the end of the run

A multi-process run (`distributed`, mtjax.distributed) runs this on every process: each
reads the same global batches and trains its rows of them; process 0 writes the run's
records (config.yaml, metrics.jsonl, summary.json), process p > 0 its own metrics.jsonl
under <run.dir>/process-<p>/.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple, Protocol

import jax
import numpy as np

import mtjax.store
from mtjax.store import shards
from mtjax import checkpoint, textfile, writable
from mtjax import config as config_lib
from mtjax import data, distributed, documents, generate, hf, model, preflight
from mtjax import reference as reference_mod
from mtjax.batch import Batch, concat
from mtjax.config import ConfigError, ExperimentConfig, RunConfig
from mtjax.errors import NonFiniteStep
from mtjax.model_config import ModelConfig
from mtjax.optim import lr_at, make_optimizer, schedule_warnings
from mtjax.plan import residency
from mtjax.progress import Progress, model_flops_per_token, peak_flops
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine


class Engine(Protocol):
    commits_every_step: bool

    def step(self, batch: Batch | np.ndarray) -> dict[str, float]: ...

    def params(self): ...

    def opt_state(self): ...

    def eval_loss(self, batch: Batch | np.ndarray) -> dict[str, float]: ...

    def stage_seconds(self) -> dict[str, float]: ...

    def commit(self, step: int, train_state: dict, flush: bool = False) -> None: ...

    def close(self) -> None: ...


class ReferenceEngine:
    """The whole model in device memory (mtjax.reference), behind the engine protocol."""

    commits_every_step = False  # each commit writes the whole state

    def __init__(self, exp: ExperimentConfig, cfg: ModelConfig, params, opt_state=None, store=None):
        self.cfg, self.store = cfg, store
        self.trainer = ReferenceTrainer(cfg, params, exp.optim, opt_state=opt_state)

    def step(self, batch) -> dict[str, float]:
        return self.trainer.step(batch)

    def params(self):
        return jax.device_get(self.trainer.params)

    def opt_state(self):
        return jax.device_get(self.trainer.opt_state)

    def commit(self, step: int, train_state: dict, flush: bool = False) -> None:
        """Write the whole state into the store, one part at a time, and commit it."""
        checkpoint.write_model(self.store, self.params(), self.opt_state(), self.trainer.tx)
        self.store.commit(step, train_state)

    def eval_loss(self, batch) -> dict[str, float]:
        return reference_mod.eval_loss(self.cfg, self.trainer.params, batch)

    def stage_seconds(self) -> dict[str, float]:
        return {}  # one program per step: no stages to time

    def close(self) -> None:
        pass  # nothing held beyond device arrays (the run closes the store)


def make_engine(exp: ExperimentConfig, cfg: ModelConfig, params, opt_state=None, *, store,
                step: int = 0, hosts=None) -> Engine:
    """The engine `exp.stream.engine` names, starting from fp32 `params` (and `opt_state`),
    or from the last commit of `store` (at `step`) when `params` is None; it commits into
    `store`. `hosts`: this process's place in a multi-process run (stream engine only)."""
    if hosts is not None:
        return StreamEngine.from_experiment(exp, cfg, params, opt_state, store=store, step=step, hosts=hosts)
    if exp.stream.engine == "reference":
        if params is None:
            params, opt_state = checkpoint.read_model(store, make_optimizer(exp.optim))
        return ReferenceEngine(exp, cfg, params, opt_state, store=store)
    return StreamEngine.from_experiment(exp, cfg, params, opt_state, store=store, step=step)


def initial_params(exp: ExperimentConfig, cfg: ModelConfig):
    """Weights of the checkpoint the experiment starts from, else a fresh initialisation."""
    if exp.model.checkpoint:
        return hf.load_params(exp.model.checkpoint, cfg)[1]
    return model.init_params(cfg, exp.run.seed)


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


def checkpoint_tokenizer(ckpt_dir: str | Path, spec: str | None = None):
    """The tokenizer saved with a checkpoint (or the one `spec` names)."""
    ckpt_dir = Path(ckpt_dir)
    if spec:
        return data.load_tokenizer(spec)
    if (ckpt_dir / "tokenizer.json").exists():
        return data.load_tokenizer(str(ckpt_dir / "tokenizer.json"))
    state = ckpt_dir / checkpoint.EXPORT_NOTE
    if state.exists() and json.loads(textfile.read(state)).get("tokenizer") == "bytes":
        return data.ByteTokenizer()
    raise data.DataError(f"{ckpt_dir} holds no tokenizer; pass --tokenizer bytes or a tokenizer.json")


def load_weights(path: str | Path):
    """(model config, fp32 params) of an HF checkpoint dir or of a layer store (its last
    committed master weights, read without taking the writer lock)."""
    path = Path(path)
    if not (path / "manifest.json").exists():
        return hf.load_params(path)
    with mtjax.store.open(path) as store:
        store.check_complete("read its weights")
        return store.config, checkpoint.read_params(store)


class Evaluation(NamedTuple):
    loss: float  # mean over the counted targets
    targets: int  # how many targets counted
    masked: bool  # whether the data's loss mask or documents left some out (chat data)


def evaluate_checkpoint(ckpt_dir, dataset: str, split: str = "val", seq_len: int = 128, batch_size: int = 8,
                        batches: int = 8, tokenizer: str | None = None) -> Evaluation:
    """Mean loss of a saved checkpoint over the first `batches` batches of a dataset split:
    over their counted targets (the answers of a chat dataset), as training counts them."""
    tok = checkpoint_tokenizer(ckpt_dir, tokenizer)
    cfg, params = load_weights(ckpt_dir)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mtjax-eval-") as cache:
        data_cfg = config_lib.DataConfig(dataset=dataset, tokenizer=_spec_file(tok, ckpt_dir, tokenizer),
                                         seq_len=seq_len, batch_size=batch_size)
        ds = data.resolve(data_cfg, cache)
        ds.check_vocab(cfg.vocab_size)
        loader = data.Loader(ds, split, seq_len, batch_size, 1, shuffle=False)
        batch = concat(loader.next() for _ in range(batches))
        return Evaluation(reference_mod.eval_loss(cfg, params, batch)["loss"], documents.trained_tokens(batch),
                          not batch.plain)


def _spec_file(tok, ckpt_dir: Path, spec: str | None) -> str:
    """A tokenizer spec `data.resolve` can load again to tokenize raw text like the checkpoint."""
    if spec or tok.spec == "bytes":
        return spec or "bytes"
    return str(Path(ckpt_dir) / "tokenizer.json")


def _eval_batches(dataset, exp: ExperimentConfig) -> Batch | None:
    """The same validation micro-batches at every evaluation (None: split too small)."""
    start, stop = dataset.split("val")
    windows = (stop - start) // exp.data.seq_len
    if windows == 0:
        return None
    rows = min(exp.data.batch_size, windows)
    loader = data.Loader(dataset, "val", exp.data.seq_len, rows, 1, shuffle=False)
    return concat(loader.next() for _ in range(exp.run.eval_batches))


def train(exp: ExperimentConfig = ExperimentConfig(), stream=None) -> dict:
    """Run the experiment; returns a summary (losses, throughput, sample, paths)."""
    out = stream or sys.stderr
    run_dir = Path(exp.run.dir)
    cfg = config_lib.model_config(exp)
    cfg.check_context(exp.data.seq_len, "data.seq_len")
    hosts = _join(exp)
    if hosts is None:  # before anything is prepared: a multi-process run's shards need all of its processes
        shards.check_count(checkpoint.store_path(exp), 1)
    else:
        exp = replace(exp, stream=dict(resident="none"))  # every part's state is split over the hosts
    run_dir.mkdir(parents=True, exist_ok=True)
    if hosts is not None and hosts.index:
        hosts.barrier("mtjax data")  # process 0 prepares a shared run.dir's data first
    dataset = data.resolve(exp.data, run_dir / "data")  # a cache: prepared again when the inputs change
    if hosts is not None and not hosts.index:
        hosts.barrier("mtjax data")
    dataset.check_vocab(cfg.vocab_size)
    asked = exp.stream  # config.yaml keeps `auto`: another machine's memory resolves it anew
    exp = residency.for_run(exp)  # stream.resident=auto: the planner's parts for this device's memory
    preflight.check(exp, cfg, dataset, processes=1 if hosts is None else hosts.count)  # before any weight is made
    tokenizer = dataset.tokenizer()
    exp = _as_run(exp, dataset, tokenizer, run_dir)
    if exp.model.checkpoint and tokenizer.spec == "bytes" and (Path(exp.model.checkpoint) / "tokenizer.json").exists():
        print(f"mtjax: warning: the data is byte-tokenized but {exp.model.checkpoint} has its own tokenizer.json; "
              f"--data.tokenizer={exp.model.checkpoint} trains on the ids the model knows", file=out, flush=True)
    # The run's store: its writer lock, and its refusals (a trained run without run.resume,
    # other fixed settings), before anything else under run.dir is written.
    store, state, created = checkpoint.open_run_store(exp, cfg, hosts)
    lead = hosts is None or hosts.index == 0  # writes the run's records
    engine = None
    try:
        val = _eval_batches(dataset, exp) if exp.run.eval_every else None
        first, cursor = (int(state["step"]), state["loader"]) if state is not None else (0, None)
        loader = data.Loader(dataset, "train", exp.data.seq_len, exp.data.batch_size, exp.data.grad_accum,
                             exp.data.seed, cursor=cursor)
        if created:
            engine = make_engine(exp, cfg, initial_params(exp, cfg), store=store, hosts=hosts)
            engine.commit(0, checkpoint.train_state(exp, 0, loader.cursor))  # resumable from the first moment
            created, origin = False, {}
        else:  # the store's last commit (or the weights `mtjax import` put there) is the start
            engine = make_engine(exp, cfg, None, store=store, step=first, hosts=hosts)
            origin = dict(store=store.root) if state is None else dict(resumed=store.root, step=first)
        # Only now that everything checked out: a run that fails to start leaves the previous one.
        records = run_dir if lead else run_dir / f"process-{hosts.index}"
        if lead:
            config_lib.dump(dataclasses.replace(exp, stream=asked), run_dir / "config.yaml")
        if state is None:
            (records / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run starts a fresh record
        tokens_per_step = exp.data.grad_accum * exp.data.batch_size * exp.data.seq_len
        print(f"mtjax: {model.num_params(cfg) / 1e6:.2f}M-parameter {cfg.model_type} ({cfg.num_hidden_layers} blocks, "
              f"width {cfg.hidden_size}), {exp.stream.engine} engine on {jax.local_devices()[0].platform}; "
              f"{dataset.meta['num_tokens']:,} tokens ({dataset.meta['tokenizer_source']}); "
              f"{_steps_text(first, exp.run.steps)} of {tokens_per_step:,} tokens; run dir {run_dir}",
              file=out, flush=True)
        if exp.stream.resident and exp.stream.resident != asked.resident:  # what auto chose
            print(f"mtjax: resident on the device (stream.resident={asked.resident}): "
                  f"{', '.join(exp.stream.resident)}; remat {exp.stream.remat}", file=out, flush=True)
        for line in weights_provenance(exp, **origin):
            print(line, file=out, flush=True)
        for warning in schedule_warnings(exp.optim, exp.run.steps):
            print(f"mtjax: warning: {warning}", file=out, flush=True)
        if hosts is not None:
            print(f"mtjax: process {hosts.index} of {hosts.count}: {len(jax.local_devices())} device(s) here; "
                  f"this process holds its rows of master and optimizer state in {store.root}", file=out, flush=True)
        return _loop(exp, cfg, engine, loader, val, tokenizer, first, tokens_per_step, out, records, lead)
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
    if exp.data.batch_size % startup.hosts.count:
        raise ConfigError(f"data.batch_size {exp.data.batch_size} must be a multiple of the number of processes "
                          f"({startup.hosts.count}): each process trains an equal share of every micro-batch's rows")
    settings = exp.to_dict()
    settings["distributed"].pop("process_id")  # the one setting that differs between processes
    distributed.check_same(startup.hosts, "experiment config", json.dumps(settings, sort_keys=True, default=str))
    if exp.stream.resident not in ("auto", "none"):  # every process raises it: their configs are the same
        raise ConfigError(f"stream.resident={exp.stream.resident!r} keeps whole parts on the device, but each of the "
                          f"{startup.hosts.count} processes holds only its rows of every part's state: set "
                          "stream.resident=none (auto streams every part here)")
    startup.done()
    return startup.hosts


def _as_run(exp: ExperimentConfig, dataset, tokenizer, run_dir: Path) -> ExperimentConfig:
    """`exp` as this run uses it, as config.yaml records it: a prepared dataset brings its
    own tokenizer (data.tokenizer only tokenizes raw text), and on data other than the
    built-in Shakespeare the default sample prompt gives way to the data's first words."""
    groups = {}
    if dataset.path.resolve() != (run_dir / "data").resolve():  # a prepared dataset, used as it is
        groups["data"] = dict(tokenizer=tokenizer.spec)
    if exp.run.sample_prompt == RunConfig.sample_prompt and exp.data.dataset != "builtin:shakespeare":
        start, stop = dataset.split("train")
        text = tokenizer.decode(dataset.tokens(start, min(stop, start + 256)).tolist())
        groups["run"] = dict(sample_prompt=" ".join(text.strip().split("\n")[0].split()[:6]))
    return replace(exp, **groups)


def _steps_text(first: int, steps: int) -> str:
    """The steps a run trains, from after step `first` to `steps`, in words."""
    if first >= steps:
        return f"no steps left (at step {first} of {steps})"
    todo = f"step {steps}" if steps == first + 1 else f"steps {first + 1}-{steps}"
    return todo if first else f"{steps} steps"


def _loop(exp, cfg, engine, loader, val, tokenizer, first, tokens_per_step, out, records: Path,
          lead: bool = True) -> dict:
    """The steps; `records`: where metrics.jsonl goes; `lead`: this process writes the run's
    export, sample and summary (one process of a multi-process run does)."""
    run_dir = Path(exp.run.dir)
    losses, val_loss, start, trained = {}, None, time.perf_counter(), 0  # losses by step, tokens trained on
    peak, peak_note = peak_flops(jax.local_devices()[0], cfg.compute_dtype)
    print(f"mtjax: {peak_note}; per-step records in {records / 'metrics.jsonl'}", file=out, flush=True)
    flops = model_flops_per_token(model.num_active_params(cfg), cfg.num_hidden_layers, exp.data.seq_len,
                                  cfg.num_attention_heads * cfg.head_dim)
    with Progress(records, exp.run.steps, tokens_per_step, exp.run.log_every, first_step=first, stream=out,
                  tensorboard=exp.run.tensorboard, flops_per_token=flops, peak_flops=peak) as progress:
        for step in range(first + 1, exp.run.steps + 1):
            try:
                batch = loader.next()
                trained += documents.trained_tokens(batch)  # a skipped step's too, as it always was
                metrics = engine.step(batch)
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
            if engine.commits_every_step:
                # One copy of the state on disk: an update may only overwrite it once this
                # step (state + pending gradients) is committed. Cheap: nothing is flushed.
                engine.commit(step, checkpoint.train_state(exp, step, loader.cursor))
            if val is not None and (step % exp.run.eval_every == 0 or step == exp.run.steps):
                terms = engine.eval_loss(val)  # the training objective; a MoE model's aux loss beside it
                val_loss = terms["loss"]
                progress.record(step, {f"val_{k}": v for k, v in terms.items()})
            if (exp.run.checkpoint_every and step % exp.run.checkpoint_every == 0 and step < exp.run.steps
                    and not engine.commits_every_step):
                engine.commit(step, checkpoint.train_state(exp, step, loader.cursor))
        seconds = time.perf_counter() - start
        engine.commit(exp.run.steps, checkpoint.train_state(exp, exp.run.steps, loader.cursor), flush=True)
        template, params = loader.ds.meta.get("chat_template"), None
        if getattr(engine, "hosts", None) is not None:
            # A shard holds its rows only: every process gathers the whole weights, one exports them.
            params = engine.params()
            final = checkpoint.export_final(exp, run_dir / "final", tokenizer, exp.run.steps, template,
                                            engine.store.root, params) if lead else run_dir / "final"
        else:
            final = checkpoint.export_final(exp, run_dir / "final", tokenizer, exp.run.steps, template)
        sample = ""
        if exp.run.sample_prompt and exp.run.sample_tokens:
            params = engine.params() if params is None else params  # (a multi-process run's: gathered above)
            if lead:
                sample = generate.complete(cfg, params, tokenizer, exp.run.sample_prompt, exp.run.sample_tokens,
                                           seed=exp.run.seed)
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
    }
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
