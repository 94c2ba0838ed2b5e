"""The precision policy: one master -> compute conversion, and every path computes it.

Each compute dtype's conversion is checked on values whose result is known (ties,
overflow, subnormals, infinities, NaNs with payloads) and on random bit patterns: the
host paths (the policy's, and the copy the fused AdamW loop writes) bit for bit against
`precision.reference`, NaNs included; XLA's convert, which the traced path is, bit for bit
on every other value.
"""

import dataclasses
import threading

import jax
import numpy as np
import optax
import pytest

from mtjax import model, parts, precision
from mtjax.optim import ADAMW_STATE, OptimConfig, make_optimizer
from mtjax.stream import StreamEngine, fused_adamw
from mtjax.stream.ranked_pool import RankedPool
from mtjax.stream.update import PartUpdate

from conftest import tiny_config

CFG = tiny_config(num_hidden_layers=1, num_attention_heads=2, head_dim=16)

# fp32 bits -> the bits of their conversion, per 16-bit dtype.
KNOWN = {
    "bfloat16": {
        0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0x3F807FFF: 0x3F80, 0x3F808001: 0x3F81,  # ties go to even
        0x7F7FFFFF: 0x7F80, 0x7F7F7FFF: 0x7F7F, 0x7F7F8000: 0x7F80,  # past the largest finite: infinity
        0x00000001: 0x0000, 0x00008000: 0x0000, 0x00018000: 0x0002, 0x80008001: 0x8001,  # subnormals
        0x7F800000: 0x7F80, 0xFF800000: 0xFF80, 0x00000000: 0x0000, 0x80000000: 0x8000,
        0x7F800001: 0x7FC0, 0xFFC00001: 0xFFC0, 0x7FA00000: 0x7FC0, 0x7FFFFFFF: 0x7FC0,  # NaN: quiet, no payload
    },
    "float16": {
        0x3F800000: 0x3C00, 0x3F801000: 0x3C00, 0x3F803000: 0x3C02,  # ties go to even
        0x477FE000: 0x7BFF, 0x477FEFFF: 0x7BFF, 0x477FF000: 0x7C00, 0x7149F2CA: 0x7C00,  # overflow
        0x33800000: 0x0001, 0x33000000: 0x0000, 0x33000001: 0x0001, 0x33C00000: 0x0002,  # subnormals
        0xFF800000: 0xFC00, 0x80000000: 0x8000,
        0x7F800001: 0x7E00, 0xFFC00001: 0xFE00, 0x7FA00000: 0x7E00, 0x7FFFFFFF: 0x7E00,
    },
}


def _values() -> np.ndarray:
    """fp32 test values: every known case of every dtype, random bit patterns (NaNs and
    subnormals among them) and random normals from tiny to huge."""
    rng = np.random.default_rng(0)
    known = np.array(sorted({b for table in KNOWN.values() for b in table}), np.uint32).view(np.float32)
    bits = rng.integers(0, 2 ** 32, 1 << 14, dtype=np.uint32).view(np.float32)
    scaled = (rng.standard_normal(1 << 14) * 10.0 ** rng.integers(-40, 39, 1 << 14)).astype(np.float32)
    return np.concatenate([known, bits, scaled])


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", sorted(KNOWN))
def test_reference_rounds_to_nearest_even(dtype):
    src = np.array(list(KNOWN[dtype]), np.uint32).view(np.float32)
    got = _bits(precision.reference(src, dtype))
    np.testing.assert_array_equal(got, np.array(list(KNOWN[dtype].values()), np.uint16))


@pytest.mark.parametrize("dtype", [d.name for d in precision.SUPPORTED])
def test_every_conversion_is_the_reference(dtype):
    """The host paths bit for bit; XLA's convert (the traced path) on every non-NaN value."""
    src = _values()
    want = precision.reference(src, dtype)
    assert want.dtype == np.dtype(dtype)
    pol = precision.Policy(dtype)
    out = np.empty(src.shape, dtype)
    precision.round_into(src, out)
    np.testing.assert_array_equal(_bits(out), _bits(want))
    shaped = {"k": src[:4096].reshape(64, 64), "v": src[4096:]}
    for name, got in pol.to_compute(shaped).items():
        np.testing.assert_array_equal(_bits(got).reshape(-1), _bits(precision.reference(shaped[name], dtype)).reshape(-1))
    traced = np.asarray(jax.jit(pol.to_compute_jax)({"v": src})["v"])
    nan = np.isnan(src)
    np.testing.assert_array_equal(_bits(traced)[~nan], _bits(want)[~nan])
    assert np.isnan(traced[nan].astype(np.float32)).all()


@pytest.mark.skipif(not fused_adamw.available(), reason="numba is not installed")
@pytest.mark.parametrize("dtype", [d.name for d in precision.SUPPORTED if fused_adamw.supports(d)])
@pytest.mark.parametrize("own", [("master", "opt", "compute"), ()])
def test_fused_loop_writes_the_reference(dtype, own):
    """The compute copy the fused AdamW writes is its new master converted by `reference`,
    bit for bit. The first step's learning rate is 0 (warmup) and the gradient 0, so the
    special values stay in the master (a decayed leaf's infinities become NaN)."""
    cfg = dataclasses.replace(CFG, compute_dtype=dtype)
    optim = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.1)
    update = PartUpdate(cfg, make_optimizer(optim), optim=optim)
    assert update.fused is not None
    src = _values()
    master = {"w.kernel": src[:8192].reshape(128, 64).copy(), "w.bias": src[8192:].copy()}
    opt = {n: np.asarray(a) for n, a in update.init_state(master).items()}
    compute = update.policy.to_compute(master)
    grads = {n: np.zeros_like(a) for n, a in master.items()}
    new_master, _, new_compute = update("block.0", master, opt, compute, grads, np.float32(1), own=own)
    for n, p in new_master.items():
        assert new_compute[n].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(_bits(new_compute[n]), _bits(precision.reference(p, dtype)), err_msg=n)
    assert np.isnan(new_master["w.bias"]).sum() == np.isnan(src[8192:]).sum()  # the specials went through


