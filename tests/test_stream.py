"""The streaming engine equals the in-memory reference trainer.

Each case runs 5 AdamW steps of both engines on a tiny model (4 blocks, width 32,
seq 16) with clipping active, and compares every parameter and optimizer-state tensor
(||a - b|| / ||b|| <= 1e-5 in fp32). The cases together cover every value of: keep
every k in {1, 2, 3, all}, prefetch depth {1, 2, 3}, RAM / disk / mixed tiers, gradient
accumulation {1, 4}, tied and untied embeddings, activations on device and on host;
and a Phi-3-shaped model (fused projections, partial rotary, longrope, a window) in RAM and on disk;
and Gemma 2 and Gemma 3 shapes (soft-capping, sliding and global layers, local RoPE) on
RAM and disk tiers.
"""

import concurrent.futures
import copy
import dataclasses
import functools
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtjax.store
from mtjax import model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import FULL, SLIDING, ModelConfig, RopeScaling
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.reference import ReferenceTrainer
from mtjax.stream import DeviceBudgetError, StreamEngine
from mtjax.stream.schedule import HANDED_AHEAD

from conftest import tiny_config, token_batches

CFG = tiny_config(vocab_size=97, num_hidden_layers=4)
# Phi-3's fused projections with Phi-4-mini's partial rotary, longrope in its long regime
# (rows of 16 past a context of 8) and a window of 5.
PHI3 = dataclasses.replace(
    CFG, model_type="phi3", fused_projections=True, partial_rotary_factor=0.75, sliding_window=5,
    layer_types=(SLIDING,) * 4, rope_scaling=RopeScaling(
        "longrope", 16.0, original_max_position_embeddings=8, short_factor=(1.0, 1.4, 2.0), long_factor=(1.5, 3.0, 7.0)))
# clip_norm far below the gradient norm (~1.2), so every step is clipped.
OPT = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=2, decay_steps=10, clip_norm=0.05, weight_decay=0.1)
STEPS = 5
_GEMMA = dict(hidden_act="gelu_pytorch_tanh", rms_norm_offset=True, embed_scale=True, sandwich_norms=True,
              query_pre_attn_scalar=5.0, sliding_window=5, rms_norm_eps=1e-6)  # window < seq 16
FAMILY_CFGS = {
    "gemma2": dataclasses.replace(CFG, model_type="gemma2", **_GEMMA, attn_logit_softcapping=0.5,
                                  final_logit_softcapping=1.0, layer_types=(SLIDING, FULL) * 2),
    "gemma3": dataclasses.replace(CFG, model_type="gemma3_text", **_GEMMA, qk_norm=True, local_rope_theta=50.0,
                                  rope_scaling=RopeScaling("linear", 4.0), layer_types=(SLIDING,) * 3 + (FULL,)),
}
DISK = StoreConfig(compute="disk", master="disk", opt="disk")


def batches(accum: int, seed: int = 0):
    return token_batches(CFG.vocab_size, (accum, 2, 16), STEPS, seed)


@functools.lru_cache(maxsize=None)
def reference(tied: bool, accum: int, compute_dtype: str = "float32", base: ModelConfig = CFG):
    cfg = dataclasses.replace(base, tie_word_embeddings=tied, compute_dtype=compute_dtype)
    trainer = ReferenceTrainer(cfg, model.init_params(cfg, seed=1), OPT)
    metrics = [trainer.step(b) for b in batches(accum)]
    return cfg, trainer.params, trainer.opt_state, metrics


