"""The stages of the streaming engine in isolation: staging-buffer reuse, prefetch,
the device budget and the trace. The host buffer pool itself: tests/test_hostmem.py."""

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import hostmem
from mtjax.stream import prefetch, staging
from mtjax.stream.budget import DeviceBudgetError, DeviceLedger
from mtjax.stream.memory_plan import DevicePlan, check_budget
from mtjax.stream.trace import Tracer


@jax.jit
def _slow_reader(w):
    """Reads w for a few hundred ms (async on the CPU backend: many flops)."""
    x = jax.lax.fori_loop(0, 3000, lambda i, x: jnp.tanh(x @ w) + 1.0, jnp.ones((128, 128)))
    return jnp.sum(x)


def _reuse_result(wait_for_readers: bool):
    """Stage w, start a long computation on it, release the slot, then refill it."""
    # One slot per shape: the second acquire must reuse the buffer the reader still reads.
    pool = staging.StagingPool(staging.Placement(jax.devices("cpu")[0]), DeviceLedger(1 << 30), max_slots=1,
                               wait_for_readers=wait_for_readers)
    schema = {"w": jax.ShapeDtypeStruct((128, 128), np.float32)}
    slot = pool.acquire(schema)
    slot.buffers["w"][:] = 1 / 128
    expected = float(_slow_reader(jnp.full((128, 128), 1 / 128, jnp.float32)))
    w = pool.put(slot, "part")["w"]
    total = _slow_reader(w)  # dispatched; still reading w for a while
    pool.release(slot, total)
    del w
    again = pool.acquire(schema)
    assert again.buffers["w"] is slot.buffers["w"]  # the same buffer is reused
    again.buffers["w"][:] = 0.0
    return float(total), expected


def test_staging_buffer_is_not_refilled_while_read():
    got, expected = _reuse_result(wait_for_readers=True)
    assert got == expected


def test_without_the_wait_reuse_corrupts():
    """The protection is what keeps the result right: removing it corrupts the sum."""
    got, expected = _reuse_result(wait_for_readers=False)
    assert got != expected


def test_pool_takes_a_new_slot_rather_than_wait_for_a_busy_one():
    pool = staging.StagingPool(staging.Placement(jax.devices("cpu")[0]), DeviceLedger(1 << 30), max_slots=2)
    schema = {"w": jax.ShapeDtypeStruct((128, 128), np.float32)}
    slot = pool.acquire(schema)
    busy = _slow_reader(pool.put(slot, "part")["w"])
    pool.release(slot, busy)
    other = pool.acquire(schema)
    assert other.buffers["w"] is not slot.buffers["w"] and not busy.is_ready()  # no wait for the reader
    pool.release(other, [])
    busy.block_until_ready()
    assert any(pool.acquire(schema).buffers["w"] is s.buffers["w"] for s in (slot, other)) and pool.allocated == 2


def test_prefetch_reraises_worker_error_in_caller():
    def load(i):
        if i == 2:
            raise OSError("disk gone")
        return i * 10

    feed = prefetch.Prefetcher(range(5), load, depth=2)
    assert feed.get() == (0, 0) and feed.get() == (1, 10)
    with pytest.raises(OSError, match="disk gone"):
        feed.get()
    with pytest.raises(OSError):
        feed.get()
    feed.close()


def test_prefetch_stays_within_depth_and_close_returns_untaken():
    loaded = []
    feed = prefetch.Prefetcher(range(10), lambda i: loaded.append(i) or i, depth=3)
    deadline = time.monotonic() + 10
    while len(loaded) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # room for a worker that ignored the bound to run further
    assert loaded == [0, 1, 2]
    assert feed.get() == (0, 0)
    left = feed.close()
    assert set(left) <= {1, 2, 3} and len(loaded) <= 4


def test_prefetch_runs_after_once_every_item_is_loaded():
    loaded, seen = [], []
    feed = prefetch.Prefetcher(range(4), lambda i: loaded.append(i) or i, depth=4, after=lambda: seen.append(list(loaded)))
    assert [feed.get() for _ in range(4)] == [(i, i) for i in range(4)]
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [[0, 1, 2, 3]]
    feed.close()

    def load(i):
        if i == 1:
            raise OSError("disk gone")
        return i

    feed = prefetch.Prefetcher(range(3), load, depth=3, after=lambda: seen.append("ran"))
    feed.get()
    with pytest.raises(OSError):
        feed.get()
    feed.close()
    assert seen == [[0, 1, 2, 3]]  # not after a failed load


