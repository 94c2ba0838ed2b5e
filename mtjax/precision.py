"""The precision policy: what the device computes with for each leaf, and the one
conversion from a leaf's fp32 master weights to it.

    policy = precision.policy(cfg)
    policy.leaf(name, master)         # a leaf's compute representation (`Compute`)
    policy.schema(master_schema)      # {leaf: ShapeDtypeStruct} of the compute weights
    policy.to_compute(master)         # host: new arrays
    policy.into(master, out)          # host: into given arrays (a staging slot)
    policy.to_compute_jax(master)     # traced, inside a jitted program

A leaf's compute representation is its master rounded to the model's compute dtype
(fp32, bf16 or fp16), `Compute`; or, for a frozen 2-D kernel of a block when the model's
`base_format` is int8 or nf4, its packed quantized bytes (mtjax.quant), `Quantized`,
which the block decodes on the device into the compute dtype (`decoded`). Which one is
decided by the leaf's part, name and shape (`Policy.leaf`); a caller converting frozen
leaves names their part.

The conversion, written once as `reference`: round to nearest, ties to even (subnormals
included, values past the largest finite one become infinities), infinities kept, and a
NaN becomes the quiet NaN of its sign without payload (what ml_dtypes and XLA's CPU
convert give for bf16). fp32 is the master itself, copied. The host paths compute
exactly `reference`, bf16 with a compiled loop (numba) whose element function the fused
AdamW loop (mtjax.stream.fused_adamw) also uses for the copy it writes; the traced path
is XLA's convert, equal to it on every non-NaN value. tests/test_precision.py checks all
of them against `reference`, bit for bit.

The host conversion of a big array runs in pieces on a pool of threads (the loops
release the GIL): staging rounds a part's master into its slot before the copy to the
device starts, and one thread would take about 0.14 s for a 218M-parameter block.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mtjax import partid, quant, roles
from mtjax.model_config import BASE_FORMATS

try:
    import numba
    from llvmlite import ir
    from numba.extending import intrinsic
except ImportError:  # the host conversion is `reference` itself
    numba = None

MIN_PIECE = 1 << 16  # elements: an array this small is converted in one piece
THREADS = os.cpu_count() or 1  # pieces of a big array converted at once
FP32, BF16, FP16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
SUPPORTED = (FP32, BF16, FP16)
# The bits of a NaN converted to each 16-bit dtype (sign bit added): quiet, no payload.
_QUIET_NAN = {BF16: 0x7FC0, FP16: 0x7E00}


@dataclasses.dataclass(frozen=True)
class Compute:
    """A leaf's compute representation: its fp32 master rounded to `dtype`."""

    dtype: np.dtype

    def struct(self, shape) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), self.dtype)

    def into(self, master: np.ndarray, out: np.ndarray, submit=None) -> None:
        round_into(np.ascontiguousarray(master, np.float32), out, submit=submit)

    def traced(self, master):
        return jnp.asarray(master).astype(self.dtype)

    def round_trip(self, master):
        """Traced: the weights the device computes with for fp32 `master`, in fp32."""
        return self.traced(master).astype(jnp.float32)

    def to_fp32(self, stored, shape) -> np.ndarray:
        """The weights the device computes with, in fp32, from the stored copy."""
        del shape
        return np.asarray(stored, np.float32)


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A frozen kernel's compute representation: its master quantized to `fmt`
    (mtjax.quant), stored and staged as packed bytes, decoded on the device into `dtype`."""

    fmt: str
    dtype: np.dtype  # what the block computes with

    def struct(self, shape) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((quant.nbytes(self.fmt, tuple(shape)),), quant.PACKED)

    def into(self, master: np.ndarray, out: np.ndarray, submit=None) -> None:  # encoded whole (no pieces)
        np.copyto(out, quant.to_host(self.fmt, master))

    def traced(self, master):
        return quant.encode(self.fmt, master)

    def round_trip(self, master):
        return quant.decode(self.fmt, self.traced(master), np.shape(master), self.dtype).astype(jnp.float32)

    def to_fp32(self, stored, shape) -> np.ndarray:
        return quant.from_host(self.fmt, np.asarray(stored), tuple(shape), self.dtype)


def quantizable(part: str, name: str, shape) -> bool:
    """Whether a leaf is one that a base format quantizes when frozen: a 2-D kernel (a
    linear layer's weight) of a block."""
    return partid.PartId(part).is_block and name.endswith("kernel") and len(shape) == 2


class Policy:
    """The compute representation of every leaf of one model, and the conversion to it.
    `base_format` (BASE_FORMATS) applies to the frozen quantizable leaves, `frozen(part,
    leaf)` says which leaves are frozen (mtjax.roles)."""

    def __init__(self, compute_dtype, base_format: str = "compute", frozen=None):
        dtype = np.dtype(compute_dtype)
        if dtype not in SUPPORTED:
            raise ValueError(f"compute dtype {dtype.name} is not one of {', '.join(d.name for d in SUPPORTED)}")
        if base_format not in BASE_FORMATS:
            raise ValueError(f"base format {base_format!r} is not one of {', '.join(BASE_FORMATS)}")
        self._all = Compute(dtype)  # every leaf's but a quantized one's
        self._quantized = Quantized(base_format, dtype) if base_format != "compute" else None
        self._frozen = frozen or (lambda part, leaf: False)

    def leaf(self, name: str, master, part: str | None = None) -> Compute | Quantized:
        """The compute representation of the leaf `name` of `part` whose master is `master`
        (anything with a shape: an array or a ShapeDtypeStruct). Without `part`, the
        leaf is taken to be trained (never quantized)."""
        if (self._quantized is not None and part is not None and quantizable(part, name, np.shape(master))
                and self._frozen(part, name)):
            return self._quantized
        return self._all

    @property
    def dtypes(self) -> frozenset:
        """Every dtype a trained leaf's compute copy may have (what an update writes)."""
        return frozenset({self._all.dtype})

    @property
    def master_is_compute(self) -> bool:
        """Whether every trained leaf's compute weights equal its fp32 master (no rounding)."""
        return self.dtypes == {FP32}

    def schema(self, master: dict, part: str | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """{leaf: ShapeDtypeStruct} of the compute weights of flat master weights `master`."""
        return {n: self.leaf(n, m, part).struct(np.shape(m)) for n, m in master.items()}

    def to_compute(self, master: dict, part: str | None = None) -> dict[str, np.ndarray]:
        """Host compute weights of flat master weights, in new arrays."""
        out = {n: np.empty(s.shape, s.dtype) for n, s in self.schema(master, part).items()}
        self.into(master, out, part)
        return out

    def into(self, master: dict, out: dict, part: str | None = None, submit=None) -> None:
        """Write the compute weights of the leaves in `out` (all of `master`'s, or some)
        into its arrays (C-contiguous, of the leaf's compute shape and dtype); `submit`:
        the threads that convert the pieces (`round_into`)."""
        for n, buf in out.items():
            rep = self.leaf(n, master[n], part)
            want = rep.struct(np.shape(master[n])).dtype
            if buf.dtype != want:
                raise ValueError(f"{n}: compute weights are {want.name}, got a {buf.dtype.name} array")
            rep.into(master[n], buf, submit)

    def to_compute_jax(self, master: dict, part: str | None = None) -> dict:
        """The compute weights of flat master weights, traced (XLA's convert: `reference` on
        every non-NaN value)."""
        return {n: self.leaf(n, m, part).traced(m) for n, m in master.items()}

    def decoded(self, w: dict, shapes: dict) -> dict:
        """Flat compute weights `w` as the layers take them, traced: each packed leaf
        (a quantized one's bytes) decoded into the compute dtype; `shapes`: {leaf:
        master shape}. Runs inside the block's programs, on the device."""
        if self._quantized is None:
            return w
        return {n: quant.decode(self._quantized.fmt, a, tuple(shapes[n]), self._quantized.dtype)
                if a.dtype == quant.PACKED else a for n, a in w.items()}


@functools.lru_cache(maxsize=64)
def policy(cfg) -> Policy:
    """The precision policy of a model config (a ModelConfig)."""
    def frozen(part: str, leaf: str) -> bool:
        return roles.role(cfg, part, leaf) == roles.FROZEN

    return Policy(str(cfg.compute_dtype), cfg.base_format, frozen)


def reference(src: np.ndarray, dtype) -> np.ndarray:
    """`src` (fp32) converted to `dtype`: the specification every conversion meets."""
    src = np.asarray(src, np.float32)
    dtype = np.dtype(dtype)
    if dtype == FP32:
        return src.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        out = src.astype(dtype)  # round to nearest even (numpy for fp16, ml_dtypes for bf16)
    nan = np.isnan(src)
    if nan.any():  # payloads dropped, sign kept
        out.view(np.uint16)[nan] = np.where(np.signbit(src[nan]), 0x8000, 0) | _QUIET_NAN[dtype]
    return out


if numba is not None:

    @intrinsic
    def bf16_bits(typingctx, x):
        """The bf16 bits (uint16) of a float32 as `reference` gives them: rounded to
        nearest even; a NaN the quiet NaN of its sign.

        Written as LLVM IR so the integer steps stay 32-bit (numba widens integer
        arithmetic to 64 bits, which halves the vector width of a loop). numba caches a
        compiled loop by its own source file only: the fused AdamW's loops inline this, so
        a change here needs their cache cleared (tests/test_precision.py fails until it is)."""
        def codegen(context, builder, signature, args):
            i32, i16 = ir.IntType(32), ir.IntType(16)
            bits = builder.bitcast(args[0], i32)
            high = builder.lshr(bits, ir.Constant(i32, 16))
            odd = builder.and_(high, ir.Constant(i32, 1))
            rounded = builder.lshr(builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd), ir.Constant(i32, 16))
            quiet = builder.or_(builder.and_(high, ir.Constant(i32, 0x8000)), ir.Constant(i32, _QUIET_NAN[BF16]))
            nan = builder.fcmp_unordered("uno", args[0], args[0])
            return builder.trunc(builder.select(nan, quiet, rounded), i16)
        return numba.uint16(numba.float32), codegen

    @numba.njit(nogil=True, error_model="numpy", cache=True)
    def _round_bf16(src, out):
        for i in range(src.size):
            out[i] = bf16_bits(src[i])


def _convert_piece(src: np.ndarray, out: np.ndarray) -> None:
    """`round_into` of 1-D arrays."""
    if out.dtype == FP32:
        np.copyto(out, src)
    elif out.dtype == BF16 and numba is not None:
        _round_bf16(src, out.view(np.uint16))
    else:
        out[...] = reference(src, out.dtype)


@functools.cache
def _pool() -> cf.ThreadPoolExecutor:
    """The threads that convert pieces of big arrays (they only run pieces, never wait)."""
    return cf.ThreadPoolExecutor(THREADS, thread_name_prefix="mtjax-round")


def pieces(size: int, count: int) -> list[slice]:
    """At most `count` contiguous slices of about equal size covering `size` elements,
    of about MIN_PIECE or more (one for a small array), starts 64-byte aligned."""
    count = max(1, min(count, size // MIN_PIECE))
    bounds = [size * i // count // 16 * 16 for i in range(count)] + [size]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def round_into(src: np.ndarray, out: np.ndarray, threads: int | None = None, submit=None) -> None:
    """Write fp32 `src` into `out` (same shape, both C-contiguous) converted to `out`'s
    dtype as `reference` does. A big array is converted in up to `threads` (default
    THREADS) pieces at once, on a pool of threads (`submit(fn, *args)` -> a Future: another
    pool's, e.g. a ranked one; default this module's); returns when every piece is written."""
    if src.shape != out.shape or not (src.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError(f"round_into needs C-contiguous arrays of one shape, got {src.shape} and {out.shape}")
    if out.dtype not in SUPPORTED:
        raise ValueError(f"no conversion to {out.dtype.name}")
    src, out = np.asarray(src, np.float32).reshape(-1), out.reshape(-1)
    cut = pieces(src.size, THREADS if threads is None else threads)
    if len(cut) == 1:
        _convert_piece(src, out)
        return
    jobs = [(submit or _pool().submit)(_convert_piece, src[s], out[s]) for s in cut]
    for job in jobs:
        job.result()
