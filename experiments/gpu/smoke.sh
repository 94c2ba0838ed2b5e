#!/usr/bin/env bash
# GPU smoke test of the streaming engine: streamed == reference on a small model, then
# step times of both on a bigger one. Run from the repository root on a CUDA machine
# with jax installed:
#
#     bash experiments/gpu/smoke.sh            # ~1-3 minutes
#
# Exits non-zero when the engines disagree. Runs on the CPU too (slowly) when no GPU
# is present: SMOKE_WIDTH=256 SMOKE_LAYERS=2 bash experiments/gpu/smoke.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# The image's python (PYTHON= picks another, e.g. .venv/bin/python) with the repository on
# its path: a GPU image has its own packages and no network. Missing ones: one line, exit 1.
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "smoke.sh: no python at '$PY'; run with PYTHON=<a python with jax>" >&2; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" experiments/gpu/check_env.py smoke.sh
# Let XLA's pinned host pool grow past its 64 GiB default (staging uses pinned_host).
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-96}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
export SMOKE_TRACE="${SMOKE_TRACE:-${OUT:-/tmp}/mtjax_smoke_trace.json}"  # Chrome trace of the stream
exec "$PY" - "$@" <<'PYEOF'
import os, statistics, sys, time

import jax
import numpy as np

from mtjax import model
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

dev = jax.devices()[0]
print(f"jax {jax.__version__}, device {dev.device_kind} ({dev.platform}), "
      f"memory kinds {[m.kind for m in dev.addressable_memories()]}")
if dev.platform == "cpu":
    print("warning: no accelerator found; running on the CPU")


def rel_err(a, b):
    return max(jax.tree.leaves(jax.tree.map(
        lambda x, y: float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                           / max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30)), a, b)))


# 1. Equality: fp32 at full matmul precision, AdamW with clipping active, accumulation 2.
with jax.default_matmul_precision("highest"):
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    opt = OptimConfig(lr=1e-3, clip_norm=0.05, schedule="constant")
    params = model.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab_size, (2, 2, 64), dtype=np.int32) for _ in range(5)]
    ref = ReferenceTrainer(cfg, params, opt)
    results = {}
    for k, depth in ((1, 1), (2, 3), (0, 2)):
        eng = StreamEngine(cfg, params, opt, keep_every=k, prefetch_depth=depth)
        for b in data:
            eng.step(b)
        results[k, depth] = eng
    for b in data:
        ref.step(b)
    ok = True
    for (k, depth), eng in results.items():
        p_err, o_err = rel_err(eng.params(), ref.params), rel_err(eng.opt_state(), ref.opt_state)
        good = p_err <= 1e-5 and o_err <= 1e-5
        ok &= good
        print(f"equality k={k} depth={depth}: params {p_err:.2e}, opt state {o_err:.2e} -> {'OK' if good else 'MISMATCH'}")
        print(f"  device bytes peak {eng.ledger.peak / 2**20:.1f} MiB of budget {eng.ledger.budget / 2**20:.1f} MiB; "
              f"pinned host staging: {eng.placement.pinned} {eng.placement.pinned_error or ''}")
        eng.close()
    del ref, results

# 2. Step times on a bigger model (bf16 compute).
layers = int(os.environ.get("SMOKE_LAYERS", 8))
width = int(os.environ.get("SMOKE_WIDTH", 2048))
seq, batch = int(os.environ.get("SMOKE_SEQ", 1024)), int(os.environ.get("SMOKE_BATCH", 4))
heads = max(width // 128, 1)
cfg = ModelConfig(vocab_size=32000, hidden_size=width, intermediate_size=int(width * 2.6875),
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                  head_dim=width // heads, compute_dtype="bfloat16")
params = model.init_params(cfg, seed=0)
data = [np.random.default_rng(i).integers(0, cfg.vocab_size, (1, batch, seq), dtype=np.int32) for i in range(4)]
times = {}
for name in ("reference", "stream"):
    eng = ReferenceTrainer(cfg, params, OptimConfig()) if name == "reference" else StreamEngine(cfg, params, OptimConfig())
    ts = []
    for b in data:
        t0 = time.perf_counter()
        eng.step(b)
        ts.append(time.perf_counter() - t0)
    times[name] = statistics.median(ts[1:])
    if name == "stream":
        print("  stream stage seconds:", {k: round(v, 3) for k, v in eng.stage_seconds().items()})
        eng.write_trace(os.environ["SMOKE_TRACE"])
        eng.close()
    del eng
toks = batch * seq
print(f"model {model.num_params(cfg) / 1e6:.0f}M params ({layers} x {width}, bf16 compute), batch {batch} x seq {seq}")
for name, s in times.items():
    print(f"  {name:9s} step {s * 1e3:8.1f} ms  {toks / s:9.0f} tokens/s")
print(f"  streamed / reference = {times['stream'] / times['reference']:.2f}; trace: {os.environ['SMOKE_TRACE']}")
sys.exit(0 if ok else 1)
PYEOF
