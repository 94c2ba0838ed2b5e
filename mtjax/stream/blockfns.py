"""The compiled per-layer-spec functions of the step: compiled once, weights as arguments.

Every block of one LayerSpec shares one compiled forward, one recompute (forward that keeps
the vjp residuals) and one backward; the embedding and the LM head have their own.
The vjp residuals come back from the recompute as a pytree (`jax.vjp`'s function is
one), so a recompute group can hold k blocks' residuals and walk them in reverse.

A block's functions return (hidden, router statistics) and its backward takes the
cotangents of both: the statistics are {} for a dense block; for a MoE block their
cotangent carries the load-balancing loss's gradient (mtjax.moe, `aux`).
Block functions take the micro-batch's document ids last (`segments`, None for plain
rows: the same programs as without them); the head takes its counted targets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtjax import model, moe, parts, treepath
from mtjax.loss import head_loss
from mtjax.layers.spec import LayerSpec
from mtjax.model_config import ModelConfig
from mtjax.partid import EMBED, HEAD


@functools.lru_cache(maxsize=8)
def block_fns(cfg: ModelConfig) -> "BlockFns":
    """The compiled functions of a model config, shared by every engine of that config."""
    return BlockFns(cfg)


class BlockFns:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.embed_forward = jax.jit(functools.partial(_embed, cfg))
        self.forward = {k: jax.jit(functools.partial(_block, cfg, k)) for k in cfg.block_specs}
        # The backward programs take `trained` (static): the names of the part's trained
        # leaves, the only ones the vjp is taken against (None: every leaf).
        self.recompute = {k: jax.jit(functools.partial(_recompute, cfg, k), static_argnames="trained")
                          for k in cfg.block_specs}
        self.grad = {k: jax.jit(functools.partial(_grad, cfg, k), static_argnames="trained") for k in cfg.block_specs}
        self.backward = jax.jit(_backward)
        # The forward of a saved group's block: (output, vjp) under a remat policy, the
        # vjp kept for the backward (no recompute beyond what the policy drops).
        self.save = {policy: {k: jax.jit(functools.partial(_save, cfg, k, policy), static_argnames="trained")
                              for k in cfg.block_specs}
                     for policy in ("dots", "none")}
        self.saved_backward = jax.jit(_saved_backward, static_argnames="names")
        self.head = jax.jit(functools.partial(_head, cfg), static_argnames=("trained", "embed_trained"))
        self.head_loss = jax.jit(functools.partial(_head_loss, cfg))
        self.embed_backward = jax.jit(functools.partial(_embed_backward, cfg))
        self.aux = jax.jit(functools.partial(_aux, cfg))
        # A part's gradient summed over micro-batches on the device, in fp32 (in place).
        self.grad_to_f32 = jax.jit(_to_f32)
        self.grad_add = jax.jit(_add_f32, donate_argnums=0)


def _to_f32(grads):
    return jax.tree.map(lambda g: g.astype(jnp.float32), grads)


def _add_f32(acc, grads):
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


def _flat_forward(cfg: ModelConfig, spec: LayerSpec):
    """block_forward_stats over the flat {leaf name: array} dicts that the stream moves
    (a quantized frozen kernel's bytes decoded here, on the device: parts.block_tree)."""

    def fn(flat, x, segments=None, dropout_key=None):
        return model.block_forward_stats(cfg, spec, parts.block_tree(cfg, spec, flat), x, segments, dropout_key)

    return fn


def _embed(cfg: ModelConfig, w: dict, tokens):
    """Token ids [b, t] -> hidden [b, t, d]."""
    return model.embed_forward(cfg, treepath.unflatten(parts.abstract_part(cfg, EMBED), w), tokens)


def _block(cfg: ModelConfig, spec: LayerSpec, w: dict, x, segments=None, dropout_key=None):
    """hidden [b, t, d] -> (hidden [b, t, d], router stats): the first forward, nothing kept.
    `dropout_key` (every block program takes it): the adapters' dropout (mtjax.lora)."""
    with jax.named_scope(f"block_{spec.label}"):
        return _flat_forward(cfg, spec)(w, x, segments, dropout_key)


def against(w: dict, trained: tuple[str, ...] | None):
    """(the trained leaves of flat weights `w`, the others): a vjp is taken against the
    first and closes over the second (mtjax.roles; `trained` None: every leaf)."""
    if trained is None:
        return w, {}
    return {n: w[n] for n in trained}, {n: a for n, a in w.items() if n not in trained}


def _vjp(fn, w: dict, x, segments, trained, dropout_key=None):
    """jax.vjp of block function `fn` against `w`'s trained leaves and `x`."""
    mine, fixed = against(w, trained)
    return jax.vjp(lambda t, x: fn({**fixed, **t}, x, segments, dropout_key), mine, x)


def _recompute(cfg: ModelConfig, spec: LayerSpec, w: dict, x, segments=None, dropout_key=None, trained=None):
    """The second forward: ((hidden, router stats), vjp) where vjp((dy, dstats)) -> (dw, dx),
    dw of the `trained` leaves."""
    with jax.named_scope(f"recompute_{spec.label}"):
        return _vjp(_flat_forward(cfg, spec), w, x, segments, trained, dropout_key)


# A saved vjp's structure (its weight leaves taken out) -> for each of its leaves, the
# name of the weight it is, or None: filled when `_save` is traced, read by `weights_in`.
_WEIGHT_LEAVES: dict = {}


def _is_none(a) -> bool:
    return a is None


def _save(cfg: ModelConfig, spec: LayerSpec, policy: str, w: dict, x, segments=None, dropout_key=None, trained=None):
    """The one forward of a block whose vjp is kept: ((hidden, router stats), vjp) keeping
    what `policy` (model.REMAT_POLICIES) saves; `saved_backward(vjp, w, (dy, dstats),
    weights_in(vjp))` -> (dw, dx).

    The vjp's residuals include the block's weights themselves, and a program's outputs
    are buffers of its own: returned with it, every weight was copied once per step (4
    bytes/param written and read back; the reference's one program keeps them in place).
    So they leave as None, and the backward takes the weights again."""
    with jax.named_scope(f"save_{spec.label}"):
        out, vjp = _vjp(model.remat_block(_flat_forward(cfg, spec), policy), w, x, segments, trained, dropout_key)
    names = {id(a): n for n, a in w.items()}
    leaves, tree = jax.tree.flatten(vjp)
    which = tuple(names.get(id(a)) for a in leaves)
    vjp = jax.tree.unflatten(tree, [None if n is not None else a for a, n in zip(leaves, which)])
    _WEIGHT_LEAVES[jax.tree.structure(vjp, is_leaf=_is_none)] = which
    return out, vjp


def weights_in(vjp) -> tuple:
    """Which of a saved vjp's leaves are the block's weights (`_save`): `saved_backward`'s `names`."""
    return _WEIGHT_LEAVES[jax.tree.structure(vjp, is_leaf=_is_none)]


def _saved_backward(vjp, w: dict, dy, names: tuple):
    """A saved vjp (`_save`) with the block's weights `w` put back, applied to `dy`."""
    leaves, tree = jax.tree.flatten(vjp, is_leaf=_is_none)
    return jax.tree.unflatten(tree, [a if n is None else w[n] for a, n in zip(leaves, names)])(dy)


def _backward(vjp, dy):
    return vjp(dy)


def _grad(cfg: ModelConfig, spec: LayerSpec, w: dict, x, dy, dstats, segments=None, dropout_key=None, trained=None):
    """Recompute and backward of one block in one program (a recompute group of 1)."""
    _, vjp = _vjp(_flat_forward(cfg, spec), w, x, segments, trained, dropout_key)
    return vjp((dy, dstats))


def _aux(cfg: ModelConfig, stats: list, tokens, weight):
    """One micro-batch's load-balancing loss from its MoE layers' forward stats, and the
    cotangent of every MoE block's stats: d(weight * coef * aux) / d(probs), the same for
    all layers (mtjax.moe); counts carry no gradient."""
    aux, dprobs = moe.aux_loss_and_cotangent(stats, tokens.size)
    dprobs = dprobs * (weight * cfg.router_aux_loss_coef)
    return aux, {"probs": dprobs, "counts": jnp.zeros_like(dprobs)}


def _head_trees(cfg: ModelConfig, head: dict, embed: dict | None):
    head_t = treepath.unflatten(parts.abstract_part(cfg, HEAD), head)
    embed_t = treepath.unflatten(parts.abstract_part(cfg, EMBED), embed) if embed is not None else None
    return head_t, embed_t


def _head_loss(cfg: ModelConfig, head: dict, embed: dict | None, x, tokens, targets=None):
    """Loss of one micro-batch, for evaluation."""
    head_t, embed_t = _head_trees(cfg, head, embed)
    return head_loss(cfg, head_t, embed_t, x, tokens, targets)


def _head(cfg: ModelConfig, head: dict, embed: dict | None, x, tokens, weight, targets=None, trained=None,
          embed_trained=None):
    """Loss of one micro-batch and its gradients: (loss, dhead, dembed | None, dx).

    `weight` (the micro-batch's share of the step's counted targets, mtjax.documents;
    1 / micro-batches for plain batches) scales the gradients, so their sum over
    micro-batches is the gradient of the step's mean. With tied embeddings the head
    kernel is the embedding's transpose. `trained`, `embed_trained`: the leaves of each
    the vjp is taken against (None: every leaf).
    """
    head_mine, head_fixed = against(head, trained)
    embed_mine, embed_fixed = against(embed, embed_trained) if embed is not None else (None, {})

    def loss_fn(h, e, x):
        head_t, embed_t = _head_trees(cfg, {**head_fixed, **h}, None if e is None else {**embed_fixed, **e})
        return head_loss(cfg, head_t, embed_t, x, tokens, targets)

    with jax.named_scope("head"):
        loss, vjp = jax.vjp(loss_fn, head_mine, embed_mine, x)
        dh, de, dx = vjp(jnp.asarray(weight, loss.dtype))
    return loss, dh, de, dx


def _embed_backward(cfg: ModelConfig, tokens, dx):
    """d(loss)/d(embedding) of the lookup (times its scale, Gemma's): rows of dx summed per
    token id, fp32."""
    table = jnp.zeros((cfg.vocab_size, cfg.hidden_size), jnp.float32)
    scale = model.embed_multiplier(cfg).astype(jnp.float32)
    return {"embedding": table.at[tokens].add(dx.astype(jnp.float32) * scale)}
