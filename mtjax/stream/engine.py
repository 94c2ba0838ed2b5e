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
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax import documents, expert_groups, treepath
from mtjax import parts as parts_mod
from mtjax.config import ExperimentConfig, StoreConfig, StreamConfig
from mtjax.errors import MtjaxError, NonFiniteStep
from mtjax.hostmem import fix_mmap_threshold
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, clip_scale
from mtjax.store.commit import OneCopy, commit_step
from mtjax.store.pending import PendingFiles
from mtjax.stream import budget as budget_mod
from mtjax.stream import schedule as schedule_mod
from mtjax.stream.blockfns import block_fns
from mtjax.stream.grads import GradSink
from mtjax.stream.groupfns import group_fns
from mtjax.stream.mesh import DeviceMesh
from mtjax.stream.prefetch import Prefetcher
from mtjax.stream.resident import Resident
from mtjax.stream.splitblock import SplitBlocks
from mtjax.stream.staging import Placement, StagingPool, raise_host_memory_limit
from mtjax.stream.tiers import Tiers, host_device
from mtjax.stream.trace import Tracer
from mtjax.stream.update import PartUpdate, full_opt_state, split_opt_state, update_for
from mtjax.stream.updater import Updater


def _beside(store) -> str | None:
    """The directory holding the store: scratch files go next to it, on the same disk."""
    return str(Path(store.root).absolute().parent) if store is not None else None


