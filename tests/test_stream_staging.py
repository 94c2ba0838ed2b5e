"""The stages of the streaming engine in isolation: staging-buffer reuse, prefetch,
the device budget and the trace. The host buffer pool itself: tests/test_hostmem.py."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax import hostmem
from mtjax.stream import prefetch, staging
from mtjax.stream.budget import DeviceBudgetError, DeviceLedger
from mtjax.stream.schedule import DevicePlan, check_budget
from mtjax.stream.trace import Tracer


@jax.jit
def _slow_reader(w):
    """Reads w for a few hundred ms (async on the CPU backend: many flops)."""
    x = jax.lax.fori_loop(0, 3000, lambda i, x: jnp.tanh(x @ w) + 1.0, jnp.ones((128, 128)))
    return jnp.sum(x)


def _reuse_result(wait_for_readers: bool):
    """Stage w, start a long computation on it, release the slot, then refill it."""
    # One slot per shape: the second acquire must reuse the buffer the reader still reads.
    pool = staging.StagingPool(staging.Placement(jax.devices("cpu")[0]), DeviceLedger(1 << 30), max_slots=1)
    pool.buffers.wait_for_readers = wait_for_readers
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
    with pytest.raises(DeviceBudgetError, match="device_budget_bytes"):
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


def test_pinned_staging_copies_each_leaf_on_its_own_thread(monkeypatch):
    """The GPU path (host buffer -> pinned -> device), forced on the CPU backend: every
    leaf arrives intact, on the device's memory, staged by the placement's threads."""
    place = staging.Placement(jax.devices("cpu")[0], pinned=True)
    assert place.pinned
    threads = set()
    stage = place._stage

    def recording(buffer):
        threads.add(__import__("threading").current_thread().name)
        time.sleep(0.05)  # long enough that the leaves overlap
        return stage(buffer)

    monkeypatch.setattr(place, "_stage", recording)
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

