"""What the equivalence tests share.

- `hf_run`: a tiny random transformers model saved as a checkpoint, run once forward and
  backward on random tokens, and the checkpoint loaded by mtjax; `assert_gradients_match`:
  mtjax's gradient of every checkpoint tensor against transformers' on those tokens
  (test_hf_parity.py, test_hf_moe.py, test_qwen3_5.py).
- `assert_export_bit_exact`: a loaded checkpoint saved again, and exported through a layer
  store, byte for byte, and reloaded by transformers (test_hf_moe.py, test_qwen3_5.py);
  `assert_greedy_decoding_equals_generate`: the streamed sampler's cached greedy tokens
  against transformers' `generate` (test_deepseek.py, test_gpt_oss.py, test_qwen3_5.py).
- `streamed_and_reference`: the same AdamW steps through the stream engine (in RAM, or on
  disk with MoE blocks in expert groups) and the in-memory reference, their losses step
  by step and the weights both end with (test_deepseek.py, test_gpt_oss.py,
  test_qwen3_5.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

import hf_models
import mtjax
import mtjax.store
from conftest import token_batches
from mtjax import hf, treepath
from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.reference import ReferenceTrainer
from mtjax.store.hf_export import export_hf
from mtjax.store.hf_import import import_hf
from mtjax.stream import StreamEngine
from mtjax.stream.sample import StreamSampler


def rel(a, b) -> float:
    """Relative L2 error of `a` against `b`, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@dataclasses.dataclass
class HfRun:
    """A transformers model, what it gave on `tokens`, and its checkpoint as mtjax loads it."""
    cfg: mtjax.ModelConfig
    params: dict
    tokens: np.ndarray
    torch_model: object
    hf_logits: np.ndarray
    hf_loss: float
    hf_grads: dict  # hub tensor name -> gradient, in the checkpoint's orientation
    router_logits: list  # one [tokens, experts] array per MoE layer (none unless asked for)
    ckpt: Path


def hf_run(directory: Path, family: str, overrides: dict, shape: tuple[int, int], router_logits: bool = False,
           sharded: bool = False) -> HfRun:
    """A tiny random `family` model with `overrides` saved under `directory` (`sharded`: in
    several files), its loss on random tokens of `shape` (with the load-balancing term where
    `router_logits`) and the gradient of every tensor of its language model, under the
    checkpoint's names; a buffer the checkpoint holds (DeepSeek-V3's routing bias) has none:
    zero."""
    ckpt, torch_model = hf_models.checkpoint(directory, family, sharded=sharded, **overrides)
    tokens = np.random.default_rng(0).integers(0, hf_models.BASE["vocab_size"], shape)
    ids = torch.as_tensor(tokens)
    forward = dict(output_router_logits=True) if router_logits else {}
    out = torch_model(input_ids=ids, labels=ids, **forward)
    out.loss.backward()
    grads = hf_models.hub_names(family, {_text_name(n): p.grad.numpy().copy() for n, p in torch_model.named_parameters()
                                         if not n.startswith(("model.vision_tower.", "model.multi_modal_projector."))})
    grads.update({n: np.zeros(b.shape, np.float32) for n, b in torch_model.state_dict().items()
                  if n.endswith("e_score_correction_bias")})
    cfg, params = mtjax.load_params(ckpt)
    routed = [r.detach().numpy() for r in out.router_logits] if router_logits else []
    return HfRun(cfg, params, tokens, torch_model, out.logits.detach().numpy(), out.loss.item(), grads, routed, ckpt)


def assert_gradients_match(cfg: mtjax.ModelConfig, params: dict, tokens: np.ndarray, hf_grads: dict,
                           rtol: float = 1e-4) -> list[str]:
    """Every trainable checkpoint tensor has a gradient on both sides (tied models: lm_head
    shares the embedding), of the same shape, within `rtol` relative L2 error; a gradient
    that is exactly zero in transformers (an expert no token was routed to) must be exactly
    zero here. `hf_grads`: checkpoint tensor name -> transformers' gradient, in the
    checkpoint's orientation. Returns the names checked."""
    grads = jax.jit(jax.grad(lambda p, t: mtjax.loss_fn(cfg, p, t, remat=False)))(params, jnp.asarray(tokens))
    specs = hf.layout(cfg)
    assert {s.hf_name for s in specs} == set(hf_grads)
    bad = {}
    for spec in specs:
        ours = hf.from_tree(spec, grads)
        theirs = hf_grads[spec.hf_name]
        assert ours.shape == theirs.shape, spec.hf_name
        if not np.any(theirs):
            ok, error = not np.any(ours), "nonzero where transformers' is zero"
        else:
            rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
            ok, error = rel <= rtol, f"relative error {rel:.2e}"
        if not ok:
            bad[spec.hf_name] = error
    assert not bad, f"gradients off (tolerance {rtol:g}): {bad}"
    return [s.hf_name for s in specs]


