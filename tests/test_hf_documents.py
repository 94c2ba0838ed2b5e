"""Packed documents and loss masks against Hugging Face transformers on the same weights.

A tiny Qwen2 with q/k/v biases and sliding-window blocks (window 3, shorter than every
document) is saved by transformers and loaded by mtjax. Each of three documents run
alone by transformers has the loss and gradients mtjax gives it inside one packed row;
a loss mask equals transformers' labels set to -100 on the masked positions.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import hf_models
import mtjax
from mtjax import documents, hf
from mtjax.batch import Batch
from mtjax.model_config import SLIDING
from mtjax.reference import loss_fn

pytestmark = pytest.mark.slow  # transformers + torch models side by side

LENGTHS, SEQ = (5, 4, 6), 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt, torch_model = hf_models.checkpoint(tmp_path_factory.mktemp("qwen2-docs"), "qwen2", num_hidden_layers=3,
                                             use_sliding_window=True, sliding_window=3, max_window_layers=1)
    cfg, params = mtjax.load_params(ckpt)
    assert SLIDING in cfg.layer_types and cfg.attention_bias
    return torch_model, cfg, params


def hf_loss_and_grads(torch_model, ids: np.ndarray, labels: np.ndarray):
    torch_model.zero_grad()
    ids, labels = (torch.as_tensor(a, dtype=torch.long) for a in (ids, labels))
    out = torch_model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.detach().numpy().copy() for n, p in torch_model.named_parameters()}


def ours_loss_and_grads(cfg, params, batch: Batch):
    inputs, _ = documents.step_inputs(batch)
    fn = jax.jit(jax.value_and_grad(lambda p, i: loss_fn(cfg, p, i.tokens, False, i.segments, i.targets)))
    loss, grads = fn(params, inputs.micro(0))
    return float(loss), grads


def assert_matches(cfg, ours, theirs):
    (loss, grads), (hf_loss, hf_grads) = ours, theirs
    assert abs(loss - hf_loss) <= 1e-6 * abs(hf_loss), (loss, hf_loss)
    errors = {}
    for spec in hf.layout(cfg):
        mine = hf.from_tree(spec, grads)
        want = hf_grads[spec.hf_name]
        errors[spec.hf_name] = np.linalg.norm(mine - want) / np.linalg.norm(want)
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= 1e-4}
    assert not bad, f"relative gradient error above 1e-4: {bad}"


def test_packed_documents_match_transformers_running_each_alone(model):
    torch_model, cfg, params = model
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, cfg.vocab_size, n) for n in LENGTHS]
    tokens = np.concatenate([*docs, np.zeros(SEQ - sum(LENGTHS), np.int64)])[None, None].astype(np.int32)
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(LENGTHS)]
                              + [np.zeros(SEQ - sum(LENGTHS))])[None, None].astype(np.int32)
    for j, doc in enumerate(docs, start=1):
        ours = ours_loss_and_grads(cfg, params, Batch(tokens, segments == j, segments))
        assert_matches(cfg, ours, hf_loss_and_grads(torch_model, doc[None], doc[None]))


def test_masked_loss_matches_transformers_labels_of_minus_100(model):
    torch_model, cfg, params = model
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, cfg.vocab_size, (1, 2, 12)).astype(np.int32)
    mask = rng.random(tokens.shape) < 0.5
    mask[0, 0, 1] = mask[0, 1, 5] = True  # something counts in each row
    labels = np.where(mask, tokens, -100)[0]
    ours = ours_loss_and_grads(cfg, params, Batch(tokens, mask))
    assert_matches(cfg, ours, hf_loss_and_grads(torch_model, tokens[0], labels))
