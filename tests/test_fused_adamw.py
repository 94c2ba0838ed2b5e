"""The one-pass AdamW loop computes what the optax program computes."""

import dataclasses
import threading
import time

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

from mtjax.hostmem import HUGE_PAGE
from mtjax.optim import OptimConfig, make_optimizer, make_schedule
from mtjax.stream import fused_adamw
from mtjax.stream.ranked_pool import RankedPool
from mtjax.stream.update import PartUpdate

from conftest import tiny_config
from test_update import _check_equal, _random

pytestmark = pytest.mark.skipif(not fused_adamw.available(), reason="numba is not installed")

CFG = tiny_config(num_hidden_layers=1, num_attention_heads=2, head_dim=16, compute_dtype="bfloat16")
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", decay_steps=10, weight_decay=0.1)
# A big leaf, odd shapes, a 3-D leaf and 1-D leaves (no decay).
SHAPES = {"big.kernel": (512, 96), "a.kernel": (300, 7), "c.kernel": (9, 4, 5), "norm.weight": (5,),
          "big.bias": (1000,)}


def _pair():
    tx = make_optimizer(OPTIM)
    return PartUpdate(CFG, tx, optim=OPTIM), PartUpdate(CFG, tx)


def _state(update, seed=0, shapes=SHAPES):
    master = jax.device_put(_random(shapes, seed, 0.02), update.cpu)
    return master, update.init_state(master), update.compute_copy(master)


def test_fused_is_used_only_for_mtjax_adamw():
    fused, xla = _pair()
    assert fused.fused is not None and xla.fused is None
    assert PartUpdate(CFG, optax.adam(1e-3), optim=OPTIM).fused is None  # not make_optimizer's chain
    f16 = dataclasses.replace(CFG, compute_dtype="float16")
    assert PartUpdate(f16, make_optimizer(OPTIM), optim=OPTIM).fused is None  # the loop writes bf16 or fp32 copies


def _adamw64(master, opt, grads, scale, step):
    """AdamW in float64 from float32 inputs: what both implementations round."""
    o = OPTIM
    lr = float(make_schedule(o)(step))
    t = step + 1
    out = {}
    for n, p in master.items():
        p, m, v = (np.asarray(x, np.float64) for x in (p, opt[f"0.mu.{n}"], opt[f"0.nu.{n}"]))
        g = np.asarray(grads[n], np.float64) * float(scale)
        m, v = o.b1 * m + (1 - o.b1) * g, o.b2 * v + (1 - o.b2) * g * g
        u = (m / (1 - o.b1 ** t)) / (np.sqrt(v / (1 - o.b2 ** t)) + o.eps)
        out[n] = (p - lr * (u + (o.weight_decay * p if p.ndim > 1 else 0)), m, v)
    return out


@pytest.mark.parametrize("own", [("master", "opt", "compute"), ()])
def test_fused_equals_the_optax_program_over_steps(own):
    """Eight steps through warmup and decay, with a clip scale: equal to XLA's program
    within fp32 rounding, each step within a few fp32 roundings of AdamW in float64, and
    the bf16 copy exactly the master rounded. (Not bit-identical to XLA's program: which
    multiply-adds XLA contracts depends on how it fuses the program.)"""
    fused, xla = _pair()
    a, b = list(_state(fused)), list(_state(xla))
    for step in range(8):
        grads = _random(SHAPES, 100 + step, 1e-3)
        scale = np.float32(0.5 if step % 2 else 1.0)
        before = [{n: np.array(x) for n, x in d.items()} for d in a]
        olds = [dict(d) for d in a]
        a = list(fused("block.0", *a, grads, scale, own=own))
        b = list(xla("block.0", *b, grads, scale))
        for got, want in zip(a, b):
            _check_equal(got, {n: np.asarray(x) for n, x in want.items()})
        for n, (p, m, v) in _adamw64(before[0], before[1], grads, scale, step).items():
            for got, want in ((a[0][n], p), (a[1][f"0.mu.{n}"], m), (a[1][f"0.nu.{n}"], v)):
                np.testing.assert_allclose(got, want, rtol=2 ** -21, atol=2 ** -23 * np.max(np.abs(want)), err_msg=n)
            np.testing.assert_array_equal(a[2][n], a[0][n].astype(ml_dtypes.bfloat16))
        assert a[1]["0.count"] == b[1]["0.count"] == a[1]["2.count"] == step + 1
        if step > 0:  # from the second step on, every array is the loop's own
            for new, old in zip(a, olds):
                for n in new:
                    if np.ndim(new[n]):
                        assert (new[n] is old[n]) == bool(own), n