def test_policy_describes_the_compute_schema():
    for dtype in ("bfloat16", "float32"):
        cfg = dataclasses.replace(CFG, compute_dtype=dtype)
        master = parts.schema(cfg, "block.0", "master")
        compute = parts.schema(cfg, "block.0", "compute")
        assert list(compute) == list(master)
        assert all(compute[n] == jax.ShapeDtypeStruct(m.shape, np.dtype(dtype)) for n, m in master.items())
        assert precision.policy(cfg).master_is_compute == (dtype == "float32")
    with pytest.raises(ValueError, match="float64"):
        precision.Policy("float64")
    with pytest.raises(ValueError, match="bfloat16"):  # a buffer of another dtype is refused, not cast into
        precision.Policy("bfloat16").into({"w": np.zeros(4, np.float32)}, {"w": np.zeros(4, np.float16)})


def test_adamw_state_layout_names_the_stored_keys():
    """The fused AdamW's declared state layout is the optimizer's own: the names a store
    keeps for a part's optimizer state (unchanged since stores were first written)."""
    tx = make_optimizer(OptimConfig())
    assert ADAMW_STATE.describes(tx)
    assert not ADAMW_STATE.describes(optax.adam(1e-3))
    assert not ADAMW_STATE.describes(optax.chain(optax.clip(1.0), tx))
    master = parts.schema(CFG, "block.0", "master")
    assert set(parts.schema(CFG, "block.0", "opt", tx)) == ADAMW_STATE.names(master)
    assert ADAMW_STATE.moments("mlp.up_proj.kernel") == ("0.mu.mlp.up_proj.kernel", "0.nu.mlp.up_proj.kernel")



@pytest.mark.parametrize("dtype", [d.name for d in precision.SUPPORTED])
def test_a_big_array_converts_in_pieces_to_the_same_bits(dtype):
    """Staging converts a big leaf in pieces on several threads: the same bits as one
    piece, every element written once (the output starts as a pattern no conversion gives)."""
    cut = precision.pieces(5 * precision.MIN_PIECE + 37, 4)
    assert len(cut) == 4 and cut[0].start == 0 and cut[-1].stop == 5 * precision.MIN_PIECE + 37
    assert all(a.stop == b.start and b.start % 16 == 0 for a, b in zip(cut, cut[1:]))
    assert precision.pieces(precision.MIN_PIECE * 2 - 1, 8) == [slice(0, precision.MIN_PIECE * 2 - 1)]
    values = _values()
    src = np.resize(values, (5 * precision.MIN_PIECE + 37) // 7 * 7).reshape(-1, 7)
    want = precision.reference(src, dtype)
    for threads in (1, 3, 8):
        out = np.empty(src.shape, dtype)
        _bits(out)[...] = 0x7FFF  # a NaN with payload: no conversion writes it
        precision.round_into(src, out, threads=threads)
        np.testing.assert_array_equal(_bits(out), _bits(want), err_msg=f"{threads} threads")


def test_pieces_run_on_the_threads_the_caller_names():
    """`round_into(..., submit=...)`: every piece goes through the caller's submit (the
    staging's rounding on the fused AdamW's ranked threads), with the same bits."""
    src = np.resize(_values(), 4 * precision.MIN_PIECE)
    want = precision.reference(src, "bfloat16")
    pool = RankedPool(3, name="test-ranked")
    calls = []

    def submit(fn, *args):
        calls.append(len(args[0]))
        return pool.submit(0, fn, *args)

    out = np.empty(src.shape, "bfloat16")
    precision.round_into(src, out, threads=4, submit=submit)
    pool.shutdown()
    assert len(calls) == 4 and sum(calls) == src.size
    np.testing.assert_array_equal(_bits(out), _bits(want))


def test_staging_rounds_a_derived_copy_on_the_fused_adamw_threads_at_the_part_rank():
    """A RAM-tier run with the fused AdamW derives each part's compute copy from master:
    the staging's rounding of a part is submitted to the AdamW's ranked threads at the
    rank the forward needs it (before the pieces of any update needed later)."""
    cfg = tiny_config()
    eng = StreamEngine(cfg, model.init_params(cfg, seed=0), OptimConfig())
    try:
        eng.step(np.zeros((1, 2, 16), np.int32))
        queue = eng.updater.updates
        order = list(queue.parts)
        submit = queue.ranked("block.0")
        assert submit is not None and submit.args == (order.index("block.0"),)
        assert submit.func.__self__ is eng.update.fused.pool
        assert queue.ranked("no.such.part") is None
        names = submit(lambda: threading.current_thread().name).result()
        assert names.startswith("mtjax-adamw")
    finally:
        eng.close()
