"""Gated delta-net linear attention (Qwen3-Next, Qwen3.5; mtjax.layers.spec.GatedDeltaNet).

As transformers computes it (modeling_qwen3_next.py, modeling_qwen3_5.py):

    q, k, v, z, b, a   input projections: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b,
                       in_proj_a; Qwen3-Next's in_proj_qkvz and in_proj_ba, laid out per
                       key head ([q, k, v of its value heads, z of them] and [b, a])
    q, k, v            a causal depthwise convolution (conv1d, linear_conv_kernel_dim
                       wide, no bias) with SiLU over their concatenation
    q, k               L2-normalised per head (epsilon 1e-6), repeated to the value heads
    beta, g            sigmoid(b); -exp(A_log) * softplus(a + dt_bias), fp32
    o                  the gated delta rule (mtjax.layers.delta_rule), fp32 state
    out_proj           of RMSNorm(o) * weight * silu(z) per value head

Packed rows: the convolution does not reach across a document start and the delta
rule's state restarts there, so each document sees only its own tokens. Its decode state
is constant in size: the convolution's last kernel - 1 inputs and the rule's state.

Rows split over devices (stream.split: sequence): the projections, the convolution (each
device fetching the K - 1 inputs before its share) and each chunk's products and solves
run on the device's share, but the scan carrying the state from chunk to chunk is
sequential in t and XLA does not split it: every device all-gathers the whole row's scan
inputs, runs the scan over every chunk of the row and keeps its share of the output (and
likewise in the backward). Same results as one device (tests/test_sequence_split.py);
the gathered inputs and their cotangents are priced (`working`), and the replicated
scan's FLOPs once per device (`flops`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtjax.layers import delta_rule, registry
from mtjax.layers.basic import Dense
from mtjax.layers.spec import GatedDeltaNet, LayerSpec
from mtjax.model_config import ModelConfig

L2_EPS = 1e-6  # transformers' l2norm, as the FLA kernels have it


def widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(key width, value width, convolution channels): hk * dk, hv * dv, 2 hk dk + hv dv."""
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return key, value, 2 * key + value


def document_starts(segments):
    """bool [b, t]: where a document starts in rows of document ids `segments` (None: None)."""
    if segments is None:
        return None
    first = jnp.ones_like(segments[:, :1], bool)
    return jnp.concatenate([first, segments[:, 1:] != segments[:, :-1]], axis=1)


def causal_conv(x, weight, starts=None, history=None):
    """SiLU of the causal depthwise convolution of x [b, t, C] by weight [C, 1, K], each
    output from the inputs at t - K + 1 .. t of its own document; `history` [b, K - 1, C]:
    the inputs before x (decoding; else zeros). Computed in fp32, returned in x's dtype,
    with the last K - 1 inputs (the next call's history)."""
    b, t, c = x.shape
    width = weight.shape[-1]
    history = jnp.zeros((b, width - 1, c), x.dtype) if history is None else history.astype(x.dtype)
    full = jnp.concatenate([history, x], axis=1).astype(jnp.float32)  # [b, K - 1 + t, C]
    ids = None if starts is None else jnp.cumsum(starts.astype(jnp.int32), axis=1)
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    out = jnp.zeros((b, t, c), jnp.float32)
    for j in range(width):  # tap j reads the input K - 1 - j tokens back
        back = width - 1 - j
        term = full[:, j:j + t] * w[:, j]
        if ids is not None and back:
            same = jnp.pad(ids[:, :t - back], ((0, 0), (back, 0)), constant_values=-1) == ids
            term = jnp.where(same[..., None], term, 0.0)
        out = out + term
    return jax.nn.silu(out).astype(x.dtype), full[:, t:].astype(x.dtype)


class Conv(nnx.Module):
    """The depthwise convolution's weight [channels, 1, kernel], as transformers' Conv1d holds it."""

    def __init__(self, channels: int, kernel: int, cfg: ModelConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        self.weight = nnx.Param(init(rngs.params(), (channels, 1, kernel), jnp.float32))


class GatedRMSNorm(nnx.Module):
    """RMSNorm(x) * weight * silu(gate) over the last axis, as transformers' Qwen3NextRMSNormGated:
    statistics in fp32, the weight applied in x's dtype, the gate in fp32."""

    def __init__(self, dim: int, cfg: ModelConfig):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = cfg.rms_norm_eps

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        y = self.weight[...].astype(x.dtype) * normed
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _l2(x):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)


class DeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs):
        d, hv = cfg.hidden_size, cfg.linear_num_value_heads
        key, value, channels = widths(cfg)
        self.cfg, self.grouped = cfg, spec.mixer.grouped
        if self.grouped:
            self.in_proj_qkvz = Dense(d, 2 * key + 2 * value, False, cfg, rngs)
            self.in_proj_ba = Dense(d, 2 * hv, False, cfg, rngs)
        else:
            self.in_proj_qkv = Dense(d, channels, False, cfg, rngs)
            self.in_proj_z = Dense(d, value, False, cfg, rngs)
            self.in_proj_b = Dense(d, hv, False, cfg, rngs)
            self.in_proj_a = Dense(d, hv, False, cfg, rngs)
        self.conv1d = Conv(channels, cfg.linear_conv_kernel_dim, cfg, rngs)
        self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
        # decay rates A uniform in [1, 16] (transformers draws them in [0.01, 16])
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg)
        self.out_proj = Dense(value, d, False, cfg, rngs)

    def projections(self, x):
        """(q, k, v concatenated [b, t, channels], z [b, t, hv, dv], b [b, t, hv], a [b, t, hv])."""
        cfg = self.cfg
        bs, t, _ = x.shape
        hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        if not self.grouped:
            z = self.in_proj_z(x).reshape(bs, t, hv, dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = hv // hk  # value heads per key head
        qkvz = self.in_proj_qkvz(x).reshape(bs, t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        b, a = jnp.split(self.in_proj_ba(x).reshape(bs, t, hk, 2 * r), 2, axis=-1)
        mixed = jnp.concatenate([y.reshape(bs, t, -1) for y in (q, k, v)], axis=-1)
        return mixed, z.reshape(bs, t, hv, dv), b.reshape(bs, t, hv), a.reshape(bs, t, hv)

    def mix(self, x, starts, conv_history, state):
        """(output [b, t, d], the convolution's history, the rule's final state)."""
        cfg = self.cfg
        bs, t, _ = x.shape
        key, _, _ = widths(cfg)
        r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        mixed, z, b, a = self.projections(x)
        mixed, history = causal_conv(mixed, self.conv1d.weight[...], starts, conv_history)
        q, k, v = jnp.split(mixed, [key, 2 * key], axis=-1)
        q, k = (jnp.repeat(_l2(y.reshape(bs, t, cfg.linear_num_key_heads, -1)), r, axis=2) for y in (q, k))
        v = v.reshape(bs, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        o, state = delta_rule.chunked(q, k, v, g, beta, starts, state)  # [b, t, hv, dv] in v's dtype
        out = self.norm(o, z).reshape(bs, t, -1)
        return self.out_proj(out), history, state

    def __call__(self, x, cos, sin, positions, segments=None):
        return self.mix(x, document_starts(segments), None, None)[0]

    def decode(self, x, state: dict, start, cos, sin, positions):
        """New tokens x [b, t, d] after those whose convolution inputs and rule state
        `state` holds ({"conv": [b, K - 1, channels], "recurrent": [b, hv, dk, dv] fp32})."""
        y, history, recurrent = self.mix(x, None, state["conv"], state["recurrent"])
        return y, {"conv": history.astype(state["conv"].dtype), "recurrent": recurrent}


def flops(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, executed: bool = True) -> float:
    """Per token and value head, over chunks of c (mtjax.layers.delta_rule.chunked): the
    chunk's products k k^T, q k^T (2 c dk each) and the two triangular solves (c (dk +
    dv)); in the scan over chunks the scores times u (2 c dv) and the state's reads and
    write (6 dk dv); and the convolution (2 K per channel). Linear in `seq`.

    Executed on rows split over devices (`cfg.splits_rows`, `seq` the whole row), every
    device runs the scan over the whole row (module docstring): the sum over the devices
    counts it `cfg.sequence_devices` times, so a device's share of the sum holds all of it."""
    c = min(delta_rule.CHUNK, seq)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    scan = 2 * c * dv + 6 * dk * dv
    copies = cfg.sequence_devices if executed else 1
    per_head = 4 * c * dk + c * (dk + dv) + copies * scan
    conv = 2 * cfg.linear_conv_kernel_dim * widths(cfg)[2]
    return float(batch * seq * (cfg.linear_num_value_heads * per_head + conv))


def decode_state(cfg: ModelConfig, spec: LayerSpec, batch: int, length: int) -> dict:
    """The convolution's last kernel - 1 inputs (compute dtype) and the rule's fp32 state:
    the same size whatever `length`."""
    return {"conv": jax.ShapeDtypeStruct((batch, cfg.linear_conv_kernel_dim - 1, widths(cfg)[2]),
                                         np.dtype(cfg.compute_dtype)),
            "recurrent": jax.ShapeDtypeStruct((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                               cfg.linear_value_head_dim), np.float32)}


def working(cfg: ModelConfig, spec: LayerSpec, batch: int, seq: int, platform: str, devices: int = 1) -> int:
    """On one device none beyond the block's vjp residuals, which hold all this layer keeps:
    q, k, v, z, beta and g, the convolution's inputs, each chunk's fp32 [c, c] decay,
    system, inverse and score matrices and the fp32 state [value heads, dk, dv] entering
    each chunk (the planner traces them from the block, mtjax.stream.block_bytes.residual_bytes).
    Its backward's per-chunk cotangents take the place of the residuals consumed by then:
    XLA's temporaries for a block's recompute and backward are its residuals within 5%
    (tests/test_working_memory.py).

    On a row split over `devices` (`seq` one device's share) the scan over chunks runs on
    the whole row on every device (module docstring): beyond its share, the scan's fp32
    inputs gathered from the other shares (per token and value head its u and key terms,
    dv and dk, the query and key scaled by the decays, 2 dk, and a row of the chunk's
    scores, c) and their cotangents over those tokens. Without it a Qwen3.5 delta-net block
    over 8 devices held 1.76-1.92x its price (tests/test_sequence_split.py)."""
    if devices == 1:
        return 0
    c = min(delta_rule.CHUNK, seq * devices)
    per_token = cfg.linear_num_value_heads * (3 * cfg.linear_key_head_dim + cfg.linear_value_head_dim + c)
    return 2 * batch * seq * (devices - 1) * per_token * 4


registry.register_mixer(GatedDeltaNet.kind, registry.MixerKind(module=DeltaNet, flops=flops, decode_state=decode_state,
                                                                working=working))
