"""mtjax's AdamW as one pass over memory: a compiled host loop (numba).

XLA's CPU backend compiles the optax AdamW update to four passes over memory (46
bytes/param; see mtjax.stream.update). This loop reads master, moments and gradient
once and writes master, moments and the bf16 compute copy once: 30 bytes/param, the
traffic of torch's fused AdamW plus the copy (28 without it: the engine's RAM tier keeps
no copy, see mtjax.stream.engine). An fp32 compute copy is the master itself, copied.
A bf16 gradient (bf16 compute, one micro-batch) is read as it is, 2 bytes/param fewer:
widening it to fp32 first was a pass of its own that cost the CPU several times this
loop (docs/cpu.md, "The gradient's dtype").

It evaluates the expressions XLA evaluates for `optim.make_optimizer`:
- XLA turns a division by a broadcast scalar into a multiplication by its reciprocal,
  so the bias corrections are applied as `m * (1 / (1 - b1**t))`;
- XLA's CPU code contracts a multiply feeding an add into a fused multiply-add; which
  product is contracted was measured per expression on a one-leaf program, and `_fma`
  below does the same;
- the bf16 copy is the precision policy's conversion (mtjax.precision.bf16_bits: round to
  nearest even, a NaN the quiet NaN of its sign).
On a part of one leaf the result is bit-identical to the optax program (jax 0.10). On a
part of several leaves XLA fuses the program differently and contracts other products,
so the two agree within fp32 rounding, not bit for bit; over 8 steps about 45% of the
elements differ in the last bits. tests/test_fused_adamw.py checks both, so a jax that
contracts differently shows up there.

Each leaf is split into one piece per core, run on a pool of threads that every update
in flight shares; the loops release the GIL. The pool runs the pieces of the part the
next forward needs first before the others' (`rank`, mtjax.stream.ranked_pool).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import precision
from mtjax.optim import ADAMW_STATE, OptimConfig, make_schedule
from mtjax.stream.ranked_pool import RankedPool
from mtjax.stream.tiers import host_device

try:
    import numba
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # the XLA program is used instead
    numba = None


def available() -> bool:
    return numba is not None


def supports(compute_dtype) -> bool:
    """Whether the loop can serve a model of this compute dtype (numba installed; the copy
    it writes is bf16, or fp32, which is the master itself)."""
    return available() and np.dtype(compute_dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float32))


if numba is not None:
    bf16_bits = precision.bf16_bits

    @intrinsic
    def _fma(typingctx, a, b, c):
        """a * b + c with one rounding, as XLA's CPU code computes it."""
        def codegen(context, builder, signature, args):
            f = ir.FloatType()
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
            return builder.call(fn, args)
        return numba.float32(numba.float32, numba.float32, numba.float32), codegen

    @intrinsic
    def _grad_f32(typingctx, g):
        """A gradient element as float32: an fp32 one itself, a bf16 one (its bits, uint16)
        widened, which is exact: the bf16 bits are the high half of the fp32 value's."""
        if g == numba.float32:
            return numba.float32(g), lambda context, builder, signature, args: args[0]
        if g == numba.uint16:
            def codegen(context, builder, signature, args):
                i32 = ir.IntType(32)
                bits = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
                return builder.bitcast(bits, ir.FloatType())
            return numba.float32(g), codegen
        return None

    @numba.njit(inline="always", error_model="numpy")
    def _adamw(p, m, v, g, k):
        """One element: (master, mu, nu, bf16 bits of master). `k` holds the step's scalars;
        `g` is fp32, or bf16 bits."""
        scale, b1, c1, b2, c2, r1, r2, eps, wd, neg_lr = k
        g = _grad_f32(g) * scale
        m = _fma(c1, g, b1 * m)  # optax: (1 - b1) * g + b1 * m
        v = _fma(b2, v, c2 * (g * g))  # optax: (1 - b2) * g**2 + b2 * v
        u = (m * r1) / (np.sqrt(v * r2) + eps)
        if wd != 0:
            u = _fma(wd, p, u)  # decoupled weight decay: u + wd * p
        p = _fma(neg_lr, u, p)  # p + (-lr) * u
        return p, m, v, bf16_bits(p)  # the copy, rounded as the precision policy says

    # Separate loops: LLVM vectorizes a loop whose inputs and outputs may overlap only
    # after a runtime check that fails when they are the same arrays, so in place gets
    # its own; and a loop without the bf16 copy moves 28 bytes/param instead of 30.
    @numba.njit(nogil=True, error_model="numpy", cache=True)
    def _in_place(p, m, v, g, out, k):
        for i in range(p.size):
            p[i], m[i], v[i], out[i] = _adamw(p[i], m[i], v[i], g[i], k)

    @numba.njit(nogil=True, error_model="numpy", cache=True)
    def _in_place_no_copy(p, m, v, g, k):
        for i in range(p.size):
            p[i], m[i], v[i], _ = _adamw(p[i], m[i], v[i], g[i], k)

    @numba.njit(nogil=True, error_model="numpy", cache=True)
    def _into(p, m, v, g, p_out, m_out, v_out, out, k):
        for i in range(p.size):
            p_out[i], m_out[i], v_out[i], out[i] = _adamw(p[i], m[i], v[i], g[i], k)

    @numba.njit(nogil=True, error_model="numpy", cache=True)
    def _into_no_copy(p, m, v, g, p_out, m_out, v_out, k):
        for i in range(p.size):
            p_out[i], m_out[i], v_out[i], _ = _adamw(p[i], m[i], v[i], g[i], k)