def rel_errors(a, b):
    def rel(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

    return jax.tree.leaves(jax.tree.map(rel, a, b))


class ForwardCounter:
    """Counts block forwards executed per step, by wrapping the engine's functions."""

    def __init__(self, engine: StreamEngine):
        self.count = 0
        fns = engine.runner.fns = copy.copy(engine.fns)  # the compiled functions are shared
        for attr in ("forward", "recompute", "grad"):
            setattr(fns, attr, {kind: self._wrap(fn) for kind, fn in getattr(fns, attr).items()})

    def _wrap(self, fn):
        def counted(*args):
            self.count += 1
            return fn(*args)

        return counted


def run_case(tmp_path, *, keep_every, depth, tiers, accum, tied, activations="device", fused=True, base=CFG):
    cfg, ref_params, ref_opt, ref_metrics = reference(tied, accum, base=base)
    store = mtjax.store.create(tmp_path / "store", cfg, make_optimizer(OPT)) if "disk" in tiers.values() else None
    # An OptimConfig alone gets the fused host AdamW; the same optax transformation passed
    # as `tx` runs as an XLA program on the CPU backend.
    engine = StreamEngine(cfg, model.init_params(cfg, seed=1), OPT,
                          StreamConfig(prefetch_depth=depth, keep_every=keep_every, activations=activations),
                          StoreConfig(**tiers), store=store, tx=None if fused else make_optimizer(OPT),
                          batch_shape=(2, 16))
    assert (engine.update.fused is not None) == fused
    assert engine.derived_compute == (fused and "disk" not in (tiers.get("master"), tiers.get("compute")))
    counter = ForwardCounter(engine)  # after the budget check, which traces shapes only
    if activations == "host":
        # Take the GPU's staging path (host buffer -> pinned_host -> device) on the CPU too.
        engine.placement.pinned = True
    for i, b in enumerate(batches(accum)):
        metrics = engine.step(b)
        assert metrics["grad_norm"] > OPT.clip_norm  # clipping is active
        np.testing.assert_allclose(metrics["loss"], ref_metrics[i]["loss"], rtol=1e-5)
        np.testing.assert_allclose(metrics["grad_norm"], ref_metrics[i]["grad_norm"], rtol=1e-4)
    # Every block runs forward exactly twice per micro-batch: streamed, then recomputed.
    assert counter.count == 2 * cfg.num_hidden_layers * accum * STEPS
    assert max(rel_errors(engine.params(), ref_params)) <= 1e-5
    assert max(rel_errors(engine.opt_state(), ref_opt)) <= 1e-5
    assert 0 < engine.ledger.peak <= engine.ledger.budget
    engine.close()
    if store is not None:
        store.close()


@pytest.mark.parametrize(
    "keep_every,depth,tiers,accum,tied,activations",
    [  # the fast tier keeps the first case; the others take 6-12 s each here
        (1, 1, {}, 1, False, "device"),
        pytest.param(2, 3, {}, 4, True, "host", marks=pytest.mark.slow),
        pytest.param(0, 2, DISK.tiers, 1, True, "device", marks=pytest.mark.slow),
        # k = 3 over 4 blocks: groups of 3 and 1 (the last block stays resident).
        pytest.param(3, 1, {"master": "disk", "opt": "disk"}, 4, False, "device", marks=pytest.mark.slow),
    ],
    ids=["k1-depth1-ram-untied", "k2-depth3-ram-accum4-tied-host-pinned", "kall-depth2-disk-tied", "k3-depth1-mixed-accum4"],
)
def test_streamed_equals_reference(tmp_path, keep_every, depth, tiers, accum, tied, activations):
    run_case(tmp_path, keep_every=keep_every, depth=depth, tiers=tiers, accum=accum, tied=tied,
             activations=activations)


@pytest.mark.slow  # a second model's compiles; the fast tier keeps the first case above
@pytest.mark.parametrize("tiers", [{}, DISK.tiers], ids=["ram", "disk"])
def test_phi3_streamed_equals_reference(tmp_path, tiers):
    run_case(tmp_path, keep_every=2, depth=2, tiers=tiers, accum=1, tied=False, base=PHI3)


@pytest.mark.parametrize("family,tiers,tied,keep_every", [
    ("gemma2", {}, True, 1),
    pytest.param("gemma3", DISK.tiers, False, 2, marks=pytest.mark.slow),
    pytest.param("gemma2", DISK.tiers, False, 0, marks=pytest.mark.slow),
    pytest.param("gemma3", {}, True, 3, marks=pytest.mark.slow),
], ids=["gemma2-ram-tied", "gemma3-disk-untied", "gemma2-disk-untied", "gemma3-ram-tied"])
def test_gemma_streamed_equals_reference(tmp_path, family, tiers, tied, keep_every):
    run_case(tmp_path, keep_every=keep_every, depth=2, tiers=tiers, accum=1, tied=tied, base=FAMILY_CFGS[family])


@pytest.mark.parametrize("tiers", [{}, {"master": "disk", "opt": "disk"}], ids=["ram", "mixed"])
def test_optax_program_update_equals_reference(tmp_path, tiers):
    """The update as XLA's program (any optax transformation) instead of the fused loop."""
    run_case(tmp_path, keep_every=2, depth=2, tiers=tiers, accum=1, tied=True, fused=False)


@pytest.mark.slow  # engine steps against the reference
def test_bf16_compute_agrees_within_bf16_tolerance():
    cfg, ref_params, _, ref_metrics = reference(False, 1, "bfloat16")
    engine = StreamEngine(cfg, model.init_params(cfg, seed=1), OPT, StreamConfig(keep_every=2))
    for i, b in enumerate(batches(1)):
        metrics = engine.step(b)
        np.testing.assert_allclose(metrics["loss"], ref_metrics[i]["loss"], rtol=2e-2)
    init = model.init_params(cfg, seed=1)
    # Compare the parameter change of the 5 steps (bf16 rounds it, not the fp32 weights).
    moved = jax.tree.map(lambda a, b: a - b, engine.params(), init)
    ref_moved = jax.tree.map(lambda a, b: a - b, ref_params, init)
    assert max(rel_errors(moved, ref_moved)) <= 0.1
    engine.close()


def test_budget_too_small_stops_before_step_one():
    params = model.init_params(CFG, seed=1)
    with pytest.raises(DeviceBudgetError, match="device_budget_bytes"):
        StreamEngine(CFG, params, OPT, StreamConfig(device_budget_bytes=10_000), batch_shape=(2, 16))
    engine = StreamEngine(CFG, params, OPT, StreamConfig(device_budget_bytes=10_000))
    with pytest.raises(DeviceBudgetError, match="raise the budget"):
        engine.step(batches(1)[0])
    assert engine.step_count == 0
    assert max(rel_errors(engine.params(), params)) == 0.0  # nothing was changed
    engine.close()


def test_trace_has_every_stage(tmp_path):
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT)
    for b in batches(1)[:2]:
        engine.step(b)
    seconds = engine.stage_seconds()
    assert set(seconds) == {"read", "h2d", "compute", "d2h", "optimizer", "write", "wait"}
    assert all(v > 0 for v in seconds.values()), seconds
    # The updates a step's forward streams in (the step before's gradients) are its own,
    # wherever their threads ran: none in the first step, every part's in the second.
    assert engine.stage_seconds(0)["optimizer"] == 0
    assert sorted(p for p, _ in engine.tracer.per_part(1, "optimizer")) == sorted(p.name for p in engine.parts)
    engine.write_trace(tmp_path / "trace.json")
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {"compute block.3", "optimizer block.0", "read head"} <= {e["name"] for e in events}
    step = engine.step_count - 1
    forward = ["embed", *(f"block.{i}" for i in range(CFG.num_hidden_layers)), "head"]
    assert [p for p, _ in engine.tracer.per_part(step, "wait")][:len(forward)] == forward  # the loop's waits, in order
    assert sorted(p for p, _ in engine.tracer.per_part(step, "h2d")) == sorted(engine.schedule.transfers)
    engine.close()


