"""Mixture-of-experts mechanics: top-k routing, dropless expert dispatch, the load-balancing loss.

Routing is transformers': a softmax in fp32 over all experts, then the top k, their
weights renormalised to sum to 1 where the config says (`norm_topk_prob`); Llama 4's
router instead keeps the top k logits, whose sigmoids scale the experts' inputs
(`route_sigmoid`, `input_scaled_experts`). Dispatch is
dropless and exact: every token reaches its k experts. The (token, expert) assignments
are sorted by expert so that each expert's tokens are contiguous, and each group goes
through its expert's kernels by one of two grouped matmuls, chosen per backend in one
place (`dispatch`):

- "ragged" (GPU, TPU): `jax.lax.ragged_dot`, which XLA lowers there to a grouped kernel.
  On the CPU it lowers to a dense masked dot over every expert, so its cost grows with E.
- "blocked" (CPU): each expert's group padded to whole blocks of B rows (at most
  (N + E (B - 1)) / B blocks for N = T k assignments, a static bound), and a loop over the
  blocks runs each block's SwiGLU with its expert's kernels sliced out (`blocked_swiglu`).
  The work is the N rows plus at most E (B - 1) padding rows, and each block's kernel
  slicing; `block_rows` picks B (8 to 128) to minimise the two, and `dispatch_rows` says
  what they cost in rows, for the planner (`backward_transient_bytes` what its backward holds).
  Memory: the padded rows [blocks * B, d], the gate and up projections [blocks * B, f]
  kept for the backward (as autodiff of ragged_dot keeps them), one expert's kernels at a
  time, and the kernels' fp32 gradient sums; never a kernel per block, which a batched
  matmul over gathered kernels would hold (blocks x d x f, several times the experts'
  own size when E is large). Its backward is written out (`jax.custom_vjp`) because
  autodiff of the loop would keep each iteration's kernel slices.

Either way the work is that of k experts per token (active parameters), whatever E.

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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import target


def route(logits: jnp.ndarray, k: int, normalize: bool):
    """Router logits [T, E] -> (kept weights [T, k] fp32, chosen experts [T, k] int32,
    probabilities [T, E] fp32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, chosen, probs


BLOCK_ROWS = (8, 16, 32, 64, 128)  # the block sizes `block_rows` chooses from
# What one block costs beyond its rows' matmuls, in rows: slicing its expert's three kernels
# out (forward and backward) and adding into their fp32 gradient sums took, on a 2-core
# CPU, as long as ~16 more rows of the block's forward and backward (measured at d = f = 512).
BLOCK_COST_ROWS = 16


def dispatch(backend: str) -> str:
    """Which grouped matmul `experts_forward` uses on `backend` (a platform as
    `mtjax.target.platform` names the one a program is traced for): "ragged" (`jax.lax.ragged_dot`) where XLA has a grouped kernel for it (GPU,
    TPU), "blocked" (`blocked_swiglu`) on the CPU, whose ragged_dot is a dense masked dot over
    every expert. A pure function of the platform, so that the choice is tested anywhere."""
    return "blocked" if backend == "cpu" else "ragged"


def block_rows(assignments: int, num_experts: int) -> int:
    """Rows per block of `blocked_swiglu` for `assignments` (token, expert) pairs over
    `num_experts`: the size in BLOCK_ROWS whose static bound of blocks costs least, each
    block its rows plus BLOCK_COST_ROWS. Small blocks waste less on padding every expert's
    group to whole blocks, large ones less on slicing kernels."""
    return min(BLOCK_ROWS, key=lambda b: num_blocks(assignments, num_experts, b) * (b + BLOCK_COST_ROWS))


def num_blocks(assignments: int, num_experts: int, rows: int) -> int:
    """A static bound on the blocks that groups of `assignments` rows over `num_experts`,
    each padded to a multiple of `rows`, occupy: sum_e ceil(n_e / rows) <= (N + E (rows - 1)) / rows."""
    return (assignments + num_experts * (rows - 1)) // rows


def dispatch_rows(assignments: int, num_experts: int, which: str) -> int:
    """Rows of matmul work each expert projection costs for `assignments` (token, expert)
    pairs, what the planner prices: the pairs themselves for "ragged"; for "blocked", every
    block of the static bound, its padding included, plus BLOCK_COST_ROWS a block for
    slicing its kernels (time the device spends, though not on FLOPs)."""
    if which == "ragged":
        return assignments
    rows = block_rows(assignments, num_experts)
    return num_blocks(assignments, num_experts, rows) * (rows + BLOCK_COST_ROWS)


def backward_transient_bytes(assignments: int, num_experts: int, hidden: int, intermediate: int, itemsize: int,
                             which: str, total: int | None = None, adapted: bool = False) -> int:
    """Bytes the experts' backward (`experts_forward` over `num_experts` kernels, `total`
    in the layer, default the same) holds beyond its vjp residuals, for the planner, from
    the shapes the dispatch builds (checked against XLA's buffer assignment in
    tests/test_working_memory.py):

    - the cotangents of the `assignments` rows (fp32 where the outputs are weighted,
      compute dtype where the rows were gathered);
    - "blocked" (the CPU): those of its padded rows (dy and dx [blocks * rows, d]) and the
      three fp32 [E, ...] gradient sums its backward adds each block into; with a compute
      dtype narrower than fp32, XLA's CPU backend runs the blocks' matmuls and the rows'
      scatter in fp32, holding fp32 copies of the stacked kernels and of the padded rows;
    - `adapted` (LoRA on the experts, mtjax.lora.expert_kernels): the cotangent of the
      gate and up deltas, concatenated as their factors [E, d, 2f] take it, in the compute
      dtype; and the adapted kernels' cotangent [E, ...], which flows on to the factors
      instead of leaving the program: ragged_dot's, in the compute dtype (without adapters
      its kernel gradients are the backward's outputs, the gradient in flight, priced as
      such), the blocked form's fp32 sums cast to a narrower compute dtype. The deltas
      A_e B_e die in the forward once added; the adapted kernels are residuals (traced).

    Measured on the CPU (the experts' program alone, fp32 and bf16, 8 and 32 experts of 64
    and 128, 256 and 1024 tokens, adapted or not): XLA's temporaries beyond the residuals
    are 0.72-1.12x this, the program's whole temporaries 0.79-1.07x residuals plus this."""
    rows_ct = assignments * hidden * (4 + itemsize)
    kernels = 3 * num_experts * hidden * intermediate  # elements of the stacked gate, up and down
    concatenated = 2 * num_experts * hidden * intermediate * itemsize if adapted else 0
    cotangent = kernels * itemsize if adapted else 0
    if which == "ragged":
        return rows_ct + concatenated + cotangent
    b = block_rows(assignments, total or num_experts)
    padded = num_blocks(assignments, num_experts, b) * b
    out = rows_ct + 2 * padded * hidden * itemsize + kernels * 4 + concatenated
    if itemsize < 4:  # fp32 copies of the kernels and the padded rows; the sums cast back
        out += kernels * 4 + padded * hidden * 4 + cotangent
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def blocked_swiglu(x, gate, up, down, owner, unroll: bool = False):
    """SwiGLU experts over rows in blocks: x [n_blocks * rows, d], block b through expert
    owner[b] (gate and up [E, d, f], down [E, f, d]) -> [n_blocks * rows, d], the matmuls
    accumulated in fp32.

    A loop over the blocks that slices one expert's kernels at a time: the work is the
    blocks' rows (the routed tokens plus padding), whatever E, and the memory one expert's
    kernels beside the rows. The backward is written out because autodiff of the loop
    would keep every iteration's kernel slices (n_blocks experts' worth) as residuals; it
    keeps the gate and up projections [n_blocks * rows, f] (what autodiff of ragged_dot
    keeps), slices the kernels again, and sums each expert's kernel gradients into one
    [E, ...] fp32 buffer per kernel.

    `unroll`: the loops unrolled. XLA's cost analysis counts a loop body once, so a FLOPs
    count of the dispatch needs them unrolled; running, the loop is as fast."""
    return _blocked_forward(x, gate, up, down, owner, unroll)[0]


def _blocks(a, n: int):
    return a.reshape(n, -1, a.shape[-1])  # [n_blocks * rows, c] -> [n_blocks, rows, c]


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _blocked_forward(x, gate, up, down, owner, unroll):
    def one(_, block):
        xb, e = block
        g, u = _dot(xb, gate[e]).astype(x.dtype), _dot(xb, up[e]).astype(x.dtype)
        return None, (_dot(jax.nn.silu(g) * u, down[e]).astype(x.dtype), g, u)

    n = owner.shape[0]
    _, (y, g, u) = jax.lax.scan(one, None, (_blocks(x, n), owner), unroll=unroll or 1)
    return y.reshape(x.shape), g, u


def _blocked_fwd(x, gate, up, down, owner, unroll):
    y, g, u = _blocked_forward(x, gate, up, down, owner, unroll)
    return y, (x, g, u, gate, up, down, owner)


def _blocked_bwd(unroll, res, dy):
    x, g, u, gate, up, down, owner = res

    def one(grads, block):
        dgate, dup, ddown = grads
        xb, gb, ub, dyb, e = block
        sg = jax.nn.sigmoid(gb.astype(jnp.float32))
        act = gb * sg  # silu(g)
        dh = _dot(dyb, down[e].T)
        dg = (dh * ub * sg * (1 + gb * (1 - sg))).astype(x.dtype)  # silu'(g) = s (1 + g (1 - s))
        du = (dh * act).astype(x.dtype)
        dx = (_dot(dg, gate[e].T) + _dot(du, up[e].T)).astype(x.dtype)
        grads = (dgate.at[e].add(_dot(xb.T, dg)), dup.at[e].add(_dot(xb.T, du)),
                 ddown.at[e].add(_dot((jax.nn.silu(gb) * ub).T, dyb)))  # h as the forward made it
        return grads, dx

    n = owner.shape[0]
    zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in (gate, up, down))
    blocks = (_blocks(x, n), _blocks(g, n), _blocks(u, n), _blocks(dy, n), owner)
    grads, dx = jax.lax.scan(one, zeros, blocks, unroll=unroll or 1)
    dgate, dup, ddown = (d.astype(w.dtype) for d, w in zip(grads, (gate, up, down)))
    return dx.reshape(x.shape), dgate, dup, ddown, None  # no cotangent for the block owners


