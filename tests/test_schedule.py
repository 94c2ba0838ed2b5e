"""The step's schedule is what the engine does: real engine steps, counted at every
transfer (weights staged, tokens, kept activations each way, gradients to the host),
every disk read and write of the store by kind, and every gradient spill, equal the
description of mtjax.stream.schedule exactly; so does the planner's, which prices it.
Resident parts cross nothing in a step; a one-copy store's commit of every step brings
their state to the host, and that too is counted."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from mtjax import expert_groups, model, parts
from mtjax.batch import Batch
from mtjax.config import DataConfig, StoreConfig, StreamConfig
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, StepShape, estimate
from mtjax.stream import StreamEngine, block_bytes, ops, schedule, step_bytes
from mtjax.stream.budget import tree_bytes
from mtjax.stream.staging import Slot

from conftest import ONE_KV_HEAD, tiny_config, tokens as random_tokens

CFG = tiny_config(num_hidden_layers=3, **ONE_KV_HEAD, compute_dtype="bfloat16")
OPT = OptimConfig(lr=1e-3, warmup_steps=0)
TX = make_optimizer(OPT)
STEPS = 2
BATCH, SEQ = 2, 8
PLACEMENTS = {  # name: (tiers, store copies)
    "ram": ({}, 2),
    "disk": ({"compute": "disk", "master": "disk", "opt": "disk"}, 2),
    "master-disk": ({"master": "disk"}, 2),  # gradients in scratch files, compute copy in RAM
    "one-copy": ({"compute": "disk", "master": "disk", "opt": "disk"}, 1),
}


class Counts:
    """Bytes by (what, detail), recorded by wrappers on the engine's own objects."""

    def __init__(self):
        self.bytes = collections.Counter()
        self.order: list[list[str]] = []  # parts staged to the device, per step

    def add(self, what: str, nbytes: int) -> None:
        self.bytes[what] += int(nbytes)


def instrument(engine: StreamEngine, counts: Counts) -> None:
    pool, place = engine.pool, engine.placement

    def wrap(obj, name, record):
        inner = getattr(obj, name)

        def counted(*args, **kwargs):
            record(*args, **kwargs)
            return inner(*args, **kwargs)

        setattr(obj, name, counted)

    def staged(slot, what, leaves=None):  # (every leaf: these steps split no MoE block)
        counts.order[-1].append(what)
        counts.add("h2d_weights", slot.nbytes)

    wrap(pool, "put", staged)
    wrap(pool, "put_host", lambda arrays, what: staged(Slot(arrays, tree_bytes(arrays)), what))  # staged in place
    wrap(place, "tokens", lambda inputs: counts.add("h2d_tokens", tree_bytes(inputs)))  # tokens (+ documents)
    wrap(place, "stash", lambda x: counts.add("d2h_activations", x.nbytes))
    wrap(place, "unstash", lambda x: counts.add("h2d_activations", x.nbytes))
    wrap(place, "start_to_host", lambda tree: counts.add("d2h_grads", tree_bytes(tree)))
    wrap(place, "to_host", lambda flat: counts.add("d2h_resident", tree_bytes(flat)))
    if engine.store is not None:
        store = engine.store

        def read(part, kind, out=None):  # every leaf, or those of `out` (a part's frozen leaves)
            counts.add(f"disk_read.{kind}", parts.nbytes(store.schema(part, kind) if out is None else out))

        wrap(store, "read", read)
        wrap(store, "write", lambda part, kind, values, carry=False: counts.add(f"disk_write.{kind}",
                                                                     sum(a.nbytes for a in values.values())))
    spill = engine.grads.spill
    if spill is not None:
        wrap(spill, "put", lambda key, arrays, sync=False: counts.add(
            "disk_write.grads", sum(np.asarray(a).nbytes for a in arrays.values())))
        inner_take = spill.take

        def take(key, keep=False):
            out = inner_take(key, keep)
            counts.add("disk_read.grads", sum(a.nbytes for a in out.values()))
            return out

        spill.take = take


def counted_steps(engine: StreamEngine, vocab_size: int, shape: tuple, steps: int) -> Counts:
    """What `steps` steps of random tokens of `shape` [accum, batch, seq] moved, and the
    parts each staged in order, flushed (the last step's deferred update included)."""
    counts = Counts()
    instrument(engine, counts)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        counts.order.append([])
        engine.step(rng.integers(0, vocab_size, shape, dtype=np.int32))
    engine.flush()
    return counts