class StreamEngine:
    """Streams one part at a time through the device; state stays in host RAM or on disk,
    except resident parts' (`stream.resident`), which stays on the device between commits.

    >>> engine = StreamEngine(cfg, params, OptimConfig(lr=1e-3), StreamConfig(keep_every=2))
    >>> metrics = engine.step(batch)    # a mtjax.batch.Batch, or int tokens [accum, batch, seq] / [batch, seq]
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
                 trace_steps: int | None = 4, owns_store: bool = False, hosts=None):
        if params is None and store is None:
            raise MtjaxError("StreamEngine needs params or an open layer store to take the state from")
        if hosts is not None:
            if store is not None and store.shard != hosts.shard:
                raise MtjaxError(f"store {store.root} is not process {hosts.index}'s shard of {hosts.count}")
            stream = dataclasses.replace(stream, resident="none")  # every part's state is split over the hosts
        self.hosts = hosts
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
        # less RAM). docs/pipeline.md, "The compute copy".
        self.derived_compute = hosts is None and schedule_mod.derives_compute(self.update.fused is not None,
                                                                             self.placement_config)
        if self.tiers.kinds_in("disk"):
            fix_mmap_threshold()  # state on disk promises host memory flat in depth
        self.parts = parts_mod.parts(cfg)
        self.schemas = {p.name: parts_mod.schema(cfg, p.name, "compute") for p in self.parts}
        self.fns = block_fns(cfg)
        self.placement = Placement(mesh=mesh or DeviceMesh.local(stream.devices))
        self.tracer = Tracer(trace_steps)
        self.ledger = budget_mod.DeviceLedger(0)
        self.split = SplitBlocks(group_fns(cfg), self.ledger, self.placement.mesh)  # split MoE blocks' passes
        # Slots per shape: the parts staged ahead, those in use (a recompute group, or
        # head + tied embedding + the resident last block), one whose readers finish.
        group = max(len(g) for g in self.groups)
        self.pool = StagingPool(self.placement, self.ledger, stream.prefetch_depth + max(group, 3) + 1)
        # A one-copy store keeps a single copy of the state: each step commits the state
        # before its update plus the gradients, durable in the store (docs/store.md).
        self.one_copy = OneCopy(store, self.tiers) if store is not None and store.copies == 1 else None
        self.grads = GradSink(self.placement, self.tracer, self._spill(), hosts)
        scale = self.one_copy.adopt(self.grads) if self.one_copy is not None and params is None else None
        self.updater = Updater([p.name for p in self.parts], self.update, self.tiers, self.grads, self.tracer,
                               self.derived_compute, self.one_copy, scale, hosts, self.schemas)
        self._schedules: dict[schedule_mod.StepShape, schedule_mod.Schedule] = {}
        self.schedule: schedule_mod.Schedule | None = None  # of the last token shape checked
        if params is None:
            self._load_ram_kinds()
        else:
            self._init_state(params, opt_state)
        self.resident = Resident(schedule_mod.resident_parts(cfg, stream.resident, self.groups), self.update,
                                 self.placement)
        self._load_resident()
        if batch_shape is not None:
            self.check_budget(*batch_shape)

    @classmethod
    def from_experiment(cls, exp: ExperimentConfig, cfg: ModelConfig, params=None, opt_state=None, *, store,
                        step: int = 0, hosts=None) -> StreamEngine:
        """A run's engine, as the experiment config asks, committing into the run's open
        layer `store` (mtjax.checkpoint opens it; every run has one): from fp32 `params`
        (and `opt_state`), or resumed from the store's last commit, `step`, when `params`
        is None. The engine owns the store from here on. `hosts`: a multi-process run's."""
        rows = exp.data.batch_size // (1 if hosts is None else hosts.count)  # this process's share
        return cls(cfg, params, exp.optim, exp.stream, exp.store, store=store, opt_state=opt_state, step=step,
                   batch_shape=(rows, exp.data.seq_len), owns_store=True, hosts=hosts)

    @property
    def commits_every_step(self) -> bool:
        """One copy of the state: each step must be committed before its update can run."""
        return self.one_copy is not None

    # --- state ---------------------------------------------------------------------

    def _spill(self) -> PendingFiles | None:
        """Where gradients wait for their update: with the master weights on disk, in files
        (a one-copy store's durable ones); otherwise in host memory (None)."""
        where = schedule_mod.spill(self.placement_config)
        if where == "pending":
            return self.one_copy.spill
        return PendingFiles(_beside(self.store)) if where == "scratch" else None

    def _init_state(self, params, opt_state=None) -> None:
        """Fill the tiers from fp32 `params` and, when resuming, the whole-model `opt_state`."""
        opt_parts = None if opt_state is None else split_opt_state(self.cfg, self.tx, opt_state)
        for p in self.parts:
            master = {n: np.asarray(a, np.float32) for n, a in treepath.flatten(parts_mod.part_params(params, p.name)).items()}
            if not self.derived_compute:
                self.updater.write(p.name, "compute", self.update.compute_copy(master))
            if self.hosts is not None:  # this process's rows of master (and so of the optimizer state)
                # Copies: device_put may alias a host array on the CPU, and a view of the
                # rows would keep the whole leaf resident for as long as the tier holds it.
                master = {n: np.array(self.hosts.shard.take(a)) for n, a in master.items()}
                if opt_parts is not None:
                    opt_parts[p.name] = {n: np.array(self.hosts.shard.take(a)) for n, a in opt_parts[p.name].items()}
            master = jax.device_put(master, host_device())
            opt = self.update.init_state(master) if opt_parts is None else jax.device_put(opt_parts[p.name], host_device())
            self.updater.write(p.name, "opt", opt)
            self.updater.write(p.name, "master", master)
        self.updater.wait_writes()

    def _load_ram_kinds(self) -> None:
        """Bring the RAM-tier kinds of a store-backed run into memory."""
        for kind in self.updater.kept_in_ram():
            for p in self.parts:
                arrays = self.store.read(p.name, kind).result()
                self.tiers.write(p.name, kind, jax.device_put(arrays, host_device()))

    def _load_resident(self) -> None:
        """Resident parts' state onto the device, from the tiers (a resumed one-copy store's
        pending update of such a part is applied first, on the host)."""
        for p in self.resident.names:
            self.updater.updated(p)
        self.updater.wait_writes()
        for p in self.resident.names:
            self.resident.load(p, self.updater.read(p, "master"), self.updater.read(p, "opt"))

    def _resident_to_tiers(self) -> None:
        """A commit brings the resident state to the host: into the tiers, from where the
        commit writes it like any other (no compute copy where none is kept)."""
        for p in self.resident.names:
            for kind in parts_mod.KINDS:
                if not (kind == "compute" and self.derived_compute):
                    self.updater.write(p, kind, self.resident.to_host(p, kind))
        self.updater.wait_writes()

    def _read_state(self, part: str, kind: str) -> dict:
        """One kind of a part's current state, as host arrays, wherever it lives (in a
        multi-process run, all-gathered from every process's rows: every process calls it)."""
        if part in self.resident:
            return self.resident.to_host(part, kind)
        arrays = self.updater.read(part, kind)
        if self.hosts is not None and kind != "compute":
            arrays = self.hosts.all_gather(arrays, parts_mod.schema(self.cfg, part, kind, self.tx))
        return arrays

    def flush(self) -> None:
        """Apply every pending update (before reading state, a checkpoint or the end)."""
        self.updater.flush()

    def params(self):
        """The fp32 master parameters, pending updates applied."""
        self.flush()
        out = {}
        for p in self.parts:
            tree = treepath.unflatten(parts_mod.abstract_part(self.cfg, p.name), self._read_state(p.name, "master"))
            # Copies: the next update overwrites RAM-tier arrays in place.
            out[p.name] = jax.tree.map(lambda a: jnp.asarray(np.array(a)), tree)
        n = self.cfg.num_hidden_layers
        return {"embed": out["embed"], "blocks": [out[f"block.{i}"] for i in range(n)], "head": out["head"]}

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
        return schedule_mod.groups(self.cfg.num_hidden_layers, self.options.keep_every)

    def plan(self, batch: int, seq: int, accum: int = 1, documents: bool = False) -> schedule_mod.Schedule:
        """The schedule of a step of `accum` micro-batches of [batch, seq], packed documents
        or not (mtjax.stream.schedule)."""
        shape = schedule_mod.StepShape(batch, seq, accum, documents)
        if shape not in self._schedules:
            self._schedules[shape] = schedule_mod.describe(self.cfg, self.options, self.placement_config, shape,
                                                           self.tx, fused=self.update.fused is not None,
                                                           devices=self.placement.mesh.count)
        return self._schedules[shape]

    def check_budget(self, batch: int, seq: int, accum: int = 1, documents: bool = False) -> None:
        """Raise DeviceBudgetError (before anything runs) when the run cannot fit; from
        here on the ledger holds the step to this schedule's device plan."""
        self.schedule = s = self.plan(batch, seq, accum, documents)
        self.ledger.enforce(s.device, schedule_mod.check_budget(s.device, self.options.device_budget_bytes))
        self._residual_bytes = s.device.residuals // max(len(g) for g in s.groups)  # one block's
        self._saved_bytes = {spec: schedule_mod.residual_bytes(self.cfg, spec, s.device_batch, seq, s.remat)
                             for spec in self.cfg.block_specs} if s.saved else {}
        if self.ledger.held_by_use["resident"] == 0 and self.resident:
            self.ledger.hold(self.resident.nbytes, "the resident parts' state", "resident")
        if self.placement.pinned:
            # Pinned host memory in flight: staged parts of each shape (embedding, blocks,
            # head), plus the kept activations when they wait in host memory.
            part = max(b.compute for b in s.part_bytes.values())
            raise_host_memory_limit(3 * self.pool.max_slots * part + s.traffic.h2d_activations)

    # --- the step ------------------------------------------------------------------

    def _load(self, part: str):
        """Prefetch worker: pending update, then read into a staging slot, then device_put.
        A split MoE block's sub-part (`part` "block.i/...") stages some of its block's
        leaves: an expert group only the experts some token reached."""
        owner, split = expert_groups.owner(part), self.schedule.split
        fresh = self.updater.updated(owner)
        schema = self.schemas[owner]
        if owner == part:
            slot, leaves = self.pool.acquire(schema), None
        else:
            groups = split[expert_groups.block_index(part)]
            sub = {n: schema[n] for n in expert_groups.leaves(schema, part, groups)}
            slot, leaves = self.pool.acquire(sub), self.split.staged(part, sub, groups)
        with self.tracer.span("read", part):
            if leaves is None or leaves:
                self.updater.compute_into(owner, slot.buffers if leaves is None else
                                          {n: slot.buffers[n] for n in leaves}, fresh)
        start = self.tracer.now()
        weights = self.pool.put(slot, part, leaves)
        self.tracer.watch("h2d", part, weights, since=start)  # until the device copy is ready
        return slot, weights if owner == part else self.split.complete(part, sub, groups, weights)

    @property
    def routed(self) -> dict:
        """{split block index: bool [E]}: the experts some token of the last pass reached
        (for `schedule.routed_traffic`)."""
        return dict(self.split.routing.reached)

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
        self.split.routing.reset()
        feed = Prefetcher(self.schedule.forward, self._load, self.options.prefetch_depth)
        try:
            xs, stats, _, _ = self._forward(feed, mbs, keep=False)
            (head_slot, head_w), tied = self._take_head(feed)
            losses = [self.fns.head_loss(head_w, tied[1], x, mb.tokens, mb.targets) for x, mb in zip(xs, mbs)]
            for slot in (head_slot, tied[0]):
                if slot is not None:
                    self.pool.release(slot, losses)
        finally:
            self.split.routing.cancel()
            for slot, _ in feed.close():
                self.pool.release(slot, [])
        w = jnp.asarray(weights, jnp.float32)
        if not self.cfg.moe_layers:
            out = {"loss": float(jnp.sum(jnp.stack(losses) * w))}  # one host sync for all
        else:
            auxes = jnp.stack([self.fns.aux(st, mb.tokens, 1.0)[0] for st, mb in zip(stats, mbs)])
            loss = jnp.sum((jnp.stack(losses) + self.cfg.router_aux_loss_coef * auxes) * w)
            out = {"loss": float(loss), "aux_loss": float(jnp.sum(auxes * w))}
        if self.hosts is not None:  # the sums of every process's shares
            out = dict(zip(out, (float(x) for x in self.hosts.all_sum(list(out.values())))))
        return out

    def _io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of disk-tier state and parked gradients so far."""
        r = w = 0
        for source in (self.store if self.tiers.kinds_in("disk") else None, self.grads.spill):
            if source is not None:
                r, w = r + source.io_bytes[0], w + source.io_bytes[1]
        return r, w

    def step(self, batch) -> dict[str, float]:
        mbs, weights = self._inputs(batch)
        start, (read0, written0) = time.perf_counter(), self._io_bytes()
        self.tracer.begin_step(self.step_count)
        self.ledger.reset()  # only resident state stays on the device between steps (even after a failed one)
        self.updater.wait_writes()
        self.split.routing.reset()
        # Once the step's last transfer is read the disk would idle until the clip scale is
        # known: the first updates' reads start then.
        feed = Prefetcher(self.schedule.transfers, self._load, self.options.prefetch_depth,
                          after=functools.partial(self.updater.read_early, self.schedule.streamed))
        try:
            losses, auxes = self._train_pass(feed, mbs, [float(w) for w in weights])
        except BaseException:
            self.grads.discard()  # a failed step's partial sums must not reach the next step
            self.resident.drop()
            raise
        finally:
            self.split.routing.cancel()  # a prefetch worker waiting for routing that will not come
            for slot, _ in feed.close():
                self.pool.release(slot, [])
        # Host sync: the clip scale needs every part's gradient norm.
        sq = self.grads.finish(tag=f"g{self.step_count + 1}")
        if self.resident:  # the resident parts' norms, from the device
            resident_sq = self.resident.finish()
            self.grads.last_sq.update(resident_sq)
            sq = sq + sum(resident_sq.values())
        self.step_count += 1
        # One host sync per step for the metrics, after the last block is enqueued.
        loss, norm_sq = float(np.dot([float(x) for x in losses], weights)), float(sq)
        aux = float(np.dot([float(a) for a in auxes], weights)) if self.cfg.moe_layers else 0.0
        if self.hosts is not None:  # the step's loss and squared norm: sums of every process's shares
            loss, norm_sq, aux = (float(x) for x in self.hosts.all_sum([loss, norm_sq, aux]))
            sq = jnp.float32(norm_sq)
        if not (math.isfinite(loss) and math.isfinite(norm_sq)):
            # Checked before any of this step's deferred updates can run: drop them all.
            order = ["head", *(f"block.{i}" for i in reversed(range(self.cfg.num_hidden_layers))), "embed"]
            bad = [p for p in order if not math.isfinite(float(self.grads.last_sq.get(p, 0.0)))]
            self.grads.drop_ready()
            self.resident.drop()
            self.updater.wait_writes()
            raise NonFiniteStep(self.step_count, loss, bad)
        scale = clip_scale(sq, self.clip_norm)
        self.updater.ready(scale)  # the updates start (one-copy: at the commit)
        self.resident.update(scale)  # on the device, now: its state is in no store until a commit
        if self.hosts is not None:
            self.updater.flush()  # on this thread, in part order: the all-gathers' order on every process
        metrics = {"loss": loss, "grad_norm": math.sqrt(norm_sq)}
        if self.cfg.moe_layers:  # the load-balancing loss, in "loss" times router_aux_loss_coef
            metrics["aux_loss"] = aux  # weighted as "loss" is
        if self.tiers.kinds_in("disk"):
            # Disk bandwidth over the step's wall time: state and gradient bytes moved meanwhile.
            seconds, (read1, written1) = time.perf_counter() - start, self._io_bytes()
            metrics["disk_read_gbps"] = (read1 - read0) / seconds / 1e9
            metrics["disk_write_gbps"] = (written1 - written0) / seconds / 1e9
        return metrics

    def _take(self, feed: Prefetcher, part: str):
        """(slot, weights) of the next part; a resident part's weights, and no slot."""
        if part in self.resident:
            return None, self.resident.weights(part)
        with self.tracer.span("wait", part):
            item, loaded = feed.get()
        assert item == part, f"prefetch order broken: expected {part}, got {item}"
        return loaded

    def _keep(self, x):
        if self.options.activations == "host":
            return self.placement.stash(x)
        self.ledger.hold(self.placement.mesh.share(x.nbytes), "a kept activation", "activations")
        return x

    def _unkeep(self, x):
        if self.options.activations == "host":
            return self.placement.unstash(x)
        self.ledger.free(self.placement.mesh.share(x.nbytes), "activations")
        return x

    def _forward(self, feed: Prefetcher, mbs: list, keep: bool):
        """Embedding and blocks over every micro-batch (documents.Inputs on the device),
        part by part: (last hidden states, per micro-batch the router stats of each MoE
        block, and for training when `keep`: per micro-batch {block index: kept input,
        ("vjp", block index): vjp kept by a saved group}, resident (slot, weights) or None)."""
        fns, pool, trace, s = self.fns, self.pool, self.tracer, self.schedule
        starts = {g.start for g in s.groups if g not in s.saved} if keep else set()
        saved = {i for g in s.saved for i in g} if keep else set()
        resident = None
        slot, w = self._take(feed, "embed")
        xs = [fns.embed_forward(w, mb.tokens) for mb in mbs]
        trace.watch("compute", "embed", xs)
        pool.release(slot, xs)  # weights dropped as soon as the part is done
        kept = [{0: self._keep(x)} if 0 in starts else {} for x in xs]
        stats = [[] for _ in xs]
        for i, spec in enumerate(self.cfg.layer_specs):
            if i in s.split:  # sub-part by sub-part (mtjax.stream.splitblock)
                xs, st, routing = self.split.forward(i, spec, s.split[i], functools.partial(self._take, feed),
                                                     pool.release, xs, [mb.segments for mb in mbs], keep)
                for m, one in enumerate(st):
                    stats[m].append(one)
                    if keep:
                        kept[m]["routing", i] = routing[m]
                trace.watch("compute", f"block.{i}", xs)
                if i + 1 in starts:
                    for k, x in zip(kept, xs):
                        k[i + 1] = self._keep(x)
                continue
            slot, w = self._take(feed, f"block.{i}")
            if i in saved:  # its one forward, keeping what the backward needs
                outs = [fns.save[s.remat][spec](w, x, mb.segments) for x, mb in zip(xs, mbs)]
                for k, (_, vjp) in zip(kept, outs):
                    self.ledger.hold(self._saved_bytes[spec], "residuals kept from the forward", "saved")
                    k["vjp", i] = vjp
                outs = [y for y, _ in outs]
            else:
                outs = [fns.forward[spec](w, x, mb.segments) for x, mb in zip(xs, mbs)]
            xs = [y for y, _ in outs]
            for per_batch, (_, st) in zip(stats, outs):
                per_batch += [st] if st else []
            del outs
            trace.watch("compute", f"block.{i}", xs)
            if keep and self.schedule.last_stays and i == self.cfg.num_hidden_layers - 1:
                resident = slot, w  # the backward starts with this block
            else:
                pool.release(slot, xs)
            if i + 1 in starts:
                for k, x in zip(kept, xs):
                    k[i + 1] = self._keep(x)
        return xs, stats, kept, resident

    def _take_head(self, feed: Prefetcher):
        """The head's (slot, weights), and the embedding's when tied (else (None, None))."""
        head = self._take(feed, "head")
        return head, self._take(feed, "embed") if self.cfg.tie_word_embeddings else (None, None)

    def _train_pass(self, feed: Prefetcher, mbs: list, weights: list[float]) -> list:
        """Forward and backward of every micro-batch, one part at a time: each part's
        weights cross to the device once per step, and its gradient is summed over the
        micro-batches on the device, then leaves once. Micro-batch i's loss gradient is
        scaled by weights[i] (its share of the step's loss), and so is the gradient of its
        load-balancing loss (mtjax.moe), which enters each MoE block's backward as the
        cotangent of its router stats. Returns the micro-batch training losses and
        load-balancing losses."""
        fns, pool, trace = self.fns, self.pool, self.tracer
        xs, stats, kept, resident = self._forward(feed, mbs, keep=True)
        auxes, dstats = zip(*(fns.aux(st, mb.tokens, weight) if st else (0.0, {})
                              for st, mb, weight in zip(stats, mbs, weights)))
        (head_slot, head_w), tied = self._take_head(feed)
        losses, dxs, dhead, dembed = [], [], None, None
        for x, mb, weight, aux in zip(xs, mbs, weights, auxes):
            loss, dh, de, dx = fns.head(head_w, tied[1], x, mb.tokens, weight, mb.targets)
            losses.append(loss + self.cfg.router_aux_loss_coef * aux if self.cfg.moe_layers else loss)
            dxs.append(dx)
            dhead = self._sum(dhead, dh, len(mbs))
            dembed = self._sum(dembed, de, len(mbs)) if tied[1] is not None else None
        trace.watch("compute", "head", dxs)
        pool.release(head_slot, dxs)
        self._add_grad("head", dhead)
        if tied[1] is not None:
            pool.release(tied[0], dxs)  # dembed waits on the device for the lookup's gradient
        del xs, head_w, tied

        for group in reversed(self.schedule.groups):
            if group.start in self.schedule.split:  # a split MoE block: a group of its own
                i = group.start
                xs = [self._unkeep(k.pop(i)) for k in kept]
                dxs, dw = self.split.backward(i, self.cfg.layer_specs[i], self.schedule.split[i],
                                              functools.partial(self._take, feed), pool.release,
                                              lambda acc, g: self._sum(acc, g, len(mbs)), xs,
                                              [k.pop(("routing", i)) for k in kept], dxs, dstats,
                                              [mb.segments for mb in mbs])
                self._finish_block(i, None, dw, dxs)
            elif group in self.schedule.saved:
                dxs = self._backward_saved(group, kept, dxs, dstats)
            else:
                xs = [self._unkeep(k.pop(group.start)) for k in kept]
                dxs = self._backward_group(feed, group, xs, dxs, dstats, [mb.segments for mb in mbs], resident)
            resident = None
        de = None
        for mb, dx in zip(mbs, dxs):
            de = self._sum(de, fns.embed_backward(mb.tokens, dx), len(mbs))
        if dembed is not None:  # tied: the head's use of the embedding plus the lookup's
            de = fns.grad_add(fns.grad_to_f32(dembed), de)
        trace.watch("compute", "embed", de)
        self._add_grad("embed", de)
        return losses, auxes

    def _add_grad(self, part: str, grads: dict) -> None:
        """A part's summed gradient of the step: to the host, or kept on the device (resident)."""
        (self.resident.add_grad if part in self.resident else self.grads.add)(part, grads)

    def _sum(self, acc, grads, count: int):
        """Running sum of a part's gradients over the micro-batches, on the device (fp32).
        With one micro-batch the gradient goes as it is (the host casts it)."""
        if count == 1:
            return grads
        return self.fns.grad_to_f32(grads) if acc is None else self.fns.grad_add(acc, grads)

    def _backward_group(self, feed: Prefetcher, group: range, xs: list, dxs: list, dstats: list, segments: list,
                        resident=None) -> list:
        """Recompute the group's blocks from their kept inputs, then walk them back, one
        micro-batch at a time with the group's weights on the device; returns the
        gradients w.r.t. the group's inputs. `dstats`: per micro-batch, the cotangent of
        every MoE block's router stats. `segments`: each micro-batch's document ids (or
        None). `resident`: the group's (one) block is still on the device from the forward."""
        fns, specs, count = self.fns, self.cfg.layer_specs, len(xs)
        moe = set(self.cfg.moe_layers)
        if len(group) == 1:  # recompute and backward fused in one program
            i = group.start
            slot, w = resident or self._take(feed, f"block.{i}")
            acc, out = None, []
            for x, dx, ds, seg in zip(xs, dxs, dstats, segments):
                dw, dx = fns.grad[specs[i]](w, x, dx, ds if i in moe else {}, seg)
                acc = self._sum(acc, dw, count)
                out.append(dx)
            self._finish_block(i, slot, acc, out)
            return out
        held = [(i, *self._take(feed, f"block.{i}")) for i in group]
        accs, out = dict.fromkeys(group), []
        for x, dx, ds, seg in zip(xs, dxs, dstats, segments):
            vjps = []
            for i, _, w in held:
                (x, _), vjp = fns.recompute[specs[i]](w, x, seg)
                self.ledger.hold(self._residual_bytes, "recompute residuals", "residuals")
                vjps.append((i, vjp))
            while vjps:
                i, vjp = vjps.pop()
                dw, dx = fns.backward(vjp, (dx, ds if i in moe else {}))
                del vjp
                self.ledger.free(self._residual_bytes, "residuals")
                accs[i] = self._sum(accs[i], dw, count)
            out.append(dx)
        del x
        for i, slot, _ in reversed(held):
            self._finish_block(i, slot, accs[i], out)
        return out

    def _backward_saved(self, group: range, kept: list, dxs: list, dstats: list) -> list:
        """A saved group's backward from the vjps its forward kept (resident blocks: no
        weights to fetch, nothing recomputed beyond what the remat policy dropped); a MoE
        block's vjp takes its router stats' cotangent too, as in `_backward_group`."""
        specs, count = self.cfg.layer_specs, len(dxs)
        moe = set(self.cfg.moe_layers)
        accs, out = dict.fromkeys(group), []
        for k, dx, ds in zip(kept, dxs, dstats):
            for i in reversed(group):
                dw, dx = self.fns.backward(k.pop(("vjp", i)), (dx, ds if i in moe else {}))
                self.ledger.free(self._saved_bytes[specs[i]], "saved")
                accs[i] = self._sum(accs[i], dw, count)
            out.append(dx)
        for i in reversed(group):
            self._finish_block(i, None, accs[i], out)
        return out

    def _finish_block(self, i: int, slot, dw, dxs: list) -> None:
        self.tracer.watch("compute", f"block.{i}", dxs)
        # The dxs are computed by the programs that last read the slot's weights.
        self.pool.release(slot, dxs)
        self._add_grad(f"block.{i}", dw)

    # --- reporting -----------------------------------------------------------------

    def stage_seconds(self, step: int | None = None) -> dict[str, float]:
        """Seconds spent per stage in a step (default: the last one)."""
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
