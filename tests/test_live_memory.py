"""What a streamed step keeps alive on the device, against its schedule's device plan.

A census of `jax.live_arrays()` after every operation of a step (the runner's handlers,
wrapped) counts the device arrays made since the engine was built. Gradient sums handed
to the host (`Placement.host_arrays`) are not counted: on the CPU backend they are the
device's arrays themselves, on a GPU host copies. An array's per-device views (which a
copy to the host makes) share its buffer and are counted once. The peak must stay within
the plan's device total, which also prices XLA's temporaries (residuals, the head's
logits, a block's working bytes) that are no live arrays. And once a step has returned, none of
its device-only values may stay alive: staged weights, hidden states and their
cotangents, kept inputs; and once its deferred updates are done, nothing at all but a few
scalars (the engine here keeps no part resident: the plan says nothing persists across
steps).
"""

from __future__ import annotations

import gc
import weakref

import jax
import pytest

from mtjax import model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig
from mtjax.stream import StreamEngine

from conftest import tiny_config, token_batches

# bf16 compute: weights cross through staging slots (an fp32 CPU run stages master in place).
CFG = tiny_config(vocab_size=97, num_hidden_layers=4, compute_dtype="bfloat16")
BATCH, SEQ, STEPS = 2, 16, 2


class Census:
    """Live device bytes made since it began, less the gradients handed to the host:
    `peak` over a step's operations, `at` the operation after which it was reached;
    `values()`, the device-only values of the steps so far still alive."""

    def __init__(self, engine: StreamEngine):
        self.before = {id(x): x for x in jax.live_arrays()}  # held (not counted) until the census ends
        self.host, self.step_values = {}, {}  # id -> weakref
        self.peak, self.at = 0, None
        placement = engine.placement
        to_host, to_device = placement.host_arrays, placement.to_device

        def host_arrays(tree):
            return self._tag(self.host, to_host(tree))

        def staged(buffers):
            return self._tag(self.step_values, to_device(buffers))

        placement.host_arrays, placement.to_device = host_arrays, staged
        for kind, handler in list(engine.runner._do.items()):
            engine.runner._do[kind] = self._after(handler)

    @staticmethod
    def _tag(into: dict, tree):
        for a in jax.tree.leaves(tree):
            into[id(a)] = weakref.ref(a, lambda _, i=id(a): into.pop(i, None))
        return tree

    def _after(self, handler):
        def counted(st, op):
            handler(st, op)
            self._tag(self.step_values, [st.flow, st.kept, st.inputs])
            now = sum(x.nbytes for x in self.live())
            if now > self.peak:
                self.peak, self.at = now, op

        return counted

    def live(self) -> list:
        """One array per device buffer (an array's per-device views, which copies to the host
        and `np.asarray` make, share its buffer), less those `before` and the host's."""
        skip = _buffers(self.before.values()) | _buffers(r() for r in list(self.host.values()))
        out = {}
        for x in jax.live_arrays():  # in device memory: not the pinned host copies of the GPU's path
            if x.is_deleted() or x.sharding.memory_kind not in (None, "device"):
                continue
            if (b := x.unsafe_buffer_pointer()) not in skip:
                out.setdefault(b, x)
        return list(out.values())

    def values(self) -> list:
        # Less the engine's own state: on the CPU a part may be staged as its master arrays.
        before = _buffers(self.before.values())
        values = _alive(r() for r in list(self.step_values.values()))
        return [a for a in values if a.unsafe_buffer_pointer() not in before]


def _alive(arrays) -> list:
    return [a for a in arrays if a is not None and not a.is_deleted()]


def _buffers(arrays) -> set[int]:
    return {a.unsafe_buffer_pointer() for a in _alive(arrays)}


@pytest.mark.parametrize("accum,depth,keep_every", [(1, 1, 1), (4, 2, 2)], ids=["accum1-depth1-k1", "accum4-depth2-k2"])
def test_live_device_arrays_stay_within_the_plan(accum, depth, keep_every):
    params = model.init_params(CFG, seed=1)
    engine = StreamEngine(CFG, params, OptimConfig(lr=1e-3), StreamConfig(prefetch_depth=depth, keep_every=keep_every,
                                                                        resident="none"),
                          StoreConfig(), batch_shape=(BATCH, SEQ))
    del params
    gc.collect()
    census = Census(engine)
    hidden = BATCH * SEQ * CFG.hidden_size * 2  # one micro-batch's hidden state, bf16
    for batch in token_batches(CFG.vocab_size, (accum, BATCH, SEQ), STEPS):
        engine.step(batch)
        engine.tracer.drain()  # its watchers hold what they time until it is computed
        gc.collect()
        left = census.values()
        assert not left, sorted((str(x.dtype), x.shape) for x in left)
        engine.flush()  # the deferred updates read the step's gradients (host memory on a GPU)
        gc.collect()
        rest = census.live()  # anything at all: only the optimizer's step counts and clip scale stay
        assert sum(x.nbytes for x in rest) < hidden, sorted((x.nbytes, str(x.dtype), x.shape) for x in rest)[-4:]
    plan = engine.schedule.device
    assert 0 < census.peak <= plan.total, (census.peak, census.at, plan.describe())
    engine.close()