def assert_equals_reference_run(engine):
    """Params and optimizer state equal the untied, accumulation-1 reference after STEPS."""
    _, ref_params, ref_opt, _ = reference(False, 1)
    assert max(rel_errors(engine.params(), ref_params)) <= 1e-5
    assert max(rel_errors(engine.opt_state(), ref_opt)) <= 1e-5


def test_commit_and_resume_from_store(tmp_path):
    """Steps on a RAM-tier engine, committed to a store, resume in a disk-tier engine."""
    tx = make_optimizer(OPT)
    data = batches(1)
    store = mtjax.store.create(tmp_path / "store", CFG, tx)
    first = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT, store=store)
    for b in data[:2]:
        first.step(b)
    first.commit(2)
    first.close()
    store.close()
    store = mtjax.store.open(tmp_path / "store", writable=True)
    assert store.step == 2
    second = StreamEngine(CFG, optim=OPT, store_config=DISK, store=store)
    for b in data[2:]:
        second.step(b)
    # The adamw step count lives in the optimizer state, so the schedule resumes too.
    assert_equals_reference_run(second)
    second.close()
    store.close()


def test_resume_from_whole_model_params_and_opt_state():
    """A RAM-tier engine restarted from params() and opt_state() (what an HF checkpoint
    plus optimizer.npz holds) continues exactly like the reference."""
    data = batches(1)
    first = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT)
    for b in data[:2]:
        first.step(b)
    params, opt_state = first.params(), first.opt_state()
    first.close()
    second = StreamEngine(CFG, params, OPT, opt_state=opt_state)
    for b in data[2:]:
        second.step(b)
    assert_equals_reference_run(second)
    second.close()


