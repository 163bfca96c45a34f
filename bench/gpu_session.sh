#!/usr/bin/env bash
# One device call: build every kernel for this GPU, run the GPU tests, the benchmark, the
# examples and the sanitizers on small shapes; logs and JSON go to $OUT, short summaries
# come last. Each step has its own time limit so that a slow one cannot eat the others'.
# Usage (repository root, on the GPU machine): COMMIT=<sha> bash bench/gpu_session.sh [pytest -k expr]
# SKIP="bench examples sanitize" leaves those steps out (steps: build tests mods-tests bench
# mods-bench examples sanitize), e.g. to fit a 600 s call when a step runs long.
# RACECHECK_DTYPES (default "float16 float32": the tensor-core kernels of both families).
set -u -o pipefail
want() { [[ " ${SKIP:-} " != *" $1 "* ]]; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
arch=$(python3 -c "from cupyflash import _cuda; print(_cuda._device_info(0)[0])")
want build && { timeout 240 python3 -m cupyflash.build_check --arch "$arch" --jobs 16 > "$OUT/build.log" 2>&1; echo "build check rc=$? ($(tail -1 "$OUT/build.log"))"; }
want tests && { timeout 150 python3 -m pytest -m gpu tests -q --ignore=tests/test_gpu_mods.py -p no:cacheprovider ${1:+-k "$1"} > "$OUT/pytest.log" 2>&1; echo "gpu tests rc=$?"; tail -n 12 "$OUT/pytest.log"; }
want mods-tests && { timeout 150 python3 -m pytest -m gpu tests/test_gpu_mods.py -q -p no:cacheprovider --durations=5 ${1:+-k "$1"} > "$OUT/pytest-mods.log" 2>&1; echo "gpu mods tests rc=$?"; tail -n 12 "$OUT/pytest-mods.log"; }
want bench && { timeout 160 python3 bench/bench_attention.py --dtypes bfloat16 --naive-max-n 4096 ${COMMIT:+--commit "$COMMIT"} --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; }
want mods-bench && { timeout 120 python3 -m cupyflash.bench --mods ${COMMIT:+--commit "$COMMIT"} --out "$OUT/bench-mods.json" > "$OUT/bench-mods.log" 2>&1; echo "mods bench rc=$?"; }
want examples && { timeout 40 python3 examples/long_sequence.py > "$OUT/long_sequence.log" 2>&1; echo "long_sequence rc=$?"; cat "$OUT/long_sequence.log"; }
want examples && { timeout 50 python3 examples/train_tiny_transformer.py --steps 300 > "$OUT/train.log" 2>&1; echo "train rc=$?"; tail -n 3 "$OUT/train.log"; }
want sanitize && { timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/sanitize_cases.py > "$OUT/sanitize-memcheck.log" 2>&1
echo "memcheck rc=$? : $(grep -E 'ERROR SUMMARY|sanitize cases' "$OUT/sanitize-memcheck.log" | tr '\n' ' ')"; }
want sanitize && { timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/sanitize_cases.py ${RACECHECK_DTYPES:-float16 float32} > "$OUT/sanitize-racecheck.log" 2>&1
echo "racecheck rc=$? : $(grep -E 'RACECHECK SUMMARY|sanitize cases' "$OUT/sanitize-racecheck.log" | tr '\n' ' ')"; }
want bench && sed -n '/^pass /,$p' "$OUT/bench.log"
want mods-bench && sed -n '/^pass /,$p' "$OUT/bench-mods.log"
