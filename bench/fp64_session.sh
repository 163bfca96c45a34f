#!/usr/bin/env bash
# One device call for fp32/fp64 kernel work (#16): both versions' fp64 kernels precompiled,
# the GPU tests of fp64 (every test whose id names float64, and the exp2 test kernel), the
# dense fp64 forward and backward A/B against another version (bench/ab_versions.py; OLD
# defaults to .ab_old: git archive <commit> cupyflash kernels_cu | tar -x -C .ab_old,
# carried to the device), then the grid's fp32/fp64 rows beside torch's peers (GRID= leaves
# them out). Usage: COMMIT=<sha> bash bench/fp64_session.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.ab_old}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
pre="import cupyflash as cf; print(len(cf.precompile(dtypes=['float64'], head_dims=[64, 128], workers=16)), 'kernels')"
python3 -c "$pre" > "$OUT/precompile.log" 2>&1; echo "precompile rc=$? ($(tail -1 "$OUT/precompile.log"))"
PYTHONPATH=$PWD/$OLD python3 -c "$pre" > "$OUT/precompile-old.log" 2>&1; echo "precompile old rc=$? ($(tail -1 "$OUT/precompile-old.log"))"
timeout 200 python3 -m pytest -m gpu tests -q -p no:cacheprovider -k "float64 or fp64 or exp2" ${TESTS_K:+-k "$TESTS_K"} \
    > "$OUT/pytest-f64.log" 2>&1; echo "fp64 gpu tests rc=$?"; tail -n 4 "$OUT/pytest-f64.log"
for pass_ in fwd bwd; do
    timeout 120 python3 bench/ab_versions.py "$OLD" --dtype float64 --seqlens 1024 4096 $([ $pass_ = bwd ] && echo --backward) \
        > "$OUT/ab-f64-$pass_.log" 2>&1; echo "ab f64 $pass_ rc=$?"; cat "$OUT/ab-f64-$pass_.log"
done
[ -n "${GRID-1}" ] && { timeout 200 python3 -m cupyflash.bench --dtypes bfloat16 --seqlens 4096 ${COMMIT:+--commit "$COMMIT"} \
    --out "$OUT/grid-wide.json" > "$OUT/grid-wide.log" 2>&1; echo "grid rc=$?"; sed -n '/^pass /,$p' "$OUT/grid-wide.log" | grep -v bfloat16; }
