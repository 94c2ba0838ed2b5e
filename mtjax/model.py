"""The decoder-only transformer: embed -> N blocks -> final norm -> LM head.

Modules are Flax NNX, but everything outside this file sees plain pytrees:

    params = {"embed": {...}, "blocks": [block_0, ..., block_{N-1}], "head": {...}}

One block is a pure function of (block params, hidden states): `block_forward`. That
list of per-block pytrees is the streaming unit of mtjax. A MoE block's MLP is a
`SparseMoE` (routing and expert dispatch in mtjax.moe), whose router statistics
`block_forward_stats` returns for the load-balancing loss; each expert is a module of
its own, so the store holds every expert's weights as separate arrays. `abstract_block` describes one
block's parameters as ShapeDtypeStructs, from which stores, byte budgets and staging
buffers are derived without allocating anything.

Parameter names mirror Hugging Face's (`self_attn.q_proj`, `mlp.down_proj`, ...), so the
name mapping in `mtjax.hf` stays a table. Kernels are stored [in, out] (y = x @ kernel).
Families whose checkpoints fuse projections (Phi-3's `qkv_proj`, `gate_up_proj`) keep them
fused here too: one matmul, its output split for compute.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtjax import documents, moe, rope
from mtjax.attention import attend, local_chunks, masked_attention
from mtjax.model_config import CHUNKED, FULL, MOE, SLIDING, ModelConfig, attention_type, uses_rope

Params = dict  # {"embed": ..., "blocks": [...], "head": ...}


def _dot(x, w):
    """x [..., d] @ w [d, f], accumulated in fp32 (bf16 matmuls are only fast that way on CPU).

    The token axes are flattened into one first. On [b, t, d], XLA's CPU backend wrote the
    backward's activation gradients transposed for the weight-gradient dots, and reduced
    3-D norms slowly: flat, one block's forward + backward ran ~9% faster (width 1024).
    """
    y = jnp.einsum("td,df->tf", x.reshape(-1, x.shape[-1]), w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[-1])


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, bias: bool, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), jnp.float32))
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32)) if bias else None

    def __call__(self, x):
        y = _dot(x, self.kernel[...])
        return y + self.bias[...].astype(y.dtype) if self.bias is not None else y


class RMSNorm(nnx.Module):
    """RMSNorm with fp32 statistics, as transformers computes it (see `rms_norm`)."""

    def __init__(self, dim: int, cfg: ModelConfig):
        # Gemma's (1 + w) norms start at w = 0, the others' w at 1: both the identity scale.
        self.weight = nnx.Param(jnp.full((dim,), 0.0 if cfg.rms_norm_offset else 1.0, jnp.float32))
        self.eps, self.offset = cfg.rms_norm_eps, cfg.rms_norm_offset

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps, self.offset)


def rms_norm(x, weight, eps: float, offset: bool = False):
    """Over the last axis; computed on a flat [rows, d] matrix (see `_dot`: 10x faster backward).

    Llama's scales by w after casting back to x's dtype; with `offset` (Gemma's) it scales
    by (1 + w) in fp32 and casts afterwards; with no weight (None: Llama 4's L2 q/k norm)
    it only normalises."""
    x32 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is None:
        return normed.astype(x.dtype).reshape(x.shape)
    if offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype).reshape(x.shape)
    return (weight.astype(x.dtype) * normed.astype(x.dtype)).reshape(x.shape)


def temperature(cfg: ModelConfig, positions):
    """Llama 4's NoPE-layer query scale at integer `positions`, fp32 [..., t]:
    log1p(floor((p + 1) / floor_scale)) * temperature_scale + 1."""
    p = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((p + 1.0) / cfg.floor_scale)) * cfg.temperature_scale + 1.0


class Attention(nnx.Module):
    """`kind`'s attention: a sliding window or chunks of the keys where its layer type
    says, RoPE unless a NoPE kind, and Llama 4's L2 q/k norm (RoPE layers) or query
    temperature (NoPE layers) where the config sets them."""

    def __init__(self, cfg: ModelConfig, kind: str, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        layer_type = attention_type(kind)
        self.cfg = cfg
        self.window = cfg.sliding_window if layer_type == SLIDING else None
        self.chunk = cfg.attention_chunk_size if layer_type == CHUNKED else None
        self.rope = uses_rope(kind)
        self.l2_norm = cfg.qk_l2_norm and self.rope
        self.temperature = cfg.attn_temperature_tuning and not self.rope
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        if cfg.fused_projections:  # one [d, q + 2 kv] kernel, split after the matmul
            self.qkv_proj = Dense(d, q + 2 * kv, cfg.attention_bias, cfg, rngs)
        else:
            self.q_proj = Dense(d, q, cfg.attention_bias, cfg, rngs)
            self.k_proj = Dense(d, kv, cfg.attention_bias, cfg, rngs)
            self.v_proj = Dense(d, kv, cfg.attention_bias, cfg, rngs)
        self.o_proj = Dense(cfg.num_attention_heads * hd, d, cfg.o_proj_bias, cfg, rngs)
        # Per head (Qwen3, Gemma 3), or over all heads of the projection at once (OLMoE).
        q_dim, k_dim = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd) if cfg.qk_norm_full else (hd, hd)
        self.q_norm = RMSNorm(q_dim, cfg) if cfg.qk_norm or cfg.qk_norm_full else None
        self.k_norm = RMSNorm(k_dim, cfg) if cfg.qk_norm or cfg.qk_norm_full else None

    def qkv(self, x, cos, sin, positions):
        """Queries [b, t, heads, hd] and keys and values [b, t, kv heads, hd], rotated
        (and normed or tempered) for tokens at `positions` [b|1, t]."""
        cfg = self.cfg
        b, t, _ = x.shape
        if cfg.fused_projections:
            q_end = cfg.num_attention_heads * cfg.head_dim
            q, k, v = jnp.split(self.qkv_proj(x), [q_end, q_end + cfg.num_key_value_heads * cfg.head_dim], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
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
            q, k = rms_norm(q, None, cfg.rms_norm_eps), rms_norm(k, None, cfg.rms_norm_eps)
        if self.temperature:
            q = (q * temperature(cfg, positions)[..., None, None]).astype(q.dtype)
        return q, k, v

    def __call__(self, x, cos, sin, positions, segments=None):
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin, positions)
        window = self.window
        if self.chunk:  # chunks as documents, and a window of one chunk to skip older key blocks
            segments, window = local_chunks(positions, self.chunk, segments), self.chunk
        # A window of W keys includes the query itself. On the CPU not jax.nn.dot_product_attention:
        # attention.py skips the masked score blocks, ~20% faster there.
        out = attend(q, k, v, cfg.attn_scale, window, cfg.attn_logit_softcapping, segments)  # btnh
        return self.o_proj(out.reshape(b, t, -1))


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with the tanh GELU (Gemma);
    `width` wide (default: the dense intermediate_size); gate and up one [d, 2f] kernel when fused."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
        d, f = cfg.hidden_size, width or cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        if cfg.fused_projections:
            self.gate_up_proj = Dense(d, 2 * f, cfg.mlp_bias, cfg, rngs)
        else:
            self.gate_proj = Dense(d, f, cfg.mlp_bias, cfg, rngs)
            self.up_proj = Dense(d, f, cfg.mlp_bias, cfg, rngs)
        self.down_proj = Dense(f, d, cfg.mlp_bias, cfg, rngs)
        self.fused = cfg.fused_projections

    def __call__(self, x):
        if self.fused:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


EXPERT_KERNELS = ("gate_proj", "up_proj", "down_proj")  # each expert's, in moe.experts_forward's order


class SparseMoE(nnx.Module):
    """Router (`gate`), the experts (each a SwiGLU MLP of its own) and a shared expert
    where the config has one: scaled by a sigmoid gate (Qwen2-MoE) or not (Llama 4, whose
    router also differs: mtjax.moe.route_sigmoid). Returns (output, router statistics)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Dense(cfg.hidden_size, cfg.num_experts, False, cfg, rngs)
        self.experts = nnx.List([MLP(cfg, rngs, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, rngs, shared) if shared else None
        gated = shared and cfg.shared_expert_gated
        self.shared_expert_gate = Dense(cfg.hidden_size, 1, False, cfg, rngs) if gated else None

    def route(self, flat):
        """Token rows [T, d] -> (kept weights [T, k], chosen experts [T, k], probabilities [T, E])."""
        cfg = self.cfg
        if cfg.sigmoid_router:
            return moe.route_sigmoid(self.gate(flat), cfg.num_experts_per_tok)
        return moe.route(self.gate(flat), cfg.num_experts_per_tok, cfg.norm_topk_prob)

    def routed(self, flat, weights, chosen, kernels=None, ids=None):
        """The experts' weighted sum over the rows routed to them: this module's experts, or
        a group's `kernels` (gate, up, down stacked [n, in, out]) of global expert ids `ids`
        (moe.experts_forward)."""
        if kernels is None:  # stacked inside the program: the store keeps one array per expert
            kernels = [jnp.stack([getattr(e, n).kernel[...] for e in self.experts]) for n in EXPERT_KERNELS]
        forward = moe.input_scaled_experts if self.cfg.sigmoid_router else moe.experts_forward
        return forward(flat, weights, chosen, *kernels, ids, total=self.cfg.num_experts)

    def shared(self, flat):
        """The shared expert's output, scaled by its sigmoid gate where it has one; 0 without one."""
        if self.shared_expert is None:
            return jnp.zeros_like(flat)
        if self.shared_expert_gate is None:
            return self.shared_expert(flat)
        return jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen, probs = self.route(flat)
        y = self.routed(flat, weights, chosen)
        if self.shared_expert is not None:
            y = y + self.shared(flat)
        return y.reshape(x.shape), moe.router_stats(probs, chosen)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). Returns (hidden,
    router statistics: {} unless the MLP is a SparseMoE).

    With `sandwich_norms` (Gemma) the attention and MLP outputs are normed too before their
    residual adds; post_attention_layernorm is then the attention output's norm and
    pre_feedforward_layernorm the MLP input's (Hugging Face's names for both layouts).
    """

    def __init__(self, cfg: ModelConfig, kind: str, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = Attention(cfg, kind, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = SparseMoE(cfg, rngs) if kind.endswith(MOE) else MLP(cfg, rngs)
        sandwich = cfg.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg) if sandwich else None

    def attention_residual(self, x, attn_out):
        """x plus the attention's output (normed first with sandwich norms)."""
        if self.pre_feedforward_layernorm is not None:
            attn_out = self.post_attention_layernorm(attn_out)
        return x + attn_out

    def mlp_residual(self, x):
        """(x plus the MLP's output, router statistics: {} for a dense MLP)."""
        sandwich = self.pre_feedforward_layernorm is not None
        y = self.mlp(self.pre_feedforward_layernorm(x) if sandwich else self.post_attention_layernorm(x))
        y, stats = y if isinstance(self.mlp, SparseMoE) else (y, {})
        return x + (self.post_feedforward_layernorm(y) if sandwich else y), stats

    def __call__(self, x, cos, sin, positions, segments=None):
        with jax.named_scope("attention"):
            x = self.attention_residual(x, self.self_attn(self.input_layernorm(x), cos, sin, positions, segments))
        with jax.named_scope("mlp"):
            return self.mlp_residual(x)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.embedding = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32))