def test_bad_tokens_and_options_are_user_errors():
    from mtjax.errors import MtjaxError

    with pytest.raises(MtjaxError, match="keep_every"):
        StreamEngine(CFG, model.init_params(CFG), OPT, StreamConfig(keep_every=-1))
    with pytest.raises(MtjaxError, match="needs a layer store"):
        StreamEngine(CFG, model.init_params(CFG), OPT, store_config=DISK)
    engine = StreamEngine(CFG, model.init_params(CFG), OPT)
    with pytest.raises(MtjaxError, match="tokens must be"):
        engine.step(np.zeros((16,), np.int32))
    engine.close()


@pytest.mark.slow  # engine steps against the reference
def test_run_config_builds_the_stream_engine(tmp_path):
    """`stream.engine=stream` in an experiment config gives this engine, with its knobs,
    and its evaluation loss equals the reference's."""
    from mtjax import checkpoint, config, engines, optim

    exp = config.load(None, [f"run.dir={tmp_path / 'run'}", "stream.engine=stream", "stream.keep_every=2",
                             "store.opt=disk", "data.batch_size=2", "data.seq_len=16"])
    cfg = config.model_config(exp)
    params = model.init_params(cfg, seed=3)
    store = mtjax.store.create(checkpoint.store_path(exp), cfg, optim.make_optimizer(exp.optim))
    engine = engines.make_engine(exp, cfg, params, store=store)
    assert isinstance(engine, StreamEngine) and engine.options.keep_every == 2
    assert engine.tiers.placement == {"compute": "ram", "master": "ram", "opt": "disk"}
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 2, 16), dtype=np.int32)
    expected = np.mean([float(model_loss(cfg, params, t)) for t in tokens])
    np.testing.assert_allclose(engine.eval_loss(tokens)["loss"], expected, rtol=1e-5)
    engine.close()


def model_loss(cfg, params, tokens):
    from mtjax.reference import loss_fn

    return loss_fn(cfg, params, jnp.asarray(tokens), remat=False)


def test_worker_error_reaches_the_caller_and_the_next_step_runs():
    """A failing read in the prefetch thread raises in step(); nothing hangs, and once
    the fault is gone the engine trains on with nothing left on the device ledger."""
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT)
    ram = engine.tiers.by_kind["compute"]
    real_read = ram.read

    loads = []

    def failing(part, kind, out=None):
        loads.append(part)
        if part == "block.2" and loads.count("block.2") == 2:  # in the backward
            raise OSError("disk on fire")
        return real_read(part, kind, out)

    ram.read = failing
    with pytest.raises(OSError, match="disk on fire"):
        engine.step(batches(1)[0])
    ram.read = real_read
    for b in batches(1):  # the same 5 steps as the reference; the failed one left no trace
        engine.step(b)
    assert engine.ledger.held == 0 and engine.ledger.peak <= engine.ledger.budget
    _, ref_params, _, _ = reference(False, 1)
    assert max(rel_errors(engine.params(), ref_params)) <= 1e-5
    engine.close()


