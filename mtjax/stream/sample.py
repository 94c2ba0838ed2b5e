"""Sampling from a layer store one part at a time, streamed as training streams them.

    with mtjax.store.open(path) as store:
        ids = StreamSampler(store).generate(prompt_ids, 50, temperature=0)

Every forward pass (the prompt's prefill, then one pass per new token) walks the parts
embed, block.0 .. block.{N-1}, head. A prefetch thread reads the next part's compute
weights from the store into a reused staging buffer while the current part computes;
the part goes to the device, runs, and its buffer is refilled only once that
computation finished (mtjax.stream.staging). Each block keeps its keys and values on
the device, so a new token costs one streamed pass over one position.

Device memory: the weights of at most two blocks (the one computing and the one staged
ahead), or the embedding and head (both, for a tied head, which reads the embedding),
plus every block's decode state (its mixer's; for softmax attention a KV cache, 2 x [1,
prompt + new tokens (rounded up to a power of two), kv heads, head_dim] in the compute
dtype). The whole model is never on the device at once; `device_bytes` bounds what a
sample holds, and a sampler given a `budget` refuses to hold more (its ledger records the
peak). Tokens stay on the device between passes: the only host sync is reading the ids
at the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import generate, model, parts, terminal, treepath
from mtjax.layers import registry
from mtjax.model_config import ModelConfig
from mtjax.partid import EMBED, HEAD
from mtjax.stream.blockfns import block_fns
from mtjax.stream.budget import DeviceLedger, tree_bytes
from mtjax.stream.prefetch import Prefetcher
from mtjax.stream.staging import Placement, StagingPool


def _cache_length(positions: int) -> int:
    """KV-cache slots for `positions` (prompt + new tokens): rounded up to a power of two,
    so fewer shapes mean fewer compiles; the slots past the last position are masked out."""
    return max(16, 1 << (positions - 1).bit_length())


def _decode_states(cfg: ModelConfig, positions: int) -> list[dict]:
    """Each layer's decode state for `positions`, as its mixer's registry entry shapes it (KV caches)."""
    length = _cache_length(positions)
    return [registry.mixer(spec).decode_state(cfg, spec, 1, length) for spec in cfg.layer_specs]


def device_bytes(cfg: ModelConfig, positions: int) -> int:
    """A bound on the device bytes a sample of `positions` (prompt + new tokens) holds: the
    decode states plus two parts' compute weights (a part computing, or the embedding and
    a tied head that reads it)."""
    weights = max(parts.nbytes(parts.schema(cfg, p.name, "compute")) for p in parts.parts(cfg))
    return tree_bytes(_decode_states(cfg, positions)) + 2 * weights


@functools.lru_cache(maxsize=4)
def _fns(cfg: ModelConfig):
    """(embed, {layer spec: cached block}, head) compiled once per config; weights are arguments."""

    def block(spec, w, x, cache, start):
        return model.block_forward_cached(cfg, spec, parts.block_tree(cfg, spec, w), x, cache, start)

    def head(w, embed, x, key, greedy, top_k, temperature):
        head_t = treepath.unflatten(parts.abstract_part(cfg, HEAD), w)
        embed_t = treepath.unflatten(parts.abstract_part(cfg, EMBED), embed) if embed is not None else None
        logits = model.head_forward(cfg, head_t, embed_t, x[:, -1:])[0, 0]  # fp32 [vocab] of the last position
        token, key = generate.pick(logits, key, greedy, top_k, temperature)
        return token.astype(jnp.int32).reshape(1, 1), key

    # The caches are donated: each block's keys and values are updated in place.
    blocks = {k: jax.jit(functools.partial(block, k), donate_argnums=(2,)) for k in cfg.block_specs}
    return block_fns(cfg).embed_forward, blocks, jax.jit(head, static_argnums=(4, 5))


class StreamSampler:
    """Samples tokens from an open layer store (read-only is enough; a run samples the
    store it has just committed). `budget`: the device bytes it may hold (None: no cap;
    its ledger records the peak either way)."""

    def __init__(self, store, device: jax.Device | None = None, budget: int | None = None):
        store.check_complete("sample from it")  # a one-copy store stopped mid-update
        self.store, self.cfg = store, store.config
        self.names = [p.name for p in parts.parts(self.cfg)]
        self.schemas = {n: store.schema(n, "compute") for n in self.names}
        self.ledger = DeviceLedger(2**62 if budget is None else budget)
        # Two slots per shape: one computing, one being filled ahead of it.
        self.pool = StagingPool(Placement(device), self.ledger, max_slots=2)

    def _load(self, name: str):
        """On the prefetch thread: the part's compute weights in a free staging slot."""
        slot = self.pool.acquire(self.schemas[name])
        self.store.read(name, "compute", out=slot.buffers).result()
        return slot

    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
                 seed: int = 0, eos_id: int | None = None) -> list[int]:
        """Like mtjax.generate.generate, with the weights streamed from the store."""
        if max_new_tokens <= 0:
            return []
        cfg = self.cfg
        prompt, max_new_tokens, top_k = generate.fit(cfg, prompt, max_new_tokens, top_k, eos_id)
        passes = max_new_tokens  # the prefill yields the first token, each later pass one more
        shapes = _decode_states(cfg, len(prompt) + max_new_tokens)
        self.ledger.hold(tree_bytes(shapes), "decode state (KV caches)")  # counted before it is made
        caches = [{n: jnp.zeros(s.shape, s.dtype) for n, s in state.items()} for state in shapes]
        sampling = (temperature <= 0, top_k, jnp.float32(max(temperature, 1e-6)))
        key = jax.random.key(seed)
        tokens, new = self.pool.placement.tokens(np.asarray([prompt], np.int32)), []
        prefetch = Prefetcher(self.names * passes, self._load, depth=1, name="mtjax-sample-prefetch")
        try:
            with terminal.bar(passes, "sampling", unit="token") as bar:
                for n in range(passes):
                    start = 0 if n == 0 else len(prompt) + n - 1  # the prompt, then the last new token
                    tokens, key = self._pass(prefetch, tokens, start, caches, key, sampling)
                    new.append(tokens)
                    bar.update()
        finally:
            prefetch.close()
            self.ledger.free(tree_bytes(shapes))
        ids = np.asarray(jnp.concatenate(new, axis=1))[0].tolist()  # the one host sync of a generation
        return generate.cut_at_eos(ids, eos_id)

    def _pass(self, prefetch, tokens, start, caches, key, sampling):
        """One forward pass over `tokens` at positions start..: (next token [1, 1], key)."""
        embed_fn, block_fn, head_fn = _fns(self.cfg)
        tied = self.cfg.tie_word_embeddings
        _, embed_slot = prefetch.get()
        embed = self.pool.put(embed_slot, EMBED)
        x = embed_fn(embed, tokens)
        if not tied:
            self.pool.release(embed_slot, x)
        start = jnp.int32(start)
        for i, spec in enumerate(self.cfg.layer_specs):
            name, slot = prefetch.get()  # waits only if the read of this part is still running
            x, caches[i] = block_fn[spec](self.pool.put(slot, name), x, caches[i], start)
            self.pool.release(slot, x)  # x's program read the slot: its buffer is free once x is ready
        _, head_slot = prefetch.get()
        token, key = head_fn(self.pool.put(head_slot, HEAD), embed if tied else None, x, key, *sampling)
        self.pool.release(head_slot, token)
        if tied:
            self.pool.release(embed_slot, token)  # the head read the embedding too
        return token, key

    def complete(self, tokenizer, prompt: str, max_new_tokens: int, eos_id: int | None = None, add_bos: bool = True,
                 **kwargs) -> str:
        """Like mtjax.generate.complete (the same prompt ids, BOS included), with the weights
        streamed from the store."""
        eos_id = tokenizer.eos_id if eos_id is None else eos_id
        ids = self.generate(generate.prompt_ids(tokenizer, prompt, add_bos), max_new_tokens, eos_id=eos_id, **kwargs)
        return tokenizer.decode(ids)
