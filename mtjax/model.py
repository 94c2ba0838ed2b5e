"""The decoder-only transformer: embed -> N blocks -> final norm -> LM head.

Modules are Flax NNX (here and in mtjax.layers), but everything else sees plain pytrees
(a split MoE block's stages too: `block_until_split`, `block_experts`, `block_combine`):

    params = {"embed": {...}, "blocks": [block_0, ..., block_{N-1}], "head": {...}}

One block is a pure function of (block params, hidden states): `block_forward`. That
list of per-block pytrees is the streaming unit of mtjax. A block's parts are built from
its LayerSpec by the registry's entries (mtjax.layers.registry; the built-in kinds are
in mtjax.layers.softmax, mtjax.layers.latent and mtjax.layers.feedforward). A MoE block's MLP is a
`SparseMoE` (routing and expert dispatch in mtjax.moe), whose router statistics
`block_forward_stats` returns for the load-balancing loss. `abstract_block` describes one
block's parameters as ShapeDtypeStructs, from which stores, byte budgets and staging
buffers are derived without allocating anything.

Parameter names mirror Hugging Face's (`self_attn.q_proj`, `mlp.down_proj`, ...), so the
name mapping in `mtjax.hf` stays a table. Kernels are stored [in, out] (y = x @ kernel).
Families whose checkpoints fuse projections (Phi-3's `qkv_proj`, `gate_up_proj`) keep them
fused here too: one matmul, its output split for compute.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtjax import documents, lora, roles, rope, treepath
from mtjax.layers import clamped_moe, delta_net, feedforward, latent, registry, softmax  # noqa: F401 - these register the built-in kinds
from mtjax.layers.basic import LOW_DOT, Dense, RMSNorm, rms_norm
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig

Params = dict  # {"embed": ..., "blocks": [...], "head": ...}


class Block(nnx.Module):
    """Pre-norm residual block. `self_attn` is the spec's token mixer and `mlp` its
    feed-forward, each built by its registry entry. Its sequence is written once, in
    `sequence`, as two stages around the feed-forward:

        mixer stage   a = x + mixer(input_layernorm(x))    (its output normed first with sandwich norms)
                      h = the feed-forward's input norm(a)
        feed-forward  y, router statistics = mlp(h)        (a MoE's split point, before its experts,
                                                             is inside: mtjax.layers.feedforward.SparseMoE)
        output stage  a + y                                (y normed first with sandwich norms)

    The whole block, the cached decode step (`block_forward_cached`) and a split MoE
    block's sub-parts (mtjax.expert_groups, through `block_until_split`, `block_experts`
    and `block_combine`) all run these stages.

    With sandwich norms (Gemma) post_attention_layernorm is the mixer output's norm and
    pre_feedforward_layernorm the MLP input's (Hugging Face's names for both layouts).
    """

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = registry.mixer(spec).module(cfg, spec, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = registry.feed_forward(spec).module(cfg, spec, rngs)
        sandwich = spec.norms.sandwich
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg) if sandwich else None
        self.ffn_chunk = cfg.ffn_chunk_tokens

    def mixer_stage(self, x, mix):
        """(a, h, aux): a = x + the mixer's output (normed first with sandwich norms), h =
        the feed-forward's input norm of a; `mix(normed x) -> (mixer output, aux)`, aux
        handed back as it is (the decode state of a decode step)."""
        y, aux = mix(self.input_layernorm(x))
        if self.pre_feedforward_layernorm is not None:
            a = x + self.post_attention_layernorm(y)
            return a, self.pre_feedforward_layernorm(a), aux
        a = x + y
        return a, self.post_attention_layernorm(a), aux

    def output_stage(self, a, y):
        """a plus the feed-forward's output y (normed first with sandwich norms)."""
        if self.post_feedforward_layernorm is not None:
            y = self.post_feedforward_layernorm(y)
        return a + y.reshape(a.shape)

    def sequence(self, x, mix):
        """(block output, router statistics, the mixer's aux): the block with `mix` as its
        mixer call (see `mixer_stage`)."""
        with jax.named_scope("attention"):
            a, h, aux = self.mixer_stage(x, mix)
        with jax.named_scope("mlp"):
            y, stats = self.feed_forward(h)
            return self.output_stage(a, y), stats, aux

    def feed_forward(self, h):
        """(the feed-forward's output, router statistics) of h [b, t, d]. With
        `ffn_chunk_tokens` set and more tokens than that, the feed-forward (dense or MoE:
        routing and expert dispatch are per token) runs over chunks of them, each under
        jax.checkpoint: its backward keeps only h, not the [tokens, intermediate] products
        (nor a MoE's [tokens x k, ...] dispatch), and recomputes one chunk at a time. The
        output is the same, row by row; router statistics, sums over tokens, are summed over
        the chunks. Whole chunks run in a loop, the remainder after them (no padding rows,
        which a router would count)."""
        n = h.shape[0] * h.shape[1]
        if not self.ffn_chunk or n <= self.ffn_chunk:
            return self.mlp(h)
        rows, d = self.ffn_chunk, h.shape[-1]
        whole = n // rows * rows
        flat = h.reshape(n, d)
        y, stats = jax.lax.map(jax.checkpoint(self.mlp), flat[:whole].reshape(-1, rows, d))
        y, stats = y.reshape(whole, -1), jax.tree.map(lambda s: jnp.sum(s, axis=0), stats)
        if whole < n:
            rest, rest_stats = jax.checkpoint(self.mlp)(flat[whole:])
            y, stats = jnp.concatenate([y, rest]), jax.tree.map(jnp.add, stats, rest_stats)
        return y.reshape(h.shape), stats

    def __call__(self, x, cos, sin, positions, segments=None):
        """(hidden, router statistics: {} unless the MLP routes)."""
        out, stats, _ = self.sequence(x, lambda h: (self.self_attn(h, cos, sin, positions, segments), None))
        return out, stats


