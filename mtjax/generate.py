"""Sampling text from a model: greedy, temperature and top-k.

A KV-cache-free loop for small models held in memory: every new token recomputes the
forward pass over a fixed-length buffer, so the whole generation is one compiled
`fori_loop` (one compile per buffer length, no per-token dispatch), called for
`progress_tokens` (PROGRESS_TOKENS) positions at a time so that a progress bar can move. Causal attention
makes the padding to the right of the current position invisible to it. `check_fits`
refuses a prompt and token count that pass the model's context (the commands call it);
`generate` itself cuts such a prompt on the left.

Models in a layer store are sampled by mtjax.stream.sample instead, one part at a time
with a KV cache; it shares `fit`, `pick` and `cut_at_eos` with this loop, so both give
the same tokens for the same weights and seed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import model, terminal
from mtjax.errors import MtjaxError
from mtjax.model_config import ModelConfig

PROGRESS_TOKENS = 32  # tokens per compiled loop call: the progress bar moves between calls


def pick(logits, key, greedy: bool, top_k: int, temperature):
    """(next token id, next key) from fp32 logits [vocab]; the key is split once per token."""
    key, sub = jax.random.split(key)
    if greedy:
        return jnp.argmax(logits), key
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(sub, logits), key


def fit(cfg: ModelConfig, prompt: list[int], max_new_tokens: int, top_k: int | None,
        eos_id: int | None) -> tuple[list[int], int, int]:
    """(prompt, max_new_tokens, top_k) made to fit the model: the prompt is cut on the left
    so prompt and continuation fit in the context; top_k 0 means the whole vocabulary."""
    context = cfg.max_position_embeddings
    max_new_tokens = min(max_new_tokens, context - 1)
    prompt = list(prompt)[-(context - max_new_tokens):] or [eos_id if eos_id is not None else 0]
    top_k = 0 if not top_k or top_k >= cfg.vocab_size else int(top_k)
    return prompt, max_new_tokens, top_k


def prompt_ids(tokenizer, prompt: str, add_bos: bool = True) -> list[int]:
    """The ids a sample continues: BOS where the tokenizer's documents start with one
    (unless `add_bos` is off: a chat template writes its own), then the prompt's."""
    bos = [] if tokenizer.bos_id is None or not add_bos else [tokenizer.bos_id]
    return bos + tokenizer.encode(prompt)


def check_fits(cfg: ModelConfig, prompt: list[int], max_new_tokens: int, names: tuple[str, str]) -> None:
    """Raise unless `prompt` and `max_new_tokens` new tokens fit in the model's context
    together (`fit` would cut the prompt); `names`: the prompt's and the count's settings."""
    context, used = cfg.max_position_embeddings, max(len(prompt), 1)  # an empty prompt starts from one token
    if used + max_new_tokens <= context:
        return
    room = context - used
    fix = (f"lower {names[1]} to {room} or less" if room > 0
           else f"shorten {names[0]} to fewer than {context} tokens")
    raise MtjaxError(f"{names[0]} ({used} token{'s' * (used != 1)}) and {names[1]} {max_new_tokens} need "
                     f"{used + max_new_tokens:,} positions, more than the model's context of {context} "
                     f"(max_position_embeddings); {fix}")


def cut_at_eos(new: list[int], eos_id: int | None) -> list[int]:
    return new[:new.index(eos_id)] if eos_id is not None and eos_id in new else new


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _sample_loop(cfg: ModelConfig, params, buffer, start, stop, greedy: bool, top_k: int, temperature, key):
    """(buffer with positions [start, stop) sampled, the key to continue from)."""
    def body(i, carry):
        buffer, key = carry
        logits = model.forward(cfg, params, buffer)[0, i - 1]  # fp32 [vocab], predicts position i
        token, key = pick(logits, key, greedy, top_k, temperature)
        return buffer.at[0, i].set(token.astype(buffer.dtype)), key

    return jax.lax.fori_loop(start, stop, body, (buffer, key))


def generate(cfg: ModelConfig, params, prompt: list[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 40, seed: int = 0, eos_id: int | None = None,
             progress_tokens: int = PROGRESS_TOKENS) -> list[int]:
    """`max_new_tokens` ids sampled after `prompt` (cut at the first EOS when given).

    temperature 0 is greedy decoding. The prompt is truncated on the left so prompt and
    continuation fit in the model's context. The loop samples `progress_tokens` positions
    a call (the progress bar moves between calls); the tokens are those of one call.
    """
    if max_new_tokens <= 0:
        return []
    prompt, max_new_tokens, top_k = fit(cfg, prompt, max_new_tokens, top_k, eos_id)
    buffer = np.zeros((1, len(prompt) + max_new_tokens), np.int32)
    buffer[0, :len(prompt)] = prompt
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    greedy, scale = temperature <= 0, jnp.float32(max(temperature, 1e-6))
    out, key = jnp.asarray(buffer), jax.random.key(seed)
    with terminal.bar(max_new_tokens, "sampling", unit="token") as bar:
        for start in range(len(prompt), out.shape[1], progress_tokens):  # the same tokens as one loop
            stop = min(start + progress_tokens, out.shape[1])
            out, key = _sample_loop(cfg, params, out, start, stop, greedy, top_k, scale, key)
            if not bar.disable:
                out.block_until_ready()  # the bar shows tokens sampled, not queued
            bar.update(stop - start)
    new = np.asarray(out[0, len(prompt):]).tolist()  # the one host sync of a generation without a live bar
    return cut_at_eos(new, eos_id)


def complete(cfg: ModelConfig, params, tokenizer, prompt: str, max_new_tokens: int, eos_id: int | None = None,
             add_bos: bool = True, **kwargs) -> str:
    """Text continuation of `prompt` using `tokenizer` (see mtjax.data.tokenizer), cut at
    `eos_id` (default: the tokenizer's EOS); the prompt starts with BOS where the
    tokenizer's documents do, unless `add_bos` is off (a chat template writes its own)."""
    eos_id = tokenizer.eos_id if eos_id is None else eos_id
    ids = generate(cfg, params, prompt_ids(tokenizer, prompt, add_bos), max_new_tokens, eos_id=eos_id, **kwargs)
    return tokenizer.decode(ids)
