"""The gradient check of the transformers parity tests (test_hf_parity.py, test_hf_moe.py):
mtjax's gradient of every checkpoint tensor against transformers' on the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mtjax
from mtjax import hf


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