def _with_adapters(cfg: ModelConfig, block: Block, rngs: nnx.Rngs) -> Block:
    """`block` with a LoRA adapter on each linear layer `cfg.lora` targets (mtjax.lora)."""
    if cfg.lora is not None:
        for path, node in list(nnx.iter_graph(block)):
            if isinstance(node, Dense) and cfg.lora.targets(path):
                node.add_adapter(cfg.lora.rank, cfg.lora.scale, rngs, cfg.lora.dropout)
            elif hasattr(node, "add_expert_adapters") and cfg.lora.adapts_experts:
                node.add_expert_adapters(cfg.lora.rank, rngs)
    return block


class _AnyDraws:
    """Stands in for nnx.Rngs where a part is built only for its shapes: every draw is the
    same key. nnx.Rngs counts its draws in a variable, and under nnx.eval_shape each count
    it writes makes JAX walk the whole trace so far (for the tracer's origin message):
    quadratic in a part's weights, most of `mtjax plan`'s time on a block of 128 experts."""

    def __init__(self):
        self._key = jax.random.key(0)

    def params(self):
        return self._key


def adaptable_experts(cfg: ModelConfig) -> bool:
    """Whether some block's routed experts take LoRA adapters (mtjax.lora.EXPERTS): its
    feed-forward module has `add_expert_adapters`."""
    plain = dataclasses.replace(cfg, lora=None)
    return any(hasattr(node, "add_expert_adapters") for spec in cfg.block_specs
               for _, node in nnx.iter_graph(nnx.eval_shape(lambda spec=spec: Block(plain, spec, _AnyDraws()))))


def linear_names(cfg: ModelConfig, experts: bool = False) -> set[str]:
    """The module names of the blocks' linear layers LoRA may adapt (mtjax.lora.check);
    `experts`: those of the routed experts' linear layers instead, which it adapts only
    as a whole (mtjax.lora.EXPERTS)."""
    plain, anything = dataclasses.replace(cfg, lora=None), lora.LoraConfig(rank=1)
    names = set()
    for spec in cfg.block_specs:
        block = nnx.eval_shape(lambda spec=spec: Block(plain, spec, _AnyDraws()))
        names |= {str(path[-1]) for path, node in nnx.iter_graph(block) if isinstance(node, Dense)
                  and (lora.EXPERTS in map(str, path) if experts else anything.targets(path))}
    return names


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