class Head(nnx.Module):
    """Final norm and (when untied) the LM head kernel [hidden, vocab]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.hidden_size, cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Dense(cfg.hidden_size, cfg.vocab_size, False, cfg, rngs)


# --- pure functions over plain pytrees -------------------------------------------------


def _module_factory(cfg: ModelConfig, part: str):
    kind = part.removeprefix("block:")
    if part.startswith("block:"):
        return lambda rngs: Block(cfg, kind, rngs)
    return {"embed": lambda rngs: Embed(cfg, rngs), "head": lambda rngs: Head(cfg, rngs)}[part]


@functools.lru_cache(maxsize=None)
def _skeleton(cfg: ModelConfig, part: str):
    """(graphdef, abstract state) of one part; built once, without allocating."""
    module = nnx.eval_shape(lambda: _module_factory(cfg, part)(nnx.Rngs(0)))
    return nnx.split(module)


def _merge(cfg: ModelConfig, part: str, params: dict):
    graphdef, state = _skeleton(cfg, part)
    state = jax.tree.map(lambda x: x, state)  # a fresh copy to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _abstract(cfg: ModelConfig, part: str) -> dict:
    return nnx.to_pure_dict(_skeleton(cfg, part)[1])


def abstract_block(cfg: ModelConfig, kind: str = FULL) -> dict:
    """One block's parameters as a pytree of float32 ShapeDtypeStructs."""
    return _abstract(cfg, "block:" + kind)


