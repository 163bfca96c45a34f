#!/usr/bin/env bash
# A/B of a backward call's launches (bench/backward_timeline.py) between another version
# (OLD, default .ab_old: git archive <commit> cupyflash kernels_cu bench/backward_timeline.py
# | tar -x -C .ab_old) and this tree, twice each, on three calls where the passes weigh:
# N = 2k d = 64, N = 2k d = 128 causal, N = 16k d = 64 with a causal window of 256.
set -u -o pipefail
OLD=${OLD:-.ab_old}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
for args in "--seqlen 2048 --head-dim 64" "--seqlen 2048 --head-dim 128 --causal" \
            "--seqlen 16384 --head-dim 64 --causal --window 256"; do
    for rep in 1 2; do
        for tree in "$OLD" .; do
            echo "== $tree $args ($rep)"
            # (180 s: a cold kernel cache builds the call's kernels first)
            timeout 180 python3 "$tree/bench/backward_timeline.py" $args 2>&1 | grep -E 'prep|convert|dkdv|span'
        done
    done
done
