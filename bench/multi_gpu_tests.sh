#!/usr/bin/env bash
# One device call on a machine of several GPUs: precompile (every dtype, d = 64 and 128, the
# options), then the GPU tests of the multi-GPU code and of what it is built on (merges,
# streaming), the log under $OUT. Usage: TESTS=<pytest -k expr> bash bench/multi_gpu_tests.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/multi_gpu_env.sh"
precompile "head_dims=[64, 128], options=True"
timeout ${TEST_SECONDS:-400} python3 -m pytest -m gpu tests/test_distributed.py tests/test_merge.py tests/test_streaming.py \
    -q -p no:cacheprovider -rs --durations=8 ${TESTS:+-k "$TESTS"} > "$OUT/pytest-multi-gpu.log" 2>&1
echo "multi-gpu tests rc=$?"; tail -n 25 "$OUT/pytest-multi-gpu.log"
