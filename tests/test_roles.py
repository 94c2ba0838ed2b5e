"""Leaf roles (mtjax.roles): a frozen leaf has a compute copy only.

Half the leaves of each part of a tiny model are frozen. The step description counts no
master, optimizer, gradient or disk-write bytes for them, and a real step moves exactly
what it says (the counting of tests/test_schedule.py); after 5 streamed steps, on the RAM
tier and with master and optimizer state on disk, the frozen leaves are bit-identical
and the trained ones equal an optax reference that masks the frozen ones out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
import pytest

import mtjax.store
from mtjax import model, parts, precision, roles, treepath
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import ConfigError
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, StepShape, estimate
from mtjax.reference import ReferenceTrainer
from mtjax.store.errors import StoreError
from mtjax.stream import StreamEngine

from conftest import ONE_KV_HEAD, tiny_config, token_batches
from test_schedule import counted_steps

# Half of each part: the embedding (its one leaf), the head's projection (1 of 2), and in
# every block its MLP, one norm and the value projection (5 of 9).
FREEZE = ("embed", "block.*/mlp.*", "block.*/input_layernorm.weight", "block.0-2/self_attn.v_proj.kernel",
          "head/lm_head.kernel")
BATCH, SEQ = 2, 8
PLACEMENTS = {"ram": {}, "master-disk": {"master": "disk"}, "state-disk": {"master": "disk", "opt": "disk"},
              "all-disk": {"compute": "disk", "master": "disk", "opt": "disk"}}
# (placement, tied); the fast tier keeps one case of the equivalence
CASES = [pytest.param(w, t, id=f"{w}-{'tied' if t else 'untied'}", marks=() if i == 0 else pytest.mark.slow)
         for i, (w, t) in enumerate([("ram", False), ("ram", True), ("master-disk", False), ("state-disk", True),
                                     ("all-disk", False)])]


def _frozen_names(cfg) -> dict[str, set[str]]:
    return {p.name: {n for n, leaf in parts.leaves(cfg, p.name).items() if leaf.role == roles.FROZEN}
            for p in parts.parts(cfg)}


def test_patterns_name_leaves_by_part_range_and_glob():
    cfg = tiny_config(num_hidden_layers=3, freeze=FREEZE)
    parts.check_roles(cfg)
    frozen = _frozen_names(cfg)
    assert frozen["embed"] == {"embedding"} and frozen["head"] == {"lm_head.kernel"}
    for i in range(3):
        leaves = parts.leaves(cfg, f"block.{i}")
        assert {n for n in leaves if n.startswith("mlp.")} <= frozen[f"block.{i}"]
        assert 2 * len(frozen[f"block.{i}"]) in (len(leaves) - 1, len(leaves), len(leaves) + 1)
    # The kinds are views: a frozen leaf has a compute copy only.
    for p in parts.parts(cfg):
        assert set(parts.schema(cfg, p.name, "compute")) == set(parts.leaves(cfg, p.name))
        assert not frozen[p.name] & set(parts.schema(cfg, p.name, "master"))
        opt = parts.schema(cfg, p.name, "opt", make_optimizer(OptimConfig()))
        assert not any(n.endswith("." + f) for n in opt for f in frozen[p.name])
    assert roles.matches("block.2-5", "block.4", "x") and not roles.matches("block.2-5", "block.6", "x")


@pytest.mark.parametrize("freeze,words", [
    (("block.9",), "names no leaf"), (("block.3-1",), "is empty"), (("embed/a/b",), "malformed"),
    (("*",), "nothing is left to train"), (("block.*/nothing.*",), "names no leaf")])
def test_bad_patterns_are_refused_in_one_line(freeze, words):
    with pytest.raises(ConfigError, match=words) as e:
        parts.check_roles(tiny_config(freeze=freeze))
    assert "\n" not in str(e.value)


def _rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _masked_reference(cfg, params, opt: OptimConfig) -> ReferenceTrainer:
    """The unfrozen model trained by optax with the frozen leaves masked out (their
    updates zero), starting from the same weights."""
    frozen = _frozen_names(cfg)
    plain = dataclasses.replace(cfg, freeze=())
    label = {p: treepath.unflatten(parts.abstract_part(cfg, p), {n: "frozen" if n in frozen[p] else "trained"
                                                                 for n in parts.leaves(cfg, p)}) for p in frozen}
    labels = {"embed": label["embed"], "head": label["head"],
              "blocks": [label[f"block.{i}"] for i in range(cfg.num_hidden_layers)]}
    tx = optax.multi_transform({"trained": make_optimizer(opt), "frozen": optax.set_to_zero()}, labels)
    return ReferenceTrainer(plain, params, tx, clip_norm=None)


@pytest.mark.parametrize("where,tied", CASES)
def test_frozen_leaves_stay_and_trained_ones_match_a_masked_reference(make_store, where, tied):
    # Tied: the frozen embedding is also the head's projection (the head's own leaf, its norm, trains).
    freeze = tuple(p for p in FREEZE if not (tied and p.startswith("head")))
    cfg = tiny_config(num_hidden_layers=3, **ONE_KV_HEAD, freeze=freeze, tie_word_embeddings=tied)
    opt = OptimConfig(lr=1e-3, warmup_steps=0, clip_norm=None)  # optax's masked chain has no global clip
    params = model.init_params(cfg, seed=0)
    tiers = PLACEMENTS[where]
    store = make_store(cfg, make_optimizer(opt)) if tiers else None
    engine = StreamEngine(cfg, params, opt, StreamConfig(keep_every=2), StoreConfig(**tiers), store=store)
    reference, ours = _masked_reference(cfg, params, opt), ReferenceTrainer(cfg, params, opt)
    for batch in token_batches(cfg.vocab_size, (2, BATCH, SEQ), 5):
        got = engine.step(batch)["loss"]
        assert got == pytest.approx(reference.step(batch)["loss"], abs=1e-5)
        ours.step(batch)
    streamed, masked, start = (treepath.flatten(t) for t in (engine.params(), reference.params, params))
    frozen = {f"{'blocks.' + p[6:] if p.startswith('block.') else p}.{n}"
              for p, names in _frozen_names(cfg).items() for n in names}
    assert frozen and set(streamed) - frozen
    for name, w in streamed.items():
        if name in frozen:  # bit for bit (fp32 compute: the compute copy is the weight)
            np.testing.assert_array_equal(np.asarray(w), np.asarray(start[name]), err_msg=name)
        else:
            assert _rel_error(w, masked[name]) <= 1e-5, name  # as tests/test_stream.py measures
            assert not np.array_equal(np.asarray(w), np.asarray(start[name])), name
    # mtjax's own reference with frozen leaves is the masked optax reference.
    for name, w in treepath.flatten(ours.params).items():
        assert _rel_error(w, masked[name]) <= 1e-6, name
    engine.close()
    if store is not None:
        store.close()


@pytest.mark.parametrize("where", PLACEMENTS)
def test_the_description_counts_no_state_for_frozen_leaves_and_a_step_moves_what_it_says(make_store, where):
    cfg = tiny_config(num_hidden_layers=3, **ONE_KV_HEAD, compute_dtype="bfloat16", freeze=FREEZE)
    opt = OptimConfig(lr=1e-3, warmup_steps=0)
    tx, tiers, accum = make_optimizer(opt), PLACEMENTS[where], 2
    store = make_store(cfg, tx) if tiers else None
    placement = StoreConfig(**tiers)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), opt, StreamConfig(), placement, store=store,
                          batch_shape=(BATCH, SEQ))
    s = engine.plan(BATCH, SEQ, accum)
    assert estimate(cfg, StreamConfig(), placement, StepShape(BATCH, SEQ, accum), BUILTIN["cpu-2core"],
                    tx=tx).schedule == s

    # Counted from the leaf specs: the master and the (fp32) gradient are the trained leaves' alone.
    frozen = _frozen_names(cfg)
    for p in parts.parts(cfg):
        trained = {n: leaf for n, leaf in parts.leaves(cfg, p.name).items() if n not in frozen[p.name]}
        fp32 = sum(4 * int(np.prod(leaf.shape)) for leaf in trained.values())
        assert s.part_bytes[p.name].master == fp32 and s.grad_bytes[p.name] == fp32
        # mu, nu and two int32 step counts; a part with nothing to train has no optimizer state
        assert s.part_bytes[p.name].opt == (2 * fp32 + 8 if fp32 else 0)
    t = s.traffic
    assert t.disk_write["master"] == (s.state.master if "master" in tiers else 0)
    assert t.disk_write["opt"] == (s.state.opt if "opt" in tiers else 0)
    # A compute copy on disk: the update writes the trained leaves' (bf16), never a frozen one's.
    trained_compute = sum(2 * int(np.prod(leaf.shape)) for p in parts.parts(cfg)
                          for n, leaf in parts.leaves(cfg, p.name).items() if n not in frozen[p.name])
    assert t.disk_write["compute"] == (trained_compute if "compute" in tiers else 0)
    assert t.d2h_grads == sum(s.grad_bytes.values())

    counts = counted_steps(engine, cfg.vocab_size, (accum, BATCH, SEQ), 2)
    expected = {"h2d_weights": t.h2d_weights, "h2d_tokens": t.h2d_tokens, "d2h_grads": t.d2h_grads,
                **{f"disk_read.{k}": b for k, b in t.disk_read.items()},
                **{f"disk_write.{k}": b for k, b in t.disk_write.items()}}
    twice = {k: 2 * b for k, b in expected.items() if b}
    if "compute" in tiers:  # the first step had no update to hand a new compute copy on: it read all
        twice["disk_read.compute"] = t.disk_read["compute"] + t.h2d_weights
    assert dict(counts.bytes) == twice
    # The frozen leaves are still their first compute copy, bit for bit (bf16 here).
    now, start = treepath.flatten(engine.params()), treepath.flatten(model.init_params(cfg, seed=0))
    for p, names in frozen.items():
        for n in names:
            name = f"{'blocks.' + p[6:] if p.startswith('block.') else p}.{n}"
            first = precision.reference(np.asarray(start[name]), cfg.compute_dtype).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(now[name]), first, err_msg=name)
    engine.close()
    if store is not None:
        store.close()


def test_frozen_leaves_shrink_the_planned_host_and_disk_bytes():
    cfg = tiny_config(num_hidden_layers=3, **ONE_KV_HEAD, compute_dtype="bfloat16")
    shape, tx = StepShape(BATCH, SEQ, 1), make_optimizer(OptimConfig())

    def plans(placement):
        return (estimate(c, StreamConfig(), placement, shape, BUILTIN["h200"], tx=tx)
                for c in (cfg, dataclasses.replace(cfg, freeze=FREEZE)))

    plain, frozen = plans(StoreConfig())
    assert frozen.state.compute == plain.state.compute  # every leaf still crosses to the device
    assert frozen.state.master < plain.state.master / 2 and frozen.state.opt < plain.state.opt / 2
    assert frozen.host.state < plain.host.state and frozen.host.grads < plain.host.grads
    assert frozen.traffic.d2h < plain.traffic.d2h
    plain, frozen = plans(StoreConfig(master="disk", opt="disk"))
    assert frozen.disk_bytes < plain.disk_bytes and frozen.traffic.disk_write < plain.traffic.disk_write / 2



@pytest.mark.parametrize("other", [(), ("embed",), (*FREEZE, "block.*/self_attn.q_proj.kernel")])
def test_a_store_written_with_one_freeze_set_refuses_another(make_store, other):
    """A frozen leaf has no master to be un-frozen from, and a newly frozen leaf's master and
    optimizer state would be left behind: the store names the difference, in one line."""
    cfg = tiny_config(freeze=FREEZE)
    store = make_store(cfg, make_optimizer(OptimConfig()))
    root = store.root
    store.close()
    mtjax.store.open(root, config=cfg).close()
    with pytest.raises(StoreError, match="freeze") as e:
        mtjax.store.open(root, config=dataclasses.replace(cfg, freeze=other))
    assert "\n" not in str(e.value)
