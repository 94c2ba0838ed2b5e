"""Attention as the layers call it: `attend` for training (causal, with its window,
soft-cap, documents and sinks) and `masked_attention` for the sampling path's cache.

Where `attend` runs (`kernel`): cuDNN's fused flash attention on an NVIDIA GPU where
its API takes the case and a probe compiles it for the shape (`cudnn_refusal`); on such a
GPU the cases it does not take (documents, soft-caps, fp32) by the Pallas kernel of
mtjax.flash_pallas where a probe compiles that (`pallas_refusal`); the chunked kernel of
mtjax.attention_chunked everywhere else. Which keys a query sees is mtjax.attention_mask's;
what attention holds on a device, priced for the planner, mtjax.attention_bytes's.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from mtjax import flash_pallas, target
from mtjax.attention_chunked import (CHUNK_ROWS, causal_attention, heads_major, sink_logits, split_attention,
                                     token_major)

FUSED_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash attention takes (fp8 aside)
PALLAS_HEAD_DIMS = (16, 32, 64, 128, 256)  # Triton's blocks are powers of two, at least 16 wide
PALLAS_CAPABILITY = 8.0  # Pallas's Triton lowering targets Ampere and later


def kernel(backend: str, dtype, head_dim: int, window: int | None = None, softcap: float | None = None,
           segments: bool = False, capability: float | None = None, sinks: bool = False) -> str:
    """Which implementation `attend` uses: "cudnn" (`jax.nn.dot_product_attention`'s fused
    flash-attention kernel), "pallas" (mtjax.flash_pallas) or "chunked" (`causal_attention`, O(t) memory past
    UNROLLED_CHUNKS chunks; not XLA's implementation of dot_product_attention, whose
    [heads, t, t] scores a long row cannot hold). A pure function of what is traced and
    where, so that the choice is tested without a GPU; `attend` probes the cuDNN choice.

    `backend` is "cpu", "cuda" (an NVIDIA GPU, `capability` its compute capability, e.g.
    9.0) or any other platform. cuDNN takes fp16/bf16 with a head dim that is a multiple
    of 8, at most 256 from Hopper (9.0) on and 128 before, and a causal sliding window;
    `jax.nn.dot_product_attention` has no logit soft-cap and no document (segment) ids
    (Llama 4's chunked layers are document ids too, `local_chunks`): those, and what else
    cuDNN does not take, go to the Pallas kernel on a CUDA GPU from Ampere (8.0) on with a
    head dim in PALLAS_HEAD_DIMS, and to the chunked path otherwise (exact on every backend).
    Sinks (gpt-oss) are in neither fused kernel: they take the chunked path everywhere.
    """
    if backend != "cuda" or capability is None or sinks:
        return "chunked"
    if (not softcap and not segments and jnp.dtype(dtype).name in FUSED_DTYPES and head_dim % 8 == 0
            and head_dim <= (256 if capability >= 9.0 else 128)):
        return "cudnn"
    return "pallas" if capability >= PALLAS_CAPABILITY and head_dim in PALLAS_HEAD_DIMS else "chunked"


@functools.lru_cache(maxsize=64)
def cudnn_refusal(q: jax.ShapeDtypeStruct, k: jax.ShapeDtypeStruct, scale: float, window: int | None) -> str | None:
    """None where cuDNN's flash attention compiles, forward and backward, for queries `q`
    and keys `k` of these shapes (and values shaped as the keys) on this process's default
    backend; else why not, in one line. Probed once a shape (a compile, not a run)."""
    local = (window - 1, 0) if window else None

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, scale=scale,
                                           implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    return _refusal(loss, q, k, k)


@functools.lru_cache(maxsize=64)
def pallas_refusal(q: jax.ShapeDtypeStruct, k: jax.ShapeDtypeStruct, scale: float, window: int | None,
                   softcap: float | None, segments: bool) -> str | None:
    """As `cudnn_refusal`, for mtjax.flash_pallas's kernel (with document ids where
    `segments`): None where it compiles, forward and backward, on the default backend."""
    def loss(q, k, v, *ids):
        out = flash_pallas.flash_attention(q, k, v, scale, window, softcap, *ids)
        return jnp.sum(out.astype(jnp.float32))

    return _refusal(loss, q, k, k, *([jax.ShapeDtypeStruct(q.shape[:2], jnp.int32)] if segments else []))


def _refusal(loss, *args) -> str | None:
    """None where the gradient of `loss` in its first three arguments compiles for `args`
    (shapes); else the first line of why not."""
    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    except Exception as e:  # noqa: BLE001  any refusal, at trace, lowering or compile time: the kernel says no
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'no reason given'}"
    return None


def _refused(which: str, q, k, scale: float, window: int | None, softcap: float | None, segments: bool) -> bool:
    """Whether kernel `which` ("cudnn" or "pallas") refuses this shape (`cudnn_refusal`,
    `pallas_refusal`); says so in one line, once a shape."""
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    if which == "cudnn":
        why, name = cudnn_refusal(shape(q), shape(k), float(scale), window), "cuDNN flash attention"
    else:
        why = pallas_refusal(shape(q), shape(k), float(scale), window, softcap, segments)
        name = "Pallas flash attention"
    if why is not None and (which, shape(q), shape(k), window, softcap, segments) not in _told:
        _told.add((which, shape(q), shape(k), window, softcap, segments))
        warnings.warn(f"{name} refused q {list(q.shape)} {q.dtype} (window {window}): {why[:200]}; "
                      f"attention runs the chunked kernel", stacklevel=3)
    return why is not None


_told: set = set()  # the shapes whose refusal was said


def _platform() -> tuple[str, float | None]:
    """(platform as `kernel` names it, CUDA compute capability or None) of the program being
    traced (mtjax.target): "cuda" with the first GPU's capability where one is here."""
    platform = target.platform()
    if platform not in ("gpu", "cuda"):
        return platform, None
    capability = cuda_capability()
    return ("cuda", capability) if capability is not None else (platform, None)


