#!/usr/bin/env bash
# One device call: the fp32 forward (both precisions) A/B against another version
# (bench/ab_versions.py; OLD defaults to .ab_old: git archive <commit> cupyflash kernels_cu
# | tar -x -C .ab_old, carried to the device), both versions' fp32 kernels precompiled
# first (HEAD_DIMS, default "64 128"), at N = $SEQLENS (default 1024 4096), non-causal and
# causal. Before the A/B, to land a branch in the same call: TESTS="<pytest -k expression>"
# runs those GPU tests of the forward and option files, SANITIZE="<sanitize_cases.py
# arguments>" racecheck and memcheck on those cases.
# Usage: TESTS="float32" SANITIZE="float32 64 128" bash bench/ab_fp32_forward_session.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.ab_old}
HEAD_DIMS=${HEAD_DIMS:-64 128}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
pre="import cupyflash as cf; print(len(cf.precompile(dtypes=['float32'], head_dims=[${HEAD_DIMS// /, }], workers=16, options=True)), 'kernels')"
python3 -c "$pre" > "$OUT/precompile.log" 2>&1; echo "precompile rc=$? ($(tail -1 "$OUT/precompile.log"))"
PYTHONPATH=$PWD/$OLD python3 -c "$pre" > "$OUT/precompile-old.log" 2>&1; echo "precompile old rc=$? ($(tail -1 "$OUT/precompile-old.log"))"
[ -n "${TESTS:-}" ] && { timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_gpu_forward.py tests/test_gpu_mods.py -k "$TESTS" > "$OUT/pytest.log" 2>&1; echo "gpu tests rc=$?"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -n 3 "$OUT/pytest.log"; }
[ -n "${SANITIZE:-}" ] && for tool in racecheck memcheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize_cases.py $SANITIZE \
        > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$? : $(grep -E 'SUMMARY|sanitize cases' "$OUT/$tool.log" | tr '\n' ' ')"
done
for precision in highest tf32; do
    timeout 150 python3 bench/ab_versions.py "$OLD" --dtype float32 --precision $precision --head-dims $HEAD_DIMS \
        --seqlens ${SEQLENS:-1024 4096} > "$OUT/ab-$precision.log" 2>&1; echo "ab $precision rc=$?"; cat "$OUT/ab-$precision.log"
done
