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
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
# Let XLA's pinned host pool grow past its 64 GiB default (staging uses pinned_host).
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-96}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
export PYTHONUNBUFFERED=1
exec "$PY" experiments/gpu/bench.py "$@"