def _module_factory(cfg: ModelConfig, part: str | LayerSpec):
    """The module of a part: "embed", "head", or a block of a LayerSpec (with its LoRA
    adapters where the config has them, drawn after the block's own weights)."""
    if isinstance(part, LayerSpec):
        return lambda rngs: _with_adapters(cfg, Block(cfg, part, rngs), rngs)
    return {"embed": lambda rngs: Embed(cfg, rngs), "head": lambda rngs: Head(cfg, rngs)}[part]


@functools.lru_cache(maxsize=None)
def _skeleton(cfg: ModelConfig, part: str | LayerSpec):
    """(graphdef, abstract state) of one part; built once, without allocating."""
    module = nnx.eval_shape(lambda: _module_factory(cfg, part)(_AnyDraws()))
    return nnx.split(module)


def _merge(cfg: ModelConfig, part: str | LayerSpec, params: dict):
    graphdef, state = _skeleton(cfg, part)
    state = jax.tree.map(lambda x: x, state)  # a fresh copy to fill in
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _abstract(cfg: ModelConfig, part: str | LayerSpec) -> dict:
    return nnx.to_pure_dict(_skeleton(cfg, part)[1])


def abstract_part(cfg: ModelConfig, part: str | LayerSpec) -> dict:
    """One part's parameters ("embed", "head", or a block by its LayerSpec) as a pytree of
    float32 ShapeDtypeStructs: a part's alone, without building the whole model's."""
    return _abstract(cfg, part)


def abstract_block(cfg: ModelConfig, spec: LayerSpec | None = None) -> dict:
    """One block's parameters as a pytree of float32 ShapeDtypeStructs (default: the first layer's)."""
    return _abstract(cfg, cfg.layer_specs[0] if spec is None else spec)


def abstract_params(cfg: ModelConfig) -> Params:
    """The whole model's parameters as ShapeDtypeStructs (no allocation), to read, not to
    fill in: blocks of one spec share one tree (map over it for a tree of your own)."""
    specs = {spec: abstract_block(cfg, spec) for spec in cfg.block_specs}  # once a spec, not once a block
    return {
        "embed": _abstract(cfg, "embed"),
        "blocks": [specs[spec] for spec in cfg.layer_specs],
        "head": _abstract(cfg, "head"),
    }


def num_params(cfg: ModelConfig) -> int:
    """How many parameters the model has (tied embeddings counted once; buffers, such as
    DeepSeek-V3's routing bias, are not parameters: mtjax.roles)."""
    abstract = abstract_params(cfg)

    def count(part: dict) -> int:
        return sum(math.prod(x.shape) for n, x in treepath.flatten(part).items() if not roles.is_buffer(n))

    return count(abstract["embed"]) + count(abstract["head"]) + sum(count(b) for b in abstract["blocks"])


def inactive_params(cfg: ModelConfig, spec: LayerSpec) -> int:
    """Parameters of a block of `spec` that one token does not use: the experts beyond its
    k (0 for a dense block). FLOPs and MFU count a block's parameters minus these."""
    return registry.feed_forward(spec).inactive_params(cfg, spec)


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: `num_params` less every layer's `inactive_params`."""
    return num_params(cfg) - sum(inactive_params(cfg, spec) for spec in cfg.layer_specs)


def init_part(cfg: ModelConfig, part: str | LayerSpec, rngs: nnx.Rngs) -> dict:
    """Fresh float32 parameters of one part, "embed", "head" or a block of a LayerSpec,
    drawn from `rngs` (`init_params` draws the embedding's, each block's, the head's)."""
    return nnx.to_pure_dict(nnx.state(_module_factory(cfg, part)(rngs)))


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Freshly initialised float32 parameters (normal(initializer_range), unit norms)."""
    rngs = nnx.Rngs(seed)
    embed = init_part(cfg, "embed", rngs)
    blocks = [init_part(cfg, spec, rngs) for spec in cfg.layer_specs]
    return {"embed": embed, "blocks": blocks, "head": init_part(cfg, "head", rngs)}


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


def block_forward_stats(cfg: ModelConfig, spec: LayerSpec, block: dict, x: jnp.ndarray, segments=None,
                        dropout_key=None):
    """One block as a pure function: (block params, hidden [b, t, d]) -> (hidden [b, t, d],
    router statistics: {} for a dense block, mtjax.moe.router_stats for a MoE block).

    `segments` [b, t] (document ids of packed rows, mtjax.batch): positions restart at each
    document and attention stays inside it; None: each row is one document.
    `dropout_key`: a training step's key of this block (mtjax.lora.dropout_key) for
    dropout on its adapters' input; None: none.
    """
    cos, sin, positions = block_rotary(cfg, spec, x, segments)
    with lora.dropout_scope(dropout_key):
        return block_module(cfg, spec, cast(block, x.dtype))(x, cos, sin, positions, segments)


def block_module(cfg: ModelConfig, spec: LayerSpec, block: dict) -> Block:
    """The Block module holding `block`'s parameters (to call its pieces one by one)."""
    return _merge(cfg, spec, block)


