"""Softmax attention, the built-in token mixer (mtjax.layers.spec.SoftmaxAttention).

Causal, grouped-query attention over the config's heads x head_dim, full or over a
sliding window or chunks of the keys (mtjax.attention computes it), with the config's
q/k/v projections, biases and q/k norms, and learned per-head sinks where the spec has
them (gpt-oss). Its registry entry: this module, its FLOPs (the
score and value products) and its decode state, a KV cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtjax import rope
from mtjax.attention import attend, masked_attention
from mtjax.attention_bytes import gathered_bytes, working_bytes
from mtjax.attention_mask import local_chunks, visible
from mtjax.layers import registry
from mtjax.layers.basic import Dense, RMSNorm, rms_norm
from mtjax.layers.spec import LayerSpec, SoftmaxAttention
from mtjax.model_config import ModelConfig


def temperature(cfg: ModelConfig, positions):
    """Llama 4's NoPE-layer query scale at integer `positions`, fp32 [..., t]:
    log1p(floor((p + 1) / floor_scale)) * temperature_scale + 1."""
    p = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((p + 1.0) / cfg.floor_scale)) * cfg.temperature_scale + 1.0


class Attention(nnx.Module):
    """A layer's softmax attention (`spec.mixer`): a sliding window or chunks of the keys
    where it says, RoPE unless the layer has none, and Llama 4's L2 q/k norm (RoPE layers)
    or query temperature (NoPE layers) where it sets them."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        mixer = spec.mixer
        self.cfg = cfg
        self.window, self.chunk, self.softcap = mixer.window, mixer.chunk, mixer.softcap
        self.rope = spec.rope is not None
        self.l2_norm, self.temperature, self.gated = mixer.qk_l2_norm, mixer.temperature, mixer.output_gate
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        if cfg.fused_projections:  # one [d, q + 2 kv] kernel, split after the matmul
            self.qkv_proj = Dense(d, q + 2 * kv, cfg.attention_bias, cfg, rngs)
        else:
            # With an output gate each head's queries are followed by its gate: [heads, 2 hd].
            self.q_proj = Dense(d, 2 * q if self.gated else q, cfg.attention_bias, cfg, rngs)
            self.k_proj = Dense(d, kv, cfg.attention_bias, cfg, rngs)
            self.v_proj = Dense(d, kv, cfg.attention_bias, cfg, rngs)
        self.o_proj = Dense(cfg.num_attention_heads * hd, d, cfg.o_proj_bias, cfg, rngs)
        # Per head (Qwen3, Gemma 3), or over all heads of the projection at once (OLMoE).
        q_dim, k_dim = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd) if cfg.qk_norm_full else (hd, hd)
        self.q_norm = RMSNorm(q_dim, cfg) if cfg.qk_norm or cfg.qk_norm_full else None
        self.k_norm = RMSNorm(k_dim, cfg) if cfg.qk_norm or cfg.qk_norm_full else None
        # gpt-oss: one logit per head joining its softmax's denominator (mtjax.attention_chunked).
        self.sinks = nnx.Param(jnp.zeros((cfg.num_attention_heads,), jnp.float32)) if mixer.sinks else None

    def qkv(self, x, cos, sin, positions):
        """Queries [b, t, heads, hd] and keys and values [b, t, kv heads, hd], rotated
        (and normed or tempered) for tokens at `positions` [b|1, t], and the output gate
        [b, t, heads * hd] (None without one)."""
        cfg = self.cfg
        b, t, _ = x.shape
        if cfg.fused_projections:
            q_end = cfg.num_attention_heads * cfg.head_dim
            q, k, v = jnp.split(self.qkv_proj(x), [q_end, q_end + cfg.num_key_value_heads * cfg.head_dim], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.gated:
            q, gate = jnp.split(q.reshape(b, t, cfg.num_attention_heads, 2 * cfg.head_dim), 2, axis=-1)
            gate = gate.reshape(b, t, -1)
        if cfg.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim)  # btnh
        k = k.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)  # btkh
        v = v.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)  # btkh
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = (rope.apply(y, cos, sin, cfg.rope_interleaved) for y in (q, k))
        if self.l2_norm:
            q, k = (rms_norm(y, None, cfg.rms_norm_eps, split=cfg.splits_rows) for y in (q, k))
        if self.temperature:
            q = (q * temperature(cfg, positions)[..., None, None]).astype(q.dtype)
        return q, k, v, gate

    def output(self, out, gate):
        """o_proj of the heads' outputs [b, t, heads, hd], times the gate's sigmoid first where there is one."""
        out = out.reshape(*out.shape[:2], -1)
        return self.o_proj(out if gate is None else out * jax.nn.sigmoid(gate))

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...]

    def _local(self, positions, segments=None):
        """(window, segments) of this layer's mask over tokens at `positions` [b, t]: chunks
        as documents (mtjax.attention_mask.local_chunks) and a window of one chunk, which lets
        the chunked kernel skip older key blocks; else its sliding window, if any."""
        if self.chunk:
            return self.chunk, local_chunks(positions, self.chunk, segments)
        return self.window, segments

    def __call__(self, x, cos, sin, positions, segments=None):
        cfg = self.cfg
        q, k, v, gate = self.qkv(x, cos, sin, positions)
        window, segments = self._local(positions, segments)
        # A window of W keys includes the query itself. On the CPU not jax.nn.dot_product_attention:
        # attention_chunked.py skips the masked score blocks, ~20% faster there.
        out = attend(q, k, v, cfg.attn_scale, window, self.softcap, segments, self._sinks(),
                     devices=cfg.sequence_devices)  # btnh
        return self.output(out, gate)

    def decode(self, x, cache: dict, start, cos, sin, positions):
        """New tokens x [b, t, d] at positions start .. start+t-1 (`positions` [1, t])
        attend to the keys and values of all earlier positions kept in `cache` ({"k", "v"}:
        [b, L, kv heads, head_dim]), so each token's keys and values are computed once.
        Returns (output [b, t, d], the cache with this call's keys and values written in)."""
        q, k, v, gate = self.qkv(x, cos, sin, positions)
        keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), start, axis=1)  # bLkh
        values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), start, axis=1)
        # The training path's mask over the cache's slots 0 .. L-1 (unwritten ones lie in
        # the future): the slots' chunks are the queries' too, at the queries' positions.
        query_pos, key_pos = positions[0], jnp.arange(keys.shape[1], dtype=jnp.int32)
        window, key_segments = self._local(key_pos[None])
        query_segments = None if key_segments is None else jnp.take(key_segments, query_pos, axis=1)
        mask = visible(query_pos, key_pos, window, query_segments, key_segments)  # [t, L] or [1, t, L]
        mask = mask[None, None] if key_segments is None else mask[:, None]
        out = masked_attention(q, keys, values, mask, self.cfg.attn_scale, self.softcap, self._sinks())
        return self.output(out, gate), {"k": keys, "v": values}


