#!/usr/bin/env bash
# One device call for fp32/fp64 kernel work (#16): both versions' kernels of DTYPES
# precompiled, the GPU tests of those dtypes (every test whose id names one, and the exp2
# test kernel), the dense forward (fp32: and precision="tf32") and backward A/B against
# another version (bench/ab_versions.py; OLD defaults to .ab_old: git archive <commit> cupyflash kernels_cu |
# tar -x -C .ab_old, carried to the device), then the grid's fp32/fp64 rows beside torch's
# peers (GRID= leaves them out). First, if given, nvcc builds and runs PROBE (a .cu file).
# Usage: DTYPES="float32 float64" COMMIT=<sha> bash bench/wide_session.sh (HEAD_DIMS="96 128" for the
# A/B: default 64 128; TESTS_K: the tests' -k expression)
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.ab_old}
DTYPES=${DTYPES:-float64}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
[ -n "${PROBE:-}" ] && nvcc -O3 -arch=sm_90a -o /tmp/probe "$PROBE" && /tmp/probe | tee "$OUT/probe.log"
list=$(printf "'%s'," $DTYPES)
pre="import cupyflash as cf; print(len(cf.precompile(dtypes=[$list], head_dims=[$(echo ${HEAD_DIMS:-64 128} | tr ' ' ,)], workers=16)), 'kernels')"
python3 -c "$pre" > "$OUT/precompile.log" 2>&1; echo "precompile rc=$? ($(tail -1 "$OUT/precompile.log"))"
PYTHONPATH=$PWD/$OLD python3 -c "$pre" > "$OUT/precompile-old.log" 2>&1; echo "precompile old rc=$? ($(tail -1 "$OUT/precompile-old.log"))"
k="exp2"; for dt in $DTYPES; do k="$k or $dt"; [ $dt = float64 ] && k="$k or fp64"; [ $dt = float32 ] && k="$k or fp32"; done
timeout ${TESTS_S:-200} python3 -m pytest -m gpu tests -q -p no:cacheprovider -k "${TESTS_K:-$k}" \
    > "$OUT/pytest-wide.log" 2>&1; echo "gpu tests ($k) rc=$?"; tail -n 4 "$OUT/pytest-wide.log"
for dt in $DTYPES; do
    # fp32's forward also with precision="tf32" (one TF32 product)
    for pass_ in fwd $([ $dt = float32 ] && echo fwd-tf32) bwd; do
        timeout 120 python3 bench/ab_versions.py "$OLD" --dtype $dt --seqlens 1024 4096 --head-dims ${HEAD_DIMS:-64 128} \
            $([ $pass_ = bwd ] && echo --backward) $([ $pass_ = fwd-tf32 ] && echo --precision tf32) \
            > "$OUT/ab-$dt-$pass_.log" 2>&1; echo "ab $dt $pass_ rc=$?"; cat "$OUT/ab-$dt-$pass_.log"
    done
done
[ -n "${GRID-1}" ] && { timeout 200 python3 -m cupyflash.bench --dtypes bfloat16 --seqlens 4096 ${COMMIT:+--commit "$COMMIT"} \
    --out "$OUT/grid-wide.json" > "$OUT/grid-wide.log" 2>&1; echo "grid rc=$?"; sed -n '/^pass /,$p' "$OUT/grid-wide.log" | grep -v bfloat16; }
