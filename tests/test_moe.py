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

from mtjax import documents, model, moe
from mtjax.batch import Batch
from mtjax.config import ConfigError, StoreConfig, StreamConfig
from mtjax.model_config import CHUNKED, FULL
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, StepShape, estimate
from mtjax.reference import ReferenceTrainer, eval_loss, loss_terms
from mtjax.stream import StreamEngine, schedule

from conftest import tiny_config, tiny_moe_config, token_batches

# Qwen3-MoE-like: a dense layer between two MoE layers, 7 experts of which 2 are picked.
CFG = tiny_moe_config()
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


def test_dispatch_flops_scale_with_the_tokens_not_the_experts():
    """Compiled FLOPs of the experts' gradient (its forward included) over the same 128 tokens (k=2)
    with 4 and 16 experts: ragged_dot's grow with E (it is a dense masked dot on the CPU),
    the blocked form's by its padding alone. Unrolled: XLA counts a loop body once."""
    rng = np.random.default_rng(2)
    t, d, f = 128, 16, 16
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)

    def flops(e, which):
        kernels = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
        weights, chosen, _ = moe.route(jnp.asarray(rng.normal(size=(t, e)), jnp.float32), 2, True)
        fn = jax.grad(lambda x, *ks: jnp.sum(moe.experts_forward(x, weights, chosen, *ks, which=which, unroll=True)),
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
    return token_batches(CFG.vocab_size, (accum, 2, 16), STEPS)


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


def _reference_steps(cfg, params, batches):
    """(each step's metrics, final params, final optimizer state) of the reference trainer."""
    reference = ReferenceTrainer(cfg, params, OPT)
    return [reference.step(b) for b in batches], reference.params, reference.opt_state


def _streamed_equals_reference(engine, batches, reference=None, tol=1e-5):
    """`reference`: `_reference_steps` of the engine's model on `batches` (default: CFG's);
    `tol`: the largest relative error of a parameter or optimizer-state leaf."""
    metrics, params, opt_state = reference or _reference_steps(CFG, _params(), batches)
    for b, ref in zip(batches, metrics, strict=True):
        ours = engine.step(b)
        np.testing.assert_allclose(ours["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(ours["aux_loss"], ref["aux_loss"], rtol=1e-5)
        np.testing.assert_allclose(ours["grad_norm"], ref["grad_norm"], rtol=1e-4)
        assert ref["grad_norm"] > OPT.clip_norm  # clipping is active
    errors = jax.tree.leaves(jax.tree.map(_rel, engine.params(), params))
    errors += jax.tree.leaves(jax.tree.map(_rel, engine.opt_state(), opt_state))
    assert max(errors) <= tol


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
def test_streamed_moe_steps_on_the_disk_tier_equal_the_reference(make_store):
    store = make_store(CFG, make_optimizer(OPT))
    tiers = StoreConfig(compute="disk", master="disk", opt="disk")
    engine = StreamEngine(CFG, _params(), OPT, StreamConfig(keep_every=2), tiers, store=store, batch_shape=(2, 16))
    try:
        _streamed_equals_reference(engine, _batches(2))
    finally:
        engine.close()
        store.close()


# Llama 4 text: a chunked RoPE MoE layer (chunks of 5 in rows of 16), then a dense NoPE
# layer; 7 experts, top 1, a shared expert; L2 q/k norm and NoPE temperature on (the
# transformers comparison, tests/test_hf_moe.py, has a NoPE MoE layer too).
LLAMA4 = tiny_config(model_type="llama4_text", vocab_size=61, intermediate_size=40, num_experts=7,
                     num_experts_per_tok=1, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                     moe_layers=(0,), no_rope_layers=(1,), layer_types=(CHUNKED, FULL), attention_chunk_size=5,
                     qk_l2_norm=True, attn_temperature_tuning=True, floor_scale=3.0, temperature_scale=0.3)


@functools.cache
def _llama4_reference():
    """The reference's five steps on LLAMA4, shared by the RAM and disk cases."""
    params = model.init_params(LLAMA4, seed=2)
    return params, _reference_steps(LLAMA4, params, _batches(2))


@pytest.mark.parametrize("tier", ["ram", pytest.param("disk", marks=pytest.mark.slow)])
def test_streamed_llama4_steps_equal_the_reference(tier, make_store):
    """Five AdamW steps of 2 micro-batches, both blocks one recompute group: the weights and
    moments equal the reference's; Llama 4's loss has no load-balancing term."""
    params, reference = _llama4_reference()
    # Two compiled blocks: a chunked RoPE MoE layer and a full NoPE dense one.
    assert [(s.mixer.chunk, s.rope is None, s.feed_forward.kind) for s in LLAMA4.block_specs] == [
        (5, False, "moe"), (None, True, "dense")]
    assert LLAMA4.router_aux_loss_coef == 0 and all(m["aux_loss"] > 0 for m in reference[0])
    store = make_store(LLAMA4, make_optimizer(OPT)) if tier == "disk" else None
    tiers = StoreConfig(compute=tier, master=tier, opt=tier)
    engine = StreamEngine(LLAMA4, params, OPT, StreamConfig(keep_every=2), tiers, store=store, batch_shape=(2, 16))
    try:
        _streamed_equals_reference(engine, _batches(2), reference)
    finally:
        engine.close()
        if store is not None:
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


# --- expert groups: a MoE block streamed as its router part, then groups of experts ---------------


# The disk case runs one micro-batch: with 4 the split run drifts to 1.3e-5 (the unsplit
# one: 6e-6) in the AdamW second moment of the dense layer's 1-D q/k norms, the most
# rounding-sensitive tensors. The split forward is bit-identical to the whole block's and
# its backward differs by rounding only (separate programs fuse differently), which five
# clipped AdamW steps amplify. So the split with several micro-batches is not held to
# 1e-5 here.


@pytest.mark.parametrize("tier, accum, keep_every",
                         [("ram", 1, 1), pytest.param("disk", 1, 2, marks=[pytest.mark.slow])])
def test_streamed_steps_with_the_moe_blocks_split_into_expert_groups_equal_the_reference(make_store, tier, accum,
                                                                                        keep_every):
    """Groups of 3 of the 7 experts (the last of one), forced; on the disk tier with 4
    micro-batches the dense block 1 is a recompute group of its own between two split blocks."""
    store, tiers = None, StoreConfig()
    if tier == "disk":
        store = make_store(CFG, make_optimizer(OPT))
        tiers = StoreConfig(compute="disk", master="disk", opt="disk")
    engine = StreamEngine(CFG, _params(), OPT, StreamConfig(keep_every=keep_every, expert_group_size=3), tiers,
                          store=store, batch_shape=(2, 16))
    try:
        assert engine.schedule.split == {0: ((0, 1, 2), (3, 4, 5), (6,)), 2: ((0, 1, 2), (3, 4, 5), (6,))}
        assert "block.2/experts.1" in engine.schedule.transfers and "block.2" not in engine.schedule.transfers
        _streamed_equals_reference(engine, _batches(accum))
    finally:
        engine.close()
        if store is not None:
            store.close()


# Gemma's norms on a MoE model: (1 + w) norms, and sandwich norms on the attention and
# MLP outputs, so a split block's output stage is a norm of the groups' summed output.
SANDWICH = dataclasses.replace(CFG, sandwich_norms=True, rms_norm_offset=True)


@pytest.mark.slow
def test_split_moe_blocks_with_sandwich_norms_equal_the_whole_ones():
    """Groups of 3 of the 7 experts under sandwich norms: five steps equal the in-memory
    trainer's, whose blocks are whole (one micro-batch: see the note above), the post-MLP
    norm's weight trained through the split."""
    params = model.init_params(SANDWICH, seed=1)
    engine = StreamEngine(SANDWICH, params, OPT, StreamConfig(keep_every=1, expert_group_size=3),
                          batch_shape=(2, 16))
    try:
        assert engine.schedule.split == {0: ((0, 1, 2), (3, 4, 5), (6,)), 2: ((0, 1, 2), (3, 4, 5), (6,))}
        # 2e-5: the split block's backward adds the expert groups' input gradients in
        # another order; fp32 rounding, squared in Adam's second moment, put the last
        # block's k_proj nu at 1.016e-5 on AMD EPYC (its parameters within 4.1e-6)
        _streamed_equals_reference(engine, _batches(1), _reference_steps(SANDWICH, params, _batches(1)), tol=2e-5)
        trained = engine.params()["blocks"][0]["post_feedforward_layernorm"]["weight"]
        assert np.abs(np.asarray(trained)).max() > 0  # the output stage's norm learned
    finally:
        engine.close()


def _counted(engine):
    """Bytes the engine hands to the device as weights, and reads of compute state from the store."""
    counts = {"h2d": 0, "read": 0}
    to_device = engine.placement.to_device

    def staged(buffers):
        counts["h2d"] += sum(b.nbytes for b in buffers.values())
        return to_device(buffers)

    engine.placement.to_device = staged
    if engine.store is not None:
        read = engine.store.read

        def counted_read(part, kind, out=None):
            if kind == "compute":
                counts["read"] += sum(b.nbytes for b in out.values())
            return read(part, kind, out)

        engine.store.read = counted_read
    return counts


@pytest.mark.parametrize("tier", ["ram", pytest.param("disk", marks=pytest.mark.slow)])  # the fast tier's budget
def test_experts_no_token_reached_stay_on_the_host_as_the_schedule_counts(make_store, tier):
    """Rows of one repeated token: every position has the same attention output (the same
    value at every key), so all tokens pick the same k of the 7 experts in each layer and
    the others stay unreached. The bytes staged (and read from a disk tier) equal the
    schedule's traffic for that routing. An expert unreached in every step still gets its
    AdamW update on the host (weight decay and its moments move it), equal to the
    reference's. (Such rows give attention's q and k no gradient but rounding, which
    AdamW scales up, so only the losses and the unreached experts are compared.)"""
    store, tiers = None, StoreConfig()
    if tier == "disk":
        store = make_store(CFG, make_optimizer(OPT))
        tiers = StoreConfig(compute="disk", master="disk", opt="disk")
    engine = StreamEngine(CFG, _params(), OPT, StreamConfig(expert_group_size=3), tiers, store=store,
                          batch_shape=(2, 16))
    reference = ReferenceTrainer(CFG, _params(), OPT)
    batches = [np.full((1, 2, 16), token, np.int32) for token in (3, 50)]
    try:
        counts, saved, never = _counted(engine), [], None
        for step, b in enumerate(batches):
            counts.update(h2d=0, read=0)
            ref, ours = reference.step(b), engine.step(b)
            np.testing.assert_allclose(ours["loss"], ref["loss"], rtol=1e-5)
            t = engine.schedule.routed_traffic(engine.routed)
            assert counts["h2d"] == t.h2d_weights < engine.schedule.traffic.h2d_weights
            assert t.h2d_weights + t.h2d_unrouted == engine.schedule.traffic.h2d_weights
            if tier == "disk":  # each part's first staging after an update takes its new copy
                handed = t.compute_handed if step else 0
                assert counts["read"] == t.disk_read["compute"] + t.compute_handed - handed
                assert t.disk_read["compute"] + t.compute_handed == t.h2d_weights
            saved.append(t.h2d_unrouted)
            step = {(i, int(e)) for i, r in engine.routed.items() for e in np.flatnonzero(~r)}
            never = step if never is None else never & step
        assert never and all(saved)
        print(f"\nexpert bytes not staged per step ({tier}): {saved}")
        ours, theirs = engine.params(), reference.params
        for i, e in sorted(never):
            for n in ("gate_proj", "up_proj", "down_proj"):
                a, b = (p["blocks"][i]["mlp"]["experts"][e][n]["kernel"] for p in (ours, theirs))
                assert _rel(a, b) <= 1e-6
                assert not np.array_equal(a, _params()["blocks"][i]["mlp"]["experts"][e][n]["kernel"])
    finally:
        engine.close()
        if store is not None:
            store.close()


def test_the_device_budget_decides_the_split_and_the_planner_prices_it():
    """Over a grid of budgets: a step that fits whole is not split; one that does not is
    split into the largest expert groups that fit (7, 3, 1 experts; the least device
    memory of them when none fits), and the planner prices that schedule. Every layer is
    MoE here, so the largest staged part is a MoE block's and shrinks with the groups."""
    cfg = dataclasses.replace(CFG, moe_layers=(0, 1, 2))
    tx, shape, hw = make_optimizer(OPT), StepShape(2, 16, 1), BUILTIN["cpu-2core"]
    whole = schedule.describe(cfg, StreamConfig(), StoreConfig(), shape, tx)
    forced = {g: schedule.describe(cfg, StreamConfig(expert_group_size=g), StoreConfig(), shape, tx) for g in (7, 3, 1)}
    assert not whole.split and all(s.split for s in forced.values())
    assert whole.device.weights > forced[7].device.weights > forced[3].device.weights > forced[1].device.weights
    assert forced[1].device.total < whole.device.total
    candidates = [(None, whole), *forced.items()]
    for budget in sorted({t for _, s in candidates for t in (s.device.total, s.device.total - 1)}):
        ours = schedule.describe(cfg, StreamConfig(device_budget_bytes=budget), StoreConfig(), shape, tx)
        fitting = [s for _, s in candidates if s.device.total <= budget]
        want = fitting[0] if fitting else min(forced.values(), key=lambda s: s.device.total)
        assert ours.split == want.split and ours.device == want.device
        plan = estimate(cfg, StreamConfig(device_budget_bytes=budget), StoreConfig(), shape, hw)
        assert plan.schedule.device == ours.device and plan.schedule.transfers == ours.transfers
    # Bytes: what an unsplit step moves, in more and smaller transfers, and the last block
    # once more: split, it no longer stays on the device from its forward to its backward.
    assert whole.last_stays and not forced[3].last_stays
    assert forced[3].traffic.h2d_weights == whole.traffic.h2d_weights + whole.part_bytes["block.2"].compute


def test_a_bad_expert_group_size_is_one_clear_error():
    for bad in (0, -2, 1.5, "four", True):
        with pytest.raises(ConfigError, match="stream.expert_group_size must be a whole number of experts >= 1"):
            StreamConfig(expert_group_size=bad)


def test_engine_and_reference_evaluate_the_same_objective_and_aux_loss():
    params, batch = _params(), _batches(2)[0]
    engine = StreamEngine(CFG, params, OPT, StreamConfig(expert_group_size=3), batch_shape=(2, 16))
    try:
        ours, ref = engine.eval_loss(batch), eval_loss(CFG, params, batch)
    finally:
        engine.close()
    assert set(ours) == set(ref) == {"loss", "aux_loss"} and ref["aux_loss"] > 0
    for key in ours:
        np.testing.assert_allclose(ours[key], ref[key], rtol=1e-5)
