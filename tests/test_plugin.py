"""A plug-in proof: a token mixer mtjax knows nothing of and a family that uses it, both
defined here and registered through the public registries (mtjax.layers.registry,
mtjax.families), train, are priced, sample and go through a store's import and export.

The toy mixer is a causal convolution over each token's last `width` positions of its
own document (packed rows never mix documents), each head's channels sharing that head's
taps, then an output projection. Its registry entry gives its FLOPs (the taps' products
beyond the 2 per parameter and token the planner counts itself) and its decode state (the
last width - 1 inputs). The toy family is Llama's config.json whose layers the family's
`layer_specs` hook makes a width-3 convolution, softmax attention and a width-2
convolution in turn; its checkpoints name a block's mixer `mixer` (its `checkpoint_names`
rule), so a convolution's tensors are `model.layers.N.mixer.taps` and
`model.layers.N.mixer.out_proj.weight`. No file in mtjax/ names either.

Shown: the streamed engine equals the in-memory reference trainer (plain JAX) over 5
AdamW steps of 2 micro-batches on the RAM and disk tiers (test_stream's helpers); the
planner (`mtjax plan`) prices its FLOPs; the streamed sampler (and `mtjax generate`)
decodes it with its own state and gives the full forward's greedy tokens; a checkpoint of
the toy family goes into a store and comes out with the same tensors under the same
names; a store of the toy family opened where the family is not registered is one clear
error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtjax
from mtjax import cli, documents, families, generate, hf, model
from mtjax.data.tokenizer import ByteTokenizer
from mtjax.families import hf_config
from mtjax.layers import registry
from mtjax.layers.basic import Dense
from mtjax.layers.spec import LayerSpec, SoftmaxAttention
from mtjax.model_config import ConfigError, ModelConfig
from mtjax.plan.cost import mfu_flops_per_token
from conftest import assert_store_round_trip, checkpoint_tensors
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
                                                             decode_state=conv_state))


@dataclasses.dataclass(frozen=True)
class UnpricedConv(CausalConv):
    """The same mixer registered with no FLOPs of its own, to see what the planner adds."""

    kind: ClassVar[str] = "test_causal_conv_unpriced"


registry.register_mixer(UnpricedConv.kind, registry.MixerKind(module=ConvMixer, flops=lambda *a: 0.0,
                                                               decode_state=conv_state))

# Layer i's mixer: a width-3 convolution, softmax attention, a width-2 convolution, in turn.
WIDTHS = (3, None, 2)


def _from_hf(hf_dict: dict) -> dict:
    return hf_config.read_common(hf_dict, (hf_config.FULL,) * int(hf_dict["num_hidden_layers"]))


def _to_hf(cfg: ModelConfig) -> dict:
    return hf_config.write_common(cfg)


def _family(model_type: str, conv: type) -> families.Family:
    """Llama's config.json; its layers take WIDTHS' mixers (`conv` convolutions, unroped)."""

    def layer_specs(cfg: ModelConfig) -> tuple:
        return tuple(s if WIDTHS[i % 3] is None else dataclasses.replace(s, mixer=conv(WIDTHS[i % 3]), rope=None)
                     for i, s in enumerate(cfg.derived_layer_specs()))

    return families.Family(model_type, "TestConvForCausalLM", _from_hf, _to_hf, layer_specs=layer_specs,
                           checkpoint_names=lambda module: ["mixer" if m == "self_attn" else m for m in module])


FAMILY, UNPRICED = _family("test_conv_llama", CausalConv), _family("test_conv_llama_unpriced", UnpricedConv)
for _f in (FAMILY, UNPRICED):
    families.register(_f)


def toy(family: families.Family = FAMILY, **fields) -> ModelConfig:
    """Three layers of the toy family, test_stream's sizes."""
    return dataclasses.replace(CFG, model_type=family.model_type, num_hidden_layers=3, layer_types=(), **fields)


TOY = toy()


def test_the_family_gives_the_toy_layers():
    assert [type(s.mixer) for s in TOY.layer_specs] == [CausalConv, SoftmaxAttention, CausalConv]
    assert [s.mixer.width for s in TOY.layer_specs[::2]] == [3, 2]
    assert [s.rope is None for s in TOY.layer_specs] == [True, False, True]
    assert mtjax.from_hf_dict(mtjax.to_hf_dict(TOY)).layer_specs == TOY.layer_specs


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


