"""Data-parallel cases, run in a child process with two CPU devices (tests/multidevice.py).

Each case trains 5 AdamW steps (clipping active) of a tiny model with the streaming
engine over both devices, and the in-memory reference trainer on the same batches;
the first case also with the engine on one device. Besides every tensor, it measures
what the engine moved: bytes that landed on the devices (each device's copy of staged
weights, its rows of tokens and kept activations), gradients that left (one device's
copy each), gradients summed across the devices (the all-reduced outputs of the
gradient programs), the store's and the gradient spill's I/O, and the device ledger's
peaks; and it records the description of the same step. Then bad device counts, and
the pinned staging path over both devices. Prints one JSON line of {case: results};
tests/test_multidevice.py asserts on it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import mtjax.store
from mtjax import hostmem, model
from mtjax.config import StoreConfig, StreamConfig
from mtjax.errors import MtjaxError
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, estimate
from mtjax.reference import ReferenceTrainer, eval_loss
from mtjax.stream import StreamEngine
from mtjax.stream.budget import tree_bytes
from mtjax.stream.mesh import DeviceMesh, local_devices
from mtjax.stream.step_bytes import StepShape
from mtjax.stream.staging import Placement

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16)
OPT = OptimConfig(lr=1e-3, warmup_steps=0, clip_norm=0.05, weight_decay=0.1)  # the norm is ~0.85: every step clips
STEPS, BATCH, SEQ = 5, 4, 8
DISK = {k: "disk" for k in ("compute", "master", "opt")}
CASES = {  # name: (tiers, accum, tied, activations, resident, also on one device)
    "ram-accum1": ({}, 1, False, "device", "none", True),
    "disk-accum4-host-activations": (DISK, 4, False, "host", "none", False),
    "ram-accum4-tied-resident": ({}, 4, True, "device", ("block.1", "head"), False),
}


def batches(accum: int):
    rng = np.random.default_rng(accum)
    return [rng.integers(0, CFG.vocab_size, (accum, BATCH, SEQ), dtype=np.int32) for _ in range(STEPS)]


def on_devices(tree) -> int:
    """Bytes of `tree`'s arrays in device buffers, every device's copy counted."""
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards)


def spread(a) -> str:
    """How an array lies over the devices: replicated, split, or on one device."""
    if len(a.sharding.device_set) == 1:
        return "one"
    return "replicated" if a.sharding.is_fully_replicated else "split"


def instrument(engine: StreamEngine, moved: dict, seen: dict) -> None:
    place = engine.placement

    def add(key, n):
        moved[key] = moved.get(key, 0) + int(n)

    def wrap(obj, name, after):
        inner = getattr(obj, name)

        def counted(*args):
            out = inner(*args)
            after(out, *args)
            return out

        setattr(obj, name, counted)

    wrap(place, "to_device", lambda out, buffers: add("h2d_weights", on_devices(out)))
    wrap(place, "tokens", lambda out, inputs: add("h2d_tokens", on_devices(out)))
    wrap(place, "unstash", lambda out, x: add("h2d_activations", on_devices(out)))
    wrap(place, "stash", lambda out, x: add("d2h_activations", x.nbytes))

    def left(out, tree):
        add("d2h_grads", tree_bytes(out))
        seen.setdefault("grads_out", set()).update(spread(a) for a in jax.tree.leaves(out))

    wrap(place, "host_arrays", left)

    def observed(event, value):
        if event == "grad":  # every micro-batch's gradient of every part passes here
            add("allreduce", tree_bytes(value))
            seen.setdefault("grads_made", set()).update(spread(a) for a in jax.tree.leaves(value))
        elif event == "keep":
            seen.setdefault("hidden", set()).add(spread(value))

    engine.observe(observed)


def rel_error(a, b) -> float:
    def rel(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

    return max(jax.tree.leaves(jax.tree.map(rel, a, b)))


def train(cfg, stream, tiers, accum, root: Path, mesh=None, measure=False, evaluate=False):
    store = mtjax.store.create(root, cfg, make_optimizer(OPT)) if tiers else None
    engine = StreamEngine(cfg, model.init_params(cfg, seed=1), OPT, stream,
                          StoreConfig(**{k: tiers.get(k, "ram") for k in DISK}), store=store, mesh=mesh,
                          batch_shape=(BATCH, SEQ))
    moved, seen = {}, {}
    if measure:
        instrument(engine, moved, seen)
    io0 = store.io_bytes if store else (0, 0)
    metrics = [engine.step(b) for b in batches(accum)]
    engine.flush()  # the last deferred update: each step streamed once and updated once
    if store:
        moved["disk_read"], moved["disk_write"] = (b - a for a, b in zip(io0, store.io_bytes))
    if engine.grads.spill is not None:
        moved["spill_read"], moved["spill_write"] = engine.grads.spill.io_bytes
    moved = dict(moved)  # the steps' (an evaluation streams the forward again)
    evaluated = engine.eval_loss(batches(accum)[0]) if evaluate else None
    out = {"eval": evaluated, "params": engine.params(), "opt": engine.opt_state(), "metrics": metrics, "moved": moved,
           "seen": {k: sorted(v) for k, v in seen.items()}, "peak": dict(engine.ledger.peak_by_use),
           "devices": engine.placement.mesh.count, "schedule": engine.plan(BATCH, SEQ, accum)}
    engine.close()
    if store:
        store.close()
    return out


def case(name: str, root: Path) -> dict:
    tiers, accum, tied, activations, resident, one_too = CASES[name]
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    stream = StreamConfig(activations=activations, resident=resident, remat="full")
    ref = ReferenceTrainer(cfg, model.init_params(cfg, seed=1), OPT)
    ref_metrics = [ref.step(b) for b in batches(accum)]
    two = train(cfg, stream, tiers, accum, root / "two", measure=True, evaluate=one_too)
    s = two["schedule"]
    t = s.traffic
    store = StoreConfig(**{k: tiers.get(k, "ram") for k in DISK})
    shape, tx = StepShape(BATCH, SEQ, accum), make_optimizer(OPT)
    plan = estimate(cfg, stream, store, shape, BUILTIN["h200"], tx=tx, devices=2)
    # The engine's devices read host memory, as a CPU profile's do (fp32 parts staged in place there).
    here = estimate(cfg, stream, store, shape, BUILTIN["cpu-2core"], tx=tx, devices=2)
    out = {
        "devices": two["devices"], "schedule_devices": s.devices,
        "vs_reference": max(rel_error(two["params"], ref.params), rel_error(two["opt"], ref.opt_state)),
        "loss_error": max(abs(m["loss"] - r["loss"]) for m, r in zip(two["metrics"], ref_metrics)),
        "norm_error": max(abs(m["grad_norm"] - float(r["grad_norm"])) for m, r in zip(two["metrics"], ref_metrics)),
        "clipped": min(float(r["grad_norm"]) for r in ref_metrics) > OPT.clip_norm,
        "moved": two["moved"], "seen": two["seen"],
        "described": {k: STEPS * v for k, v in {
            "h2d_weights": t.h2d_weights, "h2d_tokens": t.h2d_tokens, "h2d_activations": t.h2d_activations,
            "d2h_grads": t.d2h_grads, "d2h_activations": t.d2h_activations, "allreduce": t.allreduce,
            "disk_read": sum(v for k, v in t.disk_read.items() if k != "grads"),
            "disk_write": sum(v for k, v in t.disk_write.items() if k != "grads"),
            "spill_read": t.disk_read["grads"], "spill_write": t.disk_write["grads"]}.items() if v},
        "one_copy_per_device": STEPS * sum(s.part_bytes[p].compute for p in s.transfers),
        "allreduce_parts": sorted(s.allreduce),
        "peak": two["peak"], "device_plan": dataclasses.asdict(s.device),
        "planner_agrees": here.schedule == s and plan.traffic.allreduce == t.allreduce,
        "planner_interconnect_s": plan.times.interconnect,
    }
    if t.compute_handed:  # the first step, with no update before it, reads its new compute copies too
        out["described"]["disk_read"] += t.compute_handed
    if one_too:
        one = train(cfg, stream, tiers, accum, root / "one", mesh=DeviceMesh(jax.devices()[:1]))
        out["one_device"] = one["devices"]
        theirs = eval_loss(cfg, ref.params, batches(accum)[0])
        out["eval_error"] = max(abs(two["eval"][k] - theirs[k]) for k in theirs)  # the loss and the aux loss
        out["vs_one_device"] = max(rel_error(two["params"], one["params"]), rel_error(two["opt"], one["opt"]))
        out["one_device_h2d_weights"] = one["schedule"].traffic.h2d_weights
    return out


def bad_inputs() -> dict:
    out = {}
    try:
        local_devices(3)
    except MtjaxError as e:
        out["too_many"] = str(e)
    engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT, StreamConfig(resident="none"))
    try:
        engine.step(np.zeros((1, 3, SEQ), np.int32))  # 3 rows over 2 devices
    except MtjaxError as e:
        out["odd_batch"] = str(e)
    engine.close()
    return out


def replicated_put() -> dict:
    """What one replicated device_put of an aligned staging buffer does on the CPU backend:
    does each device's copy alias the buffer (no bytes copied), as one device's does?"""
    place = Placement(mesh=DeviceMesh(jax.devices()))
    buffer = hostmem.aligned_empty((64, 64), np.float32)
    w = place.to_device({"w": buffer})["w"]
    out = {"copies": len(w.addressable_shards),
           "aliased": [s.data.unsafe_buffer_pointer() == buffer.ctypes.data for s in w.addressable_shards]}
    place.close()
    return out


def pinned_path() -> dict:
    """The GPU's staging path (through pinned host memory), forced on the CPU devices:
    weights land whole on both, gradients leave from one, kept activations round-trip split."""
    place = Placement(pinned=True, mesh=DeviceMesh(jax.devices()))
    buffers = {"w": hostmem.aligned_empty((8, 4), np.float32)}
    buffers["w"][:] = np.arange(32, dtype=np.float32).reshape(8, 4)
    w = place.to_device(buffers)["w"]
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(4, 16), place.on_batch)
    back = place.unstash(place.stash(x))
    grads = place.host_arrays(place.start_to_host({"w": w}))["w"]
    out = {"pinned": place.pinned, "weights": spread(w), "copies_equal": all(
        np.array_equal(np.asarray(sh.data), buffers["w"]) for sh in w.addressable_shards),
           "activations": spread(back), "activations_equal": bool(np.array_equal(np.asarray(back), np.asarray(x))),
           "grads": spread(grads), "grads_equal": bool(np.array_equal(np.asarray(grads), buffers["w"]))}
    place.close()
    return out


def main(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: case(name, Path(tmp) / name) for name in names or CASES}
    results["bad_inputs"] = bad_inputs()
    results["pinned_path"] = pinned_path()
    results["replicated_put"] = replicated_put()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
