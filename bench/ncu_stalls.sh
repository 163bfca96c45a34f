# Sourced by the ncu session scripts (fp64_profile.sh, option_profile.sh): the metric of
# ncu's stall reasons, cycles a warp waits in each between two issued instructions, and
# their print-out from a report, largest first.
NCU_STALLS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
# stalls_largest_first REPORT [N]: the N largest (default 8), names shortened.
stalls_largest_first() {
    grep -E "issue_stalled" "$1" | sort -k3 -g -r | head -"${2:-8}" \
        | sed 's/  */ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
}
