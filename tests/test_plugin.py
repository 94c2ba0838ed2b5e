"""A plug-in proof: a token mixer mtjax knows nothing of, defined here and registered
through the public registry (mtjax.layers.registry), trains, is priced and samples.

The toy mixer is a causal convolution over each token's last `width` positions of its
own document (packed rows never mix documents), each head's channels sharing that head's
taps, then an output projection. Its registry entry gives its FLOPs (the taps' products
beyond the 2 per parameter and token the planner counts itself) and its decode state (the
last width - 1 inputs). A tiny model interleaves it with softmax attention through
`ModelConfig.explicit_layer_specs`; no file in mtjax/ names it.

Shown: the streamed engine equals the in-memory reference trainer (plain JAX) over 5
AdamW steps of 2 micro-batches on the RAM and disk tiers (test_stream's helpers); the
planner prices its FLOPs; the streamed sampler decodes it with its own state and gives
the full forward's greedy tokens. (Importing and exporting a Hugging Face checkpoint of a
family using it waits for family modules, mtjax/families/.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtjax import documents, generate, model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.layers import registry
from mtjax.layers.basic import Dense
from mtjax.layers.spec import DenseMLP, LayerSpec, Rope, SoftmaxAttention
from mtjax.model_config import ModelConfig
from mtjax.plan import BUILTIN, StepShape, estimate
from mtjax.plan.cost import mfu_flops_per_token
from test_stream import CFG, DISK, run_case


@dataclasses.dataclass(frozen=True)
class CausalConv:
    """A causal convolution over the last `width` positions of a token's document."""

    kind: ClassVar[str] = "test_causal_conv"
    width: int = 3


class ConvMixer(nnx.Module):
    """y_t = out_proj(sum_j taps[j] * x_{t-j}) over j < width with x_{t-j} in t's document
    (its position there >= j); taps [width, heads], shared by each head's channels."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        self.width, self.heads = spec.mixer.width, cfg.num_attention_heads
        self.taps = nnx.Param(jax.random.normal(rngs.params(), (self.width, self.heads), jnp.float32) * 0.5)
        self.out_proj = Dense(cfg.hidden_size, cfg.hidden_size, False, cfg, rngs)

    def _conv(self, padded, positions):
        """padded [b, width - 1 + t, d]: the width - 1 inputs before the t new ones, then
        them; positions [b|1, t] of the new ones in their documents."""
        t, d = padded.shape[1] - (self.width - 1), padded.shape[2]
        taps = jnp.repeat(self.taps[...], d // self.heads, axis=1).astype(padded.dtype)  # [width, d]
        y = jnp.zeros((padded.shape[0], t, d), padded.dtype)
        for j in range(self.width):
            shifted = padded[:, self.width - 1 - j:self.width - 1 - j + t]
            y = y + jnp.where((positions >= j)[..., None], shifted * taps[j], 0)
        return self.out_proj(y)

    def __call__(self, x, cos, sin, positions, segments=None):
        past = jnp.zeros((x.shape[0], self.width - 1, x.shape[2]), x.dtype)
        return self._conv(jnp.concatenate([past, x], axis=1), positions)

    def decode(self, x, state, start, cos, sin, positions):
        padded = jnp.concatenate([state["tail"].astype(x.dtype), x], axis=1)
        return self._conv(padded, positions), {"tail": padded[:, padded.shape[1] - (self.width - 1):]}


def conv_flops(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, executed: bool = True) -> float:
    """Each channel's width products and sums a token, less the 2 per tap parameter counted already."""
    return 2.0 * batch * seq * spec.mixer.width * (cfg.hidden_size - cfg.num_attention_heads)


def conv_state(cfg: ModelConfig, spec: LayerSpec, batch: int, length: int) -> dict:
    """The last width - 1 inputs, whatever the length."""
    return {"tail": jax.ShapeDtypeStruct((batch, spec.mixer.width - 1, cfg.hidden_size), np.dtype(cfg.compute_dtype))}


registry.register_mixer(CausalConv.kind, registry.MixerKind(module=ConvMixer, flops=conv_flops,
                                                             decode_state=conv_state, spec=CausalConv))


@dataclasses.dataclass(frozen=True)
class UnpricedConv(CausalConv):
    """The same mixer registered with no FLOPs of its own, to see what the planner adds."""

    kind: ClassVar[str] = "test_causal_conv_unpriced"


registry.register_mixer(UnpricedConv.kind, registry.MixerKind(module=ConvMixer, flops=lambda *a: 0.0,
                                                               decode_state=conv_state, spec=UnpricedConv))


def toy(conv=CausalConv, **fields) -> ModelConfig:
    """Three layers, test_stream's sizes: a width-3 convolution, attention, a width-2 one."""
    specs = (LayerSpec(conv(3), DenseMLP()), LayerSpec(SoftmaxAttention(), DenseMLP(), Rope(10000.0)),
             LayerSpec(conv(2), DenseMLP()))
    return dataclasses.replace(CFG, num_hidden_layers=3, layer_types=(), explicit_layer_specs=specs, **fields)


