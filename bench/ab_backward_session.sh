#!/usr/bin/env bash
# One device call: an option's backward A/B against another version (bench/ab_versions.py;
# OLD defaults to .ab_old: git archive <commit> cupyflash kernels_cu | tar -x -C .ab_old,
# carried to the device), both versions' kernels precompiled first (HEAD_DIMS, default
# "64 128"), the A/B at N = $SEQLENS (default 4096 16384), then the --mods rows of the
# backward at N = 16k (MODS= leaves them out). Before the A/B, to land a branch in the same
# call: TESTS="<pytest -k expression>" runs those GPU tests of the backward and option
# files, SANITIZE="<sanitize_cases.py arguments>" racecheck and memcheck on those cases.
# Usage: OPTIONS="dropout softcap" COMMIT=<sha> bash bench/ab_backward_session.sh
# (options: bench/ab_versions.py OPTIONS, "dense" for the dense call beside torch's peers)
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.ab_old}
HEAD_DIMS=${HEAD_DIMS:-64 128}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
pre="import cupyflash as cf; print(len(cf.precompile(dtypes=['bfloat16', 'float16'], head_dims=[${HEAD_DIMS// /, }], workers=16, options=True)), 'kernels')"
python3 -c "$pre" > "$OUT/precompile.log" 2>&1; echo "precompile rc=$? ($(tail -1 "$OUT/precompile.log"))"
PYTHONPATH=$PWD/$OLD python3 -c "$pre" > "$OUT/precompile-old.log" 2>&1; echo "precompile old rc=$? ($(tail -1 "$OUT/precompile-old.log"))"
[ -n "${TESTS:-}" ] && { timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_backward.py \
    tests/test_gpu_mods.py -k "$TESTS" > "$OUT/pytest.log" 2>&1; echo "gpu tests rc=$?"; tail -n 3 "$OUT/pytest.log"; }
[ -n "${SANITIZE:-}" ] && for tool in racecheck memcheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize_cases.py $SANITIZE \
        > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$? : $(grep -E 'SUMMARY|sanitize cases' "$OUT/$tool.log" | tr '\n' ' ')"
done
for option in ${OPTIONS:-dropout}; do
    timeout 150 python3 bench/ab_versions.py "$OLD" --backward --option "$option" --head-dims $HEAD_DIMS \
        --seqlens ${SEQLENS:-4096 16384} > "$OUT/ab-$option.log" 2>&1; echo "ab $option rc=$?"; cat "$OUT/ab-$option.log"
done
[ -n "${MODS-1}" ] && { timeout 200 python3 -m cupyflash.bench --mods --passes bwd --mods-seqlens 16384 ${COMMIT:+--commit "$COMMIT"} \
    --out "$OUT/mods-bwd.json" > "$OUT/mods-bwd.log" 2>&1; echo "mods rc=$?"; sed -n '/^pass /,$p' "$OUT/mods-bwd.log"; }
