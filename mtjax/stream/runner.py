"""Runs a step's operations (mtjax.stream.ops), one after another, deciding nothing.

    runner = Runner(cfg, fns, pool, tracer, ledger, placement, split, resident, grads, updater, clip_norm=1.0,
                    commit=commit)
    feed = stager.feed(schedule, schedule.transfers, depth)        # mtjax.stream.stager: stages each part ahead
    done = runner.run(schedule, schedule.operations, feed, mbs, weights, train_state)   # up to `Update`
    done.losses, done.auxes       # per micro-batch; done.stats: router stats (MoE)
    metrics = runner.update(done, squared_norm, step)          # `Update`, then the rest (`Commit`)

Every mode of the step (residency, saved groups, split blocks, host activations, the last
block staying, tied embeddings) is already in which operations the schedule compiled;
each operation has one handler here. `run` stops at `Update`, which `update` runs once
the engine has stopped the prefetcher and summed every gradient's norm (a host sync),
followed by the operations after it: a one-copy store's `Commit`, which calls
`commit(train_state)` (the engine's commit of the step, recording the run's `train_state`).

Values flow between operations in a few registers: `flow` (every micro-batch's hidden
states in the forward, their cotangents in the backward), `held` (staged or resident
weights by part), `kept` (per micro-batch: kept inputs, saved vjps, split routing) and
`summed` (a part's gradient summed over the micro-batches, until it goes out).

`observe(fn)` registers fn(event, value), called with ("grad", g) for every gradient a
program makes (every micro-batch's, of every part, before it is summed) and ("keep", x)
for every hidden state kept for the backward: a seam for tests that count them. Each
part's summed gradient goes out through `mtjax.optim.tap_grads`'s functions, if any.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from mtjax import lora, partid, parts
from mtjax.errors import NonFiniteStep
from mtjax.observers import Observers
from mtjax.optim import clip_scale
from mtjax.partid import EMBED, HEAD, PartId
from mtjax.stream import blockfns, ops
from mtjax.stream.outgoing import Outgoing
from mtjax.stream.prefetch import Prefetcher


@dataclasses.dataclass
class Pass:
    """The registers of one pass over the operations, and what it returns."""

    mbs: list  # documents.Inputs per micro-batch, on the device
    weights: list  # each micro-batch's share of the step's loss
    flow: list = None
    stats: list = None  # per micro-batch: each MoE block's router stats
    kept: list = None
    held: dict = dataclasses.field(default_factory=dict)
    inputs: list = None  # the kept inputs of the group being walked back
    summed: dict = dataclasses.field(default_factory=dict)
    dstats: tuple = ()  # per micro-batch: the cotangent of the router stats (load-balancing loss)
    dembed: dict | None = None  # a tied embedding's gradient from the head
    losses: list = None
    auxes: tuple = ()
    train_state: dict | None = None  # what the step's commit records beside the state (the run's data cursor)
    dropout_step: int | None = None  # a training pass's step: its adapters' dropout keys (mtjax.lora)
    after: tuple = ()  # the operations after `Update`


class Runner:
    def __init__(self, cfg, fns, pool, tracer, ledger, placement, split, resident, grads, updater, *, clip_norm,
                 hosts=None, commit=None, seed: int = 0):
        self.cfg, self.fns, self.pool, self.tracer, self.ledger = cfg, fns, pool, tracer, ledger
        self.placement, self.split, self.resident, self.grads = placement, split, resident, grads
        self.updater, self.clip_norm, self.hosts, self.commit = updater, clip_norm, hosts, commit
        self.observers = Observers()
        # Adapter dropout's seed (mtjax.lora; None: no dropout): each block program of a training pass takes a key.
        self.seed = seed if cfg.lora is not None and cfg.lora.dropout > 0 else None
        self.schedule = None
        self._moe = set(cfg.moe_layers)
        # Each part's trained leaves, the vjp's arguments (mtjax.roles); None: every leaf.
        self._trained = {p.name: None if len(t := parts.trained(cfg, p.name)) == len(parts.leaves(cfg, p.name)) else t
                         for p in parts.parts(cfg)}
        self.outgoing = Outgoing(cfg)  # a part's summed gradient -> what its update takes
        self._do = {
            ops.Stage: self._stage, ops.Resident: self._resident, ops.Release: self._release,
            ops.Embed: self._embed, ops.Forward: self._forward, ops.Save: self._save,
            ops.SplitForward: self._split_forward, ops.Keep: self._keep, ops.Unkeep: self._unkeep,
            ops.Head: self._head, ops.HeadLoss: self._head_loss, ops.Backward: self._backward,
            ops.RecomputeBackward: self._recompute_backward, ops.SavedBackward: self._saved_backward,
            ops.SplitBackward: self._split_backward, ops.EmbedBackward: self._embed_backward,
            ops.GradOut: self._grad_out, ops.GradStays: self._grad_stays, ops.Commit: self._commit,
        }

    def observe(self, fn):
        """Call fn(event, value) for every gradient a program makes ("grad") and every
        hidden state kept for the backward ("keep"); returns the function that stops it."""
        return self.observers.add(fn)

    # --- the pass ---------------------------------------------------------------------

    def run(self, schedule, operations, feed: Prefetcher, mbs: list, weights: list,
            train_state: dict | None = None, dropout_step: int | None = None) -> Pass:
        """Run `operations` over the micro-batches `mbs`, taking staged parts from `feed`,
        up to (not including) `Update`: see `update`. `train_state`: what the step's
        `Commit` records, if it has one. `dropout_step`: a training step's number, from
        which its adapters' dropout is drawn (None: an evaluation, no dropout)."""
        self.schedule, self._feed = schedule, feed
        self._residual = schedule.block_residual_bytes
        st = Pass(mbs, weights, stats=[[] for _ in mbs], kept=[{} for _ in mbs], train_state=train_state,
                  dropout_step=None if self.seed is None else dropout_step)
        for i, op in enumerate(operations):
            if isinstance(op, ops.Update):
                st.after = operations[i + 1:]
                break
            self._do[type(op)](st, op)
        return st

    def update(self, st: Pass, sq, step: int) -> dict[str, float]:
        """The `Update` operation, once the prefetcher is stopped and every gradient's
        squared norm is summed in `sq` (a host sync): the clip scale, then every part's
        update starts; then the operations after it. Returns the step's metrics; raises
        NonFiniteStep, dropping the updates, before any operation after `Update`."""
        weights = st.weights
        # One host sync per step for the metrics, after the last block is enqueued.
        loss, norm_sq = float(np.dot([float(x) for x in st.losses], weights)), float(sq)
        aux = float(np.dot([float(a) for a in st.auxes], weights)) if self.cfg.moe_layers else 0.0
        if self.hosts is not None:  # the step's loss and squared norm: sums of every process's shares
            loss, norm_sq, aux = (float(x) for x in self.hosts.all_sum([loss, norm_sq, aux]))
            sq = jnp.float32(norm_sq)
        if not (math.isfinite(loss) and math.isfinite(norm_sq)):
            # Checked before any of this step's deferred updates can run: drop them all.
            order = [HEAD, *(partid.block(i) for i in reversed(range(self.cfg.num_hidden_layers))), EMBED]
            bad = [p for p in order if not math.isfinite(float(self.grads.last_sq.get(p, 0.0)))]
            self.grads.drop_ready()
            self.resident.drop()
            self.updater.wait_writes()
            raise NonFiniteStep(step, loss, bad)
        scale = clip_scale(sq, self.clip_norm)
        self.updater.ready(scale)  # the updates start (one-copy: at the commit)
        self.resident.update(scale)  # on the device, now: its state is in no store until a commit
        if self.hosts is not None:
            self.updater.flush()  # on this thread, in part order: the all-gathers' order on every process
        metrics = {"loss": loss, "grad_norm": math.sqrt(norm_sq)}
        if self.cfg.moe_layers:  # the load-balancing loss, in "loss" times router_aux_loss_coef
            metrics["aux_loss"] = aux  # weighted as "loss" is
        for op in st.after:
            self._do[type(op)](st, op)
        return metrics

    def eval_metrics(self, st: Pass) -> dict[str, float]:
        """An evaluation pass's {"loss", "aux_loss" (MoE)}: its micro-batches weighted as a
        step's (in a multi-process run, summed over every process's shares)."""
        w = jnp.asarray(st.weights, jnp.float32)
        if not self.cfg.moe_layers:
            out = {"loss": float(jnp.sum(jnp.stack(st.losses) * w))}  # one host sync for all
        else:
            auxes = jnp.stack([self.fns.aux(s, mb.tokens, 1.0)[0] for s, mb in zip(st.stats, st.mbs)])
            loss = jnp.sum((jnp.stack(st.losses) + self.cfg.router_aux_loss_coef * auxes) * w)
            out = {"loss": float(loss), "aux_loss": float(jnp.sum(auxes * w))}
        if self.hosts is not None:  # the sums of every process's shares
            out = dict(zip(out, (float(x) for x in self.hosts.all_sum(list(out.values())))))
        return out

    def _sum(self, acc, grads, count: int):
        """Running sum of a part's gradients over the micro-batches, on the device (fp32).
        With one micro-batch the gradient goes as it is (the host casts it)."""
        self.observers("grad", grads)
        if count == 1:
            return grads
        return self.fns.grad_to_f32(grads) if acc is None else self.fns.grad_add(acc, grads)

    def _stage(self, st: Pass, op: ops.Stage) -> None:
        with self.tracer.span("wait", op.part):
            item, loaded = self._feed.get()
        assert item == op.part, f"prefetch order broken: expected {op.part}, got {item}"
        if op.part in self.resident:  # its frozen leaves staged, its adapters resident
            slot, weights = loaded
            loaded = slot, {**weights, **self.resident.weights(op.part)}
        st.held[op.part] = loaded

    def _resident(self, st: Pass, op: ops.Resident) -> None:
        st.held[op.part] = None, self.resident.weights(op.part)

    def _release(self, st: Pass, op: ops.Release) -> None:
        slot, _ = st.held.pop(op.part)
        self.pool.release(slot, st.flow)  # fenced by the programs that last read the weights

    def _embed(self, st: Pass, op: ops.Embed) -> None:
        w = st.held[EMBED][1]
        st.flow = [self.fns.embed_forward(w, mb.tokens) for mb in st.mbs]
        self.tracer.watch("compute", EMBED, st.flow)

    def _block(self, st: Pass, i: int, outs: list) -> None:
        st.flow = [y for y, _ in outs]
        for per_batch, (_, stats) in zip(st.stats, outs):
            per_batch += [stats] if stats else []
        self.tracer.watch("compute", partid.block(i), st.flow)

    def _key(self, st: Pass, m: int, i: int) -> dict:
        """The keyword that gives block i's program of micro-batch m its dropout key, if any."""
        return {} if st.dropout_step is None else {"dropout_key": lora.dropout_key(self.seed, st.dropout_step, m, i)}

    def _forward(self, st: Pass, op: ops.Forward) -> None:
        w, fn = st.held[partid.block(op.block)][1], self.fns.forward[self.cfg.layer_specs[op.block]]
        self._block(st, op.block, [fn(w, x, mb.segments, **self._key(st, m, op.block))
                                   for m, (x, mb) in enumerate(zip(st.flow, st.mbs))])

    def _save(self, st: Pass, op: ops.Save) -> None:
        spec = self.cfg.layer_specs[op.block]
        w, fn = st.held[partid.block(op.block)][1], self._against(self.fns.save[self.schedule.remat][spec], op.block)
        outs = [fn(w, x, mb.segments, **self._key(st, m, op.block)) for m, (x, mb) in enumerate(zip(st.flow, st.mbs))]
        for k, (_, vjp) in zip(st.kept, outs):
            self.ledger.hold(self.schedule.saved_residual_bytes(spec), "residuals kept from the forward", "saved")
            k["vjp", op.block] = vjp
        self._block(st, op.block, [y for y, _ in outs])

    def _split_forward(self, st: Pass, op: ops.SplitForward) -> None:
        i = op.block
        st.flow, stats, routing = self.split.forward(
            i, self.cfg.layer_specs[i], self.schedule.split[i], lambda p: self._take(st, p), self.pool.release,
            st.flow, [mb.segments for mb in st.mbs], op.keep)
        for m, one in enumerate(stats):
            st.stats[m].append(one)
            if op.keep:
                st.kept[m]["routing", i] = routing[m]
        self.tracer.watch("compute", partid.block(i), st.flow)

    def _take(self, st: Pass, part: PartId):
        self._stage(st, ops.Stage(part))
        return st.held.pop(part)

    def _keep(self, st: Pass, op: ops.Keep) -> None:
        for k, x in zip(st.kept, st.flow):
            self.observers("keep", x)
            if op.host:
                k[op.block] = self.placement.stash(x)
            else:
                self.ledger.hold(self.placement.mesh.share(x.nbytes), "a kept activation", "activations")
                k[op.block] = x

    def _unkeep(self, st: Pass, op: ops.Unkeep) -> None:
        xs = [k.pop(op.block) for k in st.kept]
        if op.host:
            st.inputs = [self.placement.unstash(x) for x in xs]
            return
        for x in xs:
            self.ledger.free(self.placement.mesh.share(x.nbytes), "activations")
        st.inputs = xs

    def _head(self, st: Pass, op: ops.Head) -> None:
        fns, n = self.fns, len(st.mbs)
        st.auxes, st.dstats = zip(*(fns.aux(s, mb.tokens, weight) if s else (0.0, {})
                                    for s, mb, weight in zip(st.stats, st.mbs, st.weights)))
        head_w, embed_w = st.held[HEAD][1], st.held[EMBED][1] if op.tied else None
        losses, dxs, dhead, dembed = [], [], None, None
        head = fns.head if self._trained[HEAD] is self._trained[EMBED] is None else functools.partial(
            fns.head, trained=self._trained[HEAD], embed_trained=self._trained[EMBED] if op.tied else None)
        for x, mb, weight, aux in zip(st.flow, st.mbs, st.weights, st.auxes):
            loss, dh, de, dx = head(head_w, embed_w, x, mb.tokens, weight, mb.targets)
            losses.append(loss + self.cfg.router_aux_loss_coef * aux if self.cfg.moe_layers else loss)
            dxs.append(dx)
            dhead = self._sum(dhead, dh, n)
            dembed = self._sum(dembed, de, n) if op.tied else None
        st.losses, st.flow, st.summed[HEAD], st.dembed = losses, dxs, dhead, dembed
        self.tracer.watch("compute", HEAD, dxs)

    def _head_loss(self, st: Pass, op: ops.HeadLoss) -> None:
        head_w, embed_w = st.held[HEAD][1], st.held[EMBED][1] if op.tied else None
        st.losses = [self.fns.head_loss(head_w, embed_w, x, mb.tokens, mb.targets) for x, mb in zip(st.flow, st.mbs)]
        st.flow = st.losses  # the releases' fence

    def _against(self, fn, block: int):
        """Block function `fn` (a vjp's maker) taking the vjp against the block's trained
        leaves only (mtjax.roles)."""
        trained = self._trained[partid.block(block)]
        return fn if trained is None else functools.partial(fn, trained=trained)

    def _cotangent(self, st: Pass, i: int, m: int):
        return st.dstats[m] if i in self._moe else {}

    def _backward(self, st: Pass, op: ops.Backward) -> None:
        i, count = op.block, len(st.mbs)
        w, fn = st.held[partid.block(i)][1], self._against(self.fns.grad[self.cfg.layer_specs[i]], i)
        acc, out = None, []
        for m, (x, dx, mb) in enumerate(zip(st.inputs, st.flow, st.mbs)):
            dw, dx = fn(w, x, dx, self._cotangent(st, i, m), mb.segments, **self._key(st, m, i))
            acc = self._sum(acc, dw, count)
            out.append(dx)
        st.flow, st.inputs, st.summed[partid.block(i)] = out, None, acc
        self.tracer.watch("compute", partid.block(i), out)

    def _recompute_backward(self, st: Pass, op: ops.RecomputeBackward) -> None:
        fns, specs, count = self.fns, self.cfg.layer_specs, len(st.mbs)
        accs, out = dict.fromkeys(op.blocks), []
        for m, (x, dx, mb) in enumerate(zip(st.inputs, st.flow, st.mbs)):
            vjps = []
            for i in op.blocks:
                (x, _), vjp = self._against(fns.recompute[specs[i]], i)(st.held[partid.block(i)][1], x, mb.segments,
                                                                        **self._key(st, m, i))
                self.ledger.hold(self._residual, "recompute residuals", "residuals")
                vjps.append((i, vjp))
            while vjps:
                i, vjp = vjps.pop()
                dw, dx = fns.backward(vjp, (dx, self._cotangent(st, i, m)))
                del vjp
                self.ledger.free(self._residual, "residuals")
                accs[i] = self._sum(accs[i], dw, count)
            out.append(dx)
        del x
        st.flow, st.inputs = out, None
        for i in reversed(op.blocks):
            st.summed[partid.block(i)] = accs[i]
            self.tracer.watch("compute", partid.block(i), out)

    def _saved_backward(self, st: Pass, op: ops.SavedBackward) -> None:
        specs, count = self.cfg.layer_specs, len(st.mbs)
        accs, out = dict.fromkeys(op.blocks), []
        for m, (k, dx) in enumerate(zip(st.kept, st.flow)):
            for i in reversed(op.blocks):
                vjp = k.pop(("vjp", i))  # its weights taken out: they are the resident part's (blockfns._save)
                dw, dx = self.fns.saved_backward(vjp, st.held[partid.block(i)][1], (dx, self._cotangent(st, i, m)),
                                                 names=blockfns.weights_in(vjp))
                self.ledger.free(self.schedule.saved_residual_bytes(specs[i]), "saved")
                accs[i] = self._sum(accs[i], dw, count)
            out.append(dx)
        st.flow = out
        for i in reversed(op.blocks):
            st.summed[partid.block(i)] = accs[i]
            self.tracer.watch("compute", partid.block(i), out)

    def _split_backward(self, st: Pass, op: ops.SplitBackward) -> None:
        i, count = op.block, len(st.mbs)
        st.flow, st.summed[partid.block(i)] = self.split.backward(
            i, self.cfg.layer_specs[i], self.schedule.split[i], lambda p: self._take(st, p), self.pool.release,
            lambda acc, g: self._sum(acc, g, count), st.inputs, [k.pop(("routing", i)) for k in st.kept], st.flow,
            st.dstats, [mb.segments for mb in st.mbs])
        st.inputs = None
        self.tracer.watch("compute", partid.block(i), st.flow)

    def _embed_backward(self, st: Pass, op: ops.EmbedBackward) -> None:
        fns, de = self.fns, None
        if self._trained[EMBED] == ():  # a frozen embedding: no gradient
            st.summed[EMBED], st.dembed = {}, None
            return
        for mb, dx in zip(st.mbs, st.flow):
            de = self._sum(de, fns.embed_backward(mb.tokens, dx), len(st.mbs))
        if op.tied:  # the head's use of the embedding plus the lookup's
            de = fns.grad_add(fns.grad_to_f32(st.dembed), de)
            st.dembed = None
        st.summed[EMBED] = de
        self.tracer.watch("compute", EMBED, de)

    def _grad_out(self, st: Pass, op: ops.GradOut) -> None:
        grads = self.outgoing(op.part, st.summed.pop(op.part), st.stats)
        if grads:  # a part with no trained leaf (and no buffer rule on) has no gradient, and no update
            self.grads.add(op.part, grads, self.schedule.widens_grads)

    def _grad_stays(self, st: Pass, op: ops.GradStays) -> None:
        self.resident.add_grad(op.part, self.outgoing(op.part, st.summed.pop(op.part), st.stats))

    def _commit(self, st: Pass, op: ops.Commit) -> None:
        self.commit(st.train_state)
