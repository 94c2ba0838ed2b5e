"""Shared test setup: JAX on the CPU at full matmul precision, and the tiny models, token
batches and temporary stores the tests build.

Test modules import the factories (`from conftest import tiny_config`) where a module-level
constant needs them; tests take the fixtures. Every factory keeps the numbers a test asks
for: a test that depends on a size names it as an override.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from mtjax.model_config import ModelConfig  # noqa: E402

# The tiny dense (Llama-like) model most tests use: 2 blocks, 4 query heads of 8 over 2
# key-value heads. Tests change what they need: tiny_config(num_hidden_layers=4, ...).
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
# The same width as 2 query heads of 16 over one key-value head (grouped-query attention's extreme).
ONE_KV_HEAD = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
# A tiny Qwen3-MoE: 7 experts, top 2, on blocks 0 and 2 of 3 (block 1 dense).
TINY_MOE = dict(model_type="qwen3_moe", vocab_size=61, intermediate_size=40, num_hidden_layers=3, qk_norm=True,
                num_experts=7, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
                router_aux_loss_coef=0.5, moe_layers=(0, 2))

# The same tiny model on `mtjax train`'s command line (ONE_KV_HEAD's attention).
TINY_MODEL_ARGS = ("--model.hidden_size=32", "--model.intermediate_size=64", "--model.num_hidden_layers=2",
                   "--model.num_attention_heads=2", "--model.num_key_value_heads=1", "--model.head_dim=16")


def tiny_config(**overrides) -> ModelConfig:
    """A new tiny dense ModelConfig: TINY with `overrides` (any ModelConfig field)."""
    return ModelConfig(**{**TINY, **overrides})


def tiny_moe_config(**overrides) -> ModelConfig:
    """A new tiny MoE ModelConfig: TINY_MOE over TINY, with `overrides`."""
    return tiny_config(**{**TINY_MOE, **overrides})


def tokens(vocab_size: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """One int32 token array of `shape` in [0, vocab_size), from a generator seeded with `seed`."""
    return token_batches(vocab_size, shape, 1, seed)[0]


def token_batches(vocab_size: int, shape: tuple[int, ...], count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` int32 token arrays of `shape` in [0, vocab_size), drawn one after another
    from one generator seeded with `seed` (the same seed gives the same batches)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, shape, dtype=np.int32) for _ in range(count)]


def checkpoint_tensors(ckpt: Path) -> dict[str, np.ndarray]:
    """{name: array} of a Hugging Face checkpoint directory's model.safetensors."""
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_store_round_trip(ckpt: Path, work: Path) -> Path:
    """`ckpt` imported into a layer store under `work` and exported again: the same tensor
    names and values, and the same config.json. Returns the exported directory."""
    import json

    from mtjax.store.hf_export import export_hf
    from mtjax.store.hf_import import import_hf

    import_hf(ckpt, work / "store")
    out = export_hf(work / "store", work / "out")
    saved, exported = checkpoint_tensors(ckpt), checkpoint_tensors(out)
    assert exported.keys() == saved.keys()
    for name in saved:
        np.testing.assert_array_equal(exported[name], saved[name])
    assert json.loads((out / "config.json").read_text()) == json.loads((ckpt / "config.json").read_text())
    return out


@pytest.fixture
def make_store(tmp_path):
    """A factory of new layer stores under this test's tmp_path:
    make_store(cfg, tx=None, name="store", copies=2) -> an open mtjax.store.Store."""
    import mtjax.store

    def make(cfg: ModelConfig, tx=None, name: str = "store", **kwargs):
        return mtjax.store.create(tmp_path / name, cfg, tx, **kwargs)

    return make