def assert_export_bit_exact(r: HfRun, out: Path, tokens: np.ndarray) -> None:
    """`r`'s parameters saved (out/saved) and its checkpoint imported (out/store) and
    exported (out/via-store): every tensor of the checkpoint, byte for byte, and no other;
    the saved checkpoint reloaded by transformers gives `r.torch_model`'s logits on
    `tokens` exactly."""
    mtjax.save_params(r.cfg, r.params, out / "saved")
    import_hf(r.ckpt, out / "store", compute_dtype="float32")
    export_hf(out / "store", out / "via-store")
    source = load_file(str(r.ckpt / hf.SINGLE_FILE))
    for written in ("saved", "via-store"):
        ours = load_file(str(out / written / hf.SINGLE_FILE))
        assert set(ours) == set(source)
        for name, array in source.items():
            assert ours[name].dtype == array.dtype and ours[name].tobytes() == array.tobytes(), (written, name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out / "saved", attn_implementation="eager",
                                                                 dtype=torch.float32)
    ids = torch.as_tensor(tokens)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(input_ids=ids).logits.numpy(), r.torch_model(input_ids=ids).logits.numpy())


def assert_greedy_decoding_equals_generate(ckpt: Path, torch_model, out: Path) -> None:
    """The checkpoint imported (out/store, fp32) and sampled by mtjax's streamed sampler
    greedily, 10 tokens after a one-token prompt and a nine-token one: transformers'
    `generate` from `torch_model`, token for token, and not one token repeated throughout
    (varied output, so a wrong cache or position shows)."""
    import_hf(ckpt, out / "store", compute_dtype="float32")
    sampler = StreamSampler(mtjax.store.open(out / "store"))
    for prompt in ([5], [3, 14, 15, 92, 65, 35, 89, 79, 32]):
        with torch.no_grad():
            want = torch_model.generate(torch.as_tensor([prompt]), max_new_tokens=10, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert sampler.generate(prompt, 10, temperature=0) == want, prompt
        assert len(set(want)) > 1


def _text_name(name: str) -> str:
    """A multimodal model's parameter under its text-only checkpoint name."""
    for prefix, text in hf.LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


@dataclasses.dataclass
class Streamed:
    """Flat leaf name -> weights: after the engine's steps, the reference's, and at the start."""
    streamed: dict
    expected: dict
    initial: dict
    split: dict  # the engine's expert groups per split MoE block


def streamed_and_reference(make_store, cfg: mtjax.ModelConfig, start: dict, opt: OptimConfig, tier: str,
                           metrics: tuple[str, ...] = ("loss",), steps: int = 5) -> Streamed:
    """`steps` AdamW steps from `start` of the stream engine and of the reference on the
    same batches (2 micro-batches of 2 rows of 12 tokens): each step's `metrics` equal
    within rtol 1e-5. `tier` ram: every part in RAM, whole; disk: compute, master and
    optimizer state in a store on disk (`make_store`, conftest's), MoE blocks split into
    expert groups of 3."""
    store, tiers, stream = None, StoreConfig(), StreamConfig(keep_every=1)
    if tier == "disk":
        store = make_store(cfg, make_optimizer(opt))
        tiers, stream = StoreConfig(compute="disk", master="disk", opt="disk"), StreamConfig(expert_group_size=3)
    engine = StreamEngine(cfg, start, opt, stream, tiers, store=store, batch_shape=(2, 12))
    reference = ReferenceTrainer(cfg, start, opt)
    try:
        for batch in token_batches(cfg.vocab_size, (2, 2, 12), steps):
            ours, ref = engine.step(batch), reference.step(batch)
            for metric in metrics:
                np.testing.assert_allclose(ours[metric], ref[metric], rtol=1e-5, err_msg=metric)
        return Streamed(*(treepath.flatten(t) for t in (engine.params(), reference.params, start)),
                        dict(engine.schedule.split))
    finally:
        engine.close()
        if store is not None:
            store.close()
