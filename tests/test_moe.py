"""Mixture-of-experts: the grouped dispatch, the load-balancing loss's block-by-block
decomposition, and the streaming engine against the reference trainer on MoE models.

The torch comparisons (mtjax == transformers per MoE family, import -> export) are in
tests/test_hf_moe.py under the slow marker.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtjax.store
from mtjax import documents, model, moe
from mtjax.batch import Batch
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, StepShape, estimate
from mtjax.reference import ReferenceTrainer, loss_terms
from mtjax.stream import StreamEngine

# Qwen3-MoE-like: a dense layer between two MoE layers, 7 experts of which 2 are picked.
CFG = ModelConfig(model_type="qwen3_moe", vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=7,
                  num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False, router_aux_loss_coef=0.5,
                  moe_layers=(0, 2))
OPT = OptimConfig(lr=1e-3, clip_norm=0.05, weight_decay=0.1)
STEPS = 5


@functools.cache
def _params():
    """One initialisation shared by the tests (neither trainer changes the arrays it is given)."""
    return model.init_params(CFG, seed=1)


def _dense_experts(x, weights, chosen, gate, up, down):
    """The obvious form: every token through each of its k experts' gathered kernels."""
    g, u, d = gate[chosen], up[chosen], down[chosen]  # [T, k, ...]
    h = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, g)) * jnp.einsum("td,tkdf->tkf", x, u)
    return jnp.einsum("tk,tkd->td", weights, jnp.einsum("tkf,tkfd->tkd", h, d))


@pytest.mark.parametrize("which, t, scale", [("ragged", 9, 1.0), ("blocked", 9, 1.0), ("blocked", 37, 0.4)])
def test_grouped_dispatch_equals_the_dense_form_with_unrouted_experts(which, t, scale):
    """Both grouped matmuls; at 37 tokens the blocked form's groups are uneven and some
    span several blocks (kernels scaled as an initialisation's, 1 / sqrt(fan-in),
    so that fp32 rounding of the sums stays within the tolerances)."""
    rng = np.random.default_rng(0)
    d, f, e, k = 6, 5, 6, 2
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    gate, up = (jnp.asarray(scale * rng.normal(size=(e, d, f)), jnp.float32) for _ in range(2))
    down = jnp.asarray(scale * rng.normal(size=(e, f, d)), jnp.float32)
    # The router never picks experts 1 and 4.
    logits = jnp.asarray(rng.normal(size=(t, e)), jnp.float32).at[:, jnp.array([1, 4])].set(-30.0)
    weights, chosen, _ = moe.route(logits, k, True)
    assert not set(np.asarray(chosen).ravel()) & {1, 4}
    sizes = np.bincount(np.asarray(chosen).ravel(), minlength=e)
    b = moe.block_rows(t * k, e)
    if t > 9:  # some groups fill several blocks, and they end at different points of one
        assert sizes.max() > b and len(set(sizes[sizes > 0] % b)) > 1, (b, sizes)

    def both(fn):
        out, vjp = jax.vjp(fn, x, weights, gate, up, down)
        return out, vjp(jnp.cos(out))

    ours, dours = jax.jit(both, static_argnums=0)(lambda *a: moe.experts_forward(a[0], a[1], chosen, *a[2:], which=which))
    dense, ddense = jax.jit(both, static_argnums=0)(lambda *a: _dense_experts(a[0], a[1], chosen, *a[2:]))
    np.testing.assert_allclose(ours, dense, rtol=1e-5, atol=1e-5)
    for a, b in zip(dours, ddense):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not np.any(dours[2][np.array([1, 4])])  # unrouted experts: exactly zero gradient


def test_the_cpu_dispatches_by_blocks_and_accelerators_by_ragged_dot():
    assert moe.dispatch("cpu") == "blocked"
    assert moe.dispatch("gpu") == moe.dispatch("tpu") == "ragged"
    x, w, c = jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.zeros((4, 2), jnp.int32)
    traced = str(jax.make_jaxpr(lambda x: moe.experts_forward(x, w, c, *[jnp.ones((3, 3, 3))] * 3))(x))
    assert "scan" in traced and "ragged_dot" not in traced  # the default is the backend's (this CPU's)