def abstract_params(cfg: ModelConfig) -> Params:
    """The whole model's parameters as ShapeDtypeStructs (no allocation), to read, not to
    fill in: blocks of one kind share one tree (map over it for a tree of your own)."""
    kinds = {kind: abstract_block(cfg, kind) for kind in set(cfg.layer_kinds)}  # once a kind, not once a block
    return {
        "embed": _abstract(cfg, "embed"),
        "blocks": [kinds[kind] for kind in cfg.layer_kinds],
        "head": _abstract(cfg, "head"),
    }


def num_params(cfg: ModelConfig) -> int:
    """How many parameters the model has (tied embeddings counted once)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))


def inactive_params(cfg: ModelConfig, kind: str) -> int:
    """Parameters of a block of `kind` that one token does not use: the experts beyond its
    k (0 for a dense block). FLOPs and MFU count a block's parameters minus these."""
    if not kind.endswith(MOE):
        return 0
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size  # gate, up, down; no biases
    return (cfg.num_experts - cfg.num_experts_per_tok) * expert


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: `num_params` less every layer's `inactive_params`."""
    return num_params(cfg) - sum(inactive_params(cfg, kind) for kind in cfg.layer_kinds)


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Freshly initialised float32 parameters (normal(initializer_range), unit norms)."""
    rngs = nnx.Rngs(seed)
    parts = {"embed": _module_factory(cfg, "embed")(rngs)}
    blocks = [_module_factory(cfg, "block:" + kind)(rngs) for kind in cfg.layer_kinds]
    parts["head"] = _module_factory(cfg, "head")(rngs)
    out = {k: nnx.to_pure_dict(nnx.state(m)) for k, m in parts.items()}
    out["blocks"] = [nnx.to_pure_dict(nnx.state(b)) for b in blocks]
    return {"embed": out["embed"], "blocks": out["blocks"], "head": out["head"]}


def cast(tree, dtype):
    """Cast every floating leaf of a pytree (the compute copy of master weights)."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def positions_for(tokens: jnp.ndarray) -> jnp.ndarray:
    return jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)


