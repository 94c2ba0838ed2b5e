"""The streaming engine: one training step as a pipeline of per-part stages.

    tier/store -> prefetch (update, read, stage) -> device_put -> block fwd/bwd
               -> gradients to host -> (next step) optax update on CPU -> tier/store

The step reads as those stages; docs/pipeline.md draws the timeline. Forward streams
embed, blocks and head; the head computes the loss and its gradient at once; backward
streams the blocks back in reverse, one recompute group (k blocks) at a time, each
block's forward recomputed once from the group's kept input. Updates are deferred to
the next step's prefetch so that global-norm clipping stays exact (DESIGN-NOTES 2).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax import parts as parts_mod
from mtjax import treepath
from mtjax.errors import MtjaxError, NonFiniteStep
from mtjax.hostmem import BufferPool, fix_mmap_threshold
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, clip_scale
from mtjax.store.pending import PendingFiles
from mtjax.stream import budget as budget_mod
from mtjax.stream import fused_adamw
from mtjax.stream.blockfns import block_fns
from mtjax.stream.grads import GradSink
from mtjax.stream.prefetch import Prefetcher
from mtjax.stream.staging import Placement, StagingPool, raise_host_memory_limit
from mtjax.stream.tiers import Tiers, derives_compute, host_device
from mtjax.stream.trace import Tracer
from mtjax.stream.update import PartUpdate, full_opt_state, split_opt_state, update_for


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    prefetch_depth: int = 2  # parts staged on the device ahead of use
    keep_every: int = 1  # keep every k-th block input; 0 keeps only the embedding output
    activations: str = "device"  # where kept block inputs wait for the backward: device | host
    device_budget_bytes: int | None = None  # None: derived from the plan of the run

    def __post_init__(self):
        if self.prefetch_depth < 1:
            raise MtjaxError(f"stream.prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.keep_every < 0:
            raise MtjaxError(f"stream.keep_every must be >= 0 (0 keeps only the embedding output), got {self.keep_every}")
        if self.activations not in ("device", "host"):
            raise MtjaxError(f"stream.activations must be 'device' or 'host', got {self.activations!r}")


def _beside(store) -> str | None:
    """The directory holding the store: scratch files go next to it, on the same disk."""
    root = getattr(store, "root", None)
    return str(Path(root).absolute().parent) if root is not None else None


def _is_store(obj) -> bool:
    return all(hasattr(obj, a) for a in ("read", "write", "commit"))


class StreamEngine:
    """Streams one part at a time through the device; state stays in host RAM or on disk.

    >>> engine = StreamEngine(cfg, params, OptimConfig(lr=1e-3), keep_every=2)
    >>> metrics = engine.step(tokens)   # int [accum, batch, seq] or [batch, seq]
    >>> engine.params()                 # fp32 master params, pending updates applied

    `params_or_store` is a params pytree (mtjax.model layout) or an open layer store;
    `tiers` places each kind of state ({"compute"|"master"|"opt": "ram"|"disk"}), and
    "disk" kinds live in `store` (the store itself when one is passed as the state).
    `trace_steps` is how many recent steps keep their stage timings (None: all).
    """

    def __init__(self, cfg: ModelConfig, params_or_store, optimizer: OptimConfig | optax.GradientTransformation = OptimConfig(),
                 clip_norm: float | None = None, *, prefetch_depth: int = 2, keep_every: int = 1,
                 activations: str = "device", device_budget_bytes: int | None = None,
                 tiers: Mapping[str, str] | None = None, store=None, batch_shape: tuple[int, int] | None = None,
                 device: jax.Device | None = None, trace_steps: int | None = 4, opt_state=None):
        self.cfg = cfg
        self.options = StreamOptions(prefetch_depth, keep_every, activations, device_budget_bytes)
        if isinstance(optimizer, OptimConfig):
            clip_norm = optimizer.clip_norm if clip_norm is None else clip_norm
            self.update = update_for(cfg, optimizer)
        else:
            self.update = PartUpdate(cfg, optimizer)
        self.tx, self.clip_norm = self.update.tx, clip_norm
        from_store = _is_store(params_or_store)
        self.store = params_or_store if from_store else store
        self.tiers = Tiers(tiers or {}, self.store)
        # With the master weights in RAM and the fused update, no compute copy is kept: the
        # prefetcher rounds master into the staging slot (reading 4 bytes/param there
        # instead of the update writing 2 that the prefetcher then reads; 2 bytes/param
        # less RAM). docs/pipeline.md, "The compute copy".
        self.derived_compute = derives_compute(self.update.fused is not None, self.tiers.placement["master"],
                                               self.tiers.placement["compute"])
        if self.tiers.kinds_in("disk"):
            fix_mmap_threshold()  # state on disk promises host memory flat in depth
        self.parts = parts_mod.parts(cfg)
        self.schemas = {p.name: parts_mod.schema(cfg, p.name, "compute") for p in self.parts}
        self.fns = block_fns(cfg)
        self.placement = Placement(device)
        self.tracer = Tracer(trace_steps)
        self.ledger = budget_mod.DeviceLedger(0)
        # Slots per shape: the parts staged ahead, those in use (a recompute group, or
        # head + tied embedding + the resident last block), one whose readers finish.
        group = max(len(g) for g in self.groups)
        self.pool = StagingPool(self.placement, self.ledger, prefetch_depth + max(group, 3) + 1)
        # A one-copy store keeps a single copy of the state: each step commits the state
        # before its update plus the gradients, durable in the store (docs/store.md).
        self.one_copy = self.store is not None and getattr(self.store, "copies", 2) == 1
        if self.one_copy and self.tiers.kinds_in("ram"):
            raise MtjaxError("a one-copy store (store.copies=1) holds every kind of state: set store.compute, "
                             "store.master and store.opt to 'disk', or use store.copies=2")
        # With the master weights on disk, gradients awaiting their update wait in files.
        if self.one_copy:
            spill = PendingFiles(directory=self.store.pending_dir)
        else:
            spill = PendingFiles(_beside(self.store)) if self.tiers.placement["master"] == "disk" else None
        self.grads = GradSink(self.placement, self.tracer, spill)
        self._uncommitted = False  # one-copy: this step's gradients are not yet in a commit
        self._scale = None  # the clip scale of the pending updates (CPU scalar)
        self._writes: list[cf.Future] = []
        self._writes_lock = threading.Lock()  # update workers add writes concurrently
        # Deferred updates start as soon as the clip scale is known, on a few host threads
        # (one for disk tiers: each update in flight holds a part's state in read buffers);
        # the prefetcher waits for a part's update before staging it.
        workers = 1 if self.tiers.kinds_in("disk") else max(1, min(8, os.cpu_count() or 1))
        self._update_pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="mtjax-update")
        self._updates: dict[str, cf.Future] = {}
        self.read_buffers = BufferPool(sets_per_shape=1)  # the optimizer's disk-tier reads
        self._plans: dict[tuple[int, int, int], budget_mod.DevicePlan] = {}
        self._residual_bytes_by_shape: dict[tuple, int] = {}
        self.step_count = 0
        self._owns_store = False  # close() closes a store the engine created
        if from_store:
            self._load_ram_kinds()
            self._adopt_pending()
        else:
            self._init_state(params_or_store, opt_state)
        if batch_shape is not None:
            self.check_budget(*batch_shape)

    @classmethod
    def from_experiment(cls, exp, cfg: ModelConfig, params, opt_state=None) -> StreamEngine:
        """The engine an experiment config (mtjax.config) asks for, from fp32 `params`.

        Disk tiers get a new store at `store.path` (default <run.dir>/store).
        """
        tiers, store = exp.store.tiers, None
        if "disk" in tiers.values():
            import mtjax.store
            from mtjax.optim import make_optimizer

            path = exp.store.path or str(Path(exp.run.dir) / "store")
            store = mtjax.store.create(path, cfg, make_optimizer(exp.optim), copies=exp.store.copies)
        s = exp.stream
        engine = cls(cfg, params, exp.optim, prefetch_depth=s.prefetch_depth, keep_every=s.keep_every,
                   activations=s.activations, device_budget_bytes=s.device_budget_bytes, tiers=tiers,
                   store=store, batch_shape=(exp.data.batch_size, exp.data.seq_len), opt_state=opt_state)
        engine._owns_store = store is not None
        return engine

    # --- state ---------------------------------------------------------------------

    def _init_state(self, params, opt_state=None) -> None:
        """Fill the tiers from fp32 `params` and, when resuming, the whole-model `opt_state`."""
        opt_parts = None if opt_state is None else split_opt_state(self.cfg, self.tx, opt_state)
        for p in self.parts:
            master = {n: np.asarray(a, np.float32) for n, a in treepath.flatten(parts_mod.part_params(params, p.name)).items()}
            master = jax.device_put(master, host_device())
            opt = self.update.init_state(master) if opt_parts is None else jax.device_put(opt_parts[p.name], host_device())
            self._write(p.name, "opt", opt)
            if not self.derived_compute:
                self._write(p.name, "compute", self.update.compute_copy(master))
            self._write(p.name, "master", master)
        self._wait_writes()

    def _load_ram_kinds(self) -> None:
        """Bring the RAM-tier kinds of a store-backed run into memory."""
        for kind in self._kept_in_ram():
            for p in self.parts:
                arrays = self.store.read(p.name, kind).result()
                self.tiers.write(p.name, kind, jax.device_put(arrays, host_device()))

    def _adopt_pending(self) -> None:
        """Resume a one-copy store mid-update: its committed gradients are this engine's pending ones."""
        pending = getattr(self.store, "pending", None)
        if not pending:
            return
        schemas = {p: self.store.schema(p, "master") for p in pending["parts"]}
        self.grads.adopt(pending["parts"], pending["tag"], schemas)
        self._scale = jax.device_put(np.float32(pending["scale"]), host_device())

    def _kept_in_ram(self) -> list[str]:
        """The kinds of state the RAM tier holds (a derived compute copy is not held)."""
        return [k for k in self.tiers.kinds_in("ram") if not (k == "compute" and self.derived_compute)]

    def _round_master(self, part: str, out: dict | None = None) -> dict:
        """The derived compute copy of `part`: its master weights rounded into `out`
        ({leaf: array}; new arrays when None)."""
        master = {n: np.asarray(a) for n, a in self._read(part, "master").items()}
        out = {n: np.empty(a.shape, self.update.dtype) for n, a in master.items()} if out is None else out
        for n, a in master.items():
            fused_adamw.round_into(a, out[n])
        return out

    def _write(self, part: str, kind: str, arrays: dict) -> None:
        with self.tracer.span("write", part):
            fut = self.tiers.write(part, kind, arrays)
        self._track(fut)

    def _track(self, fut: cf.Future) -> None:
        with self._writes_lock:
            # Keep only unfinished or failed writes: a finished one must not pin its arrays.
            self._writes = [f for f in self._writes if not f.done() or f.exception()] + [fut]

    def _wait_writes(self) -> None:
        """Host sync: re-raise write errors, and make the state readable from the tiers."""
        with self._writes_lock:
            writes, self._writes = self._writes, []
        for fut in writes:
            fut.result()
        if self.store is not None:
            self.store.wait()  # also lets the store drop the results of finished reads

    def _read(self, part: str, kind: str) -> dict:
        with self.tracer.span("read", part):
            return self.tiers.read(part, kind).result()

    def _read_for_update(self, part: str, kind: str):
        """(arrays, buffers to hand back or None): disk reads land in reused buffers."""
        if self.tiers.placement[kind] == "ram":
            return self._read(part, kind), None
        schema = self.store.schema(part, kind)
        buffers = self.read_buffers.acquire(schema)
        with self.tracer.span("read", part):
            return self.tiers.read(part, kind, out=buffers).result(), buffers

    def _apply_update(self, part: str) -> dict | None:
        """The deferred optimizer update of `part`, if one is pending; returns the new compute copy."""
        if self._uncommitted and part in self.grads.pending():
            raise MtjaxError("with a one-copy store a step must be committed (engine.commit(step, train_state)) "
                             "before its update may overwrite the only copy of the state")
        grads = self.grads.take(part)
        if grads is None:
            return None
        (master, m_bufs), (opt, o_bufs) = self._read_for_update(part, "master"), self._read_for_update(part, "opt")
        # The old compute copy receives the new one (RAM tier only), and RAM-tier state is
        # updated in place: nothing else reads it while its part's update is pending.
        old = self._read(part, "compute") if "compute" in self._kept_in_ram() else None
        with self.tracer.span("optimizer", part) if self.update.fused else contextlib.nullcontext():
            master, opt, compute = self.update(part, master, opt, old, grads, self._scale,
                                               own=self.tiers.kinds_in("ram"), copy=not self.derived_compute)
        for bufs in (m_bufs, o_bufs):
            if bufs is not None:
                self.read_buffers.release(bufs, fence=master)
        if not self.update.fused:  # the optax program runs asynchronously: time it until done
            self.tracer.watch("optimizer", part, master)
        self._write(part, "master", master)
        self._write(part, "opt", opt)
        if compute is not None:
            self._write(part, "compute", compute)
        if self.one_copy:
            # Once the new state is on disk the manifest names it and its gradient can go.
            self._track(self.store.commit_part(part, after=lambda: self.grads.release(part)))
        # A copy headed for disk is not handed to the prefetcher: updates run ahead of the
        # forward, and holding every new copy until staged grows host memory with depth.
        # The prefetcher reads it back (the store orders that read after this write).
        return None if self.tiers.placement["compute"] == "disk" else compute

    def _start_updates(self) -> None:
        """Start every pending update on the update threads, in the order the forward needs them."""
        for p in self.parts:
            if p.name in self.grads.pending() and p.name not in self._updates:
                self._updates[p.name] = self._update_pool.submit(self._apply_update, p.name)

    def _updated(self, part: str) -> dict | None:
        """The new compute copy of `part` once its pending update is done (None: no update,
        or no copy kept)."""
        fut = self._updates.pop(part, None)
        return fut.result() if fut is not None else self._apply_update(part)

    def flush(self) -> None:
        """Apply every pending update (before reading state, a checkpoint or the end)."""
        for p in self.parts:
            self._updated(p.name)
        self._wait_writes()

    def params(self):
        """The fp32 master parameters, pending updates applied."""
        self.flush()
        out = {}
        for p in self.parts:
            tree = treepath.unflatten(parts_mod.abstract_part(self.cfg, p.name), self._read(p.name, "master"))
            # Copies: the next update overwrites RAM-tier arrays in place.
            out[p.name] = jax.tree.map(lambda a: jnp.asarray(np.array(a)), tree)
        n = self.cfg.num_hidden_layers
        return {"embed": out["embed"], "blocks": [out[f"block.{i}"] for i in range(n)], "head": out["head"]}

    def opt_state(self):
        """The optimizer state shaped as the reference trainer's `tx.init(params)`."""
        self.flush()
        per_part = {p.name: {n: jnp.asarray(np.array(a)) for n, a in self._read(p.name, "opt").items()} for p in self.parts}
        return full_opt_state(self.cfg, self.tx, per_part)

    def commit(self, step: int | None = None, train_state=None, flush: bool | None = None) -> None:
        """Make the current state durable in the store: RAM-tier kinds are written too.

        Pending updates are applied first (`flush`), except with a one-copy store, which
        commits them as gradients still to apply (a resume applies them): no pause.
        """
        if self.store is None:
            raise MtjaxError("commit needs a layer store: pass store=mtjax.store.create(...)")
        step = self.step_count if step is None else step
        if self.one_copy:
            # Updates already started (by an earlier commit of this step) must finish first:
            # a commit changes which slot each part's next write goes to.
            for fut in list(self._updates.values()):
                fut.result()
            self._wait_writes()  # the part commits of this step's updates included
            self.store.commit(step, train_state, pending=self.grads.pending_update(self._scale))
            self._uncommitted = False
            if not flush:
                self._start_updates()  # only now may they overwrite the one copy
                return
        self.flush()
        for kind in self.tiers.kinds_in("ram"):
            for p in self.parts:
                if kind == "compute" and self.derived_compute:
                    arrays = self._round_master(p.name)
                else:
                    arrays = {n: np.asarray(a) for n, a in self._read(p.name, kind).items()}
                # One part at a time: np.asarray joins the optimizer's RowChunks into copies.
                self.store.write(p.name, kind, arrays).result()
        self._wait_writes()
        self.store.commit(step, train_state)
        self._uncommitted = False

    # --- the plan ------------------------------------------------------------------

    @property
    def groups(self) -> list[range]:
        """Recompute groups: block ranges whose first input is kept."""
        n, k = self.cfg.num_hidden_layers, self.options.keep_every
        k = n if k == 0 else min(k, n)
        return [range(s, min(s + k, n)) for s in range(0, n, k)]

    def plan(self, batch: int, seq: int, accum: int = 1) -> budget_mod.DevicePlan:
        """Device bytes this engine needs for `accum` micro-batches of [batch, seq]."""
        if (batch, seq, accum) in self._plans:
            return self._plans[batch, seq, accum]
        cfg, dt = self.cfg, np.dtype(self.cfg.compute_dtype)
        x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), dt)
        residuals = self._residuals(x)
        plan = budget_mod.plan_bytes(
            max_part_bytes=max(parts_mod.nbytes(s) for s in self.schemas.values()),
            max_grad_bytes=max(parts_mod.nbytes(s) for s in self.schemas.values()),
            hidden_bytes=math.prod(x.shape) * dt.itemsize,
            logits_bytes=batch * seq * cfg.vocab_size * 4,
            residual_bytes=residuals,
            prefetch_depth=self.options.prefetch_depth,
            group=max(len(g) for g in self.groups),
            kept=len(self.groups),
            activations_on_device=self.options.activations == "device",
            accum=accum,
            max_part_params=max(parts_mod.nbytes(s) // np.dtype(cfg.compute_dtype).itemsize
                                for s in self.schemas.values()),
        )
        self._plans[batch, seq, accum] = plan
        return plan

    def _residuals(self, x: jax.ShapeDtypeStruct) -> int:
        """Bytes of the largest block's vjp residuals for hidden states shaped like `x`."""
        if x.shape in self._residual_bytes_by_shape:
            return self._residual_bytes_by_shape[x.shape]
        residuals = 0
        for p in self.parts:
            if p.fn_kind.startswith("block:"):
                kind = p.fn_kind.removeprefix("block:")
                _, vjp = jax.eval_shape(self.fns.recompute[kind], self.schemas[p.name], x)
                residuals = max(residuals, budget_mod.tree_bytes(vjp))
        self._residual_bytes_by_shape[x.shape] = residuals
        return residuals

    def check_budget(self, batch: int, seq: int, accum: int = 1) -> None:
        """Raise DeviceBudgetError (before anything runs) when the run cannot fit."""
        plan = self.plan(batch, seq, accum)
        self.ledger.budget = budget_mod.check_budget(plan, self.options.device_budget_bytes)
        self._residual_bytes = plan.residuals // max(len(g) for g in self.groups)  # one block's
        if self.placement.pinned:
            # Pinned host memory in flight: staged parts of each shape (embedding, blocks,
            # head), plus the kept activations when they wait in host memory.
            part = max(parts_mod.nbytes(s) for s in self.schemas.values())
            hidden = batch * seq * self.cfg.hidden_size * np.dtype(self.cfg.compute_dtype).itemsize
            stashed = accum * len(self.groups) * hidden if self.options.activations == "host" else 0
            raise_host_memory_limit(3 * self.pool.max_slots * part + stashed)

    # --- the step ------------------------------------------------------------------

    def _schedule(self, backward: bool = True) -> list[str]:
        """The parts a step streams, in order of use: once, whatever the number of micro-batches."""
        n = self.cfg.num_hidden_layers
        fwd = ["embed", *(f"block.{i}" for i in range(n)), "head"]
        fwd += ["embed"] if self.cfg.tie_word_embeddings else []  # the head's kernel
        bwd = [f"block.{i}" for g in reversed(self.groups) for i in g]
        bwd = bwd[1:] if self._last_stays else bwd  # already on the device
        return fwd + bwd if backward else fwd

    def _load(self, part: str):
        """Prefetch worker: pending update, then read into a staging slot, then device_put."""
        fresh = self._updated(part)
        slot = self.pool.acquire(self.schemas[part])
        with self.tracer.span("read", part):
            if self.derived_compute:
                self._round_master(part, slot.buffers)  # the updated master, straight into the slot
            elif fresh is not None:
                # np.asarray waits for the update (host sync on this worker thread):
                # the new compute copy is staged without a round trip through the tier.
                for n, buf in slot.buffers.items():
                    np.copyto(buf, np.asarray(fresh[n]))
            else:
                self.tiers.read(part, "compute", out=slot.buffers).result()
        with self.tracer.span("h2d", part):
            return slot, self.pool.put(slot, part)

    def _tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim == 2:
            tokens = tokens[None]
        if tokens.ndim != 3:
            raise MtjaxError(f"tokens must be [accum, batch, seq] or [batch, seq], got shape {tokens.shape}")
        self.check_budget(*tokens.shape[1:], accum=len(tokens))  # before anything changes
        return tokens

    def eval_loss(self, tokens) -> float:
        """Mean loss over int32 [n, batch, seq] with the current weights; no update."""
        tokens = self._tokens(tokens)
        feed = Prefetcher(self._schedule(backward=False), self._load, self.options.prefetch_depth)
        try:
            toks = [self.placement.tokens(t) for t in tokens]
            xs, _, _ = self._forward(feed, toks, keep=False)
            (head_slot, head_w), tied = self._take_head(feed)
            losses = [self.fns.head_loss(head_w, tied[1], x, t) for x, t in zip(xs, toks)]
            for slot in (head_slot, tied[0]):
                if slot is not None:
                    self.pool.release(slot, losses)
        finally:
            for slot, _ in feed.close():
                self.pool.release(slot, [])
        return float(jnp.mean(jnp.stack(losses)))  # one host sync for all batches

    def _io_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of disk-tier state and parked gradients so far."""
        r = w = 0
        for source in (self.store if self.tiers.kinds_in("disk") else None, self.grads.spill):
            if source is not None:
                r, w = r + source.io_bytes[0], w + source.io_bytes[1]
        return r, w

    def step(self, tokens) -> dict[str, float]:
        tokens = self._tokens(tokens)
        start, (read0, written0) = time.perf_counter(), self._io_bytes()
        accum = len(tokens)
        self.tracer.begin_step(self.step_count)
        self.ledger.held = 0  # nothing stays on the device between steps (even after a failed one)
        self._wait_writes()
        feed = Prefetcher(self._schedule(), self._load, self.options.prefetch_depth)
        try:
            losses = self._train_pass(feed, [self.placement.tokens(t) for t in tokens], 1.0 / accum)
        except BaseException:
            self.grads.discard()  # a failed step's partial sums must not reach the next step
            raise
        finally:
            for slot, _ in feed.close():
                self.pool.release(slot, [])
        # Host sync: the clip scale needs every part's gradient norm.
        sq = self.grads.finish(tag=f"g{self.step_count + 1}")
        self.step_count += 1
        # One host sync per step for the metrics, after the last block is enqueued.
        loss, norm_sq = float(np.mean([float(x) for x in losses])), float(sq)
        if not (math.isfinite(loss) and math.isfinite(norm_sq)):
            # Checked before any of this step's deferred updates can run: drop them all.
            order = ["head", *(f"block.{i}" for i in reversed(range(self.cfg.num_hidden_layers))), "embed"]
            bad = [p for p in order if not math.isfinite(float(self.grads.last_sq.get(p, 0.0)))]
            self.grads.drop_ready()
            self._wait_writes()
            raise NonFiniteStep(self.step_count, loss, bad)
        self._scale = jax.device_put(clip_scale(sq, self.clip_norm), host_device())
        self._uncommitted = self.one_copy
        self._wait_writes()
        if not self.one_copy:
            self._start_updates()  # they run while the caller logs, evaluates, fetches data
        metrics = {"loss": loss, "grad_norm": math.sqrt(norm_sq)}
        if self.tiers.kinds_in("disk"):
            # Disk bandwidth over the step's wall time: state and gradient bytes moved meanwhile.
            seconds, (read1, written1) = time.perf_counter() - start, self._io_bytes()
            metrics["disk_read_gbps"] = (read1 - read0) / seconds / 1e9
            metrics["disk_write_gbps"] = (written1 - written0) / seconds / 1e9
        return metrics

    def _take(self, feed: Prefetcher, part: str):
        item, loaded = feed.get()
        assert item == part, f"prefetch order broken: expected {part}, got {item}"
        return loaded

    def _keep(self, x):
        if self.options.activations == "host":
            return self.placement.stash(x)
        self.ledger.hold(x.nbytes, "a kept activation")
        return x

    def _unkeep(self, x):
        if self.options.activations == "host":
            return self.placement.unstash(x)
        self.ledger.free(x.nbytes)
        return x

    @property
    def _last_stays(self) -> bool:
        """Whether the last block's weights stay on the device from its forward to its
        backward (saves one transfer): when it is a recompute group of its own."""
        return len(self.groups[-1]) == 1

    def _forward(self, feed: Prefetcher, toks: list, keep: bool):
        """Embedding and blocks over every micro-batch, part by part; for training when
        `keep`: (last hidden states, per micro-batch {block index: kept input}, resident
        (slot, weights) or None)."""
        fns, pool, trace = self.fns, self.pool, self.tracer
        starts = {g.start for g in self.groups} if keep else set()
        resident = None
        slot, w = self._take(feed, "embed")
        xs = [fns.embed_forward(w, t) for t in toks]
        trace.watch("compute", "embed", xs)
        pool.release(slot, xs)  # weights dropped as soon as the part is done
        kept = [{0: self._keep(x)} if keep else {} for x in xs]
        for i, kind in enumerate(self.cfg.layer_types):
            slot, w = self._take(feed, f"block.{i}")
            xs = [fns.forward[kind](w, x) for x in xs]
            trace.watch("compute", f"block.{i}", xs)
            if keep and self._last_stays and i == self.cfg.num_hidden_layers - 1:
                resident = slot, w  # the backward starts with this block
            else:
                pool.release(slot, xs)
            if i + 1 in starts:
                for k, x in zip(kept, xs):
                    k[i + 1] = self._keep(x)
        return xs, kept, resident

    def _take_head(self, feed: Prefetcher):
        """The head's (slot, weights), and the embedding's when tied (else (None, None))."""
        head = self._take(feed, "head")
        return head, self._take(feed, "embed") if self.cfg.tie_word_embeddings else (None, None)

    def _train_pass(self, feed: Prefetcher, toks: list, weight: float) -> list:
        """Forward and backward of every micro-batch, one part at a time: each part's
        weights cross to the device once per step, and its gradient is summed over the
        micro-batches on the device, then leaves once. Returns the micro-batch losses."""
        fns, pool, trace = self.fns, self.pool, self.tracer
        xs, kept, resident = self._forward(feed, toks, keep=True)
        (head_slot, head_w), tied = self._take_head(feed)
        losses, dxs, dhead, dembed = [], [], None, None
        for x, t in zip(xs, toks):
            loss, dh, de, dx = fns.head(head_w, tied[1], x, t, weight)
            losses.append(loss)
            dxs.append(dx)
            dhead = self._sum(dhead, dh, len(toks))
            dembed = self._sum(dembed, de, len(toks)) if tied[0] is not None else None
        trace.watch("compute", "head", dxs)
        pool.release(head_slot, dxs)
        self.grads.add("head", dhead)
        if tied[0] is not None:
            pool.release(tied[0], dxs)  # dembed waits on the device for the lookup's gradient
        del xs, head_w, tied

        for group in reversed(self.groups):
            xs = [self._unkeep(k.pop(group.start)) for k in kept]
            dxs = self._backward_group(feed, group, xs, dxs, resident)
            resident = None
        de = None
        for t, dx in zip(toks, dxs):
            de = self._sum(de, fns.embed_backward(t, dx), len(toks))
        if dembed is not None:  # tied: the head's use of the embedding plus the lookup's
            de = fns.grad_add(fns.grad_to_f32(dembed), de)
        trace.watch("compute", "embed", de)
        self.grads.add("embed", de)
        return losses

    def _sum(self, acc, grads, count: int):
        """Running sum of a part's gradients over the micro-batches, on the device (fp32).
        With one micro-batch the gradient goes as it is (the host casts it)."""
        if count == 1:
            return grads
        return self.fns.grad_to_f32(grads) if acc is None else self.fns.grad_add(acc, grads)

    def _backward_group(self, feed: Prefetcher, group: range, xs: list, dxs: list, resident=None) -> list:
        """Recompute the group's blocks from their kept inputs, then walk them back, one
        micro-batch at a time with the group's weights on the device; returns the
        gradients w.r.t. the group's inputs. `resident`: the group's (one) block is still
        on the device from the forward."""
        fns, kinds, count = self.fns, self.cfg.layer_types, len(xs)
        if len(group) == 1:  # recompute and backward fused in one program
            i = group.start
            slot, w = resident or self._take(feed, f"block.{i}")
            acc, out = None, []
            for x, dx in zip(xs, dxs):
                dw, dx = fns.grad[kinds[i]](w, x, dx)
                acc = self._sum(acc, dw, count)
                out.append(dx)
            self._finish_block(i, slot, acc, out)
            return out
        held = [(i, *self._take(feed, f"block.{i}")) for i in group]
        accs, out = dict.fromkeys(group), []
        for x, dx in zip(xs, dxs):
            vjps = []
            for i, _, w in held:
                x, vjp = fns.recompute[kinds[i]](w, x)
                self.ledger.hold(self._residual_bytes, "recompute residuals")
                vjps.append((i, vjp))
            while vjps:
                i, vjp = vjps.pop()
                dw, dx = fns.backward(vjp, dx)
                del vjp
                self.ledger.free(self._residual_bytes)
                accs[i] = self._sum(accs[i], dw, count)
            out.append(dx)
        del x
        for i, slot, _ in reversed(held):
            self._finish_block(i, slot, accs[i], out)
        return out

    def _finish_block(self, i: int, slot, dw, dxs: list) -> None:
        self.tracer.watch("compute", f"block.{i}", dxs)
        # The dxs are computed by the programs that last read the slot's weights.
        self.pool.release(slot, dxs)
        self.grads.add(f"block.{i}", dw)

    # --- reporting -----------------------------------------------------------------

    def stage_seconds(self, step: int | None = None) -> dict[str, float]:
        """Seconds spent per stage in a step (default: the last one)."""
        self.tracer.drain()
        return self.tracer.step_totals(self.step_count - 1 if step is None else step)

    def write_trace(self, path) -> None:
        """Chrome trace JSON of every step so far (open in Perfetto)."""
        self.tracer.write(path)

    def close(self) -> None:
        self._update_pool.shutdown(wait=True)
        self.grads.close()
        self.tracer.close()
        self.tiers.close()
        if self._owns_store:
            self.store.close()