TOY = toy()


@pytest.mark.slow  # compiles the toy model's forward twice
def test_the_toy_layers_mix_inside_documents_only():
    """A packed row's second document gives the same outputs as that document alone."""
    params = model.init_params(TOY, seed=1)
    rng = np.random.default_rng(0)
    doc = rng.integers(0, TOY.vocab_size, (1, 7), dtype=np.int32)
    packed = np.concatenate([rng.integers(0, TOY.vocab_size, (1, 9), dtype=np.int32), doc], axis=1)
    segments = np.asarray([[1] * 9 + [2] * 7], np.int32)
    forward = jax.jit(functools.partial(model.forward, TOY))
    alone = forward(params, doc)
    together = forward(params, packed, segments=segments)
    np.testing.assert_allclose(together[:, 9:], alone, rtol=1e-5, atol=1e-6)
    assert documents.positions(segments)[0, 9] == 0
    # Without the document ids the second document would see the first's last tokens.
    assert not np.allclose(forward(params, packed)[:, 9:], alone, atol=1e-4)


@pytest.mark.slow  # two models' compiles and 10 streamed steps each
@pytest.mark.parametrize("tiers", [{}, DISK.tiers], ids=["ram", "disk"])
def test_the_toy_model_streams_as_the_reference_trains_it(tmp_path, tiers):
    run_case(tmp_path, keep_every=2, depth=2, tiers=tiers, accum=2, tied=False, base=TOY)


def test_the_planner_prices_the_toy_mixer_with_its_own_flops():
    """The plan of the toy model less that of the same model whose mixer costs nothing:
    3 forwards of the conv layers' FLOPs (useful work), in the model FLOPs and in MFU's."""
    shape, hw = StepShape(2, 16, 2), BUILTIN["cpu-2core"]
    priced, unpriced = (estimate(c, StreamConfig(), StoreConfig(), shape, hw) for c in (TOY, toy(UnpricedConv)))
    convs = [s for s in TOY.layer_specs if isinstance(s.mixer, CausalConv)]
    assert len(convs) == 2
    per_micro_batch = sum(conv_flops(TOY, s, shape.batch, shape.seq, False) for s in convs)
    assert per_micro_batch > 0
    assert priced.model_flops - unpriced.model_flops == pytest.approx(3 * shape.accum * per_micro_batch)
    per_token = 3 * sum(conv_flops(TOY, s, 1, 16) for s in convs) / 16
    assert mfu_flops_per_token(TOY, 16) - mfu_flops_per_token(toy(UnpricedConv), 16) == pytest.approx(per_token)


def test_a_store_keeps_the_toy_specs_by_kind_and_refuses_an_unknown_kind():
    """A store's model config keeps explicit layer specs by kind and fields; one whose
    kind this process never registered is one clear error, not a wrong model."""
    from mtjax.store import layout

    stored = layout.config_to_json(TOY)
    assert layout.config_from_json(stored) == TOY
    stored["explicit_layer_specs"][0]["mixer"]["kind"] = "test_unregistered"
    with pytest.raises(registry.UnknownKind, match="no mixer kind 'test_unregistered' is registered"):
        layout.config_from_json(stored)


@functools.cache
def _sampling_store(tmp_dir):
    import mtjax.store
    from mtjax.run import load_weights

    cfg = toy(initializer_range=0.5, max_position_embeddings=24)  # large weights: varied greedy output
    path = mtjax.store.init_store(cfg, tmp_dir / "store", seed=3)
    loaded, params = load_weights(path)
    assert loaded == cfg  # the explicit layer specs read back from the store
    return path, cfg, params


@pytest.mark.slow  # compiles a cached block per spec and a whole forward
def test_streamed_sampling_decodes_the_toy_mixer_with_its_own_state(tmp_path):
    """Greedy tokens from the store, each layer carrying its own decode state (the toy's
    last inputs, attention's KV cache), equal the full forward's argmax at every step."""
    import mtjax.store
    from mtjax.stream.sample import StreamSampler

    path, cfg, params = _sampling_store(tmp_path)
    sampler = StreamSampler(mtjax.store.open(path))
    forward = jax.jit(functools.partial(model.forward, cfg))
    for prompt, n in (([7], 10), ([1, 2, 3, 4, 5, 6, 7, 8], 12)):
        got = sampler.generate(prompt, n, temperature=0)
        logits = forward(params, np.asarray([prompt + got], np.int32))[0]
        assert got == np.argmax(logits[len(prompt) - 1:-1], axis=-1).tolist()
        assert len(set(got)) > 1  # varied, so a wrong state or position shows
        assert got == generate.generate(cfg, params, prompt, n, temperature=0)