def embed_forward(cfg: ModelConfig, embed: dict, tokens: jnp.ndarray) -> jnp.ndarray:
    """Token ids [b, t] -> hidden states [b, t, d] in the compute dtype."""
    table = embed["embedding"]
    x = jnp.take(table, tokens, axis=0).astype(cfg.compute_dtype)
    return x * embed_multiplier(cfg) if cfg.embed_scale else x


def embed_multiplier(cfg: ModelConfig):
    """What embeddings are multiplied by: sqrt(hidden_size) rounded to the compute dtype, as
    transformers' Gemma rounds it to the weights' dtype; 1 without `embed_scale`."""
    return jnp.asarray(cfg.hidden_size**0.5 if cfg.embed_scale else 1.0, jnp.float32).astype(cfg.compute_dtype)


def block_forward_stats(cfg: ModelConfig, kind: str, block: dict, x: jnp.ndarray, segments=None):
    """One block as a pure function: (block params, hidden [b, t, d]) -> (hidden [b, t, d],
    router statistics: {} for a dense block, mtjax.moe.router_stats for a MoE block).

    `segments` [b, t] (document ids of packed rows, mtjax.batch): positions restart at each
    document and attention stays inside it; None: each row is one document.
    """
    cos, sin, positions = block_rotary(cfg, kind, x, segments)
    return block_module(cfg, kind, cast(block, x.dtype))(x, cos, sin, positions, segments)


def block_module(cfg: ModelConfig, kind: str, block: dict) -> Block:
    """The Block module holding `block`'s parameters (to call its pieces one by one)."""
    return _merge(cfg, "block:" + kind, block)


def block_rotary(cfg: ModelConfig, kind: str, x: jnp.ndarray, segments=None):
    """(cos, sin, positions [b, t]) of a block's rotary embedding at the positions of hidden
    states x [b, t, d] (each token's position in its document)."""
    positions = positions_for(x[..., 0]) if segments is None else documents.positions(segments)
    cos, sin = rope.cos_sin(rope.for_layer(cfg, kind), positions, x.dtype)
    return cos, sin, positions


def block_forward(cfg: ModelConfig, kind: str, block: dict, x: jnp.ndarray, segments=None) -> jnp.ndarray:
    """`block_forward_stats` without the router statistics."""
    return block_forward_stats(cfg, kind, block, x, segments)[0]


def head_kernel(cfg: ModelConfig, head: dict, embed: dict | None):
    """The LM head kernel [d, vocab]: the embedding's transpose when tied."""
    if cfg.tie_word_embeddings:
        return embed["embedding"].T
    return head["lm_head"]["kernel"]


