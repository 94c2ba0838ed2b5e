#!/usr/bin/env bash
# The GPU benchmark (issues 5 and 31): one JSON line per figure on stdout (the link's
# pinned and mapped GB/s, one block's staging time, streamed and in-memory step time,
# tokens/s and MFU, compiles after step 1, the forward's wait per part, and the streamed
# figures again in a process whose device memory is capped at a quarter of the state).
# One command on one GPU, under 8 minutes (experiments/gpu/bench.py says what each is):
#
#     bash experiments/gpu/bench.sh [--out DIR]   # writes its section of docs/benchmarks.md (date, machine);
#                                                 # DIR gets bench.jsonl, bench.json, bench.md, the traces
#     bash experiments/gpu/bench.sh --dry         # every path at tiny sizes on the CPU, figures marked
#                                                 # dry, no docs written (.ci/run and the test suite run it)
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
# One persistent compilation cache for the run: the capped run's process loads the
# programs the first one compiled instead of compiling them again.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/mtjax-bench-jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
exec "$PY" experiments/gpu/bench.py "$@"