def test_prefetch_exhausted_schedule():
    feed = prefetch.Prefetcher([1], lambda i: i, depth=1)
    feed.get()
    with pytest.raises(prefetch.PrefetchError):
        feed.get()
    feed.close()


def test_budget_check_and_ledger():
    plan = DevicePlan(weights=600, activations=20, residuals=200, head=60, working=50)
    assert plan.total == 930 and check_budget(plan, None) == plan.total
    # Sizes read as people read them: a tiny budget is not "0.0 MiB".
    with pytest.raises(DeviceBudgetError, match=r"needs 930 B on the device \(weights 600 B, .*"
                                                r"device_budget_bytes is 929 B"):
        check_budget(plan, plan.total - 1)
    ledger = DeviceLedger(100)
    ledger.hold(60, "a")
    with pytest.raises(DeviceBudgetError):
        ledger.hold(50, "b")
    ledger.free(60)
    assert ledger.held == 0 and ledger.peak == 60
    # Held to a plan, each use stays within its planned bytes as well as the budget.
    ledger.enforce(plan, 1000)
    ledger.hold(600, "weights", "weights")
    with pytest.raises(DeviceBudgetError, match="plan allows"):
        ledger.hold(1, "a part", "weights")
    ledger.hold(20, "an activation", "activations")
    assert ledger.peak_by_use == {"weights": 600, "activations": 20, "residuals": 0, "resident": 0, "saved": 0,
                                  "routing": 0}
    ledger.reset()
    assert ledger.held == 0 and ledger.held_by_use["weights"] == 0


