"""Multi-head latent attention (DeepSeek V2 and V3; mtjax.layers.spec.LatentAttention).

Each token's keys and values come from one latent of kv_lora_rank features (normed) and
one rotary key of head_dim features shared by every head, both from
`kv_a_proj_with_mqa`; `kv_b_proj` expands the latent into each head's non-rotary key
(qk_nope_head_dim) and value (v_head_dim). Queries come from `q_proj`, or through a
q_lora_rank bottleneck (`q_a_proj`, its norm, `q_b_proj`) where the config has one; each
query head is qk_nope_head_dim features without RoPE then head_dim with it. The softmax
scale is (qk_nope_head_dim + head_dim) ** -0.5, times yarn's mscale(factor, mscale_all_dim)
squared where the rope says, as transformers folds it in.

Its registry entry: this module, its FLOPs and its decode state, which holds the latent
and the rotary key of each token (kv_lora_rank + head_dim numbers), not each head's keys
and values: decoding expands the cache through kv_b_proj.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtjax import rope
from mtjax.attention import attend, masked_attention
from mtjax.attention_bytes import gathered_bytes, working_bytes
from mtjax.attention_mask import visible
from mtjax.layers import registry
from mtjax.layers.basic import Dense, RMSNorm
from mtjax.layers.spec import LatentAttention, LayerSpec
from mtjax.model_config import ModelConfig

LATENT_NORM_EPS = 1e-6  # transformers builds the q and kv latents' norms with their default, not rms_norm_eps


def softmax_scale(cfg: ModelConfig, spec: LayerSpec) -> float:
    """(qk_nope_head_dim + head_dim) ** -0.5, times yarn's mscale(factor, mscale_all_dim) ** 2
    where the layer's rope is yarn with mscale_all_dim set."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    scaling = spec.rope.scaling if spec.rope else None
    if scaling is not None and scaling.rope_type == "yarn" and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttentionModule(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        d, heads, rot = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.cfg, self.scale = cfg, softmax_scale(cfg, spec)
        self.rope = spec.rope is not None
        q_width = heads * (cfg.qk_nope_head_dim + rot)
        if cfg.q_lora_rank:
            self.q_a_proj = Dense(d, cfg.q_lora_rank, cfg.attention_bias, cfg, rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg, LATENT_NORM_EPS)
            self.q_b_proj = Dense(cfg.q_lora_rank, q_width, False, cfg, rngs)
        else:
            self.q_proj = Dense(d, q_width, False, cfg, rngs)
        self.kv_a_proj_with_mqa = Dense(d, cfg.kv_lora_rank + rot, cfg.attention_bias, cfg, rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg, LATENT_NORM_EPS)
        self.kv_b_proj = Dense(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, cfg, rngs)
        self.o_proj = Dense(heads * cfg.v_head_dim, d, cfg.attention_bias, cfg, rngs)

    def queries(self, x, cos, sin):
        """Queries [b, t, heads, qk_nope_head_dim + head_dim], their rotary part rotated."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = q.reshape(b, t, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.head_dim)
        nope, rot = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
        return jnp.concatenate([nope, self._rotate(rot, cos, sin)], axis=-1)

    def latent(self, x, cos, sin):
        """(normed latent [b, t, kv_lora_rank], rotated shared key [b, t, head_dim]): what the
        cache keeps of each token."""
        latent, rot = jnp.split(self.kv_a_proj_with_mqa(x), [self.cfg.kv_lora_rank], axis=-1)
        return self.kv_a_layernorm(latent), self._rotate(rot[:, :, None], cos, sin)[:, :, 0]

    def keys_values(self, latent, rot):
        """Each head's keys [b, s, heads, qk_nope_head_dim + head_dim] and values
        [b, s, heads, v_head_dim] from the latents and shared rotary keys of s tokens."""
        cfg = self.cfg
        b, s, _ = latent.shape
        kv = self.kv_b_proj(latent).reshape(b, s, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        nope, v = jnp.split(kv, [cfg.qk_nope_head_dim], axis=-1)
        shared = jnp.broadcast_to(rot[:, :, None], (b, s, cfg.num_attention_heads, cfg.head_dim)).astype(nope.dtype)
        return jnp.concatenate([nope, shared], axis=-1), v

    def _rotate(self, y, cos, sin):
        return rope.apply(y, cos, sin, self.cfg.rope_interleaved) if self.rope else y

    def _attend(self, q, k, v, attention):
        """`attention(q, k, v)` with q, k and v zero-padded to one width (the attention
        kernels take equal ones; zeros add nothing to the scores), the values' width kept."""
        width = max(q.shape[-1], v.shape[-1])
        q, k, v_padded = (jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])]) for a in (q, k, v))
        return attention(q, k, v_padded)[..., :v.shape[-1]]

    def __call__(self, x, cos, sin, positions, segments=None):
        b, t, _ = x.shape
        k, v = self.keys_values(*self.latent(x, cos, sin))
        out = self._attend(self.queries(x, cos, sin), k, v,
                           lambda q, k, v: attend(q, k, v, self.scale, None, None, segments,
                                                  devices=self.cfg.sequence_devices))
        return self.o_proj(out.reshape(b, t, -1))

    def decode(self, x, cache: dict, start, cos, sin, positions):
        """New tokens x [b, t, d] at positions start .. start+t-1 attend to the latents and
        rotary keys of all earlier positions in `cache` ({"latent": [b, L, kv_lora_rank],
        "rope_key": [b, L, head_dim]}), expanded into every head's keys and values here.
        Returns (output [b, t, d], the cache with this call's tokens written in)."""
        b, t, _ = x.shape
        latent, rot = self.latent(x, cos, sin)
        cache = {"latent": jax.lax.dynamic_update_slice_in_dim(
                     cache["latent"], latent.astype(cache["latent"].dtype), start, axis=1),
                 "rope_key": jax.lax.dynamic_update_slice_in_dim(
                     cache["rope_key"], rot.astype(cache["rope_key"].dtype), start, axis=1)}
        k, v = self.keys_values(cache["latent"].astype(x.dtype), cache["rope_key"].astype(x.dtype))
        mask = visible(positions[0], jnp.arange(k.shape[1], dtype=jnp.int32))[None, None]  # unwritten slots: future
        out = self._attend(self.queries(x, cos, sin), k, v,
                           lambda q, k, v: masked_attention(q, k, v, mask, self.scale))
        return self.o_proj(out.reshape(b, t, -1)), cache