def cuda_capability() -> float | None:
    """The first GPU's CUDA compute capability, None without a CUDA GPU here."""
    try:  # CUDA devices report e.g. "9.0"; other GPUs report none or an architecture name
        return float(jax.devices("gpu")[0].compute_capability)
    except (RuntimeError, IndexError, AttributeError, TypeError, ValueError):  # no GPU here, or not CUDA
        return None


def attend(q, k, v, scale: float, window: int | None = None, softcap: float | None = None, segments=None,
           sinks=None, *, platform: tuple[str, float | None] | None = None, devices: int = 1):
    """Causal attention by the fastest exact path of the platform being traced for (`kernel`);
    `softcap`: soft-capped scores (Gemma 2); `segments` [b, t]: document ids of packed rows,
    which confine attention to each document. On a CUDA GPU both take the Pallas kernel
    (mtjax.flash_pallas), elsewhere the chunked path. `sinks` [heads]: per-head sink
    logits (gpt-oss), on the chunked path everywhere. Where cuDNN or Pallas refuses a shape
    `kernel` expected it to take (`cudnn_refusal`, `pallas_refusal`, probed once a shape),
    the chunked kernel computes it, and a warning says so in one line.
    `platform`: (backend, CUDA capability) to choose for instead of the one being traced
    for (how the GPU's choice is checked without a GPU). `devices` > 1: the row's tokens are
    split over that many devices (`split_attention`, on every platform)."""
    if devices > 1:  # sinks are refused there by the family (mtjax.families.gpt_oss)
        return split_attention(q, k, v, scale, window, softcap, segments, devices)
    backend, capability = _platform() if platform is None else platform
    which = kernel(backend, q.dtype, q.shape[-1], window, softcap, segments=segments is not None,
                   capability=capability, sinks=sinks is not None)
    if which == "chunked" or _refused(which, q, k, scale, window, softcap, segments is not None):
        return causal_attention(q, k, v, scale, window, CHUNK_ROWS, softcap, segments, sinks)
    if which == "pallas":
        return flash_pallas.flash_attention(q, k, v, scale, window, softcap, segments)
    local = (window - 1, 0) if window else None  # W keys including the query itself
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, scale=scale,
                                        implementation=which)


def masked_attention(q, k, v, mask, scale: float, softcap: float | None = None, sinks=None):
    """softmax(cap(q k^T * scale) where `mask` [, sinks]) v for an explicit boolean mask
    [b|1, 1, tq, tk] (the sampling path's cache); q [b, tq, heads, hd], k and v [b, tk, kv
    heads, hd]; `sinks` [heads] as `causal_attention` takes them."""
    if not softcap and sinks is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    kv = k.shape[2]
    qh, kh, vh = heads_major(q, kv), heads_major(k, kv)[:, :, 0], heads_major(v, kv)[:, :, 0]
    s = jnp.einsum("bkgth,bksh->bkgts", qh, kh, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, :, None], jnp.tanh(s / softcap) * softcap if softcap else s, -jnp.inf)
    if sinks is not None:  # one more column in each row's softmax, dropped after it
        sink = jnp.broadcast_to(sink_logits(sinks, kv), (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    else:
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return token_major(jnp.einsum("bkgts,bksh->bkgth", p, vh, preferred_element_type=jnp.float32).astype(q.dtype))