CASES = [  # (placement, accum, keep_every, tied, activations, resident)
    *[("ram", a, k, t, "device", "none") for a in (1, 4) for k in (1, 2, 0) for t in (False, True)],
    ("ram", 4, 2, False, "host", "none"),
    ("ram", 1, 0, True, "host", "none"),
    ("disk", 1, 1, False, "device", "none"),
    ("disk", 4, 2, True, "host", "none"),
    ("disk", 4, 0, False, "device", "none"),
    ("master-disk", 4, 1, True, "device", "none"),
    ("master-disk", 1, 2, False, "host", "none"),
    ("one-copy", 1, 0, True, "device", "none"),
    ("one-copy", 4, 1, False, "device", "none"),
    ("one-copy", 4, 2, True, "host", "none"),
    # Some or all parts resident: the last block (a group of its own) and the tied embedding included.
    ("ram", 1, 2, True, "device", 2),
    ("ram", 4, 1, False, "device", "3-dots"),  # blocks 0-2 keep their projections: not recomputed
    ("disk", 4, 2, False, "host", ("block.2", "head")),
    ("master-disk", 1, 1, True, "device", 3),
    ("one-copy", 4, 0, True, "device", "all"),
]


@pytest.mark.parametrize("where,accum,keep_every,tied,activations,resident", CASES,
                         ids=[f"{w}-accum{a}-k{k}-{'tied' if t else 'untied'}-{x}-resident{r}"
                              for w, a, k, t, x, r in CASES])
def test_engine_moves_what_the_schedule_says(make_store, where, accum, keep_every, tied, activations, resident):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    tiers, copies = PLACEMENTS[where]
    store = make_store(cfg, TX, copies=copies) if tiers else None
    remat = "full"
    if isinstance(resident, str) and "-" in resident:  # "N-policy": N parts resident, their groups saved
        count, remat = resident.split("-")
        resident = int(count)
    stream = StreamConfig(keep_every=keep_every, activations=activations, resident=resident, remat=remat)
    placement = StoreConfig(**{k: tiers.get(k, "ram") for k in parts.KINDS}, copies=copies)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), OPT, stream, placement, store=store,
                          batch_shape=(BATCH, SEQ))
    shape = StepShape(BATCH, SEQ, accum)
    s = engine.plan(BATCH, SEQ, accum)
    # The planner prices the very same description for this machine (its device reads host memory, as a CPU profile's does;
    # a GPU profile's prices its kernels' working bytes).
    plan = estimate(cfg, stream, placement, shape, BUILTIN["cpu-2core"], tx=TX)
    assert plan.schedule == s
    assert (plan.traffic.h2d, plan.traffic.d2h) == (s.traffic.h2d, s.traffic.d2h)
    assert plan.traffic.disk_read == s.traffic.disk_read_bytes and plan.traffic.disk_write == s.traffic.disk_write_bytes

    if copies == 1:
        engine.commit(0)
    io0 = store.io_bytes if store is not None else (0, 0)
    # A one-copy store's step ends with its commit, which its updates wait for; with the
    # flush, every step streams once and updates once.
    counts = counted_steps(engine, cfg.vocab_size, (accum, BATCH, SEQ), STEPS)
    t = s.traffic

    # Each step stages its parts in the schedule's order, once whatever the accum; resident
    # parts never.
    assert counts.order == [list(s.transfers)] * STEPS
    assert s.resident == engine.resident.names and not set(s.transfers) & set(s.resident)
    if resident != "none":
        assert s.resident and (resident != "all" or not s.transfers)
    expected = {"h2d_weights": t.h2d_weights, "h2d_tokens": t.h2d_tokens, "h2d_activations": t.h2d_activations,
                "d2h_grads": t.d2h_grads, "d2h_activations": t.d2h_activations, "d2h_resident": t.d2h_resident,
                **{f"disk_read.{k}": b for k, b in t.disk_read.items()},
                **{f"disk_write.{k}": b for k, b in t.disk_write.items()}}
    expected = {k: STEPS * b for k, b in expected.items()}
    # The first step has no update to hand it new compute copies: it reads them from the disk.
    expected["disk_read.compute"] += t.compute_handed
    assert (t.compute_handed > 0) == (placement.compute == "disk" and bool(s.transfers))
    assert dict(counts.bytes) == {k: b for k, b in expected.items() if b}
    # The store's and the spill's own counters agree (tensor bytes of finished I/O).
    if store is not None:
        io1 = store.io_bytes
        assert io1[0] - io0[0] == STEPS * sum(b for k, b in t.disk_read.items() if k != "grads") + t.compute_handed
        assert io1[1] - io0[1] == STEPS * sum(b for k, b in t.disk_write.items() if k != "grads")
    assert (engine.grads.spill is not None) == (s.spill is not None)
    if s.spill is not None:
        assert engine.grads.spill.durable == (s.spill == "pending")
        assert engine.grads.spill.io_bytes == [STEPS * t.disk_read["grads"], STEPS * t.disk_write["grads"]]
    assert s.derived_compute == engine.derived_compute

    # The ledger held the step to the device plan: kept activations exactly, a group's
    # residuals exactly (a group of one runs fused and holds none), staged weights within.
    peak = engine.ledger.peak_by_use
    assert peak["activations"] == (s.kept_bytes if activations == "device" else 0)
    grouped = max((len(g) for g in s.groups if g not in s.saved), default=0) > 1
    assert peak["residuals"] == (s.device.residuals if grouped else 0)
    assert peak["saved"] == s.device.saved and (s.device.saved > 0) == bool(s.saved) == (remat == "dots")
    assert peak["weights"] <= s.device.weights and (peak["weights"] > 0) == bool(s.transfers)
    assert peak["resident"] == s.device.resident and (s.device.resident > 0) == bool(s.resident)
    engine.close()
    if store is not None:
        store.close()