def test_dispatch_flops_scale_with_the_tokens_not_the_experts(monkeypatch):
    """Compiled FLOPs of the experts' gradient (its forward included) over the same 128 tokens (k=2)
    with 4 and 16 experts: ragged_dot's grow with E (it is a dense masked dot on the CPU),
    the blocked form's by its padding alone. Unrolled: XLA counts a loop body once."""
    monkeypatch.setattr(moe, "UNROLL", True)
    rng = np.random.default_rng(2)
    t, d, f = 128, 16, 16
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)

    def flops(e, which):
        kernels = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
        weights, chosen, _ = moe.route(jnp.asarray(rng.normal(size=(t, e)), jnp.float32), 2, True)
        fn = jax.grad(lambda x, *ks: jnp.sum(moe.experts_forward(x, weights, chosen, *ks, which=which)),
                      argnums=(0, 1, 2, 3))
        cost = jax.jit(fn).lower(x, *kernels).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    few, many = flops(4, "blocked"), flops(16, "blocked")
    ragged = flops(16, "ragged") / flops(4, "ragged")
    assert many / few < 1.5 and ragged > 3, (many / few, ragged)
    expert_flops = 3 * 3 * 2 * t * 2 * d * f  # 3 projections of k = 2 rows a token, forward and 2 backward matmuls
    assert expert_flops < few < 1.5 * expert_flops, few / expert_flops


def _switch_loss(logits_per_layer, k):
    """transformers' load_balancing_loss_func, written from its definition: all layers'
    router logits concatenated, one fraction of picks and one mean probability per expert."""
    logits = jnp.concatenate(logits_per_layer)
    probs = jax.nn.softmax(logits, axis=-1)
    picks = jax.nn.one_hot(jax.lax.top_k(probs, k)[1], logits.shape[-1]).sum(1)
    return logits.shape[-1] * jnp.sum(jnp.mean(picks, 0) * jnp.mean(probs, 0))


def test_aux_loss_decomposes_by_layer_with_the_gradient_of_the_whole():
    rng = np.random.default_rng(1)
    layers = [jnp.asarray(rng.normal(size=(10, 5)), jnp.float32) for _ in range(3)]

    def per_layer_stats(ls):
        out = []
        for lg in ls:
            _, chosen, probs = moe.route(lg, 2, False)
            out.append(moe.router_stats(probs, chosen))
        return out

    whole, dwhole = jax.jit(jax.value_and_grad(lambda ls: _switch_loss(ls, 2)))(layers)
    ours = jax.jit(lambda ls: moe.aux_loss(per_layer_stats(ls), 10))(layers)
    np.testing.assert_allclose(ours, whole, rtol=1e-6)
    # The streamed form: each layer's vjp fed the one shared cotangent of its probs.
    _, shared = moe.aux_loss_and_cotangent(per_layer_stats(layers), 10)
    for lg, expected in zip(layers, dwhole):
        _, vjp = jax.vjp(lambda l: per_layer_stats([l])[0]["probs"], lg)
        np.testing.assert_allclose(vjp(shared)[0], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # a whole-model gradient's compile; the fast tier checks aux's gradient per layer above
def test_aux_loss_reaches_every_router():
    """The load-balancing loss has a gradient at every MoE layer's router (and only there
    among the MLPs: the dense layer has no router)."""
    params = _params()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16)))
    grads = jax.jit(jax.grad(lambda p: loss_terms(CFG, p, tokens, remat=False)[1]))(params)
    for i in CFG.moe_layers:
        assert np.linalg.norm(grads["blocks"][i]["mlp"]["gate"]["kernel"]) > 1e-4
    assert "gate" not in grads["blocks"][1]["mlp"]


