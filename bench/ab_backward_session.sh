#!/usr/bin/env bash
# One device call: an option's backward A/B against another version (bench/ab_versions.py;
# OLD defaults to .ab_old: git archive <commit> cupyflash kernels_cu | tar -x -C .ab_old,
# carried to the device), both versions' kernels precompiled first, the A/B at N = $SEQLENS
# (default 4096 16384), then the --mods rows of the backward at N = 16k (MODS= leaves them
# out). Usage: OPTIONS="dropout softcap" COMMIT=<sha> bash bench/ab_backward_session.sh
# (options: bench/ab_versions.py OPTIONS, "dense" for the dense call beside torch's peers)
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.ab_old}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
pre="import cupyflash as cf; print(len(cf.precompile(dtypes=['bfloat16'], head_dims=[64, 128], workers=16, options=True)), 'kernels')"
python3 -c "$pre" > "$OUT/precompile.log" 2>&1; echo "precompile rc=$? ($(tail -1 "$OUT/precompile.log"))"
PYTHONPATH=$PWD/$OLD python3 -c "$pre" > "$OUT/precompile-old.log" 2>&1; echo "precompile old rc=$? ($(tail -1 "$OUT/precompile-old.log"))"
for option in ${OPTIONS:-dropout}; do
    timeout 150 python3 bench/ab_versions.py "$OLD" --backward --option "$option" --seqlens ${SEQLENS:-4096 16384} \
        > "$OUT/ab-$option.log" 2>&1; echo "ab $option rc=$?"; cat "$OUT/ab-$option.log"
done
[ -n "${MODS-1}" ] && { timeout 200 python3 -m cupyflash.bench --mods --passes bwd --mods-seqlens 16384 ${COMMIT:+--commit "$COMMIT"} \
    --out "$OUT/mods-bwd.json" > "$OUT/mods-bwd.log" 2>&1; echo "mods rc=$?"; sed -n '/^pass /,$p' "$OUT/mods-bwd.log"; }