@pytest.mark.parametrize("leaf", [("big.kernel", (512, 96)), ("norm.weight", (1000,))])
def test_one_leaf_part_is_bit_identical_to_the_optax_program(leaf):
    """On a part of one leaf (decayed matrix, undecayed vector) XLA compiles the program
    whose multiply-adds the loop reproduces: the same bits, every step."""
    shapes = dict([leaf])
    fused, xla = _pair()
    a, b = list(_state(fused, shapes=shapes)), list(_state(xla, shapes=shapes))
    for step in range(8):
        grads = _random(shapes, 100 + step, 1e-3)
        scale = np.float32(0.5 if step % 2 else 1.0)
        a = list(fused("block.0", *a, grads, scale, own=("master", "opt", "compute")))
        b = list(xla("block.0", *b, grads, scale))
        for got, want in zip(a, b):
            for n in want:
                np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]), err_msg=f"step {step}: {n}")


def test_into_leaves_its_inputs_alone():
    """Not owned (disk tier, first update): results go to new arrays, inputs unchanged."""
    fused, _ = _pair()
    master, opt, compute = (
        {n: np.array(x) for n, x in d.items()} for d in _state(fused))
    kept = [{n: x.copy() for n, x in d.items()} for d in (master, opt, compute)]
    new = fused("block.0", master, opt, compute, _random(SHAPES, 7, 1e-3), np.float32(1), own=())
    for d, k, n in zip((master, opt, compute), kept, new):
        for leaf in d:
            np.testing.assert_array_equal(d[leaf], k[leaf])
            assert not np.shares_memory(d[leaf], n[leaf]) or d[leaf].ndim == 0
    assert not np.array_equal(new[1]["0.mu.big.kernel"], opt["0.mu.big.kernel"])  # (the first lr is 0: warmup)


def test_bf16_rounding_matches_ml_dtypes():
    """The loop's bf16 copy on ties, near-overflow, subnormals, infinities and NaN."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x80008000,
                     0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000000, 0x80000000],
                    np.uint32)
    rng = np.random.default_rng(0)
    bits = np.concatenate([bits, rng.integers(0, 2 ** 32, 4096, dtype=np.uint32)])
    p = bits.view(np.float32).copy()
    n = p.size
    zeros = np.zeros(n, np.float32)
    out = np.zeros(n, ml_dtypes.bfloat16)
    # lr 0 and no decay: the master passes through (NaN and inf included); the copy is its rounding.
    k = tuple(np.float32(x) for x in (1, 0.9, 0.1, 0.95, 0.05, 1, 1, 1e-8, 0, 0))
    leaf = fused_adamw.Leaf(p, zeros.copy(), zeros.copy(), zeros.copy(), (p, zeros.copy(), zeros.copy(), out), False)
    for fn, args in leaf.pieces(3):
        fn(*args, k)
    plain = (bits != 0x80000000) & ~np.isnan(bits.view(np.float32))  # -0 + 0 is +0; arithmetic quiets NaNs
    np.testing.assert_array_equal(p.view(np.uint32)[plain], bits[plain])
    want = p.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = out.view(np.uint16)
    nan = np.isnan(p)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(got[nan] & 0x7FC0, 0x7FC0)  # NaN stays a (quiet) NaN


def test_a_bf16_gradient_is_read_as_it_is():
    """A bf16 gradient (bf16 compute, one micro-batch) goes into the loop without an fp32
    copy and updates exactly as its fp32 value does, bit for bit, over steps, through the
    engine's update too; another dtype is refused with one line."""
    fused, _ = _pair()
    a, b = list(_state(fused)), list(_state(fused))
    scalars, _ = fused.fused.step(np.int32(3), np.int32(3), np.float32(0.5))
    for step in range(3):
        grads = {n: g.astype(ml_dtypes.bfloat16) for n, g in _random(SHAPES, 50 + step, 1e-3).items()}
        for state, cast in ((a, False), (b, True)):
            master, opt, compute = ({n: np.array(x) for n, x in d.items()} for d in state)
            leaves = []
            for n, g in grads.items():
                ins = (master[n], opt[f"0.mu.{n}"], opt[f"0.nu.{n}"])
                leaves.append(fused_adamw.Leaf(*ins, g.astype(np.float32) if cast else g, (*ins, compute[n]),
                                               n.endswith("kernel")))
            fused.fused.run(leaves, scalars)
            state[:] = master, opt, compute
        for got, want in zip(a, b):
            for n in want:
                np.testing.assert_array_equal(got[n], want[n], err_msg=f"step {step}: {n}")
    grads = _random(SHAPES, 60, 1e-3)
    got = fused("block.0", *a, {n: g.astype(ml_dtypes.bfloat16) for n, g in grads.items()}, np.float32(1))
    want = fused("block.0", *b, {n: g.astype(ml_dtypes.bfloat16).astype(np.float32) for n, g in grads.items()},
                 np.float32(1))
    for g, w in zip(got, want):
        for n in w:
            np.testing.assert_array_equal(g[n], w[n], err_msg=n)
    ins = [np.zeros(4, np.float32) for _ in range(3)]
    half = fused_adamw.Leaf(*ins, np.zeros(4, np.float16), (*ins, None), False)
    with pytest.raises(ValueError, match="fp32 or bf16 gradients, not float16"):
        next(half.pieces(1))


