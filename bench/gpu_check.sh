#!/usr/bin/env bash
# Prove the GPU path on a lent GPU, with random weights (no model download), then the daemon path.
# Needs this checkout installed with its dependencies (pip install -e .). See docs/gpu.md.
#   bench/gpu_check.sh                 # the four kernel/runner parts, then the daemon (below)
#   bench/gpu_check.sh --llama-layers 8
# Exits 2 with a message where there is no CUDA device; --smoke runs the code on CPU at tiny shapes.
#
# The daemon path (after the parts succeed; not with --smoke or --help, nor with GPU_CHECK_DAEMON=0):
# one `streamchat serve` (one core process on the GPU, the bundled model) per session count in
# GPU_CHECK_SESSIONS (default "1 16 64"), driven through its websocket by bench/longchat.py: each
# session brings a history past the window, then all ask at once; one JSON line per count (prefill
# seconds, failed responses, aggregate decode tokens/s, inter-token latency p50/p99).
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
python="${PYTHON:-python}"
timeout "${GPU_CHECK_TIMEOUT_S:-470}" "$python" bench/gpu_check.py "$@"

for arg in "$@"; do
    case "$arg" in --smoke | --help | -h) exit 0 ;; esac
done
[ "${GPU_CHECK_DAEMON:-1}" = 0 ] && exit 0
for sessions in ${GPU_CHECK_SESSIONS:-1 16 64}; do
    # --max-running: every session decodes in the same step (the default may queue 64)
    timeout "${GPU_CHECK_DAEMON_TIMEOUT_S:-300}" "$python" bench/longchat.py --sessions "$sessions" \
        --history "${GPU_CHECK_HISTORY:-2300}" --tokens "${GPU_CHECK_TOKENS:-32}" --skip-transformers --json \
        --daemon-arg=--device=cuda --daemon-arg=--max-running="$(( sessions > 64 ? sessions : 64 ))"
done
