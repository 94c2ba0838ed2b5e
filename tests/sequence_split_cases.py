"""Context-parallel cases, run in a child process with two CPU devices (tests/multidevice.py).

`split_attention` over both devices against the unsplit kernel (window, soft-cap, packed
documents; outputs and gradients), then the streaming engine with each row's tokens split
over both devices (stream.split: sequence) against the engine on one device: 3 AdamW steps
of a tiny model on rows of 384 tokens (3 of the kernel's 128-row blocks, split 192 | 192,
so a device's share starts mid-block), plain and packed rows; and XLA's temporaries of one
block's gradient at 8k tokens, per device, split over two devices and on one. Prints one
JSON line of results; tests/test_sequence_split.py asserts on them. With the argument
`planned` (a child of 16 devices), the device plan's price of a split attention block
against XLA's instead (`planned_block_cases`), the head's temporaries over two split
rows (`head_cases`), and a delta-net and a latent-attention block over two split rows
(`mixer_cases`).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import model, parts
from mtjax.attention_bytes import gathered_bytes
from mtjax.attention_chunked import SEQUENCE, causal_attention, split_attention
from mtjax.batch import Batch
from mtjax.config import StreamConfig
from mtjax.layers import registry
from mtjax.loss import head_bytes
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig
from mtjax.stream import StreamEngine, block_bytes, blockfns

from test_working_memory import CFG as WIDE

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
OPT = OptimConfig(lr=1e-3, warmup_steps=0, clip_norm=0.05, weight_decay=0.1)
STEPS, BATCH, SEQ = 3, 2, 384


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def kernel_cases() -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), (SEQUENCE,))
    put = lambda x: None if x is None else jax.device_put(x, jax.sharding.NamedSharding(  # noqa: E731
        mesh, jax.sharding.PartitionSpec(None, SEQUENCE)))
    out = {}
    for name, t, window, softcap, packed, rows in [("plain", 64, None, None, False, 8),
                                                   ("window-softcap", 60, 9, 2.0, False, 7),
                                                   ("documents", 54, None, None, True, 5)]:
        kq, kk, kv, kd = jax.random.split(jax.random.key(t), 4)
        q, dout = jax.random.normal(kq, (2, t, 4, 8)), jax.random.normal(kd, (2, t, 4, 8))
        k, v = jax.random.normal(kk, (2, t, 2, 8)), jax.random.normal(kv, (2, t, 2, 8))
        seg = None
        if packed:  # documents crossing the devices' boundary, padding (0) at one row's end
            seg = jnp.asarray(np.repeat([[1, 2, 3, 0], [4, 5, 6, 7]], [20, 11, 15, t - 46], axis=1), jnp.int32)

        def value_and_vjp(fn, q, k, v, d, s):
            return jax.jit(lambda q, k, v, d, s: (lambda o, vjp: (o, *vjp(d)))(
                *jax.vjp(lambda q, k, v: fn(q, k, v, s), q, k, v)))(q, k, v, d, s)

        want = value_and_vjp(lambda q, k, v, s: causal_attention(q, k, v, 0.3, window, t, softcap, s), q, k, v, dout, seg)
        got = value_and_vjp(lambda q, k, v, s: split_attention(q, k, v, 0.3, window, softcap, s, 2, rows),
                            *map(put, (q, k, v, dout, seg)))
        out[name] = {"errors": [rel(a, b) for a, b in zip(got, want)],
                     "out_spec": str(got[0].sharding.spec)}
    return out


def batches(packed: bool) -> list[Batch]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, CFG.vocab_size, (1, BATCH, SEQ), dtype=np.int32)
        if not packed:
            out.append(Batch(tokens))
            continue
        lengths = [[100, 150, 134], [250, 120, 14]]  # the second row ends in padding
        segments = np.stack([np.repeat(np.arange(1, 4), n) for n in lengths])[None].astype(np.int32)
        segments[0, 1, -14:] = 0
        out.append(Batch(tokens, segments != 0, segments))
    return out


def engine_case(packed: bool) -> dict:
    runs, kept = {}, []
    for devices in (1, 2):
        engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT,
                              StreamConfig(keep_every=1, devices=devices, split="sequence"))
        stop = engine.observe(lambda event, x: kept.append(str(x.sharding.spec)) if event == "keep" and devices == 2
                              else None)
        losses = [engine.step(b)["loss"] for b in batches(packed)]
        stop()
        runs[devices] = (losses, engine.params(), engine.fns.cfg.sequence_devices)
        engine.close()
    (l1, p1, s1), (l2, p2, s2) = runs[1], runs[2]
    return {"loss_error": max(abs(a - b) / abs(b) for a, b in zip(l2, l1)),
            "param_error": max(jax.tree.leaves(jax.tree.map(rel, p2, p1))),
            "sequence_devices": [s1, s2], "kept_specs": sorted(set(kept))}


def block_temp_bytes(devices: int, seq: int = 8192) -> int:
    """Each device's temporaries in the compiled gradient of one block over a row of `seq`
    tokens split over `devices` devices (memory_analysis: nothing runs)."""
    cfg, spec = dataclasses.replace(CFG, sequence_devices=devices), CFG.layer_specs[0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (SEQUENCE,))
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, SEQUENCE)))
    block = model.init_params(cfg, seed=0)["blocks"][0]
    grad = jax.grad(lambda b, x: jnp.sum(model.block_forward(cfg, spec, b, x)), argnums=(0, 1))
    return jax.jit(grad).lower(block, x).compile().memory_analysis().temp_size_in_bytes


def planned_block_cases() -> dict:
    """Each device's temporaries in the compiled recompute and backward of one gated
    softmax-attention block (tests/test_working_memory.py's Qwen3.5 model) as the engine
    runs it (blockfns._grad) over rows of 8192 tokens split over 2, 4, 8 and 16 devices
    (fp32) and 2 and 8 (bf16), one row and (under "<dtype> batch 2") two, beside the device
    plan's price for one device's share: the block's traced residuals and its mixer's
    working bytes, with and without the gathered keys and values
    (mtjax.attention_bytes.gathered_bytes), plus below fp32 the CPU's fp32 weight-gradient
    matmuls (block_bytes.promoted_bytes)."""
    spec, seq, out = WIDE.layer_specs[1], 8192, {}
    for dtype, batch, counts in (("float32", 1, (2, 4, 8, 16)), ("bfloat16", 1, (2, 8)),
                                 ("float32", 2, (2, 8)), ("bfloat16", 2, (2, 8))):
        model_cfg, key = dataclasses.replace(WIDE, compute_dtype=dtype), dtype + (" batch 2" if batch == 2 else "")
        out[key] = {}
        for devices in counts:
            cfg, share = dataclasses.replace(model_cfg, sequence_devices=devices), seq // devices
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (SEQUENCE,))
            on = lambda *axes: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))  # noqa: E731
            w = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=on())
                 for n, v in parts.schema(cfg, "block.1", "compute").items()}
            x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), np.dtype(dtype), sharding=on(None, SEQUENCE))
            grad = jax.jit(lambda w, x, dy: blockfns._grad(cfg, spec, w, x, dy, {}))
            temp = grad.lower(w, x, x).compile().memory_analysis().temp_size_in_bytes
            # the plan prices with the model's config (sequence_devices 1) and one device's share
            promoted = block_bytes.promoted_bytes(model_cfg, spec, batch, share) if dtype != "float32" else 0
            planned = (block_bytes.residual_bytes(model_cfg, spec, batch, share) + promoted
                       + registry.mixer(spec).working(model_cfg, spec, batch, share, "cpu", devices))
            gathered = gathered_bytes("cpu", dtype, batch, WIDE.num_key_value_heads, share, WIDE.head_dim, devices)
            out[key][devices] = {"temp": temp, "planned": planned, "gathered": gathered, "promoted": promoted}
    return out


def head_cases() -> dict:
    """Each device's temporaries in the compiled loss and gradient of the head (untied;
    blockfns._head, as the engine runs it) over two rows of 8192 tokens, whole on one
    device and split over 2 and 8, beside the plan's price of one device's share
    (mtjax.loss.head_bytes), with the spec of the hidden states' gradient; under "chunked"
    fp32 in chunks of 1024 tokens (a large vocabulary's several chunks), with the loss and
    the hidden states' gradient split against whole (`errors`); under "bf16 chunked" bf16
    in chunks of 1024."""
    seq, batch, out = 8192, 2, {}
    for name, dtype, chunk in (("float32", "float32", 0), ("bfloat16", "bfloat16", 0), ("chunked", "float32", 1024),
                               ("bf16 chunked", "bfloat16", 1024)):
        out[name] = {}
        for devices in (1, 2, 8):
            cfg = dataclasses.replace(WIDE, compute_dtype=dtype, tie_word_embeddings=False,
                                      sequence_devices=devices, head_chunk_tokens=chunk)
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (SEQUENCE,))
            on = lambda *axes: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))  # noqa: E731
            head = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=on())
                    for n, v in parts.schema(cfg, "head", "compute").items()}
            x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype),
                                     sharding=on(None, SEQUENCE))
            tokens = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=on(None, SEQUENCE))
            compiled = jax.jit(lambda h, x, t: blockfns._head(cfg, h, None, x, t, 1.0)).lower(head, x, tokens).compile()
            dx = compiled.output_shardings[3]
            out[name][devices] = {"temp": compiled.memory_analysis().temp_size_in_bytes,
                                  "planned": head_bytes(cfg, batch * seq // devices, "cpu"),
                                  "dx_spec": str(dx.spec) if hasattr(dx, "spec") else str(dx)}
    runs = {}
    for devices in (1, 2):  # 2 rows of 384 tokens in chunks of 128: several chunks a device
        cfg = dataclasses.replace(CFG, sequence_devices=devices, head_chunk_tokens=128)
        put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(  # noqa: E731
            jax.sharding.Mesh(np.array(jax.devices()[:devices]), (SEQUENCE,)), jax.sharding.PartitionSpec(None, SEQUENCE)))
        head = {n: 1 + 0.1 * jax.random.normal(jax.random.key(2), v.shape, v.dtype)
                for n, v in parts.schema(cfg, "head", "compute").items()}
        x = put(jax.random.normal(jax.random.key(3), (2, SEQ, cfg.hidden_size)))
        tokens = put(jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, SEQ)), jnp.int32))
        loss, _, _, dx = jax.jit(lambda h, x, t: blockfns._head(cfg, h, None, x, t, 1.0))(head, x, tokens)
        runs[devices] = (loss, dx)
    out["chunked"]["errors"] = [rel(runs[2][0], runs[1][0]), rel(runs[2][1], runs[1][1])]
    return out


# A small DeepSeek-V3 block (latent attention, dense feed-forward), width and heads as WIDE's.
LATENT = ModelConfig(model_type="deepseek_v3", vocab_size=256, hidden_size=128, intermediate_size=384,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16, q_lora_rank=64,
                     kv_lora_rank=64, qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=4096)
MIXERS = {"delta-net": (WIDE, 0), "latent": (LATENT, 0)}


def mixer_cases() -> dict:
    """A gated delta-net block (WIDE's block 0) and a latent-attention block, two rows a
    micro-batch: each device's temporaries in the compiled recompute and backward over rows
    of 4096 tokens split over 2 and 8 devices beside the plan's price of its share (as
    `planned_block_cases`), and under "errors" the block's output and gradients over two
    rows of 256 tokens split over 2 devices against one device's."""
    out = {}
    for name, (base, index) in MIXERS.items():
        spec, seq, batch = base.layer_specs[index], 4096, 2
        out[name] = {}
        for dtype in ("float32", "bfloat16"):
            model_cfg = dataclasses.replace(base, compute_dtype=dtype)
            out[name][dtype] = {}
            for devices in (2, 8):
                cfg, share = dataclasses.replace(model_cfg, sequence_devices=devices), seq // devices
                mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (SEQUENCE,))
                on = lambda *axes: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))  # noqa: E731
                w = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=on())
                     for n, v in parts.schema(cfg, f"block.{index}", "compute").items()}
                x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), np.dtype(dtype), sharding=on(None, SEQUENCE))
                grad = jax.jit(lambda w, x, dy: blockfns._grad(cfg, spec, w, x, dy, {}))
                temp = grad.lower(w, x, x).compile().memory_analysis().temp_size_in_bytes
                promoted = block_bytes.promoted_bytes(model_cfg, spec, batch, share) if dtype != "float32" else 0
                split = registry.mixer(spec).working(model_cfg, spec, batch, share, "cpu", devices)
                whole = registry.mixer(spec).working(model_cfg, spec, batch, share, "cpu", 1)
                out[name][dtype][devices] = {
                    "temp": temp, "planned": block_bytes.residual_bytes(model_cfg, spec, batch, share) + promoted + split,
                    "gathered": split - whole}
        block = model.init_params(base, seed=0)["blocks"][index]
        x, dy = (jax.random.normal(jax.random.key(k), (batch, 256, base.hidden_size)) for k in (1, 2))
        runs = {}
        for devices in (1, 2):
            cfg = dataclasses.replace(base, sequence_devices=devices)
            put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(  # noqa: E731
                jax.sharding.Mesh(np.array(jax.devices()[:devices]), (SEQUENCE,)), jax.sharding.PartitionSpec(None, SEQUENCE)))
            vjp = jax.jit(lambda b, x, dy, cfg=cfg: (lambda y, back: (y, *back(dy)))(
                *jax.vjp(lambda b, x: model.block_forward(cfg, spec, b, x), b, x)))
            runs[devices] = vjp(block, put(x), put(dy))
        (y1, db1, dx1), (y2, db2, dx2) = runs[1], runs[2]
        out[name]["errors"] = [rel(y2, y1), rel(dx2, dx1), max(jax.tree.leaves(jax.tree.map(rel, db2, db1)))]
        out[name]["out_spec"] = str(y2.sharding.spec)
    return out


def main() -> None:
    if sys.argv[1:] == ["planned"]:  # a child of 16 devices
        print(json.dumps({**planned_block_cases(), "head batch 2": head_cases(), "mixers": mixer_cases()}))
        return
    assert len(jax.devices()) == 2
    results = {"kernel": kernel_cases(), "plain": engine_case(False), "documents": engine_case(True),
               "block_temp_bytes": [block_temp_bytes(1), block_temp_bytes(2)]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