def test_a_packed_step_sends_its_document_ids_and_targets_as_described():
    """Chat data's micro-batches carry document ids and counted targets beside the tokens:
    the description prices them, and the engine sends exactly that."""
    engine = StreamEngine(CFG, model.init_params(CFG, seed=0), OPT, StreamConfig(keep_every=1))
    counts = Counts()
    instrument(engine, counts)
    accum = 2
    tokens = random_tokens(CFG.vocab_size, (accum, BATCH, SEQ))
    segments = np.repeat(np.array([1] * (SEQ // 2) + [2] * (SEQ - SEQ // 2), np.int32)[None, None], accum * BATCH,
                         axis=0).reshape(accum, BATCH, SEQ)
    counts.order.append([])
    engine.step(Batch(tokens, np.ones(tokens.shape, bool), segments))
    engine.close()
    s = engine.plan(BATCH, SEQ, accum, documents=True)
    assert counts.bytes["h2d_tokens"] == s.traffic.h2d_tokens > engine.plan(BATCH, SEQ, accum).traffic.h2d_tokens
    assert StepShape.of(dataclasses.replace(DataConfig(), format="chat")).documents


def test_transfers_and_device_plan_follow_the_knobs():
    """The part order of docs/pipeline.md, and the device plan's terms."""
    stream, store = StreamConfig(keep_every=2, prefetch_depth=3), StoreConfig()
    s = schedule.describe(CFG, stream, store, StepShape(BATCH, SEQ, 4), TX)
    # groups [0, 1], [2]: block 2 stays on the device, group [0, 1] comes back in order.
    assert s.transfers == ("embed", "block.0", "block.1", "block.2", "head", "block.0", "block.1")
    tied = schedule.describe(dataclasses.replace(CFG, tie_word_embeddings=True), StreamConfig(keep_every=0), store,
                             StepShape(BATCH, SEQ), TX)
    assert tied.transfers == ("embed", "block.0", "block.1", "block.2", "head", "embed", "block.0", "block.1",
                              "block.2")
    assert not tied.last_stays and tied.groups == (range(0, 3),)
    hidden = BATCH * SEQ * CFG.hidden_size * 2
    max_part = max(b.compute for b in s.part_bytes.values())
    assert s.device.weights == (3 + 3) * max_part  # depth 3 ahead; head, tied embedding and last block in use
    assert s.device.activations == 2 * 4 * hidden  # two kept inputs per micro-batch, four micro-batches
    assert s.device.residuals == 2 * block_bytes.residual_bytes(CFG, CFG.layer_specs[0], BATCH, SEQ)
    # Gradients leave in the compute dtype with one micro-batch, in fp32 with several.
    one = schedule.describe(CFG, stream, store, StepShape(BATCH, SEQ, 1), TX)
    m = sum(b.master for b in s.part_bytes.values())
    assert s.traffic.d2h_grads == m
    assert one.traffic.d2h_grads == m // 2 + s.part_bytes["embed"].master // 2


def test_preflight_checks_the_device_plan_the_engine_enforces(tmp_path):
    """A budget below the step's device plan is refused before anything is built, in the
    words the engine would use; at the plan's total it passes, and the engine runs under it."""
    from mtjax import config, data, preflight

    exp = config.load(None, ["--stream.engine=stream", "--data.batch_size=2", "--data.seq_len=16",
                             "--data.grad_accum=2", f"--run.dir={tmp_path / 'run'}"])
    cfg, ds = config.model_config(exp), data.resolve(exp.data, tmp_path / "data")
    plan = preflight.check(exp, cfg, ds)
    need = plan.device.total
    short = dataclasses.replace(exp, stream=dataclasses.replace(exp.stream, device_budget_bytes=need - 1))
    with pytest.raises(preflight.PreflightError, match="stream.device_budget_bytes"):
        preflight.check(short, cfg, ds)
    exact = dataclasses.replace(exp, stream=dataclasses.replace(exp.stream, device_budget_bytes=need))
    preflight.check(exact, cfg, ds)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), exp.optim, exact.stream)
    engine.step(np.zeros((2, 2, 16), np.int32))
    assert engine.schedule.device == plan.device and engine.ledger.budget == need
    engine.close()


