#!/usr/bin/env bash
# Prove the GPU path on a lent GPU in under 8 minutes, with random weights (no model download).
# Needs this checkout installed with its dependencies (pip install -e .). See docs/gpu.md.
#   bench/gpu_check.sh                 # all four parts (bench/gpu_check.py --help for the knobs)
#   bench/gpu_check.sh --llama-layers 8
# Exits 2 with a message where there is no CUDA device; --smoke runs the code on CPU at tiny shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
exec timeout "${GPU_CHECK_TIMEOUT_S:-470}" "${PYTHON:-python}" bench/gpu_check.py "$@"