def block_rotary(cfg: ModelConfig, spec: LayerSpec, x: jnp.ndarray, segments=None):
    """(cos, sin, positions [b, t]) of a block's rotary embedding at the positions of hidden
    states x [b, t, d] (each token's position in its document)."""
    positions = positions_for(x[..., 0]) if segments is None else documents.positions(segments)
    cos, sin = rope.cos_sin(rope.for_layer(cfg, spec), positions, x.dtype)
    return cos, sin, positions


def block_forward(cfg: ModelConfig, spec: LayerSpec, block: dict, x: jnp.ndarray, segments=None) -> jnp.ndarray:
    """`block_forward_stats` without the router statistics."""
    return block_forward_stats(cfg, spec, block, x, segments)[0]


def head_kernel(cfg: ModelConfig, head: dict, embed: dict | None):
    """The LM head kernel [d, vocab]: the embedding's transpose when tied."""
    if cfg.tie_word_embeddings:
        return embed["embedding"].T
    return head["lm_head"]["kernel"]


def head_forward(cfg: ModelConfig, head: dict, embed: dict | None, x: jnp.ndarray) -> jnp.ndarray:
    """Final norm and LM head: hidden [b, t, d] -> fp32 logits [b, t, vocab] (soft-capped
    by final_logit_softcapping where set).

    Flattened b * t: never called on rows split over devices (`cfg.splits_rows`,
    where this would gather every row onto every device; mtjax.loss.head_loss orders split
    tokens token-major). Only the streaming engine compiles with that config, and only its
    blocks and head_loss; the reference engine refuses stream.split, and sampling
    (mtjax.stream.sample, mtjax.generate) runs on one device with the store's or the
    caller's config, whose sequence_devices the config files cannot set."""
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
        policies = jax.checkpoint_policies
        keep = policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                                policies.save_only_these_names(LOW_DOT))
        return jax.checkpoint(fn, policy=keep)
    raise ValueError(f"remat policy must be one of {REMAT_POLICIES}, got {policy!r}")


def hidden_stats(cfg: ModelConfig, params: Params, tokens: jnp.ndarray, remat: bool | str = False,
                 segments=None, dropout=None):
    """(the last block's output [b, t, d], router statistics of each MoE layer in order):
    the model up to its head (the loss takes it from there: mtjax.loss.head_loss).
    `remat`: a REMAT_POLICIES name (True = "full"); `segments`: document ids of packed rows
    (see `block_forward_stats`). `dropout(i)`: block i's dropout key in a training step
    (mtjax.lora.dropout_key); None: no dropout."""
    policy = {True: "full", False: "none"}.get(remat, remat)
    x, stats = embed_forward(cfg, params["embed"], tokens), []
    for i, (spec, block) in enumerate(zip(cfg.layer_specs, params["blocks"])):
        fn = functools.partial(block_forward_stats, cfg, spec, dropout_key=None if dropout is None else dropout(i))
        x, s = remat_block(fn, policy)(block, x, segments)
        stats += [s] if s else []
    return x, stats


def forward_stats(cfg: ModelConfig, params: Params, tokens: jnp.ndarray, remat: bool | str = False,
                  segments=None):
    """(whole-model logits fp32 [b, t, vocab], router statistics of each MoE layer in order):
    `hidden_stats` and the head."""
    x, stats = hidden_stats(cfg, params, tokens, remat, segments)
    return head_forward(cfg, params["head"], params["embed"], x), stats


