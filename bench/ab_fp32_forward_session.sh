#!/usr/bin/env bash
# One device call: the fp32 forward (both precisions) A/B against another version
# (bench/ab_versions.py; OLD defaults to .ab_old: git archive <commit> cupyflash kernels_cu
# | tar -x -C .ab_old, carried to the device), both versions' fp32 kernels precompiled
# first (HEAD_DIMS, default "64 128"), at N = $SEQLENS (default 1024 4096), non-causal and
# causal. Before the A/B, to land a branch in the same call: TESTS="<pytest -k expression>"
# runs those GPU tests of the forward and option files, SANITIZE="<sanitize_cases.py
# arguments>" racecheck and memcheck on those cases.
# Usage: TESTS="float32" SANITIZE="float32 64 128" bash bench/ab_fp32_forward_session.sh
source "$(dirname "$0")/ab_session_common.sh"
precompile_both "['float32']"
gpu_tests tests/test_gpu_forward.py tests/test_gpu_mods.py
sanitize
for precision in highest tf32; do
    timeout 150 python3 bench/ab_versions.py "$OLD" --dtype float32 --precision $precision --head-dims $HEAD_DIMS \
        --seqlens ${SEQLENS:-1024 4096} > "$OUT/ab-$precision.log" 2>&1; echo "ab $precision rc=$?"; cat "$OUT/ab-$precision.log"
done