def test_returned_state_is_a_snapshot():
    """params() and opt_state() must not alias buffers that later updates overwrite."""
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT)
    data = batches(1)
    engine.step(data[0])
    state = engine.params(), engine.opt_state()
    copy_ = jax.tree.map(np.array, state)
    engine.step(data[1])
    engine.params()
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), b)), state, copy_)))
    engine.close()


def test_cpu_fp32_stages_the_master_arrays_themselves():
    """On the CPU backend, fp32 compute with no compute copy kept, a part is staged as its
    master arrays (the device reads them in place: no staging copy); bf16 compute stages
    rounded copies in slots. Streamed == reference with the first: test_streamed_equals_reference."""
    data = batches(1)
    for dtype, in_place in (("float32", True), ("bfloat16", False)):
        cfg = dataclasses.replace(CFG, compute_dtype=dtype)
        engine = StreamEngine(cfg, model.init_params(cfg, seed=1), OPT)
        staged, load = [], engine.stager.load
        engine.stager.load = lambda part: staged.append((part, out := load(part))) or out
        engine.step(data[0])  # its update makes the RAM tier's master arrays, updated in place from then on
        staged.clear()
        engine.step(data[1])
        engine.flush()
        assert {p for p, _ in staged} == {p.name for p in engine.parts}
        for part, (slot, weights) in staged:
            master = engine.updater.read(part, "master")
            aliased = {n: w.unsafe_buffer_pointer() == np.asarray(master[n]).ctypes.data for n, w in weights.items()}
            assert all(aliased.values()) if in_place else not any(aliased.values()), (dtype, part, aliased)
            assert slot.pooled != in_place
        engine.close()


def test_disk_tier_updates_run_only_a_few_parts_ahead_of_staging(tmp_path):
    """With the compute copy on disk each finished update holds its new copy until its part
    is staged: between steps only `HANDED_AHEAD` updates have run, the rest wait for the
    staging to take those copies; training still equals the reference."""
    store = mtjax.store.create(tmp_path / "store", CFG, make_optimizer(OPT))
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT, StreamConfig(keep_every=1), DISK, store=store,
                          batch_shape=(2, 16))
    updater, names = engine.updater, [p.name for p in engine.parts]
    for b in batches(1):
        engine.step(b)
        concurrent.futures.wait(list(updater.updates.started.values()))  # the update thread has done what it may
        assert list(updater.updates.started) == names[:HANDED_AHEAD]
        assert all(f.result() is not None for f in updater.updates.started.values())  # each holds its new copy
        assert updater.updates.queued == names[HANDED_AHEAD:]
    _, ref_params, _, _ = reference(False, 1)
    assert max(rel_errors(engine.params(), ref_params)) <= 1e-5
    engine.close()
    store.close()