blocked_swiglu.defvjp(_blocked_fwd, _blocked_bwd)


def _swiglu_ragged(rows, sizes, gate, up, down):
    """SwiGLU of `rows` [n, d] grouped by expert (`sizes` [E] rows each) by ragged_dot."""
    def grouped(x, kernels):
        return jax.lax.ragged_dot(x, kernels, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    return grouped(jax.nn.silu(grouped(rows, gate)) * grouped(rows, up), down)


def experts_forward(x, weights, chosen, gate, up, down, ids=None, which: str | None = None,
                    total: int | None = None, unroll: bool = False):
    """sum over k of weight * SwiGLU expert(x) over the experts given: x [T, d], weights
    and chosen (global expert ids) [T, k], gate and up [n, d, f], down [n, f, d] -> [T, d].

    `ids` [n] (int) names the global expert of each kernel, for a group of the experts
    (an expert group streamed on its own): assignments to experts outside it add nothing.
    None: the kernels are all E experts, in order. `which`: the grouped matmul ("ragged" or
    "blocked"; default `dispatch` of the backend being traced for). `total`: the layer's
    expert count (default n), from which "blocked" sizes its blocks, so that a group's
    experts run in the same blocks as in the whole layer. `unroll`: "blocked"'s loops unrolled
    (`blocked_swiglu`), for a FLOPs count.
    """
    which = which or dispatch(target.platform())
    t, k = chosen.shape
    e = gate.shape[0]
    member = None
    if ids is not None:  # global ids -> positions in the group; e (sorted last) for experts outside it
        match = chosen[..., None] == jnp.asarray(ids, chosen.dtype)  # [T, k, n]
        member = jnp.any(match, axis=-1)
        chosen = jnp.where(member, jnp.argmax(match, axis=-1).astype(chosen.dtype), e)
    gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)  # outsiders beyond every group: no expert's rows
    rows = x[order // k]  # [T k, d]
    if which == "ragged":
        y = _swiglu_ragged(rows, sizes, gate, up, down)
        place = jnp.arange(t * k)  # sorted assignment j is row j
    else:
        # Each expert's group padded to whole blocks of b rows: sorted assignment j of
        # expert g goes to row (g's padded start) + (j - g's start); padding rows are zero.
        b = block_rows(t * k, total or e)
        n = num_blocks(t * k, e, b)
        padded = (sizes + b - 1) // b * b
        ends = jnp.cumsum(padded)
        start = ends - padded
        first = jnp.cumsum(sizes) - sizes
        expert = flat[order]
        inside = jnp.minimum(expert, e - 1)
        # Outsiders get a row past the end: dropped below, and masked out after the gather.
        place = jnp.where(expert < e, start[inside] + jnp.arange(t * k) - first[inside], n * b)
        owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n) * b, side="right"), e - 1).astype(jnp.int32)
        # Added into zeros (the places are distinct): the transpose of an add is a gather,
        # where that of a set scatters a u32 id per element to find which update won.
        placed = jnp.zeros((n * b, x.shape[-1]), x.dtype).at[place].add(rows, mode="drop")
        y = blocked_swiglu(placed, gate, up, down, owner, unroll)
    where = jnp.zeros_like(place).at[order].set(place)  # row of each (token, slot) assignment
    y = y[where].reshape(t, k, -1).astype(jnp.float32) * weights[..., None]
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


