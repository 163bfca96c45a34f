#!/usr/bin/env bash
# One device call (#18): bench/ring_profile.py on 2 and 4 GPUs at the given N per GPU
# (default 32768), with each rank's step timeline, then once more on 2 GPUs with NCCL held
# to 4 P2P channels. Usage (repository root, on the GPU machine):
#   COMMIT=<sha> bash bench/ring_profile.sh [N per GPU ...]
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/multi_gpu_env.sh"
seqlens=${*:-32768}
precompile "dtypes=['bfloat16'], head_dims=[128]"
run() {   # run NAME WORLD [VAR=value ...]: one launch
    local name=$1 world=$2; shift 2
    [ "$world" -le "$gpus" ] || return 0
    env "$@" timeout 150 python3 -m cupyflash.distributed.launch --nproc "$world" bench/ring_profile.py \
        --seqlen-per-gpu $seqlens --timeline ${COMMIT:+--commit "$COMMIT"} \
        --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?"
}
run ring-profile-2 2
run ring-profile-4 4
run ring-profile-2-p2p4 2 NCCL_MAX_P2P_NCHANNELS=4
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
python3 - "$OUT"/ring-profile-*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        doc = json.load(open(path))
    except (OSError, ValueError) as e:
        print(path, e); continue
    print(path.rsplit("/", 1)[-1], doc.get("nccl_env", {}).get("NCCL_MAX_P2P_NCHANNELS", ""))
    for r in doc["rows"]:
        if "message" in r:
            print(f"  exchange {r['message']:10} {r['bytes'] / 1e6:8.0f} MB {r['ms']:7.2f} ms {r['gb_per_s']:6.0f} GB/s")
        else:
            print(f"  {r['variant']:7} gpus={r['gpus']} N={r['N']} {r['pass']} {r['tflops']:6.1f} TFLOP/s {r['ms']:8.2f} ms")
PY
