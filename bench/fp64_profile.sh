#!/usr/bin/env bash
# One device call: where the fp64 kernels' time goes (#16). For the fp64 forward at d = 64
# and 128 and the backward at d = 128 (N = 4096): ncu's throughput, pipe and stall
# sections, and the SASS opcode count of the instantiation that runs (NVRTC's PTX through
# ptxas and nvdisasm); and what mma.m16n8k16.f64 becomes in SASS (bench/dmma_k16.cu).
# Usage: bash bench/fp64_profile.sh   (CASES="fwd64 fwd128 bwd128" picks cases; NO_K16=1 skips
# the DMMA k16 check). The stall reasons are printed largest first. PHASES=1 first prints
# the backward's kernel durations at d = 128, default and deterministic=True: its dK/dV
# kernel with dQ against the same without it (how much of the time dQ's phase takes;
# session 23: 60 against 40 ms).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import cupyflash as cf; print(len(cf.precompile(dtypes=['float64'], head_dims=[64, 128], workers=16)), 'kernels')"
[ -n "${PHASES:-}" ] && for det in "" --deterministic; do
    echo "backward d = 128 ${det:-default}: pre-pass, dK/dV, then dQ conversion or kernel"
    timeout 150 ncu --section SpeedOfLight -k regex:flash_bwd -c 3 python3 bench/profile_case.py --dtype float64 \
        --head-dim 128 --seqlen 4096 --backward --repeat 1 $det 2>&1 | grep -E "^  [a-z_ ]*flash_bwd|Duration" | cut -c1-100
done
[ -z "${NO_K16:-}" ] && nvcc -cubin -arch=sm_90a bench/dmma_k16.cu -o "$OUT/dmma_k16.cubin" \
    && cuobjdump -sass "$OUT/dmma_k16.cubin" | grep -E "DMMA|HMMA" | sed 's/^ */  /'
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats"
. bench/ncu_stalls.sh
stalls="--metrics $NCU_STALLS"
for case in ${CASES:-fwd64 fwd128 bwd128}; do
    d=${case//[a-z]/}
    args="--dtype float64 --head-dim $d --seqlen 4096 --repeat 2 --ptx"
    kernel=regex:flash_fwd
    [[ $case == bwd* ]] && { args="$args --backward"; kernel=regex:flash_bwd_dkdv; }
    ptx=$(python3 bench/profile_case.py $args | tail -1)
    ptxas -arch=sm_90a "$ptx" -o "$OUT/$case.cubin" && nvdisasm -c "$OUT/$case.cubin" > "$OUT/$case.sass" \
        && { echo "$case SASS:"; python3 bench/sass_histogram.py < "$OUT/$case.sass"; }
    timeout 240 ncu $sections $stalls -k "$kernel" -c 1 python3 bench/profile_case.py $args > "$OUT/ncu-$case.txt" 2>&1
    echo "$case ncu rc=$?"
    stalls_largest_first "$OUT/ncu-$case.txt"
    grep -E "Duration|Issue Slots Busy|Executed Ipc Active|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput|Memory Throughput|Shared|FP64|pipe|utiliz" "$OUT/ncu-$case.txt" | head -30
done
rm -f "$OUT"/*.cubin
tar -czf "$OUT/sass.tgz" -C "$OUT" $(cd "$OUT" && ls *.sass) && rm -f "$OUT"/*.sass
