"""mtjax.hostmem: aligned and huge-page arrays, and the fenced buffer pool's reuse rule."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mtjax import hostmem

F32 = {"w": jax.ShapeDtypeStruct((128, 128), np.float32)}


@jax.jit
def _slow_reader(w):
    """Reads w for a few hundred ms (async on the CPU backend: many flops)."""
    x = jax.lax.fori_loop(0, 3000, lambda i, x: jnp.tanh(x @ w) + 1.0, jnp.ones((128, 128)))
    return jnp.sum(x)


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((7,), ml_dtypes.bfloat16), ((), np.float32),
                                         ((3 << 18,), np.float32)])
def test_aligned_empty_is_page_aligned_zeroed_and_writable(shape, dtype):
    buf = hostmem.aligned_empty(shape, dtype)
    assert buf.ctypes.data % hostmem.PAGE == 0 and buf.shape == shape and buf.dtype == dtype
    assert buf.flags.writeable and buf.flags.c_contiguous and not buf.any()


def test_huge_empty_is_huge_page_aligned_above_2_mib():
    a = hostmem.huge_empty((3 << 20,), np.float32)
    assert a.flags.writeable and a.flags.c_contiguous and a.shape == (3 << 20,) and a.dtype == np.float32
    assert a.ctypes.data % hostmem.HUGE_PAGE == 0
    a[:] = 1.5
    assert float(a.sum()) == 1.5 * (3 << 20)
    small = hostmem.huge_empty((5, 3), ml_dtypes.bfloat16)
    assert small.shape == (5, 3) and small.dtype == ml_dtypes.bfloat16 and small.flags.writeable


def _reuse(wait: bool):
    """Fill a set, start a long read of its device copy, release it fenced by that read,
    acquire it again and overwrite it: (the read's result, the right result, reused?)."""
    pool = hostmem.BufferPool(sets_per_shape=1, wait_for_readers=wait)
    bufs = pool.acquire(F32)
    bufs["w"][:] = 1 / 128
    expected = float(_slow_reader(jnp.full((128, 128), 1 / 128, jnp.float32)))
    total = _slow_reader(jax.device_put(bufs["w"], jax.devices("cpu")[0]))  # may alias bufs["w"]
    pool.release(bufs, fence={"out": total, "ignored": np.ones(3)})
    again = pool.acquire(F32)
    ready_at_acquire = total.is_ready()
    again["w"][:] = 0.0
    return float(total), expected, again["w"] is bufs["w"], ready_at_acquire


def test_a_reused_set_waits_for_its_fence():
    got, expected, reused, ready = _reuse(wait=True)
    assert reused and ready and got == expected


def test_without_the_wait_reuse_corrupts():
    """The fence is what keeps the result right: without the wait the sum is wrong."""
    got, expected, reused, ready = _reuse(wait=False)
    assert reused and not ready and got != expected


def test_a_ready_set_is_preferred_to_a_busy_one():
    pool = hostmem.BufferPool(sets_per_shape=2)
    busy_bufs, idle_bufs = pool.acquire(F32), pool.acquire(F32)
    busy = _slow_reader(jax.device_put(busy_bufs["w"], jax.devices("cpu")[0]))
    pool.release(busy_bufs, busy)  # released first: the oldest
    pool.release(idle_bufs)
    assert pool.acquire(F32) is idle_bufs and not busy.is_ready()
    # At the cap, with only the busy set free, acquire waits for it rather than allocate.
    assert pool.acquire(F32) is busy_bufs and busy.is_ready() and pool.allocated == 2
    busy.block_until_ready()


def test_sets_are_reused_by_shape_dtype_and_names():
    pool = hostmem.BufferPool(sets_per_shape=1)
    a = pool.acquire(F32)
    pool.release(a)
    for other in ({"w": jax.ShapeDtypeStruct((128, 64), np.float32)},
                  {"w": jax.ShapeDtypeStruct((128, 128), ml_dtypes.bfloat16)},
                  {"v": jax.ShapeDtypeStruct((128, 128), np.float32)}):
        b = pool.acquire(other)
        assert b is not a and {n: (x.shape, x.dtype) for n, x in b.items()} == {
            n: (s.shape, np.dtype(s.dtype)) for n, s in other.items()}
        pool.release(b)
    assert pool.acquire(F32) is a and pool.allocated == 4


def test_with_every_set_out_acquire_makes_one_more():
    """The cap bounds the sets kept, not the sets out: a caller holding every set of a
    shape gets a new one instead of waiting on itself."""
    pool = hostmem.BufferPool(sets_per_shape=1)
    held = [pool.acquire(F32) for _ in range(3)]
    assert len({id(s["w"]) for s in held}) == 3 and pool.allocated == 3
    for s in held:
        pool.release(s)
    again = pool.acquire(F32)
    assert any(again is s for s in held) and pool.allocated == 3


def test_spare_counts_the_sets_held_per_shape():
    """`spare`: whether another set of a shape can be taken within the cap, counting the
    sets acquired and not released (the updater reads ahead only into such a set)."""
    pool = hostmem.BufferPool(sets_per_shape=2)
    other = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
    a = pool.acquire(F32)
    assert pool.spare(F32)
    b = pool.acquire(F32)
    assert not pool.spare(F32) and pool.spare(other)
    pool.release(a)
    assert pool.spare(F32)
    c = pool.acquire(F32)
    assert c is a and not pool.spare(F32)
    pool.release(b), pool.release(c)
    assert pool.spare(F32) and pool.allocated == 2