def test_trace_times_device_work_and_writes_chrome_json(tmp_path):
    tracer = Tracer()
    with tracer.span("read", "block.0"):
        time.sleep(0.01)
    tracer.watch("compute", "block.0", jnp.ones((64, 64)) @ jnp.ones((64, 64)))
    data = json.loads(tracer.write(tmp_path / "t.json").read_text())
    names = {e["name"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert names == {"read block.0", "compute block.0"}
    assert tracer.step_totals(0)["read"] >= 0.01
    tracer.close()


def test_work_attributed_to_a_step_is_filed_under_it_on_its_own_thread_only():
    tracer = Tracer()
    tracer.begin_step(3)

    def worker():
        with tracer.attributed(4):
            with tracer.span("optimizer", "block.0"):
                pass
            tracer.watch("optimizer", "block.1", jnp.ones(4))
            with tracer.attributed(None):  # the running step
                with tracer.span("write", "block.0"):
                    pass
        with tracer.span("write", "block.1"):
            pass

    t = threading.Thread(target=worker)
    with tracer.attributed(4):
        t.start()  # a thread of its own does not inherit it
        t.join()
    with tracer.span("read", "block.2"):
        pass
    tracer.drain()
    assert sorted((e.step, e.stage, e.part) for e in tracer.events) == [
        (3, "read", "block.2"), (3, "write", "block.0"), (3, "write", "block.1"),
        (4, "optimizer", "block.0"), (4, "optimizer", "block.1")]
    tracer.close()


def test_a_transfer_is_timed_on_its_own_lane_not_behind_a_computation():
    """Each lane has its own watcher: a transfer watched after a computation that has not
    finished is timed when its array is ready, not when the computation ends."""

    class Unfinished:  # a computation's output, ready when the test says so
        def __init__(self):
            self.done = threading.Event()

        def block_until_ready(self):
            self.done.wait(60)
            return self

    tracer = Tracer()
    compute = Unfinished()
    tracer.watch("compute", "block.1", compute)
    tracer.watch("h2d", "block.2", jnp.ones(8))  # already on the device
    deadline = time.monotonic() + 30
    while not [e for e in tracer.events if e.stage == "h2d"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e.stage for e in tracer.events] == ["h2d"]  # timed while the computation still runs
    compute.done.set()
    tracer.drain()
    assert sorted(e.stage for e in tracer.events) == ["compute", "h2d"]
    tracer.close()


def test_pinned_staging_copies_each_leaf_on_its_own_thread():
    """The GPU path (host buffer -> pinned -> device), forced on the CPU backend: every
    leaf arrives intact, on the device's memory, staged by the placement's threads."""
    place = staging.Placement(jax.devices("cpu")[0], pinned=True)
    assert place.pinned
    threads = set()

    def recording(buffer):
        threads.add(__import__("threading").current_thread().name)
        time.sleep(0.05)  # long enough that the leaves overlap

    place.observe(recording)
    rng = np.random.default_rng(0)
    buffers = {f"w{i}": hostmem.aligned_empty((64, 48), np.float32) for i in range(4)}
    for b in buffers.values():
        b[:] = rng.standard_normal(b.shape)
    out = place.to_device(buffers)
    assert set(out) == set(buffers)
    for name, b in buffers.items():
        assert out[name].sharding.memory_kind == "device" and np.array_equal(np.asarray(out[name]), b)
    assert len(threads) > 1 and all(t.startswith("mtjax-stage") for t in threads)
    place.close()



class _LossyLink(staging.Placement):
    """A placement whose host copy of a gradient differs from the device's (every entry
    doubled): a squared norm reduced from the host copy would come out four times too big."""

    def host_arrays(self, tree):
        return {n: x * 2 for n, x in super().host_arrays(tree).items()}


def test_gradient_norms_are_reduced_on_the_device_and_only_the_scalar_comes_back():
    from mtjax.stream.grads import GradSink

    place = _LossyLink(jax.devices("cpu")[0])
    sink = GradSink(place, Tracer())
    rng = np.random.default_rng(0)
    parts = {"embed": {"e": rng.standard_normal((40, 8)).astype(np.float32)},
             "block.0": {"w": rng.standard_normal((8, 8)).astype(jnp.bfloat16), "b": np.ones(8, np.float32)}}
    for part, g in parts.items():
        sink.add(part, {n: jax.device_put(x) for n, x in g.items()}, widen=False)
    sq = sink.finish()
    expected = {p: sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in g.values())
                for p, g in parts.items()}
    assert isinstance(sq, np.float32) and all(isinstance(v, np.float32) for v in sink.last_sq.values())
    np.testing.assert_allclose(sq, sum(expected.values()), rtol=1e-6)
    for p in parts:
        np.testing.assert_allclose(sink.last_sq[p], expected[p], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(sink.take("embed")["e"]), parts["embed"]["e"] * 2)  # the copy is the link's
    # bf16 stays bf16 (no fp32 copy on the host): the fused update reads it as it is.
    assert {n: g.dtype for n, g in sink.take("block.0").items()} == {"w": jnp.bfloat16, "b": np.float32}
    sink.close()
    place.close()


_FIRST_BACKEND = """
import os, sys
import jax._src.xla_bridge as xla_bridge
from mtjax.stream import staging

def first_backend(*a, **k):  # what the GPU client would read as it starts (JAX has no public hook)
    print("limit at the first backend start:", os.environ.get(staging.HOST_MEMORY_LIMIT), flush=True)
    os._exit(0)

xla_bridge.backends = first_backend
from mtjax import cli
cli.main(["train", "--run.steps=1", "--run.dir=" + sys.argv[1], *sys.argv[2:]])
print("no backend started", flush=True)
"""


def test_mtjax_train_sets_the_pinned_host_limit_before_the_backend_starts(tmp_path):
    """XLA's GPU client reads XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB once, as it starts: `mtjax
    train` raises it to its plan's need before anything starts a JAX backend."""
    import dataclasses
    import os
    import subprocess
    import sys

    from mtjax import config

    # Every micro-batch's kept block inputs wait in pinned host memory: a plan past XLA's 64 GiB default.
    settings = ["--stream.activations=host", "--data.grad_accum=17000"]
    exp = config.ExperimentConfig()
    need = staging.pinned_host_bytes(config.model_config(exp), dataclasses.replace(exp.stream, activations="host"),
                                     exp.data.batch_size, exp.data.seq_len, 17000)
    assert -(-need // 2**30) == 100
    env = {k: v for k, v in os.environ.items() if k != staging.HOST_MEMORY_LIMIT}
    r = subprocess.run([sys.executable, "-c", _FIRST_BACKEND, str(tmp_path / "run"), *settings], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.stdout.strip() == "limit at the first backend start: 100", r.stdout + r.stderr


def test_the_plans_pinned_bound_is_the_engines_figure_and_the_cap_is_only_raised(monkeypatch):
    """`pinned_host_bytes` (settings alone) is what the engine stages through pinned memory
    (its schedule's staging sets and kept activations), read from the same step
    description; the limit is raised to whole GiB, never lowered, and a backend already
    started leaves it as it is, with a warning."""
    from mtjax import model, model_config
    from mtjax.config import StreamConfig
    from mtjax.optim import OptimConfig
    from mtjax.stream import StreamEngine

    # bf16 compute: staged through slots on this CPU too (fp32 would be staged in place here,
    # `step_parts.staged_in_place`, which a device with pinned memory never does).
    cfg = model_config.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, compute_dtype="bfloat16")
    params = model.init_params(cfg, seed=0)
    for stream in (StreamConfig(activations="host", keep_every=0), StreamConfig(prefetch_depth=3)):
        eng = StreamEngine(cfg, params, OptimConfig(), stream, batch_shape=(2, 16))
        eng.check_budget(2, 16, accum=2)
        assert not eng.schedule.resident and not eng.schedule.split  # every part streams whole
        exact = eng.schedule.staging_bytes + eng.schedule.traffic.h2d_activations
        assert staging.pinned_host_bytes(cfg, stream, 2, 16, 2) == exact
        eng.close()
    monkeypatch.setenv(staging.HOST_MEMORY_LIMIT, "96")
    assert staging.raise_host_memory_limit(90 << 30, started=False)
    assert staging.os.environ[staging.HOST_MEMORY_LIMIT] == "96"
    assert staging.raise_host_memory_limit((100 << 30) + 1, started=False)
    assert staging.os.environ[staging.HOST_MEMORY_LIMIT] == "101"
    with pytest.warns(UserWarning, match="export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=200 before"):
        assert not staging.raise_host_memory_limit(200 << 30)  # this process's backend has started
    assert staging.os.environ[staging.HOST_MEMORY_LIMIT] == "101"


def test_staging_without_dma_mapping_takes_todays_path():
    """The CPU client refuses dma_map: no buffer is mapped, staging copies as before."""
    place = staging.Placement(jax.devices("cpu")[0], pinned=True)
    assert not place.mapped and "DmaMap" in place.mapped_error
    pool = staging.StagingPool(place, DeviceLedger(1 << 30), max_slots=1)
    slot = pool.acquire({"w": jax.ShapeDtypeStruct((32, 16), np.float32)})
    slot.buffers["w"][:] = np.arange(512, dtype=np.float32).reshape(32, 16)
    assert not place.is_mapped(slot.buffers["w"])
    out = pool.put(slot, "part")
    np.testing.assert_array_equal(np.asarray(out["w"]), slot.buffers["w"])
    place.close()


class _MappingClient:
    """A client that maps host memory for DMA (as a GPU client does), refusing one size."""

    def __init__(self, refuse: int):
        self.refuse, self.live, self.unmapped = refuse, {}, []

    def dma_map(self, address, size):
        if size == self.refuse:
            raise RuntimeError("INVALID_ARGUMENT: cannot map this range")
        self.live[address] = size

    def dma_unmap(self, address):
        self.unmapped.append(self.live.pop(address))


def test_mapped_staging_buffers_are_mapped_once_and_sent_without_the_pinned_copy():
    place = staging.Placement(jax.devices("cpu")[0], pinned=True)
    place.client, place.mapped = _MappingClient(refuse=7 * 4), True
    staged = []
    place.observe(lambda b: staged.append(b.nbytes))
    pool = staging.StagingPool(place, DeviceLedger(1 << 30), max_slots=1)
    schema = {"a": jax.ShapeDtypeStruct((64, 8), np.float32), "b": jax.ShapeDtypeStruct((7,), np.float32),
              "c": jax.ShapeDtypeStruct((3, 5), np.float32)}
    rng = np.random.default_rng(1)
    for _ in range(2):  # the second acquire reuses the set: mapped once
        slot = pool.acquire(schema)
        for b in slot.buffers.values():
            b[:] = rng.standard_normal(b.shape)
        out = pool.put(slot, "part")
        for n, b in slot.buffers.items():
            np.testing.assert_array_equal(np.asarray(out[n]), b)
        pool.release(slot, out)
    assert sorted(place.client.live.values()) == [15 * 4, 64 * 8 * 4]  # mapped once each; b was refused
    assert staged == [7 * 4, 7 * 4] and "cannot map" in place.mapped_error  # only the refused one was copied
    place.close()
    assert sorted(place.client.unmapped) == [15 * 4, 64 * 8 * 4] and not place.client.live