def forward(cfg: ModelConfig, params: Params, tokens: jnp.ndarray, remat: bool | str = False,
            segments=None) -> jnp.ndarray:
    """Whole-model logits, fp32 [b, t, vocab]: `forward_stats` without the router statistics."""
    return forward_stats(cfg, params, tokens, remat, segments)[0]


def block_forward_cached(cfg: ModelConfig, spec: LayerSpec, block: dict, x: jnp.ndarray, state: dict, start):
    """`block_forward` for sampling: new tokens x [b, t, d] at positions start .. start+t-1,
    the mixer keeping in `state` what later tokens need of earlier ones (its registry
    entry's decode_state, e.g. softmax attention's keys and values), so each token's part
    of it is computed once. The block's sequence is `Block.sequence`, the mixer's `decode`
    in its place.

    Returns (hidden [b, t, d], the state with this call's tokens in).
    """
    m = block_module(cfg, spec, cast(block, x.dtype))
    positions = (start + jnp.arange(x.shape[1], dtype=jnp.int32))[None]  # [1, t]
    cos, sin = rope.cos_sin(rope.for_layer(cfg, spec), positions, x.dtype)
    out, _, state = m.sequence(x, lambda h: m.self_attn.decode(h, state, start, cos, sin, positions))
    return out, state


# --- a MoE block split at its feed-forward's split point (mtjax.expert_groups) ---------
# The stages of `Block.sequence`, run part by part over the flat leaves ({"mlp.gate.kernel":
# array, ...}) a part stages; a stage reads only its own leaves.

OUTPUT_NORM = "post_feedforward_layernorm."  # the output stage's leaves (sandwich norms only)


def output_leaves(cfg: ModelConfig, spec: LayerSpec) -> tuple[str, ...]:
    """The flat leaves the output stage reads: the sandwich norm's weight, or none."""
    return tuple(n for n in treepath.flatten(abstract_block(cfg, spec)) if n.startswith(OUTPUT_NORM))


def _partial_module(cfg: ModelConfig, spec: LayerSpec, leaves: dict, dtype) -> Block:
    """The block module holding the flat `leaves` in `dtype`; the others, which the stage
    called on it never reads, empty."""
    template = abstract_block(cfg, spec)
    full = {n: leaves[n].astype(dtype) if n in leaves else jnp.zeros((0,), dtype) for n in treepath.flatten(template)}
    return block_module(cfg, spec, treepath.unflatten(template, full))


def block_until_split(cfg: ModelConfig, spec: LayerSpec, leaves: dict, x, segments=None):
    """The block up to its feed-forward's split point: (a [b, t, d], h [T, d], the
    feed-forward's `before_experts(h)`): the mixer stage (attention residual a, the
    feed-forward's input h as rows), then routing and the shared expert."""
    m = _partial_module(cfg, spec, leaves, x.dtype)
    cos, sin, positions = block_rotary(cfg, spec, x, segments)
    a, h, _ = m.mixer_stage(x, lambda n: (m.self_attn(n, cos, sin, positions, segments), None))
    h = h.reshape(-1, x.shape[-1])
    return a, h, m.mlp.before_experts(h)


def block_experts(cfg: ModelConfig, spec: LayerSpec, kernels: dict, h, weights, chosen, ids):
    """The feed-forward's experts stage over the rows h [T, d] for a group of experts:
    `kernels` ({leaf in the expert, e.g. "gate_proj.kernel": stacked [n, ...]}) of global
    expert ids `ids` [n]."""
    return _partial_module(cfg, spec, {}, h.dtype).mlp.routed(h, weights, chosen, kernels, ids)


def block_combine(cfg: ModelConfig, spec: LayerSpec, leaves: dict, a, experts_out, shared):
    """(block output, z): the feed-forward's output z [T, d] from its experts' summed
    output and its shared expert's, then the output stage over a and z (`leaves`: at
    least `output_leaves`)."""
    m = _partial_module(cfg, spec, leaves, a.dtype)
    z = m.mlp.after_experts(experts_out, shared)
    return m.output_stage(a, z), z


def block_output(cfg: ModelConfig, spec: LayerSpec, leaves: dict, a, z):
    """The output stage: a + the feed-forward's output z (normed first with sandwich norms)."""
    return _partial_module(cfg, spec, leaves, a.dtype).output_stage(a, z)
