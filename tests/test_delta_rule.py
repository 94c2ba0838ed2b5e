"""The chunked gated delta rule (mtjax.layers.delta_rule.chunked, fp32) equals the plain
token-by-token recurrence computed in float64, forward and backward, over lengths that
are and are not multiples of the chunk, with and without document starts and a state
carried in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.layers import delta_rule

B, H, DK, DV, CHUNK = 2, 3, 8, 6, 8


def _inputs(t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(B, t, H, DK)) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))  # L2-normed, as the mixer gives them
    v = rng.normal(size=(B, t, H, DV))
    g = -np.exp(rng.normal(-1.5, 1.0, size=(B, t, H)))  # decays exp(g) mostly 0.5 .. 0.95
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, t, H))))
    return q, k, v, g, beta


def _starts(t: int) -> np.ndarray:
    """Documents starting at 5 and 2 * CHUNK + 3 in row 0 (inside chunks; a carried state
    reaches its first tokens), at 0 and CHUNK in row 1 (a chunk's first token)."""
    s = np.zeros((B, t), bool)
    s[1, 0] = True
    s[0, [p for p in (5, 2 * CHUNK + 3) if p < t]] = True
    s[1, [p for p in (CHUNK,) if p < t]] = True
    return s


def _reference(inputs, starts, state):
    """float64 forward and the gradient of sum(o * w) + sum(S * w_s) w.r.t. every input."""
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in inputs]
        s0 = None if state is None else jnp.asarray(state, jnp.float64)
        st = None if starts is None else jnp.asarray(starts)

        def f(*a):
            o, s = delta_rule.recurrent(*a[:5], starts=st, state=a[5] if s0 is not None else None)
            return o, s

        o, s = f(*args, s0)
        weights = np.random.default_rng(9).normal(size=o.shape), np.random.default_rng(8).normal(size=s.shape)
        grads = jax.grad(lambda *a: jnp.sum(f(*a)[0] * weights[0]) + jnp.sum(f(*a)[1] * weights[1]),
                         argnums=tuple(range(6 if s0 is not None else 5)))(*args, *([s0] if s0 is not None else []))
        return np.asarray(o), np.asarray(s), [np.asarray(x) for x in grads], weights


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("t, documents, carried", [
    (3 * CHUNK, False, False), (3 * CHUNK - 3, False, True), (3 * CHUNK, True, True), (3 * CHUNK - 3, True, False),
    (5, True, True)])
def test_chunked_equals_the_float64_recurrence(t, documents, carried):
    inputs = _inputs(t)
    starts = _starts(t) if documents else None
    state = np.random.default_rng(3).normal(size=(B, H, DK, DV)) if carried else None
    want_o, want_s, want_grads, (w_o, w_s) = _reference(inputs, starts, state)

    args = [jnp.asarray(x, jnp.float32) for x in inputs] + ([jnp.asarray(state, jnp.float32)] if carried else [])
    st = None if starts is None else jnp.asarray(starts)

    def f(*a):
        return delta_rule.chunked(*a[:5], starts=st, state=a[5] if carried else None, chunk=CHUNK)

    o, s = jax.jit(f)(*args)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert _rel(o, want_o) < 1e-5 and _rel(s, want_s) < 1e-5
    loss = lambda *a: jnp.sum(f(*a)[0] * w_o) + jnp.sum(f(*a)[1] * w_s)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    for name, ours, theirs in zip(("q", "k", "v", "g", "beta", "state"), grads, want_grads):
        assert _rel(ours, theirs) < 1e-4, name


def test_a_document_start_drops_what_came_before():
    """The output from a document start on is the document's alone (the test above would
    pass for a rule that ignored starts on both sides: this one would not)."""
    t = 2 * CHUNK + 5
    inputs = _inputs(t)
    starts = np.zeros((B, t), bool)
    starts[:, 0] = starts[:, 11] = True
    o, _ = delta_rule.chunked(*(jnp.asarray(x, jnp.float32) for x in inputs), starts=jnp.asarray(starts), chunk=CHUNK)
    alone, _ = delta_rule.chunked(*(jnp.asarray(x[:, 11:], jnp.float32) for x in inputs), chunk=CHUNK)
    np.testing.assert_allclose(np.asarray(o)[:, 11:], np.asarray(alone), atol=1e-5)
    whole, _ = delta_rule.chunked(*(jnp.asarray(x, jnp.float32) for x in inputs), chunk=CHUNK)
    assert np.abs(np.asarray(whole)[:, 11:] - np.asarray(alone)).max() > 1e-2