def _plan(tmp_path, capsys, family: families.Family) -> dict:
    """`mtjax plan` of a config.json of `family`'s toy model: 2 micro-batches of 2 x 16."""
    ckpt = tmp_path / family.model_type
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(mtjax.to_hf_dict(toy(family))))
    rc = cli.main(["plan", str(ckpt / "config.json"), "--hardware", "cpu-2core", "--batch-size", "2",
                   "--seq-len", "16", "--grad-accum", "2", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_mtjax_plan_prices_the_toy_mixer_with_its_own_flops(tmp_path, capsys, monkeypatch):
    """The plan of the toy model less that of the same model whose mixer costs nothing:
    3 forwards of the conv layers' FLOPs (useful work), in the model FLOPs and in MFU's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # never the user's profile cache
    priced, unpriced = _plan(tmp_path, capsys, FAMILY), _plan(tmp_path, capsys, UNPRICED)
    convs = [s for s in TOY.layer_specs if isinstance(s.mixer, CausalConv)]
    assert len(convs) == 2
    per_micro_batch = sum(conv_flops(TOY, s, 2, 16, False) for s in convs)
    assert per_micro_batch > 0
    assert priced["model_flops"] - unpriced["model_flops"] == pytest.approx(3 * 2 * per_micro_batch)
    per_token = 3 * sum(conv_flops(TOY, s, 1, 16) for s in convs) / 16
    assert mfu_flops_per_token(TOY, 16) - mfu_flops_per_token(toy(UNPRICED), 16) == pytest.approx(per_token)


def test_the_store_imports_and_exports_the_toy_familys_checkpoint(tmp_path):
    """A checkpoint written from the toy model's params under the family's names goes into
    a store and out again with the same tensors, names and config.json."""
    params = model.init_params(TOY, seed=2)
    hf.save_params(TOY, params, tmp_path / "ckpt")
    saved = checkpoint_tensors(tmp_path / "ckpt")
    heads, d = TOY.num_attention_heads, TOY.hidden_size
    assert saved["model.layers.0.mixer.taps"].shape == (3, heads)
    assert saved["model.layers.2.mixer.taps"].shape == (2, heads)
    np.testing.assert_array_equal(saved["model.layers.0.mixer.taps"], params["blocks"][0]["self_attn"]["taps"])
    np.testing.assert_array_equal(saved["model.layers.2.mixer.out_proj.weight"],
                                  np.asarray(params["blocks"][2]["self_attn"]["out_proj"]["kernel"]).T)
    assert saved["model.layers.1.mixer.q_proj.weight"].shape == (heads * TOY.head_dim, d)
    assert not [n for n in saved if "self_attn" in n]
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["model_type"] == FAMILY.model_type
    assert_store_round_trip(tmp_path / "ckpt", tmp_path)  # the same tensors, names and config.json


def test_a_store_of_the_toy_family_opened_without_it_is_one_config_error(tmp_path, capsys):
    """A store records the model_type and its family rebuilds the layers; where that family
    is not registered, opening the store says so in one line, not a wrong model."""
    import mtjax.store
    from mtjax.store import layout

    assert layout.config_from_json(layout.config_to_json(TOY)) == TOY
    path = mtjax.store.init_store(TOY, tmp_path / "store", seed=0)
    before = {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    families.unregister(FAMILY.model_type)
    try:
        with pytest.raises(ConfigError, match=f"model_type '{FAMILY.model_type}' is not supported; supported: llama"):
            layout.config_from_json(layout.config_to_json(TOY))
        assert cli.main(["generate", str(path), "--tokenizer", "bytes", "--tokens", "2"]) != 0
        err = capsys.readouterr().err.strip()
        assert f"model_type '{FAMILY.model_type}' is not supported" in err and "\n" not in err
        assert "Traceback" not in err
        assert {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()} == before
    finally:
        families.register(FAMILY)


@functools.cache
def _sampling_store(tmp_dir):
    import mtjax.store
    from mtjax.checkpoint import load_weights

    cfg = toy(initializer_range=0.5, max_position_embeddings=24)  # large weights: varied greedy output
    path = mtjax.store.init_store(cfg, tmp_dir / "store", seed=3)
    loaded, params = load_weights(path)
    assert loaded == cfg  # the family rebuilds the toy layers
    return path, cfg, params


@pytest.mark.slow  # compiles a cached block per spec and a whole forward
def test_streamed_sampling_decodes_the_toy_mixer_with_its_own_state(tmp_path, capsys):
    """Greedy tokens from the store, each layer carrying its own decode state (the toy's
    last inputs, attention's KV cache), equal the full forward's argmax at every step;
    `mtjax generate` prints them."""
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
    # Byte ids of the prompt below the toy's vocabulary of 97.
    assert cli.main(["generate", str(path), "--tokenizer", "bytes", "--prompt", "AB", "--tokens", "12",
                     "--temperature", "0"]) == 0
    greedy = sampler.generate([ord("A"), ord("B")], 12, temperature=0)
    assert len(set(greedy)) > 1
    assert capsys.readouterr().out == "AB" + ByteTokenizer().decode(greedy) + "\n"


def test_no_file_of_the_package_names_the_toy_mixer_or_family():
    names = (CausalConv.kind, UnpricedConv.kind, FAMILY.model_type, "CausalConv", "ConvMixer")
    package = Path(mtjax.__file__).parent
    assert not [p for p in package.rglob("*.py") if any(n in p.read_text() for n in names)]
