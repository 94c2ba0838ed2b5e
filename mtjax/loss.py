"""Next-token cross-entropy, averaged over the counted targets in fp32 (as transformers does).

Two forms of one loss:

    head_loss(cfg, head, embed, x, tokens, targets)   final norm, LM head and loss over chunks of
                                                      tokens: [tokens, vocab] logits never exist
    cross_entropy(logits, tokens, targets)            the loss of logits already computed

Training and evaluation (the in-memory reference and the streaming engine alike) call
`head_loss`; its memory is one chunk's logits whatever the sequence length. A custom vjp
keeps only the head's input and each token's log-partition from the forward and
recomputes each chunk's logits in the backward (two head matmuls forward, as a remat).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import model, target
from mtjax.layers.basic import rms_norm, rows as flat_rows, transposed
from mtjax.model_config import ModelConfig

# The largest fp32 logits of one chunk of tokens: the head's working memory is a few of
# these (head_bytes), flat in the sequence length.
HEAD_CHUNK_BYTES = 256 * 2**20
CHUNK_MULTIPLE = 128  # chunk rows are a multiple of this (matmul tiles)


def chunk_rows(vocab_size: int, tokens: int | None = None) -> int:
    """Tokens per chunk of the head: HEAD_CHUNK_BYTES of fp32 logits (a multiple of
    CHUNK_MULTIPLE, at least one), and no more than `tokens` when given."""
    rows = max(CHUNK_MULTIPLE, HEAD_CHUNK_BYTES // (4 * vocab_size) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return rows if tokens is None else max(1, min(rows, tokens))


def head_rows(cfg: ModelConfig, tokens: int) -> int:
    """Tokens per chunk of `head_loss` over `tokens` tokens: model.head_chunk_tokens, or
    `chunk_rows` where it is 0."""
    return max(1, min(cfg.head_chunk_tokens or chunk_rows(cfg.vocab_size), tokens))


def head_bytes(cfg: ModelConfig, tokens: int, platform: str | None = None) -> int:
    """Device bytes `head_loss` and its gradient work in, beyond their inputs and outputs, for
    `tokens` tokens (a micro-batch's) on `platform` (default the backend's here), as XLA's
    buffer assignment holds them (tests/test_working_memory.py on the CPU; the GPU's from
    experiments/gpu/aot_memory.py's deviceless compile for an H200). Flat in the sequence
    length but for the per-token terms (tests/test_loss.py):

    - a chunk's fp32 logits; on the CPU beside them their fp32 gradient, or (when larger)
      that gradient in the compute dtype beside the chunk's fp32 kernel gradient [width,
      vocab] before it joins the sum: in fp32 the logits beside the larger of the two (the
      GPU fuses both away: the softmax gradient is written in the compute dtype into the
      dot's input, the kernel gradient added inside its dot);
    - the fp32 sum of the kernel's gradient over chunks [width, vocab], below fp32 or (the
      CPU) with tied embeddings (untied in fp32 it is the output's own buffer; tied, the
      output is the embedding's [vocab, width] gradient, which the sum is transposed into);
    - a chunk's hidden states and their gradient in fp32 (the CPU: the gradient alone);
    - a tied kernel's transposed copy in the compute dtype: on the GPU; on the CPU it lives
      in the embedding gradient's output buffer, dead before that is written;
    - per token 16 bytes (log-partition, weight, id, padding) and the chunks' stacked
      hidden-state gradients in the compute dtype; on the CPU also one fp32 [tokens,
      width] array: the final norm's output in fp32, an fp32 copy of the input below fp32.

    On the CPU below fp32 two phases add per-token terms (XLA's buffer assignment, bf16):
    during the chunks, the normed hidden states widened to fp32 (XLA slices the scan's
    input in fp32) beside a chunk's work; after them, the norm's backward in two fp32
    [tokens, width] arrays, three with rms_norm_offset. Priced as the fp32 head's, a
    Qwen3.5 head (offset, width 128, vocabulary 256) over 2 x 8192 tokens in chunks of
    1024 held 1.92x its price, 1.00x now; the tested heads 0.98-1.02x, 0.94-1.67x before
    (tests/test_working_memory.py).

    Split rows (`cfg.splits_rows`; `tokens` one device's share): a chunk holds the
    device's share of its rows, and in several chunks two copies of the share's hidden
    states in the compute dtype, the token-major and the every-n-th-token reorderings,
    while the chunks run (fp32 2 x 8192, chunks of 1024: XLA held 1.52x the price without
    them at 2 devices; 0.93x now at 2 and 8, tests/test_sequence_split.py); below fp32
    they are dead by the norm's backward (priced beside it, a bf16 head there held 0.73x
    its price at 2 devices, 0.75x at 8; 0.90x and 0.92x now)."""
    platform = platform or jax.default_backend()
    item = np.dtype(cfg.compute_dtype).itemsize
    d, vocab, devices = cfg.hidden_size, cfg.vocab_size, cfg.sequence_devices
    below = item < 4
    rows = head_rows(cfg, tokens * devices)
    reordered = 2 * tokens * d * item if cfg.splits_rows and rows < tokens * devices else 0
    rows = -(-rows // devices)  # the device's share of a chunk
    logits = rows * vocab * 4  # a chunk's, fp32
    kernel_grad = 4 * d * vocab  # [width, vocab], fp32
    hidden = rows * d * 4  # a chunk's hidden states, or their gradient, fp32
    stacked = tokens * (d * item + 16)  # the stacked hidden-state gradients; log-partition, weight, id, padding
    if platform != "cpu":
        summed = kernel_grad if below else 0
        copy = d * vocab * item if cfg.tie_word_embeddings else 0
        return logits + 2 * hidden + summed + copy + stacked + reordered
    summed = kernel_grad if below or cfg.tie_word_embeddings else 0
    # a chunk's logits beside their gradient, or it in the compute dtype beside the chunk's kernel gradient
    chunks = max(2 * logits, rows * vocab * item + kernel_grad) + hidden + summed + reordered
    wide = tokens * d * 4  # fp32 [tokens, width]: the norm's output (fp32), the input's copy (below fp32)
    if not below:
        return stacked + wide + chunks
    after = (3 if cfg.rms_norm_offset else 2) * wide  # the norm's backward
    return stacked + wide + max(chunks + wide, after)  # during the chunks: their input widened


def _counted(tokens: jnp.ndarray, targets=None):
    """(next token ids [b * t], counted [b * t] bool, count): row i predicts token i + 1; the
    last position of each row and (with `targets`, mtjax.documents.targets) the unmarked
    ones do not count; count is at least 1 with targets (the mean of none is 0)."""
    b, t = tokens.shape
    next_ids = jnp.roll(tokens, -1, axis=1).reshape(b * t)
    counted = jnp.broadcast_to(jnp.arange(t) < t - 1, (b, t))
    if targets is not None:
        counted = counted & jnp.roll(targets, -1, axis=1)
    count = b * (t - 1) if targets is None else jnp.maximum(jnp.sum(counted), 1)
    return next_ids, counted.reshape(b * t), count


def cross_entropy(logits: jnp.ndarray, tokens: jnp.ndarray, targets=None) -> jnp.ndarray:
    """Mean loss of predicting tokens[:, 1:] from logits[:, :-1] ([b, t, v], [b, t]).

    `targets` (bool [b, t], mtjax.documents.targets: the loss mask with padding and document
    boundaries folded in) keeps only the tokens it marks; the mean is over those (0 when
    there are none). None: every target counts.

    Written for the CPU's fusions: logits stay one [b * t, v] matrix (no sliced copy; the
    last position of each row gets weight 0) and the target logit is picked by comparing
    against the vocabulary index, so the backward is one elementwise pass, not a scatter.
    """
    b, t, v = logits.shape
    logits = logits.reshape(b * t, v).astype(jnp.float32)
    next_ids, counted, count = _counted(tokens, targets)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.sum(jnp.where(jnp.arange(v)[None, :] == next_ids[:, None], logits, 0.0), axis=-1)
    return jnp.sum(jnp.where(counted, logz - picked, 0.0)) / count


def head_loss(cfg: ModelConfig, head: dict, embed: dict | None, x: jnp.ndarray, tokens: jnp.ndarray, targets=None,
              chunk: int | None = None) -> jnp.ndarray:
    """`cross_entropy(model.head_forward(cfg, head, embed, x), tokens, targets)` computed
    over chunks of `chunk` tokens (default `head_rows`): hidden [b, t, d] -> the mean loss.
    The final norm runs on all the tokens at once (its autodiff keeps O(tokens x d)); the
    head's matmul, soft-cap and loss run chunk by chunk (`_summed_loss`).

    With each row's tokens split over devices (`cfg.splits_rows`) the tokens go
    token-major, as the dense layers' (basic.rows), on every platform: flattened b * t at
    batch 2 lost the split, every device ran the head over both rows (fp32, 2 x 8192
    tokens: 1.40x one device's temporaries on each of 2 or 8, tests/test_sequence_split.py;
    2 x 4096, vocab 4096, 8 CPU devices on AMD Zen 4: 3.8 s of CPU time, 0.5 s now). Normed
    after the reordering: normed [b, t, d], its gradient came back whole on every device.
    The loss is a sum: the order changes no value."""
    b, t, d = x.shape
    split = cfg.splits_rows
    h = rms_norm(flat_rows(x, split)[0], head["norm"]["weight"], cfg.rms_norm_eps, cfg.rms_norm_offset)
    kernel = model.head_kernel(cfg, head, embed).astype(x.dtype)
    next_ids, counted, count = _counted(tokens, targets)
    next_ids, counted = (flat_rows(a.reshape(b, t, 1), split)[0][:, 0] for a in (next_ids, counted))
    rows = head_rows(cfg, b * t) if chunk is None else min(chunk, b * t)
    n = -(-(b * t) // rows)
    pad = n * rows - b * t  # padded rows count for nothing
    # Split, chunk i takes every n-th token from i: each device holds its share of every
    # chunk. Consecutive tokens a chunk lay on one device each, and the scan over them
    # gathered the whole row onto every device (tests/test_sequence_split.py).
    chunks = (lambda a: jnp.swapaxes(a.reshape(rows, n, *a.shape[1:]), 0, 1)) if split else (
        lambda a: a.reshape(n, rows, *a.shape[1:]))
    h = chunks(jnp.pad(h, ((0, pad), (0, 0))))
    next_ids = chunks(jnp.pad(next_ids, (0, pad)))
    weights = chunks(jnp.pad(counted.astype(jnp.float32), (0, pad)))
    return _summed_loss(cfg.final_logit_softcapping or 0.0, h, kernel, next_ids, weights) / count


def _logits(cap: float, h, kernel):
    """fp32 logits [rows, v] of one chunk: h [rows, d] @ kernel [d, v], soft-capped (cap > 0)."""
    z = jnp.einsum("td,dv->tv", h, kernel, preferred_element_type=jnp.float32)
    return jnp.tanh(z / cap) * cap if cap else z


def _chunk_terms(cap: float, h, kernel, ids, weights):
    """(summed weighted loss, log-partition [rows]) of one chunk."""
    y = _logits(cap, h, kernel)
    logz = jax.nn.logsumexp(y, axis=-1)
    picked = jnp.sum(jnp.where(jnp.arange(y.shape[-1])[None, :] == ids[:, None], y, 0.0), axis=-1)
    return jnp.sum(weights * (logz - picked)), logz


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _summed_loss(cap: float, h, kernel, ids, weights):
    """Sum over chunks [n, rows, ...] of each token's weighted loss: h [n, rows, d], kernel
    [d, v], ids and weights [n, rows]."""
    return _loss_fwd(cap, h, kernel, ids, weights)[0]


def _loss_fwd(cap: float, h, kernel, ids, weights):
    def chunk(total, xs):
        loss, logz = _chunk_terms(cap, xs[0], kernel, xs[1], xs[2])
        return total + loss, logz

    total, logz = jax.lax.scan(chunk, jnp.float32(0), (h, ids, weights))
    # Kept for the backward: the inputs and each token's log-partition ([n, rows] fp32).
    return total, (h, kernel, ids, weights, logz)


def _loss_bwd(cap: float, saved, g):
    """Each chunk's logits again; d(loss)/d(logits) = g w (softmax - onehot), through the
    soft-cap's tanh; dh per chunk, dkernel summed over chunks in fp32."""
    h, kernel, ids, weights, logz = saved

    def chunk(dkernel, xs):
        hc, ic, wc, lc = xs
        y = _logits(cap, hc, kernel)
        probs = jnp.exp(y - lc[:, None])
        dy = (g * wc)[:, None] * (probs - (jnp.arange(y.shape[-1])[None, :] == ic[:, None]))
        dz = dy * (1.0 - jnp.square(y / cap)) if cap else dy
        dz = dz.astype(hc.dtype)
        dh = jnp.einsum("tv,dv->td", dz, kernel, preferred_element_type=jnp.float32).astype(hc.dtype)
        # On the CPU below fp32, the tokens-major operand is transposed into a copy of its own
        # first, so that XLA runs the dot in bf16, not upcast to fp32 (basic.transposed): head +
        # loss forward + backward in bf16 (width 1024, seq 512, vocab 8192, AMD Zen 4) 200-216 ->
        # 162-163 ms of CPU time (experiments/bench/cpu_pieces.py).
        low = hc.dtype != jnp.float32 and target.platform() == "cpu"
        ht = transposed(hc) if low else hc.T
        return dkernel + jnp.einsum("dt,tv->dv", ht, dz, preferred_element_type=jnp.float32), dh

    dkernel, dh = jax.lax.scan(chunk, jnp.zeros(kernel.shape, jnp.float32), (h, ids, weights, logz))
    return dh, dkernel.astype(kernel.dtype), None, None


_summed_loss.defvjp(_loss_fwd, _loss_bwd)