def _increment(count):
    """optax's safe_increment: +1, saturating at the dtype's maximum."""
    top = jnp.iinfo(count.dtype).max
    return jnp.where(count < top, count + 1, top)


@dataclasses.dataclass
class Leaf:
    """One parameter leaf's update: inputs, where results go, and whether it decays."""

    master: np.ndarray
    mu: np.ndarray
    nu: np.ndarray
    grad: np.ndarray  # fp32, or bf16 as the backward made it (read as it is: no fp32 copy)
    out: tuple  # new master, mu, nu (arrays, or the inputs themselves: in place), bf16 copy or None
    decay: bool

    def pieces(self, count: int):
        """(kernel, args) for `count` contiguous pieces of about equal size (fewer for a
        small leaf), all 1-D views."""
        ins, copy = (self.master, self.mu, self.nu), self.out[3]
        in_place = all(o is a for o, a in zip(self.out, ins))
        arrays = (*ins, self.grad, *self.out[:3]) + (() if copy is None else (copy,))
        if not all(a.flags.c_contiguous for a in arrays):
            raise ValueError("the fused AdamW needs C-contiguous arrays (a reshape would copy)")
        if copy is not None and copy.dtype != np.dtype(jnp.bfloat16):
            raise ValueError(f"the fused AdamW writes a bf16 compute copy, not {copy.dtype}")
        if self.grad.dtype not in (np.dtype(np.float32), precision.BF16):
            raise ValueError(f"the fused AdamW reads fp32 or bf16 gradients, not {self.grad.dtype}")
        grad = self.grad.view(np.uint16) if self.grad.dtype == precision.BF16 else self.grad
        flat = [a.reshape(-1) for a in (*ins, grad)]
        outs = [] if in_place else [a.reshape(-1) for a in self.out[:3]]
        outs += [] if copy is None else [copy.reshape(-1).view(np.uint16)]
        fn = {(True, True): _in_place, (True, False): _in_place_no_copy,
              (False, True): _into, (False, False): _into_no_copy}[in_place, copy is not None]
        for s in precision.pieces(flat[0].size, count):
            yield fn, (*[x[s] for x in flat], *[o[s] for o in outs])


class FusedAdamW:
    """The update of `make_optimizer(optim)` on host arrays, one pass per leaf.

    `state` says where its optimizer state keeps moments and counts (`ADAMW_STATE`);
    `step(counts)` gives the step's scalars and new step counts; `run(leaves, scalars,
    rank)` updates the leaves (in place where each Leaf's outputs are its inputs), its
    pieces queued behind those of lower `rank` (a part the forward needs earlier).
    """

    state = ADAMW_STATE

    def __init__(self, optim: OptimConfig, threads: int | None = None):
        if numba is None:
            raise RuntimeError("the fused AdamW needs numba (pip install numba)")
        self.optim = optim
        schedule, b1, b2 = make_schedule(optim), optim.b1, optim.b2

        @jax.jit
        def scalars(adam_count, schedule_count):
            # The expressions optax evaluates (scale_by_adam, scale_by_learning_rate).
            t = _increment(adam_count)
            r1, r2 = 1 / (1 - b1 ** t), 1 / (1 - b2 ** t)
            lr = jnp.asarray(-schedule(schedule_count), jnp.float32)
            return (r1.astype(jnp.float32), r2.astype(jnp.float32), lr), (t, _increment(schedule_count))

        self._scalars = scalars
        # Compiled now, with the int32 scalar counts optax keeps, so that its first use (the
        # first update, deferred into the second step) compiles nothing.
        with jax.default_device(host_device()):
            scalars(np.int32(0), np.int32(0))
        self._last = None  # (counts, their scalars): every part of a step has the same counts
        self.threads = threads or os.cpu_count() or 1
        self.pool = RankedPool(self.threads, name="mtjax-adamw")

    def step(self, adam_count, schedule_count, scale) -> tuple[tuple, tuple]:
        """(kernel scalars for a decaying leaf, for a non-decaying one), (new counts)."""
        key = (int(adam_count), int(schedule_count))
        if self._last is None or self._last[0] != key:
            with jax.default_device(host_device()):
                self._last = key, self._scalars(np.asarray(adam_count), np.asarray(schedule_count))
        (r1, r2, lr), counts = self._last[1]
        f = np.float32
        o = self.optim
        base = (f(scale), f(o.b1), f(1 - o.b1), f(o.b2), f(1 - o.b2), f(r1), f(r2), f(o.eps))
        return ((*base, f(o.weight_decay), f(lr)), (*base, f(0), f(lr))), tuple(np.asarray(c) for c in counts)

    def run(self, leaves: list[Leaf], scalars: tuple, rank: int = 0) -> None:
        """Update every leaf; returns when all are done (waits on the kernel threads)."""
        # One contiguous piece of each leaf per thread: each streams its own region of
        # memory (measured faster than many small pieces taken in turn).
        jobs = [self.pool.submit(rank, fn, *args, scalars[0] if leaf.decay else scalars[1])
                for leaf in leaves for fn, args in leaf.pieces(self.threads)]
        for job in jobs:
            job.result()