@pytest.mark.parametrize("where,keep_every,tied", [("ram", 1, False), ("ram", 2, True), ("disk", 0, True),
                                                   ("disk", 1, False)])
def test_staging_pool_allocates_what_the_planner_prices(make_store, where, keep_every, tied):
    """The staging slots and the update's read buffers come from the step's schedule: the
    engine's pools allocate exactly the bytes the planner prices as host staging (all of
    it with every kind in RAM; the slots' and read buffers' share with state on disk),
    before the first step and after steps and an evaluation."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    tiers, copies = PLACEMENTS[where]
    store = make_store(cfg, TX, copies=copies) if tiers else None
    stream = StreamConfig(keep_every=keep_every)
    placement = StoreConfig(**{k: tiers.get(k, "ram") for k in parts.KINDS}, copies=copies)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), OPT, stream, placement, store=store,
                          batch_shape=(BATCH, SEQ))
    plan = estimate(cfg, stream, placement, StepShape(BATCH, SEQ), BUILTIN["h200"], tx=TX)
    assert plan.host.slots == plan.schedule.staging_bytes > 0
    assert (plan.host.staging == plan.host.slots) == (where == "ram")
    assert engine.pool.allocated_bytes == plan.host.slots
    reads = engine.updater.read_ahead.buffers
    assert (plan.schedule.read_bytes > 0) == (where == "disk")
    assert reads.allocated_bytes == plan.schedule.read_bytes
    assert plan.host.staging >= plan.host.slots + reads.allocated_bytes
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        engine.step(rng.integers(0, cfg.vocab_size, (1, BATCH, SEQ), dtype=np.int32))
    engine.eval_loss(rng.integers(0, cfg.vocab_size, (1, BATCH, SEQ), dtype=np.int32))
    assert engine.pool.allocated_bytes == plan.host.slots and reads.allocated_bytes == plan.schedule.read_bytes
    engine.close()
    if store is not None:
        store.close()


def test_cpu_fp32_stages_in_place_with_no_slots():
    """On the CPU backend with fp32 compute and no compute copy kept, every whole part is
    staged as its master arrays (mtjax.stream.stager): the schedule gives them no staging
    slot and prices no master -> slot copy, and the engine allocates none and still stages
    what the schedule says. bf16 compute keeps its slots; a GPU's (h200) plan keeps them both."""
    stream, store, shape = StreamConfig(keep_every=1), StoreConfig(), StepShape(BATCH, SEQ)
    for dtype in ("float32", "bfloat16"):
        fp32 = dtype == "float32"
        cfg = dataclasses.replace(CFG, compute_dtype=dtype)
        engine = StreamEngine(cfg, model.init_params(cfg, seed=0), OPT, stream, batch_shape=(BATCH, SEQ))
        s = engine.plan(BATCH, SEQ)
        host = estimate(cfg, stream, store, shape, BUILTIN["cpu-2core"], tx=TX)
        gpu = estimate(cfg, stream, store, shape, BUILTIN["h200"], tx=TX).schedule
        assert host.schedule == s and s.derived_compute and gpu.derived_compute
        assert s.in_place == (s.streamed if fp32 else ()) and s.streamed and not gpu.in_place
        assert (not s.staging) == fp32 and gpu.staging and gpu.staging_bytes > 0
        # The GPU's plan copies master into a slot at each transfer (read + write); in place, none.
        # It copies each gradient out of its transfer buffer (read + write) where the CPU's
        # device reads it once, for its norm.
        copies = sum(s.part_bytes[p].master + s.part_bytes[p].compute for p in s.transfers)
        assert gpu.traffic.host_memory - s.traffic.host_memory == (copies if fp32 else 0) + s.traffic.d2h_grads
        assert engine.pool.allocated_bytes == host.host.slots == s.staging_bytes
        counts = counted_steps(engine, cfg.vocab_size, (1, BATCH, SEQ), STEPS)
        assert counts.order == [list(s.transfers)] * STEPS
        assert counts.bytes["h2d_weights"] == STEPS * s.traffic.h2d_weights
        engine.eval_loss(np.zeros((1, BATCH, SEQ), np.int32))
        assert engine.pool.allocated_bytes == s.staging_bytes
        engine.close()


