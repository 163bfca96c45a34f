#!/usr/bin/env bash
# The backward's whole-tensor passes under ncu, cupyflash's beside a torch backend's
# (default cuDNN: compute_dot_do_o and convert_dq_to_16bits against flash_bwd_prep and
# flash_bwd_dq_convert), on one call shape: time, DRAM bytes and throughput, occupancy,
# the launch's shape. The third call's two passes (the first two build and warm): a case
# whose backward has both passes (cupyflash's 16-bit Hopper path, d <= 128; else ncu
# profiles the wrong launches or none). Run from the repository's root; appends to the log.
#   bash bench/passes_ncu.sh [OUTDIR] [case args, default --seqlen 2048 --head-dim 64]
set -u -o pipefail
OUT_DIR=${1:-${OUT:-/tmp}}
shift || true
ARGS=${*:---seqlen 2048 --head-dim 64}
PEER=${PEER:-torch-cudnn}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
PASSES="regex:flash_bwd_prep|flash_bwd_dq_convert|dot_do_o|convert_dq"
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__occupancy_limit_registers,smsp__inst_executed.sum,l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio
for who in cupyflash "$PEER"; do
    peer=()
    [ "$who" != cupyflash ] && peer=(--peer "$who")
    echo "== $who $ARGS"
    ncu -k "$PASSES" --launch-skip 4 --launch-count 2 --metrics "$METRICS" \
        python3 bench/backward_call.py $ARGS "${peer[@]}" --calls 3 2>&1 \
        | grep -vE '^==PROF==|^$' | sed 's/  */ /g' | tee -a "$OUT_DIR/passes-ncu.log"
done
