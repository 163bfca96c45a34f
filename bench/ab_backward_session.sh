#!/usr/bin/env bash
# One device call: an option's backward A/B against another version (bench/ab_versions.py;
# OLD defaults to .ab_old: git archive <commit> cupyflash kernels_cu | tar -x -C .ab_old,
# carried to the device), both versions' kernels precompiled first (HEAD_DIMS, default
# "64 128"), the A/B at N = $SEQLENS (default 4096 16384), then the --mods rows of the
# backward at N = 16k (MODS= leaves them out). Before the A/B, to land a branch in the same
# call: TESTS="<pytest -k expression>" runs those GPU tests of the backward and option
# files, SANITIZE="<sanitize_cases.py arguments>" racecheck and memcheck on those cases.
# DTYPE (default the 16-bit pair, with torch's peers) picks one dtype, e.g. float32.
# Usage: OPTIONS="dropout softcap" COMMIT=<sha> bash bench/ab_backward_session.sh
# (options: bench/ab_versions.py OPTIONS, "dense" for the dense call beside torch's peers)
source "$(dirname "$0")/ab_session_common.sh"
if [ -n "${DTYPE:-}" ]; then precompile_both "['$DTYPE']"; else precompile_both "['bfloat16', 'float16']"; fi
gpu_tests tests/test_gpu_backward.py tests/test_gpu_mods.py
sanitize
for option in ${OPTIONS:-dropout}; do
    timeout 150 python3 bench/ab_versions.py "$OLD" --backward --option "$option" ${DTYPE:+--dtype $DTYPE} --head-dims $HEAD_DIMS \
        --seqlens ${SEQLENS:-4096 16384} > "$OUT/ab-${option//+/_}.log" 2>&1; echo "ab $option rc=$?"; cat "$OUT/ab-${option//+/_}.log"
done
[ -n "${MODS-1}" ] && { timeout 200 python3 -m cupyflash.bench --mods --passes bwd --mods-seqlens 16384 ${COMMIT:+--commit "$COMMIT"} \
    --out "$OUT/mods-bwd.json" > "$OUT/mods-bwd.log" 2>&1; echo "mods rc=$?"; sed -n '/^pass /,$p' "$OUT/mods-bwd.log"; }