def test_a_multi_process_schedule_keeps_the_compute_copy_and_stages_nothing_in_place():
    """A process of a multi-process run holds only its rows of master (mtjax.shard), so it
    cannot round the compute copy from them nor stage master as it: its schedule keeps the
    compute copy and gives every streamed part a slot, on the CPU in fp32 too, where one
    process stages in place; otherwise it is one process's schedule."""
    cfg, stream, store, shape = dataclasses.replace(CFG, compute_dtype="float32"), StreamConfig(), StoreConfig(), \
        StepShape(BATCH, SEQ)
    one = schedule.describe(cfg, stream, store, shape, TX, fused=True, reads_host=True)
    two = schedule.describe(cfg, stream, store, shape, TX, fused=True, reads_host=True, processes=2)
    assert one.derived_compute and one.in_place == one.streamed and not one.staging
    assert not two.derived_compute and not two.in_place and two.staging_bytes > 0
    assert schedule.derives_compute(True, store) and not schedule.derives_compute(True, store, processes=2)
    assert two.widens_grads and not one.widens_grads  # the reduce-scatter takes fp32 sums
    assert dataclasses.replace(two, derived_compute=True, in_place=one.in_place, staging=(), processes=1,
                               widens_grads=False, traffic=one.traffic) == one


@pytest.mark.parametrize("where,xla,flipped", [("ram", False, False), ("master-disk", False, False),
                                               ("ram", True, False), ("ram", False, True),
                                               ("master-disk", False, True)])
def test_the_sink_widens_a_gradient_where_the_schedule_says(make_store, monkeypatch, where, xla, flipped):
    """A bf16 gradient of one micro-batch reaches the update as the step's schedule says
    (`widens_grads`, which its host-memory price reads too): as computed in RAM for the
    fused loop and for XLA's program, fp32 where it is spilled to files. The sink takes
    that from the schedule rather than deciding again: a schedule that says the opposite
    (`flipped`) is followed."""
    if flipped:
        describe = schedule.describe
        monkeypatch.setattr(schedule, "describe", lambda *a, **k: dataclasses.replace(
            describe(*a, **k), widens_grads=not describe(*a, **k).widens_grads))
    tiers, copies = PLACEMENTS[where]
    placement = StoreConfig(**{k: tiers.get(k, "ram") for k in parts.KINDS}, copies=copies)
    engine = StreamEngine(CFG, model.init_params(CFG, seed=0), OPT, StreamConfig(), placement,
                          store=make_store(CFG, TX, copies=copies) if tiers else None, tx=TX if xla else None,
                          batch_shape=(BATCH, SEQ))
    s = engine.plan(BATCH, SEQ)
    assert s.widens_grads == ((where != "ram") != flipped) and (engine.update.fused is None) == xla
    taken, take = {}, engine.grads.take

    def recorded(part):
        grads = take(part)
        if grads is not None:
            taken[part] = sum(np.asarray(g).nbytes for g in grads.values())
        return grads

    engine.grads.take = recorded
    engine.step(random_tokens(CFG.vocab_size, (1, BATCH, SEQ)))
    engine.flush()
    narrow = [p for p in s.transfers if s.grad_bytes[p] < s.part_bytes[p].master]
    assert narrow and set(taken) == set(s.transfers)
    assert taken == {p: s.part_bytes[p].master if s.widens_grads else s.grad_bytes[p] for p in s.transfers}
    engine.close()


