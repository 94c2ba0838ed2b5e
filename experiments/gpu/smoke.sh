#!/usr/bin/env bash
# GPU equality check of the streaming engine: five AdamW steps (fp32 at full matmul
# precision, clipping active, accumulation 2) streamed == the whole model in device
# memory, for several keep/prefetch settings and host-kept activations. Speed is
# experiments/gpu/bench.sh's job. Run from the repository root on a CUDA machine:
#
#     bash experiments/gpu/smoke.sh            # about a minute
#
# Exits non-zero when the engines disagree. Runs on the CPU too (no accelerator: a line says so).
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
exec "$PY" - "$@" <<'PYEOF'
import sys

import jax
import numpy as np

from mtjax import model
from mtjax.config import StreamConfig
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
    for k, depth, kept in ((1, 1, "device"), (2, 3, "device"), (0, 2, "device"), (1, 2, "host")):
        eng = StreamEngine(cfg, params, opt, StreamConfig(keep_every=k, prefetch_depth=depth, activations=kept))
        for b in data:
            eng.step(b)
        results[k, depth, kept] = eng
    for b in data:
        ref.step(b)
    ok = True
    for (k, depth, kept), eng in results.items():
        p_err, o_err = rel_err(eng.params(), ref.params), rel_err(eng.opt_state(), ref.opt_state)
        good = p_err <= 1e-5 and o_err <= 1e-5
        ok &= good
        print(f"equality k={k} depth={depth} activations={kept}: params {p_err:.2e}, opt state {o_err:.2e} -> {'OK' if good else 'MISMATCH'}")
        print(f"  device bytes peak {eng.ledger.peak / 2**20:.1f} MiB of budget {eng.ledger.budget / 2**20:.1f} MiB; "
              f"pinned host staging: {eng.placement.pinned} {eng.placement.pinned_error or ''}")
        eng.close()
    del ref, results

sys.exit(0 if ok else 1)
PYEOF
