"""The streaming engine: one training step as a pipeline of per-part stages.

    tier/store -> prefetch (update, read, stage) -> device_put -> block fwd/bwd
               -> gradients to host -> (next step) AdamW update on the host -> tier/store

The step reads as those stages; docs/pipeline.md draws the timeline. Forward streams
embed, blocks and head; the head computes the loss and its gradient at once; backward
streams the blocks back in reverse, one recompute group (k blocks) at a time, each
block's forward recomputed once from the group's kept input. The optimizer update is
deferred to the next step's prefetch (mtjax.stream.updater), so that global-norm
clipping stays exact: every part's gradient is in before the clip scale is known. The
commit protocols (two-copy, one-copy, multi-host) are mtjax.store.commit. Resident parts
(mtjax.stream.resident) are not streamed and are updated on the device at the end of
the step; a saved group of them keeps its forward's vjps instead of recomputing. In a
multi-process run (`hosts`, mtjax.stream.hosts) each process runs its rows of every
micro-batch, keeps its rows of master and optimizer state, and the step gains a
reduce-scatter per part's gradient, an all-reduce of the loss and norm, and an
all-gather per part's new compute copy.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax import documents, treepath
from mtjax import parts as parts_mod
from mtjax.config import ExperimentConfig, StoreConfig, StreamConfig
from mtjax.errors import MtjaxError
from mtjax.hostmem import fix_mmap_threshold
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig
from mtjax.store.commit import OneCopy, commit_step
from mtjax.store.pending import PendingFiles
from mtjax.stream import budget as budget_mod
from mtjax.stream import engine_state
from mtjax.stream import hosts as hosts_mod
from mtjax.stream import memory_plan
from mtjax.stream import schedule as schedule_mod
from mtjax.stream import step_bytes, step_parts
from mtjax.stream.blockfns import block_fns
from mtjax.stream.grads import GradSink
from mtjax.stream.groupfns import group_fns
from mtjax.stream.mesh import DeviceMesh
from mtjax.stream.resident import Resident
from mtjax.stream.runner import Runner
from mtjax.stream.stager import Stager
from mtjax.stream.splitblock import SplitBlocks
from mtjax.stream.staging import Placement, StagingPool, raise_host_memory_limit
from mtjax.stream.tiers import Tiers
from mtjax.stream.trace import Tracer
from mtjax.stream.update import PartUpdate, full_opt_state, update_for
from mtjax.stream.updater import Updater


def _beside(store) -> str | None:
    """The directory holding the store: scratch files go next to it, on the same disk."""
    return str(Path(store.root).absolute().parent) if store is not None else None


def _spill(placement_config: StoreConfig, one_copy, store) -> PendingFiles | None:
    """Where gradients wait for their update: with the master weights on disk, in files
    (a one-copy store's durable ones); otherwise in host memory (None)."""
    where = schedule_mod.spill(placement_config)
    if where == "pending":
        return one_copy.spill
    return PendingFiles(_beside(store)) if where == "scratch" else None


def _io_bytes(store, spill) -> tuple[int, int]:
    """(read, written) bytes of disk-tier state (`store`, or None) and parked gradients so far."""
    r = w = 0
    for source in (store, spill):
        if source is not None:
            r, w = r + source.io_bytes[0], w + source.io_bytes[1]
    return r, w


class StreamEngine:
    """Streams one part at a time through the device; state stays in host RAM or on disk,
    except resident parts' (`stream.resident`), which stays on the device between commits.

    >>> engine = StreamEngine(cfg, params, OptimConfig(lr=1e-3), StreamConfig(keep_every=2))
    >>> metrics = engine.step(batch)    # a mtjax.batch.Batch, or int tokens [accum, batch, seq] / [batch, seq]
    >>> engine.commit(step)             # the state into the layer store (a one-copy store's steps commit themselves)
    >>> engine.params()                 # fp32 master params, pending updates applied

    This constructor is for tests and scripts; `from_experiment` builds a run's engine.
    `params` (fp32, mtjax.model layout; `opt_state`: the whole-model optimizer state to
    continue from) fills the tiers; None resumes from `store`, an open layer store.
    `store_config` places each kind of state in RAM or in `store` (a one-copy store is
    one whose manifest says so; the config's `copies` and `path` are for creating one).
    `tx` runs the update as that optax transformation's XLA program instead of the fused
    AdamW of `optim`, whose clip_norm applies either way. `step`: the steps already
    trained (a resume). `owns_store`: close() closes the store too. `trace_steps`: how
    many recent steps keep their stage timings (None: all). `mesh`: the devices the step
    runs on, data parallel (mtjax.stream.mesh); by default this process's `stream.devices`.
    """

    def __init__(self, cfg: ModelConfig, params=None, optim: OptimConfig = OptimConfig(),
                 stream: StreamConfig = StreamConfig(), store_config: StoreConfig = StoreConfig(), *, store=None,
                 tx: optax.GradientTransformation | None = None, opt_state=None, step: int = 0,
                 batch_shape: tuple[int, int] | None = None, mesh: DeviceMesh | None = None,
                 trace_steps: int | None = 4, owns_store: bool = False, hosts=None, seed: int = 0):
        if params is None and store is None:
            raise MtjaxError("StreamEngine needs params or an open layer store to take the state from")
        if hosts is not None:
            if store is not None and store.shard != hosts.shard:
                raise MtjaxError(f"store {store.root} is not process {hosts.index}'s shard of {hosts.count}")
            # Every part's state is split over the hosts: nothing is resident, adapters included.
            stream = dataclasses.replace(stream, resident="none", adapters="streamed")
        self.hosts = hosts
        self.processes = 1 if hosts is None else hosts.count  # in the run: its schedule's `processes`
        parts_mod.check_roles(cfg)
        self.cfg, self.options, self.step_count = cfg, stream, step
        self.update = update_for(cfg, optim) if tx is None else PartUpdate(cfg, tx)
        self.tx, self.clip_norm = self.update.tx, optim.clip_norm
        self.store, self._owns_store = store, owns_store
        self.tiers = Tiers(store_config.tiers, store)
        # The placement as the step's schedule reads it: the store's own number of copies.
        self.placement_config = dataclasses.replace(store_config, copies=getattr(store, "copies", 2))
        # With the master weights in RAM and the fused update, no compute copy is kept: the
        # prefetcher rounds master into the staging slot (reading 4 bytes/param there
        # instead of the update writing 2 that the prefetcher then reads; 2 bytes/param
        # less RAM); a multi-process run keeps one. docs/device.md, "The compute copy".
        self.derived_compute = schedule_mod.derives_compute(self.update.fused is not None, self.placement_config,
                                                            parts_mod.frozen_any(cfg), self.processes)
        if self.tiers.kinds_in("disk"):
            fix_mmap_threshold()  # state on disk promises host memory flat in depth
        self.parts = parts_mod.parts(cfg)
        self.schemas = {p.name: parts_mod.schema(cfg, p.name, "compute") for p in self.parts}
        self.placement = Placement(mesh=mesh or DeviceMesh.local(stream.devices, stream.split))
        # The compiled programs' config: attention split over the devices where the rows' tokens are.
        compute_cfg = cfg.split_over(self.placement.mesh.split, self.placement.mesh.count)
        self.fns = block_fns(compute_cfg)
        self.tracer = Tracer(trace_steps)
        self.ledger = budget_mod.DeviceLedger(0)
        self.split = SplitBlocks(group_fns(compute_cfg), self.ledger, self.placement.mesh)  # split MoE blocks' passes
        # Staging slots: each step's schedule says how many of each shape (`check_budget`).
        self.pool = StagingPool(self.placement, self.ledger, memory_plan.staged_at_once(stream, self.groups) + 1)
        # A one-copy store keeps a single copy of the state: each step commits the state
        # before its update plus the gradients, durable in the store (docs/store.md).
        self.one_copy = OneCopy(store, self.tiers) if store is not None and store.copies == 1 else None
        self.grads = GradSink(self.placement, self.tracer, _spill(self.placement_config, self.one_copy, store), hosts)
        scale = self.one_copy.adopt(self.grads) if self.one_copy is not None and params is None else None
        self.updater = Updater([p.name for p in self.parts], self.update, self.tiers, self.grads, self.tracer,
                               self.derived_compute, self.one_copy, scale, hosts, self.schemas)
        self._schedules: dict[step_bytes.StepShape, schedule_mod.Schedule] = {}
        self.schedule: schedule_mod.Schedule | None = None  # of the last token shape checked
        if params is None:
            engine_state.load_ram_kinds(self.updater, self.tiers, store, [p.name for p in self.parts])
        else:
            self._init_state(params, opt_state)
        whole = step_parts.resident_parts(cfg, stream.resident, self.groups)
        adapters = step_parts.adapter_parts(cfg, stream, whole)  # resident while their part's frozen leaves stream
        self.resident = Resident(whole + adapters, self.update, self.placement, staged=adapters)
        self.stager = Stager(cfg, self.pool, self.tracer, self.split, self.updater, self.schemas)
        self.runner = Runner(cfg, self.fns, self.pool, self.tracer, self.ledger, self.placement, self.split,
                             self.resident, self.grads, self.updater, clip_norm=self.clip_norm, hosts=hosts,
                             commit=lambda train_state: self.commit(self.step_count, train_state), seed=seed)
        engine_state.load_resident(self.updater, self.resident)
        if batch_shape is not None:
            self.check_budget(*batch_shape)

    @classmethod
    def from_experiment(cls, exp: ExperimentConfig, cfg: ModelConfig, params=None, opt_state=None, *, store,
                        step: int = 0, hosts=None) -> StreamEngine:
        """A run's engine, as the experiment config asks, committing into the run's open
        layer `store` (mtjax.checkpoint opens it; every run has one): from fp32 `params`
        (and `opt_state`), or resumed from the store's last commit, `step`, when `params`
        is None. The engine owns the store from here on. `hosts`: a multi-process run's."""
        rows = exp.data.batch_size if hosts is None else hosts_mod.share(exp.data.batch_size, hosts.count)
        return cls(cfg, params, exp.optim, exp.stream, exp.store, store=store, opt_state=opt_state, step=step,
                   batch_shape=(rows, exp.data.seq_len), owns_store=True, hosts=hosts, seed=exp.run.seed)

    @property
    def commits_every_step(self) -> bool:
        """One copy of the state: each step is committed before its update can run, by its
        own `Commit` operation (`step`'s train_state)."""
        return self.one_copy is not None

    # --- state ---------------------------------------------------------------------

    def _init_state(self, params, opt_state=None) -> None:
        """Fill the tiers from fp32 `params` and, when resuming, the whole-model `opt_state`."""
        engine_state.fill(self.cfg, self.update, self.updater, [p.name for p in self.parts], params, opt_state,
                          derived_compute=self.derived_compute, hosts=self.hosts)

    def _resident_to_tiers(self) -> None:
        engine_state.resident_to_tiers(self.updater, self.resident, derived_compute=self.derived_compute)

    def _read_state(self, part: str, kind: str) -> dict:
        return engine_state.read(self.cfg, self.tx, self.updater, self.resident, part, kind, self.hosts)

    def flush(self) -> None:
        """Apply every pending update (before reading state, a checkpoint or the end)."""
        self.updater.flush()

    def params(self):
        """The fp32 master parameters, pending updates applied (a frozen leaf's: its compute
        copy in fp32, all it has)."""
        self.flush()
        out = {}
        for p in self.parts:
            flat = parts_mod.fp32_weights(self.cfg, p.name, self._read_state(p.name, "master"),
                                          lambda: self._read_state(p.name, "compute"))
            tree = treepath.unflatten(parts_mod.abstract_part(self.cfg, p.name), flat)
            # Copies: the next update overwrites RAM-tier arrays in place.
            out[p.name] = jax.tree.map(lambda a: jnp.asarray(np.array(a)), tree)
        return parts_mod.whole_params(self.cfg, out)

    def opt_state(self):
        """The optimizer state shaped as the reference trainer's `tx.init(params)`."""
        self.flush()
        per_part = {p.name: {n: jnp.asarray(np.array(a)) for n, a in self._read_state(p.name, "opt").items()}
                    for p in self.parts}
        return full_opt_state(self.cfg, self.tx, per_part)

    def commit(self, step: int | None = None, train_state=None, flush: bool | None = None) -> None:
        """Make the current state durable in the store: RAM-tier kinds are written too.

        Pending updates are applied first (`flush`), except with a one-copy store, which
        commits them as gradients still to apply (a resume applies them): no pause.
        The protocols are mtjax.store.commit's.
        """
        if self.store is None:
            raise MtjaxError("commit needs a layer store: pass store=mtjax.store.create(...)")
        commit_step(self.store, self.step_count if step is None else step, train_state, self.updater,
                    collect=self._resident_to_tiers, one_copy=self.one_copy,
                    barrier=None if self.hosts is None else self.hosts.barrier, flush=flush)

    # --- the plan ------------------------------------------------------------------

    @property
    def groups(self) -> tuple[range, ...]:
        """Recompute groups: block ranges whose first input is kept."""
        return step_parts.groups(self.cfg.num_hidden_layers, self.options.keep_every)

    def plan(self, batch: int, seq: int, accum: int = 1, documents: bool = False) -> schedule_mod.Schedule:
        """The schedule of a step of `accum` micro-batches of [batch, seq], packed documents
        or not (mtjax.stream.schedule)."""
        shape = step_bytes.StepShape(batch, seq, accum, documents)
        if shape not in self._schedules:
            self._schedules[shape] = schedule_mod.describe(self.cfg, self.options, self.placement_config, shape,
                                                           self.tx, fused=self.update.fused is not None,
                                                           devices=self.placement.mesh.count,
                                                           reads_host=self.placement.reads_host,
                                                           processes=self.processes)
        return self._schedules[shape]

    def check_budget(self, batch: int, seq: int, accum: int = 1, documents: bool = False) -> None:
        """Raise DeviceBudgetError (before anything runs) when the run cannot fit; from
        here on the ledger holds the step to this schedule's device plan."""
        self.schedule = s = self.plan(batch, seq, accum, documents)
        if s.split and self.cfg.lora is not None and self.cfg.lora.dropout > 0:
            raise MtjaxError("lora.dropout > 0 does not run with MoE blocks split into expert groups yet; set "
                             "lora.dropout=0, or give the device the budget for whole blocks")
        self.ledger.enforce(s.device, memory_plan.check_budget(s.device, self.options.device_budget_bytes))
        self.updater.order(s.needed)  # the updates run in the order the forward needs the parts
        if self.ledger.held_by_use["resident"] == 0 and self.resident:
            self.ledger.hold(self.resident.nbytes, "the resident parts' state", "resident")
        for name, sets, _ in s.staging:  # the staging slots the schedule prices, made now
            self.pool.provide(schedule_mod.unit_schema(self.cfg, name, s.split, s.adapters), sets)
        for part, kind, sets, _ in s.reads:  # and the update's read buffers
            self.updater.read_ahead.provide(part, kind, sets)
        if self.placement.pinned:
            # Pinned host memory in flight: the staging slots' parts, plus the kept
            # activations when they wait in host memory.
            raise_host_memory_limit(s.staging_bytes + s.traffic.h2d_activations)

    # --- the step ------------------------------------------------------------------

    @property
    def routed(self) -> dict:
        """{split block index: bool [E]}: the experts some token of the last pass reached
        (for `schedule.routed_traffic`)."""
        return dict(self.split.routing.reached)

    def observe(self, fn):
        """Call fn(event, value) for every gradient a program makes ("grad") and every
        hidden state kept for the backward ("keep"): mtjax.stream.runner. Returns the
        function that stops it."""
        return self.runner.observe(fn)

    def _inputs(self, batch, what: str = "step") -> tuple[list[documents.Inputs], np.ndarray]:
        """The micro-batches' device inputs (each put on the device once, tokens with their
        document ids and counted targets) and their weights in the loss."""
        inputs, weights = documents.step_inputs(batch, what)
        if self.hosts is not None:  # this process's rows of every micro-batch
            inputs, weights = self.hosts.local_inputs(inputs, weights)
        self.check_budget(*inputs.tokens.shape[1:], accum=len(weights), documents=inputs.segments is not None)
        return [self.placement.tokens(inputs.micro(i)) for i in range(len(weights))], weights

    def eval_loss(self, batch) -> dict[str, float]:
        """{"loss": the training objective, "aux_loss": the load-balancing loss (MoE
        models)} over the counted targets of a batch [n, batch, seq] (mtjax.batch.Batch
        or int32 tokens), its micro-batches weighted as a step's, with the current
        weights; no update. As mtjax.reference.eval_loss reports them."""
        mbs, weights = self._inputs(batch, "evaluation")
        s = self.schedule
        self.split.routing.reset()
        feed = self.stager.feed(s, s.forward, self.options.prefetch_depth)
        try:
            done = self.runner.run(s, s.eval_operations, feed, mbs, list(weights))
        finally:
            self.stager.close(feed)
        return self.runner.eval_metrics(done)

    def step(self, batch, train_state: dict | None = None) -> dict[str, float]:
        """One optimizer step: the schedule's operations (mtjax.stream.ops), run by the
        runner; `Update` once every gradient's norm is in. With a one-copy store the step
        ends with its `Commit` (`commits_every_step`), recording `train_state` (the run's
        data cursor; mtjax.checkpoint.train_state) beside the state."""
        mbs, weights = self._inputs(batch)
        s = self.schedule
        disk = self.store if self.tiers.kinds_in("disk") else None
        start, io0 = time.perf_counter(), _io_bytes(disk, self.grads.spill)
        self.tracer.begin_step(self.step_count)
        self.ledger.reset()  # only resident state stays on the device between steps (even after a failed one)
        self.updater.wait_writes()
        self.split.routing.reset()
        # Once the step's last transfer is read the disk would idle until the clip scale is
        # known: the first updates' reads start then.
        feed = self.stager.feed(s, s.transfers, self.options.prefetch_depth,
                                after=functools.partial(self.updater.read_early, s.host_updated))
        try:
            done = self.runner.run(s, s.operations, feed, mbs, [float(w) for w in weights], train_state,
                                   dropout_step=self.step_count)
        except BaseException:
            self.grads.discard()  # a failed step's partial sums must not reach the next step
            self.resident.drop()
            raise
        finally:
            self.stager.close(feed)
        # Host sync: the clip scale needs every part's gradient norm.
        sq = self.grads.finish(tag=f"g{self.step_count + 1}")
        self.pool.forget_ready()  # the step's programs are done: its slots' fences need not keep their outputs
        if self.resident:  # the resident parts' norms, from the device
            resident_sq = self.resident.finish()
            self.grads.last_sq.update(resident_sq)
            sq = sq + sum(resident_sq.values())
        self.step_count += 1
        metrics = self.runner.update(done, sq, self.step_count)
        if self.tiers.kinds_in("disk"):
            # Disk bandwidth over the step's wall time: state and gradient bytes moved meanwhile.
            seconds, io1 = time.perf_counter() - start, _io_bytes(disk, self.grads.spill)
            metrics["disk_read_gbps"] = (io1[0] - io0[0]) / seconds / 1e9
            metrics["disk_write_gbps"] = (io1[1] - io0[1]) / seconds / 1e9
        return metrics

    # --- reporting -----------------------------------------------------------------

    def stage_seconds(self, step: int | None = None) -> dict[str, float]:
        """Seconds spent per stage in a step (default: the last one), complete once it has
        returned: its optimizer stage is the updates its forward streamed in (the step
        before's gradients), not its own, which the next step (or `flush`) applies."""
        self.tracer.drain()
        return self.tracer.step_totals(self.step_count - 1 if step is None else step)

    def write_trace(self, path) -> None:
        """Chrome trace JSON of every step so far (open in Perfetto)."""
        self.tracer.write(path)

    def close(self) -> None:
        self.updater.close()
        self.grads.close()
        self.tracer.close()
        self.tiers.close()
        self.placement.close()
        if self._owns_store:
            self.store.close()
