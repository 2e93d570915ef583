#!/usr/bin/env bash
# The GPU checks as one prepared command, on a machine with a GPU and JAX (no network needed): the GPU
# test subset, then the GPU benchmark. Logs and tools/results-style JSON go to ${OUT:-tools/results}.
#   bash tools/gpu_check.sh [bench cases, comma-separated, or all; default: the short set, about 5 minutes]
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-tools/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Uninstalled, the package hlopass.passes is the passes/ folder: a link git ignores (.gitignore).
"$python" -c "import hlopass.passes" 2>/dev/null || ln -sfn ../passes hlopass/passes
"$python" -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 150 "$python" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --tb=short 2>&1 | tee "$out/gpu_tests.log"
cases=${1:-}
timeout 900 "$python" -m tools.bench_gpu ${cases:+--cases "$cases"} --json "$out/gpu.json" 2>&1 | tee "$out/gpu_bench.log"
