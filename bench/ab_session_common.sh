# Sourced by the one-call A/B session scripts (bench/ab_backward_session.sh,
# bench/ab_fp32_forward_session.sh): the settings (OUT, OLD: the other version's tree,
# default .ab_old; HEAD_DIMS, default "64 128"), the environment, the GPU's clocks, and
#   precompile_both DTYPES   both versions' kernels of DTYPES (a Python list) with options
#   gpu_tests FILES...       the GPU tests of FILES that TESTS (a pytest -k expression) selects
#   sanitize                 racecheck and memcheck on the sanitize cases SANITIZE names
# each a no-op where its variable is empty.
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.ab_old}
HEAD_DIMS=${HEAD_DIMS:-64 128}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader

precompile_both() {
    local pre="import cupyflash as cf; print(len(cf.precompile(dtypes=$1, head_dims=[${HEAD_DIMS// /, }], workers=16, options=True)), 'kernels')"
    python3 -c "$pre" > "$OUT/precompile.log" 2>&1; echo "precompile rc=$? ($(tail -1 "$OUT/precompile.log"))"
    PYTHONPATH=$PWD/$OLD python3 -c "$pre" > "$OUT/precompile-old.log" 2>&1
    echo "precompile old rc=$? ($(tail -1 "$OUT/precompile-old.log"))"
}

gpu_tests() {
    [ -n "${TESTS:-}" ] || return 0
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider "$@" -k "$TESTS" \
        > "$OUT/pytest.log" 2>&1
    echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -n 3 "$OUT/pytest.log"
}

sanitize() {
    [ -n "${SANITIZE:-}" ] || return 0
    local tool
    for tool in racecheck memcheck; do
        timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize_cases.py $SANITIZE \
            > "$OUT/$tool.log" 2>&1
        echo "$tool rc=$? : $(grep -E 'SUMMARY|sanitize cases' "$OUT/$tool.log" | tr '\n' ' ')"
    done
}
