"""Mixture-of-experts mechanics: top-k routing, dropless expert dispatch, the load-balancing loss.

Routing is transformers': a softmax in fp32 over all experts, then the top k, their
weights renormalised to sum to 1 where the config says (`norm_topk_prob`); Llama 4's
router instead keeps the top k logits, whose sigmoids scale the experts' inputs
(`route_sigmoid`, `input_scaled_experts`). Dispatch is
dropless and exact: every token reaches its k experts. The (token, expert) assignments
are sorted by expert so that each expert's tokens are contiguous, and
`jax.lax.ragged_dot` multiplies each group by its expert's kernel: the work is that of
k experts per token (active parameters), whatever the number of experts.

The load-balancing loss (transformers' `load_balancing_loss_func`, Switch Transformer)
over the L MoE layers of one forward over N token rows is

    aux = E * sum_e (C_e / (L N)) * (P_e / (L N)),   C = sum_l c_l,  P = sum_l p_l,

with c_l[e] the number of the layer's top-k picks of expert e (no gradient) and p_l[e]
the layer's router probabilities summed over tokens. It is not a sum of per-layer terms,
but d aux / d p_l = E C / (L N)^2 is the same vector for every layer, and known once the
forward has counted C: a streamed backward feeds it to each MoE block as the cotangent
of p_l (`aux_loss_and_cotangent`), so every router gets its exact gradient block by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits: jnp.ndarray, k: int, normalize: bool):
    """Router logits [T, E] -> (kept weights [T, k] fp32, chosen experts [T, k] int32,
    probabilities [T, E] fp32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, chosen, probs


def _grouped(x, kernels, sizes):
    """Rows of x [n, i], grouped by expert (`sizes` [E] rows each), times their expert's
    kernel [E, i, o], accumulated in fp32."""
    y = jax.lax.ragged_dot(x, kernels.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def experts_forward(x, weights, chosen, gate, up, down, ids=None):
    """sum over k of weight * SwiGLU expert(x) over the experts given: x [T, d], weights
    and chosen (global expert ids) [T, k], gate and up [n, d, f], down [n, f, d] -> [T, d].

    `ids` [n] (int) names the global expert of each kernel, for a group of the experts
    (an expert group streamed on its own): assignments to experts outside it add nothing.
    None: the kernels are all E experts, in order.
    """
    t, k = chosen.shape
    n = gate.shape[0]
    member = None
    if ids is not None:  # global ids -> positions in the group; n (sorted last) for experts outside it
        match = chosen[..., None] == jnp.asarray(ids, chosen.dtype)  # [T, k, n]
        member = jnp.any(match, axis=-1)
        chosen = jnp.where(member, jnp.argmax(match, axis=-1).astype(chosen.dtype), n)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
    sizes = jnp.bincount(flat, length=n).astype(jnp.int32)  # outsiders beyond every group: no expert's rows
    rows = x[order // k]
    h = jax.nn.silu(_grouped(rows, gate, sizes)) * _grouped(rows, up, sizes)
    y = _grouped(h, down, sizes)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))  # the inverse permutation
    y = y[back].reshape(t, k, -1).astype(jnp.float32) * weights[..., None]
    if member is not None:
        y = jnp.where(member[..., None], y, 0.0)
    return jnp.sum(y, axis=1).astype(x.dtype)


def router_stats(probs, chosen) -> dict:
    """One MoE layer's share of the load-balancing loss: {"probs": probabilities summed
    over tokens [E], "counts": top-k picks per expert [E] (no gradient)}, both fp32."""
    counts = jnp.zeros(probs.shape[-1], jnp.float32).at[chosen.reshape(-1)].add(1.0)
    return {"probs": jnp.sum(probs, axis=0), "counts": jax.lax.stop_gradient(counts)}


def aux_loss(stats: list[dict], rows: int) -> jnp.ndarray:
    """The load-balancing loss of one forward over `rows` tokens from its MoE layers' stats."""
    return aux_loss_and_cotangent(stats, rows)[0]


def aux_loss_and_cotangent(stats: list[dict], rows: int):
    """(aux loss, d aux / d probs of each layer's stats [E]: one vector, the same for all)."""
    num_experts = stats[0]["counts"].shape[-1]
    total = rows * len(stats)
    counts = sum(s["counts"] for s in stats)
    probs = sum(s["probs"] for s in stats)
    scale = num_experts / (total * total)
    return scale * jnp.sum(counts * probs), jax.lax.stop_gradient(scale * counts)


def route_sigmoid(logits: jnp.ndarray, k: int):
    """Llama 4's router: the top k of the logits [T, E], each kept one's sigmoid its weight
    (fp32 [T, k]; the others weigh 0), with the chosen experts [T, k] and, for the router
    statistics, the softmax probabilities [T, E] as `route` gives them."""
    top, chosen = jax.lax.top_k(logits, k)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return jax.nn.sigmoid(top.astype(jnp.float32)), chosen, probs


def input_scaled_experts(x, weights, chosen, gate, up, down, ids=None):
    """sum over k of SwiGLU expert(weight * x) (Llama 4: the router weight scales the
    expert's input, not its output): each (token, pick) assignment one row of
    `experts_forward` with weight 1 (`ids`: as there)."""
    t, k = chosen.shape
    rows = (jnp.repeat(x, k, axis=0).astype(jnp.float32) * weights.reshape(-1, 1)).astype(x.dtype)
    y = experts_forward(rows, jnp.ones((t * k, 1), jnp.float32), chosen.reshape(-1, 1), gate, up, down, ids)
    return jnp.sum(y.reshape(t, k, -1).astype(jnp.float32), axis=1).astype(x.dtype)
