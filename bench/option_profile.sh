#!/usr/bin/env bash
# One device call: ncu on the Hopper backward's key-block kernel, dense against options
# (#15): duration, DRAM and L2 traffic, issue slots and the stall reasons (cycles a warp
# waits between two issues, largest first), one kernel launch each.
# Usage: CASES="dense:--head-dim 64|softcap:--head-dim 64 --softcap 30" bash bench/option_profile.sh
# (name:profile_case arguments, '|' between cases; --backward --seqlen 16384 by default,
# SEQLEN= changes it; FORWARD=1 profiles the forward's kernel instead). Full reports go to
# $OUT/ncu-options.tgz. SOURCE=1 samples the stalls per SASS instruction instead
# (bench/ncu_source_summary.py: <name>-srcsum.txt in the archive).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats"
. bench/ncu_stalls.sh
stalls="--metrics $NCU_STALLS,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_tex_lookup_hit.sum,lts__t_sectors_srcunit_tex_lookup_miss.sum"
dir=$(mktemp -d)
if [ -n "${FORWARD:-}" ]; then kernel=flash_fwd pass_=; else kernel=flash_bwd_dkdv pass_=--backward; fi
IFS='|' read -ra cases <<< "${CASES:-dense:--head-dim 64}"
for spec in "${cases[@]}"; do
    name=${spec%%:*}; args=${spec#*:}
    if [ -n "${SOURCE:-}" ]; then
        timeout 150 ncu --section SourceCounters --section WarpStateStats -k regex:$kernel -c 1 -o "$dir/$name" \
            python3 bench/profile_case.py $pass_ --seqlen ${SEQLEN:-16384} --repeat 1 $args > "$dir/$name.log" 2>&1
        echo "== $name ($args) ncu rc=$?"
        ncu -i "$dir/$name.ncu-rep" --page source --csv --print-source sass > "$dir/$name.csv" 2>&1 \
            && python3 bench/ncu_source_summary.py < "$dir/$name.csv" > "$dir/$name-srcsum.txt" && head -14 "$dir/$name-srcsum.txt" || { tail -3 "$dir/$name.log"; head -5 "$dir/$name.csv"; }
        continue
    fi
    timeout 150 ncu $sections $stalls -k regex:$kernel -c 1 \
        python3 bench/profile_case.py $pass_ --seqlen ${SEQLEN:-16384} --repeat 1 $args > "$dir/$name.txt" 2>&1
    echo "== $name ($args) ncu rc=$?"
    grep -E "^ *(Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Registers Per Thread|Grid Size) |highest-utilized" "$dir/$name.txt" | sed 's/  */ /g'
    grep -E "dram__bytes_(read|write)\.sum|lookup_(hit|miss)" "$dir/$name.txt" | sed 's/  */ /g'
    stalls_largest_first "$dir/$name.txt" 7
done
tar -czf "$OUT/ncu-options.tgz" -C "$dir" $(cd "$dir" && ls *.txt *.log 2>/dev/null)