def test_ram_tier_state_gets_huge_page_arrays():
    """The first in-place update moves RAM-tier state into arrays it then keeps updating:
    big ones 2 MiB-aligned (madvised for transparent huge pages), all writable. The
    allocator itself: tests/test_hostmem.py."""
    fused, _ = _pair()
    state = _state(fused)
    big = SHAPES["big.kernel"]
    new = fused("block.0", *state, _random(SHAPES, 3, 1e-3), np.float32(1), own=("master", "opt", "compute"))
    for arr in (new[0]["big.kernel"], new[1]["0.mu.big.kernel"], new[1]["0.nu.big.kernel"]):
        assert arr.shape == big and arr.flags.writeable
        assert arr.nbytes < HUGE_PAGE or arr.ctypes.data % HUGE_PAGE == 0


def test_ranked_pool_runs_the_lowest_rank_first():
    """Jobs waiting for a thread run by rank, equal ranks in the order they came: first
    come, first served would run them as submitted (backward: the head first)."""
    pool, hold, ran = RankedPool(1), threading.Event(), []
    pool.submit(-1, hold.wait)
    while pool.waiting:  # the thread holds the blocker
        time.sleep(0.001)
    jobs = [pool.submit(rank, ran.append, (rank, i)) for rank in (3, 2, 1, 0) for i in range(2)]
    hold.set()
    for job in jobs:
        job.result()
    assert ran == [(rank, i) for rank in (0, 1, 2, 3) for i in range(2)]
    pool.shutdown()


def test_updates_in_flight_finish_in_the_order_the_forward_needs_them():
    """Several parts' updates share the loop's threads. Queued in backward order (the head
    first, the embedding last), they finish in the order the forward needs the parts:
    the embedding first."""
    update = PartUpdate(CFG, make_optimizer(OPTIM))
    update.fused = fused_adamw.FusedAdamW(OPTIM, threads=1)  # one thread: a strict order
    shapes = {"w.kernel": (2048, 2048)}  # a part's pieces take milliseconds: longer than a thread's wake-up
    master, opt, _ = _state(update, shapes=shapes)
    grads = _random(shapes, 1, 0.01)
    pool, hold, finished = update.fused.pool, threading.Event(), []
    pool.submit(-1, hold.wait)
    while pool.waiting:
        time.sleep(0.001)

    def run(part: str, rank: int) -> None:
        update(part, master, opt, None, grads, 1.0, rank=rank)
        finished.append(part)

    needed = ["embed", "block.0", "block.1", "head"]
    threads = []
    for rank, part in reversed(list(enumerate(needed))):
        queued = pool.waiting
        threads.append(threading.Thread(target=run, args=(part, rank)))
        threads[-1].start()
        while pool.waiting == queued:  # its pieces wait behind the blocker
            time.sleep(0.001)
    hold.set()
    for t in threads:
        t.join()
    assert finished == needed
