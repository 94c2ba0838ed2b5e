"""A streamed step compiles everything it runs during the first step: the second and third
compile nothing (the GPU benchmark's "compiles after step 1", which must be none). The
first step's update is deferred into the second, so a program first used by the update
path is the one this catches."""

from __future__ import annotations

import jax
import pytest

import mtjax.store
from mtjax import model
from mtjax.config import StoreConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream import StreamEngine

from conftest import tiny_config, token_batches

CFG = tiny_config()
DISK = StoreConfig(compute="disk", master="disk", opt="disk")

# XLA compiles in this process: each backend compile, and each executable loaded from a
# persistent compilation cache in its place (when the environment sets one).
_COMPILES = [0]


def _count(event: str, *_args, **_kwargs) -> None:
    if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)
jax.monitoring.register_event_listener(_count)


@pytest.mark.parametrize("tiers, lr", [("ram", 1e-3), ("disk", 2e-3), ("disk-one-copy", 3e-3)])
def test_no_compile_after_the_first_step(tmp_path, tiers, lr):
    # Each case its own learning rate: an update program that another case compiled
    # (XLA's in-process cache is shared by identical programs) would not be compiled again.
    OPT = OptimConfig(lr=lr, clip_norm=0.05)
    store, kwargs = None, {}
    if tiers != "ram":
        store = mtjax.store.create(tmp_path / "store", CFG, make_optimizer(OPT), copies=1 if "one-copy" in tiers else 2)
        kwargs = dict(store_config=DISK, store=store)
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT, **kwargs)
    after_first = None
    for i, tokens in enumerate(token_batches(CFG.vocab_size, (1, 2, 16), 3)):
        engine.step(tokens)  # a one-copy store's step commits itself; its update path commits each part
        if i == 0:
            after_first = _COMPILES[0]
    engine.close()  # the third step's update, deferred until now, runs too
    if store is not None:
        store.close()
    assert _COMPILES[0] - after_first == 0
