"""cupyflash against one torch SDPA peer on the same tensors, in alternation: each round
times cupyflash, then the peer, then cupyflash again (bench.time_ms each), so that a drift
of the GPU's clocks over the run falls on both. Prints per cell the range and median of
each side's readings and the median of the ratios peer ms / cupyflash ms (above 1:
cupyflash is faster), each peer reading against both cupyflash readings beside it. The
cells are the grid's (bench --passes bwd: B N = 16k, H d = 2048, the grid's inputs); a
check of its one reading a cell, not a replacement.

    python bench/peer_ratio_probe.py [--pass bwd] [--peer torch-cudnn] [--rounds 5]
        [--dtypes bfloat16 float16] [--head-dims 64 128] [--seqlens 2048 4096] [--causal 0 1]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash import bench  # noqa: E402


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--peer", choices=list(bench.TORCH_BACKENDS), default="torch-cudnn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtypes", nargs="+", choices=("float16", "bfloat16", "float32", "float64"),
                   default=["bfloat16", "float16"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    a = p.parse_args(argv)
    torch, SDPBackend, _ = bench._torch()
    if torch is None:
        p.error("needs torch with CUDA")
    backend = getattr(SDPBackend, bench.TORCH_BACKENDS[a.peer])
    print(f"{'case':34} {'cupyflash ms: range (median)':>30} {a.peer + ' ms: range (median)':>30} "
          f"{'peer/cupyflash: median [range]':>30}")
    for dtype in a.dtypes:
        for d in a.head_dims:
            for N in a.seqlens:
                for causal in a.causal:
                    case = f"{dtype} d={d} N={N} causal={causal}"
                    try:
                        line = probe_cell(a, torch, backend, dtype, d, N, bool(causal))
                    except Exception as exc:  # a cell one side cannot run is reported, not fatal
                        line = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                    print(f"{case:34} {line}", flush=True)


def probe_cell(a, torch, backend, dtype, d, N, causal):
    """One cell's readings, as a line of the table."""
    B, H = bench.TOKENS // N, bench.HIDDEN // d
    (q, k, v, do), tensors = bench.make_inputs(dtype, (B, H, N, d), N * d + causal)   # the grid's
    scale = 1 / math.sqrt(d)
    ours = bench._cupyflash_runs(q, k, v, do, causal=causal, scale=scale)[a.pass_]()
    theirs = bench._torch_runs(torch, backend, *tensors, is_causal=causal, scale=scale)[a.pass_]()
    mine, peer, ratios = [], [], []
    for _ in range(a.rounds):
        x = bench.time_ms(ours)
        y = bench.time_ms(theirs)
        z = bench.time_ms(ours)
        mine += [x, z]
        peer.append(y)
        ratios += [y / x, y / z]
    return (f"{min(mine):9.3f}-{max(mine):7.3f} ({np.median(mine):7.3f}) "
            f"{min(peer):9.3f}-{max(peer):7.3f} ({np.median(peer):7.3f}) "
            f"{np.median(ratios):13.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main(sys.argv[1:])
