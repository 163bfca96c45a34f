#!/usr/bin/env bash
# One device call: build every kernel for this GPU, run the GPU tests, the sanitizers on
# small shapes, and the benchmark; logs and JSON go to $OUT, a short table comes last.
# Usage (repository root, on the GPU machine): bash bench/gpu_session.sh [pytest -k expr]
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
arch=$(python3 -c "from cupyflash import _cuda; print(_cuda._device_info(0)[0])")
python3 -m cupyflash.build_check --arch "$arch" --jobs 16 > "$OUT/build.log" 2>&1; echo "build check rc=$? ($(tail -1 "$OUT/build.log"))"
python3 -m pytest -m gpu tests -q -p no:cacheprovider ${1:+-k "$1"} > "$OUT/pytest.log" 2>&1; echo "gpu tests rc=$?"; tail -n 25 "$OUT/pytest.log"
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize_cases.py > "$OUT/sanitize-$tool.log" 2>&1
  echo "$tool rc=$? : $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases' "$OUT/sanitize-$tool.log" | tr '\n' ' ')"
done
python3 bench/bench_attention.py ${BENCH_ARGS:-} --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
sed -n '/^pass /,$p' "$OUT/bench.log"