def keys_per_query(spec: LayerSpec, seq: int) -> float:
    """Average number of keys a query may see (causal, optionally windowed or chunked)."""
    mixer = spec.mixer
    if mixer.chunk:  # whole chunks of c, then the rest r: each a causal triangle
        c = mixer.chunk
        whole, r = divmod(seq, c)
        return (whole * c * (c + 1) / 2 + r * (r + 1) / 2) / seq
    w = mixer.window
    if not w or w >= seq:
        return (seq + 1) / 2
    return (w * (w + 1) / 2 + (seq - w) * w) / seq


def flops(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, executed: bool = True) -> float:
    """QK^T and AV: 4 x heads x head_dim per (query, key) pair; `executed`: every query
    against every key (the model's XLA attention masks afterwards), else the visible keys only."""
    keys = seq if executed else keys_per_query(spec, seq)
    return 4.0 * batch * seq * cfg.num_attention_heads * cfg.head_dim * keys


def kv_cache(cfg: ModelConfig, spec: LayerSpec, batch: int, length: int) -> dict:
    """The keys and values of `length` positions, [batch, length, kv heads, head_dim] each, in the compute dtype."""
    s = jax.ShapeDtypeStruct((batch, length, cfg.num_key_value_heads, cfg.head_dim), np.dtype(cfg.compute_dtype))
    return {"k": s, "v": s}


def working(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, platform: str, devices: int = 1) -> int:
    """What the attention kernel holds at once beyond its residuals (its score tiles and,
    unrolled, each chunk's key and value slices: mtjax.attention_bytes.working_bytes); a
    chunked layer's window is its chunk, as the kernel gets it (`Attention._local`). A row
    split over `devices` (`seq` one device's share) adds the keys and values gathered from
    the other shares and their cotangents (mtjax.attention_bytes.gathered_bytes)."""
    mixer = spec.mixer
    return (working_bytes(platform, cfg.compute_dtype, batch, cfg.num_attention_heads, seq, cfg.head_dim,
                          mixer.chunk or mixer.window, mixer.softcap, mixer.sinks, devices, cfg.num_key_value_heads)
            + gathered_bytes(platform, cfg.compute_dtype, batch, cfg.num_key_value_heads, seq, cfg.head_dim, devices))


registry.register_mixer(SoftmaxAttention.kind, registry.MixerKind(module=Attention, flops=flops, decode_state=kv_cache,
                                                                  working=working))
