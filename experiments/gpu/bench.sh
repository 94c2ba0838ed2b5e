#!/usr/bin/env bash
# The GPU benchmark (issue 5): host<->device bandwidth through pinned staging, streamed
# vs in-memory throughput, and MFU with the state 4x the engine's device budget.
# One command on one GPU, a few minutes (experiments/gpu/bench.py says what each part does):
#
#     bash experiments/gpu/bench.sh [--out DIR]      # DIR gets bench.json, bench.md, a trace
#     bash experiments/gpu/bench.sh --dry            # tiny sizes on the CPU (the test suite runs this)
#
# Then put DIR/bench.md into docs/benchmarks.md:
#     .venv/bin/python experiments/bench/harness.py section gpu-bench DIR/bench.md
set -euo pipefail
cd "$(dirname "$0")/../.."
# The image's python (PYTHON= picks another, e.g. .venv/bin/python) with the repository on
# its path: a GPU image has its own packages and no network. Missing ones: one line, exit 1.
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "bench.sh: no python at '$PY'; run with PYTHON=<a python with jax>" >&2; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" experiments/gpu/check_env.py bench.sh
# Let XLA's pinned host pool grow past its 64 GiB default (staging uses pinned_host).
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-96}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
export PYTHONUNBUFFERED=1
exec "$PY" experiments/gpu/bench.py "$@"
