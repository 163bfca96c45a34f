"""Summarise ncu's SASS source page of one kernel (CSV on stdin, from
``ncu -i report.ncu-rep --page source --csv --print-source sass``): the executed
instructions by opcode, then the instructions with the most stall samples, each with its
three largest stall reasons.

    python bench/ncu_source_summary.py [--top 40] < source.csv > srcsum.txt
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    # ncu prints a few lines before the table: start at the header row.
    lines = sys.stdin.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"') or line.startswith("Address"))
    rows = list(csv.DictReader(lines[start:]))
    samples_key = next(k for k in ("Warp Stall Sampling (All Samples)", "# Samples") if k in rows[0])
    executed_key = "Instructions Executed"
    stall_keys = [k for k in rows[0] if k.startswith("stall_")]
    by_opcode = collections.Counter()
    for r in rows:
        match = re.match(r"\s*(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)", r["Source"])
        if match:
            by_opcode[match.group(1)] += _number(r[executed_key])
    total = sum(by_opcode.values())
    samples = sum(_number(r[samples_key]) for r in rows)
    print(f"instructions executed {total:.3g}, stall samples {samples:.3g}")
    for op, n in by_opcode.most_common(30):
        print(f"{op:12s} {100 * n / total:6.2f}%  {n:.3g}")
    print(f"\n{'samples':>8} {'executed':>10}  instruction  (largest stall reasons)")
    for r in sorted(rows, key=lambda r: -_number(r[samples_key]))[:a.top]:
        stalls = sorted(((_number(r[k]), k[6:]) for k in stall_keys), reverse=True)[:3]
        reasons = ", ".join(f"{name} {n:.0f}" for n, name in stalls if n > 0)
        print(f"{_number(r[samples_key]):8.0f} {_number(r[executed_key]):10.3g}  {r['Source'].strip()[:70]}  ({reasons})")


if __name__ == "__main__":
    main(sys.argv[1:])