def _batches(accum: int):
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, (accum, 2, 16), dtype=np.int32) for _ in range(STEPS)]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _packed_batches(accum: int):
    """Packed rows of 2-3 documents with trailing padding and loss masks that count different
    numbers of targets per micro-batch (so their weights in the step differ)."""
    rng, out = np.random.default_rng(3), []
    for tokens in _batches(accum)[:3]:
        cuts = np.sort(rng.integers(1, 16, (*tokens.shape[:2], 2)), axis=-1)
        segments = 1 + (np.arange(16) >= cuts[..., :1]) + (np.arange(16) >= cuts[..., 1:])
        segments[..., 13:] = 0
        mask = rng.random(tokens.shape) < np.linspace(0.3, 0.9, accum)[:, None, None]
        out.append(Batch(tokens, mask, segments.astype(np.int32)))
    return out


def _streamed_equals_reference(engine, batches):
    reference = ReferenceTrainer(CFG, _params(), OPT)
    for b in batches:
        ref, ours = reference.step(b), engine.step(b)
        np.testing.assert_allclose(ours["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(ours["aux_loss"], ref["aux_loss"], rtol=1e-5)
        np.testing.assert_allclose(ours["grad_norm"], ref["grad_norm"], rtol=1e-4)
        assert ref["grad_norm"] > OPT.clip_norm  # clipping is active
    errors = jax.tree.leaves(jax.tree.map(_rel, engine.params(), reference.params))
    errors += jax.tree.leaves(jax.tree.map(_rel, engine.opt_state(), reference.opt_state))
    assert max(errors) <= 1e-5


def test_streamed_moe_steps_equal_the_reference():
    engine = StreamEngine(CFG, _params(), OPT, StreamConfig(keep_every=1), batch_shape=(2, 16))
    try:
        _streamed_equals_reference(engine, _batches(1))
    finally:
        engine.close()


def test_packed_documents_through_a_recompute_group_and_a_saved_resident_moe_block():
    """Documents and loss masks over 2 micro-batches; blocks 0 (MoE) and 1 (dense) are one
    recompute group, block 2 (MoE) is resident and saved: its kept vjp takes the router
    stats' cotangent as a recompute's does."""
    engine = StreamEngine(CFG, _params(), OPT, StreamConfig(keep_every=2, resident=("block.2",), remat="dots"),
                          batch_shape=(2, 16))
    try:
        batches = _packed_batches(2)
        _streamed_equals_reference(engine, batches)
        assert engine.schedule.saved == (range(2, 3),) and range(2) in engine.schedule.groups
        assert len(set(documents.targets(batches[0]).sum(axis=(1, 2)).tolist())) > 1
    finally:
        engine.close()


@pytest.mark.slow
def test_streamed_moe_steps_on_the_disk_tier_equal_the_reference(tmp_path):
    store = mtjax.store.create(tmp_path / "store", CFG, make_optimizer(OPT))
    tiers = StoreConfig(compute="disk", master="disk", opt="disk")
    engine = StreamEngine(CFG, _params(), OPT, StreamConfig(keep_every=2), tiers, store=store, batch_shape=(2, 16))
    try:
        _streamed_equals_reference(engine, _batches(2))
    finally:
        engine.close()
        store.close()


def test_active_parameters_price_the_compute_and_all_parameters_the_bytes():
    """Against the same model with only k experts (all of them active): the FLOPs differ
    by the wider router alone, the state bytes by the unused experts too."""
    few = dataclasses.replace(CFG, num_experts=CFG.num_experts_per_tok)
    extra, d, layers = CFG.num_experts - few.num_experts, CFG.hidden_size, len(CFG.moe_layers)
    assert model.num_active_params(few) == model.num_params(few)
    assert model.num_active_params(CFG) == model.num_params(few) + extra * d * layers
    shape, hw = StepShape(2, 16, 2), BUILTIN["cpu-2core"]
    ours, theirs = (estimate(c, StreamConfig(), StoreConfig(), shape, hw) for c in (CFG, few))
    assert ours.model_flops - theirs.model_flops == 3 * 2 * extra * d * layers * shape.tokens
    expert = 3 * d * CFG.moe_intermediate_size
    assert ours.schedule.state.master - theirs.schedule.state.master == 4 * extra * (expert + d) * layers