MOE = ModelConfig(model_type="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=7, num_experts_per_tok=2,
                  moe_intermediate_size=24, moe_layers=(0, 2), compute_dtype="bfloat16")


@pytest.mark.parametrize("cfg,stream", [
    (CFG, StreamConfig(keep_every=1)),
    (dataclasses.replace(CFG, tie_word_embeddings=True), StreamConfig(keep_every=0, activations="host")),
    (dataclasses.replace(CFG, tie_word_embeddings=True), StreamConfig(keep_every=2, resident=("embed", "block.2"))),
    (CFG, StreamConfig(keep_every=1, resident=3, remat="dots")),
    (CFG, StreamConfig(resident="all")),
    (MOE, StreamConfig(keep_every=1, expert_group_size=3)),
    (MOE, StreamConfig(keep_every=2, expert_group_size=3, activations="host")),
])
def test_operations_stage_the_transfers_and_send_every_gradient_once(cfg, stream):
    """A step's operations take the staged parts in the schedule's transfer order (a split
    block's sub-parts staged by its own operations), release each staged part once, keep
    each kept input once and take it back once, and send every part's gradient once:
    to the host when streamed, staying on the device when resident."""
    from mtjax.stream import ops

    s = schedule.describe(cfg, stream, StoreConfig(), StepShape(2, 8, 2), make_optimizer(OptimConfig()))
    staged, released, kept, out, stays = [], [], [], [], []
    for op in s.operations:
        if isinstance(op, ops.Stage):
            staged.append(op.part)
        elif isinstance(op, (ops.SplitForward, ops.SplitBackward)):
            names = list(expert_groups.names(f"block.{op.block}", s.split[op.block]))
            staged += names if isinstance(op, ops.SplitForward) else names[:0:-1] + names[:1]
        released += [op.part] if isinstance(op, ops.Release) else []
        kept += [("keep", op.block, op.host)] if isinstance(op, ops.Keep) else []
        kept += [("unkeep", op.block, op.host)] if isinstance(op, ops.Unkeep) else []
        out += [op.part] if isinstance(op, ops.GradOut) else []
        stays += [op.part] if isinstance(op, ops.GradStays) else []
    assert tuple(staged) == s.transfers
    whole = [p for p in staged if "/" not in p]
    assert sorted(released) == sorted(whole)
    host = stream.activations == "host"
    assert sorted(k for k in kept if k[0] == "keep") == [("keep", g.start, host) for g in s.groups
                                                          if g not in s.saved]
    assert sorted(k for k in kept if k[0] == "unkeep") == [("unkeep", g.start, host) for g in s.groups
                                                            if g not in s.saved]
    assert sorted(out) == sorted(s.streamed) and sorted(stays) == sorted(s.resident)
    assert isinstance(s.operations[-1], ops.Update) and str(s).splitlines()[0] == f"  0  {s.operations[0]}"
    forward = [op.part for op in s.eval_operations if isinstance(op, ops.Stage)]
    assert [p for p in s.forward if "/" not in p] == forward


def test_the_pipeline_docs_list_a_steps_operations_as_the_schedule_compiles_them():
    """docs/pipeline.md's operation list of a 2-block step (keep_every=1, accum 2), and the
    commit that ends a one-copy store's step, are the schedule's own listing."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "pipeline.md").read_text()
    section = text[text.index("## The step as operations"):]
    blocks = section.split("```")[1::2]  # the fenced listings, in order
    cfg = tiny_config(num_hidden_layers=2)
    shape = step_bytes.StepShape(2, 16, 2)
    s = schedule.describe(cfg, StreamConfig(keep_every=1), StoreConfig(), shape, TX)
    assert blocks[0].strip("\n") == ops.listing(s.operations)
    one_copy = StoreConfig(compute="disk", master="disk", opt="disk", copies=1)
    listed = ops.listing(schedule.describe(cfg, StreamConfig(keep_every=1), one_copy, shape, TX).operations)
    assert listed.endswith(blocks[2].strip("\n"))