def flops(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, executed: bool = True) -> float:
    """QK^T over qk_nope_head_dim + head_dim and AV over v_head_dim per head and (query,
    key) pair; `executed`: every query against every key, both products at the padded
    width the kernels run (`_attend`), else the causal half at the true widths."""
    qk = cfg.qk_nope_head_dim + cfg.head_dim
    if executed:
        return 2.0 * batch * seq * cfg.num_attention_heads * 2 * max(qk, cfg.v_head_dim) * seq
    return 2.0 * batch * seq * cfg.num_attention_heads * (qk + cfg.v_head_dim) * (seq + 1) / 2


def latent_cache(cfg: ModelConfig, spec: LayerSpec, batch: int, length: int) -> dict:
    """The latent [batch, length, kv_lora_rank] and the rotary key [batch, length, head_dim]
    of `length` positions, in the compute dtype."""
    dtype = np.dtype(cfg.compute_dtype)
    return {"latent": jax.ShapeDtypeStruct((batch, length, cfg.kv_lora_rank), dtype),
            "rope_key": jax.ShapeDtypeStruct((batch, length, cfg.head_dim), dtype)}


def working(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, platform: str, devices: int = 1) -> int:
    """What the attention kernel holds at once beyond its residuals (its score tiles and,
    unrolled, each chunk's key and value slices: mtjax.attention_bytes.working_bytes), at the one
    padded width the kernel gets (`_attend`), and on a row split over `devices` the
    keys and values (one per query head, at that width) gathered from the other shares and
    their cotangents (mtjax.attention_bytes.gathered_bytes)."""
    width = max(cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim)
    heads = cfg.num_attention_heads
    return (working_bytes(platform, cfg.compute_dtype, batch, heads, seq, width, devices=devices)
            + gathered_bytes(platform, cfg.compute_dtype, batch, heads, seq, width, devices))


registry.register_mixer(LatentAttention.kind, registry.MixerKind(
    module=LatentAttentionModule, flops=flops, decode_state=latent_cache, working=working))
