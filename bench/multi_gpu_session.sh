#!/usr/bin/env bash
# One device call on a machine of several GPUs (#18): NCCL through CuPy checked, the
# multi-GPU tests (bench/multi_gpu_tests.sh: the ring over NCCL in processes, 2 and 4
# ranks, every dtype; the one-process split over 2 and 4 GPUs; merges, streaming), then bench/distributed.py's rows: the ring and the split at the
# given N per GPU, each beside its single-GPU rows. Logs and JSON go to $OUT, a short table
# comes last. Usage (repository root, on the GPU machine):
#   COMMIT=<sha> bash bench/multi_gpu_session.sh [N per GPU ...]     (default 32768 131072)
# SKIP="tests ring devices" leaves steps out, TESTS=<pytest -k expr> picks the tests;
# BIG=<N per GPU> adds the 4-GPU rows at that N (262144: a 1M-token sequence), the split
# timed against one GPU over the whole sequence.
set -u -o pipefail
want() { [[ " ${SKIP:-} " != *" $1 "* ]]; }
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/multi_gpu_env.sh"
seqlens=${*:-32768 131072}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "from cupy.cuda import nccl; print('nccl available', nccl.available, nccl.get_version() if nccl.available else '')"
if want tests; then
    bash "$(dirname "$0")/multi_gpu_tests.sh"   # precompiles the kernels the rows use too
else
    precompile "head_dims=[64, 128], options=True"
fi
rows=()
# bench_rows VARIANT GPUS NAME REPEAT "N per GPU ..." [bench/distributed.py options]: one step's JSON and log.
bench_rows() {
    local variant=$1 world=$2 name=$3 repeat=$4 ns=$5; shift 5
    want "$variant" || return 0
    if [ "$variant" = ring ]; then
        set -- -m cupyflash.distributed.launch --nproc "$world" bench/distributed.py "$@"
    else
        set -- bench/distributed.py --devices $(seq -s ' ' 0 $((world - 1))) "$@"
    fi
    timeout 240 python3 "$@" --seqlen-per-gpu $ns --repeat "$repeat" ${COMMIT:+--commit "$COMMIT"} \
        --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?"; rows+=("$OUT/$name.json")
}
for world in 2 4; do
    [ "$world" -le "$gpus" ] || continue
    bench_rows ring "$world" "ring-$world" 3 "$seqlens"
    bench_rows devices "$world" "devices-$world" 3 "$seqlens"
done
if [ -n "${BIG:-}" ] && [ "$gpus" -ge 4 ]; then
    bench_rows ring 4 ring-4-big 2 "$BIG"
    bench_rows devices 4 devices-4-big 2 "$BIG" --single-whole
fi
# One archive of the logs (the device tool brings back at most 8 files) beside the JSON.
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
python3 - "${rows[@]}" <<'EOF'
import json, sys
print(f"{'variant':8} {'gpus':>4} {'N/gpu':>7} {'seqlen':>8} {'pass':4} {'TFLOP/s/gpu':>11} {'ms':>9}")
for path in sys.argv[1:]:
    try:
        rows = json.load(open(path))["rows"]
    except (OSError, ValueError) as e:
        print(f"{path}: {e}")
        continue
    for r in rows:
        print(f"{r['variant']:8} {r['gpus']:>4} {r['N']:>7} {r['seqlen']:>8} {r['pass']:4} {r['tflops']:>11.1f} {r['ms']:>9.1f}")
EOF
