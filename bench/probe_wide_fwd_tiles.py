"""The fp32/fp64 forward's fwd_wide.cu tiles against each other, in one process: each tile
given (alone at the front of _kernels.FWD_WIDE_TILES, so every call takes it) times the
dense forward at the grid's shapes, twice in turn (A, B, A, B), TFLOP/s per reading.

    python bench/probe_wide_fwd_tiles.py --dtype float64 --head-dim 64 --tiles 64,32,32,4,64 64,16,16,4,64
        [--seqlens 1024 4096] [--causal]

A tile is (BLOCK_M, BLOCK_N, SUB_N, WARPS, DV_TILE) as in the table. (fp32 on Hopper runs
fwd_sm90.cu: this probes the wide kernels, which fp32 takes elsewhere.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupyflash  # noqa: E402
from cupyflash import _cuda, _kernels, bench  # noqa: E402


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float64")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tiles", nargs="+", required=True)
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", action="store_true")
    a = p.parse_args(argv)
    d = a.head_dim
    tiles = [tuple(int(x) for x in t.split(",")) for t in a.tiles]
    table = _kernels.FWD_WIDE_TILES[a.dtype]
    original = table[d]
    try:
        probe(a, d, tiles, table)
    finally:
        table[d] = original
        _cuda._FORWARD_PLANS.clear()


def probe(a, d, tiles, table):
    for N in a.seqlens:
        H, B = bench.HIDDEN // d, bench.TOKENS // N
        (q, k, v, _), _ = bench.make_inputs(a.dtype, (B, H, N, d), N)
        flop = bench.flops(B, H, N, d, a.causal, "fwd")
        readings = {t: [] for t in tiles}
        for _ in range(2):
            for t in tiles:
                table[d] = (t,)
                _cuda._FORWARD_PLANS.clear()
                run = lambda: cupyflash.attention(q, k, v, causal=a.causal, scale=1 / math.sqrt(d))  # noqa: E731
                readings[t].append(flop / bench.time_ms(run) / 1e9)
        for t in tiles:
            print(f"{a.dtype} d={d} N={N} causal={int(a.causal)} tile={t}: "
                  + " / ".join(f"{x:.1f}" for x in readings[t]) + " TFLOP/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