def head_forward(cfg: ModelConfig, head: dict, embed: dict | None, x: jnp.ndarray) -> jnp.ndarray:
    """Final norm and LM head: hidden [b, t, d] -> fp32 logits [b, t, vocab] (soft-capped
    by final_logit_softcapping where set)."""
    h = rms_norm(x, head["norm"]["weight"], cfg.rms_norm_eps, cfg.rms_norm_offset)
    kernel = head_kernel(cfg, head, embed).astype(x.dtype)
    logits = jnp.einsum("td,dv->tv", h.reshape(-1, x.shape[-1]), kernel, preferred_element_type=jnp.float32)
    cap = cfg.final_logit_softcapping
    if cap:
        logits = jnp.tanh(logits / cap) * cap
    return logits.reshape(*x.shape[:-1], kernel.shape[-1])  # flat for the CPU, as in `_dot`


# What the backward keeps of each block's forward (the rest is recomputed), by name:
#   "none": no remat, every intermediate is kept (fastest, most memory);
#   "full": only the block input, the whole block runs again in the backward
#           (transformers' per-layer gradient checkpointing);
#   "dots": the block input and the projection outputs the backward reads (q, k, v, o,
#           gate, up: about 4 d + 2 f floats per token, vs d for "full"); the backward
#           recomputes only norms, RoPE, attention and SwiGLU (~10% of a forward's FLOPs).
REMAT_POLICIES = ("none", "full", "dots")


def remat_block(fn, policy: str):
    """`fn(block, x, ...)` wrapped by the named remat policy (see REMAT_POLICIES)."""
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn)
    if policy == "dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"remat policy must be one of {REMAT_POLICIES}, got {policy!r}")


def forward_stats(cfg: ModelConfig, params: Params, tokens: jnp.ndarray, remat: bool | str = False,
                  segments=None):
    """(whole-model logits fp32 [b, t, vocab], router statistics of each MoE layer in order).
    `remat`: a REMAT_POLICIES name (True = "full"); `segments`: document ids of packed rows
    (see `block_forward_stats`)."""
    policy = {True: "full", False: "none"}.get(remat, remat)
    x, stats = embed_forward(cfg, params["embed"], tokens), []
    for kind, block in zip(cfg.layer_kinds, params["blocks"]):
        x, s = remat_block(functools.partial(block_forward_stats, cfg, kind), policy)(block, x, segments)
        stats += [s] if s else []
    return head_forward(cfg, params["head"], params["embed"], x), stats


def forward(cfg: ModelConfig, params: Params, tokens: jnp.ndarray, remat: bool | str = False,
            segments=None) -> jnp.ndarray:
    """Whole-model logits, fp32 [b, t, vocab]: `forward_stats` without the router statistics."""
    return forward_stats(cfg, params, tokens, remat, segments)[0]


def block_forward_cached(cfg: ModelConfig, kind: str, block: dict, x: jnp.ndarray, cache: dict, start):
    """`block_forward` for sampling: new tokens x [b, t, d] at positions start .. start+t-1
    attend to the keys and values of all earlier positions kept in `cache` ({"k", "v"}:
    [b, L, kv heads, head_dim]), so each token's keys and values are computed once.

    Returns (hidden [b, t, d], the cache with this call's keys and values written in).
    """
    m = block_module(cfg, kind, cast(block, x.dtype))
    attn = m.self_attn
    b, t, _ = x.shape
    positions = start + jnp.arange(t, dtype=jnp.int32)  # [t]
    cos, sin = rope.cos_sin(rope.for_layer(cfg, kind), positions[None], x.dtype)
    q, k, v = attn.qkv(m.input_layernorm(x), cos, sin, positions[None])
    keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), start, axis=1)  # bLkh
    values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), start, axis=1)
    key_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
    visible = key_pos[None, :] <= positions[:, None]  # [t, L]: causal; unwritten slots lie in the future
    if attn.window:
        visible &= key_pos[None, :] > positions[:, None] - attn.window  # W keys, the query's own included
    if attn.chunk:
        visible &= key_pos[None, :] // attn.chunk == positions[:, None] // attn.chunk
    out = masked_attention(q, keys, values, visible[None, None], cfg.attn_scale, cfg.attn_logit_softcapping)
    x = m.attention_residual(x, attn.o_proj(out.reshape(b, t, -1)))
    return m.mlp_residual(x)[0], {"k": keys, "v": values}