def test_updates_are_ranked_by_the_forwards_need():
    """The step's gradients come in backward order (head first, the embedding last); the
    updates start in the order the next forward needs the parts, as the schedule's
    operations take them (a tied embedding: first, not after the head), and each gives
    the fused AdamW's threads that rank."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=1), OPT, StreamConfig(keep_every=2), batch_shape=(2, 16))
    needed = ("embed", "block.0", "block.1", "block.2", "block.3", "head")
    assert engine.schedule.needed == needed
    assert engine.updater.updates.parts == list(needed)
    update, calls, lock = engine.updater.updates.update, [], threading.Lock()

    class Recording:  # the queue's update, seen through its public attribute
        def __getattr__(self, name):
            return getattr(update, name)

        def __call__(self, part, *args, rank, **kw):
            with lock:
                calls.append((part, rank))
            return update(part, *args, rank=rank, **kw)

    engine.updater.updates.update = Recording()
    engine.step(token_batches(cfg.vocab_size, (1, 2, 16), 1)[0])
    engine.flush()
    assert sorted(calls, key=lambda c: c[1]) == [(p, i) for i, p in enumerate(needed)]
    engine.close()


def test_disk_tier_reads_the_first_updates_state_during_the_backward(tmp_path):
    """Once a step's prefetch has read its last transfer, and before its clip scale is
    known, the reads of the first updates' master and optimizer state start: in update
    order, as many as the read buffer sets allow (two per shape, here the embedding, two
    blocks and the head). A write of that state other than its update drops them, so
    no update uses a stale read."""
    store = mtjax.store.create(tmp_path / "store", CFG, make_optimizer(OPT))
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT, StreamConfig(keep_every=1), DISK, store=store,
                          batch_shape=(2, 16))
    updater, early = engine.updater, []
    read_early = updater.read_early

    def recording(updated):
        # The early reads this call starts (not the updates' own read-ahead, by part);
        # step_count grows once the backward is done.
        started = read_early(updated)
        early.extend((engine.step_count, part) for part in started)
        return started

    updater.read_early = recording
    for i, b in enumerate(batches(1)):
        engine.step(b)
        assert [p for step, p in early if step == i] == ["embed", "block.0", "block.1", "head"]
    _, ref_params, _, _ = reference(False, 1)
    assert max(rel_errors(engine.params(), ref_params)) <= 1e-5

    # New state written from outside the updates while reads of the old are in flight.
    updater.read_early([p.name for p in engine.parts])
    assert updater.read_ahead.reading == {"embed", "block.0", "block.1", "head"}
    fresh = model.init_params(CFG, seed=2)
    engine._init_state(fresh)
    assert updater.read_ahead.reading == set()
    other = StreamEngine(CFG, fresh, OPT, StreamConfig(keep_every=1), batch_shape=(2, 16))
    for b in batches(1, seed=3)[:2]:
        engine.step(b), other.step(b)
    assert max(rel_errors(engine.params(), other.params())) <= 1e-6
    for e in (engine, other):
        e.close()
    store.close()


def test_a_slow_disk_holds_updates_back_instead_of_piling_up_their_state(tmp_path, monkeypatch):
    """With reads on threads of their own, nothing else slows the updates down to the
    disk's pace: an update waits for the writes of the update before last before it makes
    new state, so while the disk finishes no write only two updates compute."""
    import threading

    store = mtjax.store.create(tmp_path / "store", CFG, make_optimizer(OPT))
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT, StreamConfig(keep_every=1), DISK, store=store,
                          batch_shape=(2, 16))
    data = batches(1)
    engine.step(data[0])
    engine.flush()
    updater, computed, release = engine.updater, [], threading.Event()
    update, write = updater.updates.update, store.write

    class Counting:
        def __getattr__(self, name):
            return getattr(update, name)

        def __call__(self, part, *args, **kw):
            computed.append(part)
            return update(part, *args, **kw)

    def held_write(part, kind, values):  # finishes once the disk is back
        done = concurrent.futures.Future()
        threading.Thread(target=lambda: release.wait(60) and done.set_result(write(part, kind, values).result())).start()
        return done

    monkeypatch.setattr(updater.updates, "update", Counting())
    monkeypatch.setattr(store, "write", held_write)
    engine.step(data[1])  # its updates start
    flushing = threading.Thread(target=engine.flush)
    flushing.start()
    try:
        deadline = time.monotonic() + 30
        while len(computed) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # room for a third update that did not wait
        assert computed == ["embed", "block.0"]
    finally:
        release.set()
        flushing.join(60)
    for b in data[2:]:
        engine.step(b)
    _, ref_params, _, _ = reference(False, 1)
    assert max(rel_errors(engine.params(), ref_params)) <= 1e-5
    engine.close()
    store.close()