def input_scaled_experts(x, weights, chosen, gate, up, down, ids=None, total: int | None = None):
    """sum over k of SwiGLU expert(weight * x) (Llama 4: the router weight scales the
    expert's input, not its output): each (token, pick) assignment one row of
    `experts_forward` with weight 1 (`ids`, `total`: as there)."""
    t, k = chosen.shape
    rows = (jnp.repeat(x, k, axis=0).astype(jnp.float32) * weights.reshape(-1, 1)).astype(x.dtype)
    y = experts_forward(rows, jnp.ones((t * k, 1), jnp.float32), chosen.reshape(-1, 1), gate, up, down, ids, total=total)
    return jnp.sum(y.reshape(t, k, -1).astype(jnp.float32), axis=1).astype(x.dtype)


def route_grouped(logits: jnp.ndarray, k: int, groups: int, kept_groups: int, scale: float,
                  sigmoid: bool, normalize: bool, bias=None):
    """DeepSeek's group-limited routing of logits [T, E] over `groups` equal groups of
    experts: each token picks its k experts from its `kept_groups` best groups only.

    sigmoid (V3): scores are the logits' sigmoids; a group's score is the sum of its two
        best scores plus `bias` [E] (the correction bias, for choosing only: the weights
        are the chosen experts' scores without it), renormalised to sum to 1 with
        `normalize`.
    softmax (V2): scores are the softmax over all experts; a group's score is its best
        one; the weights are the chosen scores.
    Either way the weights are then multiplied by `scale` (routed_scaling_factor).
    Returns (weights [T, k] fp32, chosen experts [T, k], the scores [T, E] fp32 for the
    router statistics)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    t, e = choice.shape
    grouped = choice.reshape(t, groups, e // groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1) if sigmoid else jnp.max(grouped, axis=-1)
    _, best = jax.lax.top_k(group_score, kept_groups)
    kept = jnp.zeros((t, groups), bool).at[jnp.arange(t)[:, None], best].set(True)
    kept = jnp.repeat(kept, e // groups, axis=-1)
    _, chosen = jax.lax.top_k(jnp.where(kept, choice, -jnp.inf), k)
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, chosen, scores


def excess_load(stats: list[dict]) -> jnp.ndarray:
    """One MoE layer's load above the mean, times E, from its router stats over some
    micro-batches: E * C_e - sum_e C_e [E] fp32, C the summed top-k picks. Its sign is
    that of C_e - mean(C); it is an integer (exact in fp32), and linear in the counts, so
    it sums over micro-batches and processes as a gradient does."""
    counts = sum(s["counts"] for s in stats)
    return counts * counts.shape[-1] - jnp.sum(counts)


def balance_bias(bias, excess, rate: float) -> np.ndarray:
    """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step: each
    expert's correction bias [E] moves by `rate` toward balance, bias + rate *
    sign(mean load - load_e), from `excess_load` of the step. fp32, on the host."""
    bias, excess = np.asarray(bias, np.float32), np.asarray(excess, np.float32)
    return bias + np.float32(rate) * np.sign(-excess).astype(np.float32)


def route_topk_softmax(logits: jnp.ndarray, k: int):
    """gpt-oss's router: the top k of the logits [T, E] (its bias already in them), their
    softmax the weights (fp32 [T, k]), with the chosen experts [T, k] and, for the router
    statistics, the softmax over all experts [T, E] (transformers' aux loss takes that)."""
    logits = logits.astype(jnp.float32)
    top, chosen = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), chosen, jax.nn.softmax(logits, axis=-1)


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss's activation, fp32: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
    g = min(gate, limit)."""
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def clamped_experts(x, weights, chosen, gate, up, down, gate_bias, up_bias, down_bias, alpha: float, limit: float,
                    ids=None):
    """sum over k of weight * expert(x), each expert gpt-oss's: down(clamped_swiglu(gate(x)
    + gate_bias, up(x) + up_bias)) + down_bias. x [T, d], weights and chosen [T, k]; gate
    and up [n, d, f], down [n, f, d], their biases [n, f] / [n, d]; `ids` as for
    `experts_forward` (a group of the experts) -> [T, d].

    Grouped by `jax.lax.ragged_dot` on every backend (on the CPU a dense masked dot over
    the n experts: n / k times the routed work); the projections in fp32."""
    t, k = chosen.shape
    e = gate.shape[0]
    member = None
    if ids is not None:  # as experts_forward: outsiders sorted last, in no group's rows
        match = chosen[..., None] == jnp.asarray(ids, chosen.dtype)
        member = jnp.any(match, axis=-1)
        chosen = jnp.where(member, jnp.argmax(match, axis=-1).astype(chosen.dtype), e)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    expert = jnp.minimum(flat[order], e - 1)  # each sorted row's expert, for its bias (outsiders masked below)
    rows = x[order // k]  # [T k, d]

    def grouped(a, kernels, bias):
        y = jax.lax.ragged_dot(a, kernels.astype(a.dtype), sizes, preferred_element_type=jnp.float32)
        return y + bias.astype(jnp.float32)[expert]

    h = clamped_swiglu(grouped(rows, gate, gate_bias), grouped(rows, up, up_bias), alpha, limit)
    y = grouped(h.astype(x.dtype), down, down_bias)
    y = y[jnp.zeros_like(order).at[order].set(jnp.arange(t * k))]  # back to (token, slot) order
    y = y.reshape(t, k, -1) * weights[..., None]
    if member is not None:
        y = jnp.where(member[..., None], y, 0.0)
    return jnp.sum(y, axis=1).astype(x.dtype)
