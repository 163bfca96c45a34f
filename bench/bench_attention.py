"""The benchmark grid (`python -m cupyflash.bench`), plus forward tile tuning for kernel work.

    python bench/bench_attention.py --out bench/results/<gpu>-<date>.json [--plot]
    python bench/bench_attention.py --tune [dtype ...]   # TFLOP/s of each candidate forward tile shape

Every option but ``--tune`` is `cupyflash.bench`'s (see ``--help`` there). Tuning stays in
this script because it rewrites `cupyflash._kernels`' tile tables: a tool for changing the
kernels, not for measuring them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash import _cuda, _kernels, bench  # noqa: E402

# Forward tile candidates per (dtype, head dim), in the form of the tile tables' entries:
# for 16-bit dtypes ("sm90", _kernels.FWD_SM90_TILES' (BLOCK_N, CONSUMERS, STAGES)) (Hopper
# only) and ("sm80", _kernels.FWD_SM80_TILES' (BLOCK_M, BLOCK_N, WARPS)), for fp32/fp64
# _kernels.FWD_WIDE_TILES' (BLOCK_M, BLOCK_N, SUB_N, WARPS, DV_TILE) (all spill-free), and
# for fp32 on Hopper ("sm90", FWD_SM90_F32_TILES' entry); "tf32" is fp32 with
# precision="tf32" (FWD_SM90_TF32_TILES).
TUNE_CANDIDATES = {
    ("bfloat16", 64): [("sm90", (128, 3, 2)), ("sm90", (128, 2, 2)), ("sm90", (128, 3, 3)),
                       ("sm90", (128, 2, 4)), ("sm90", (64, 3, 4)), ("sm90", (192, 2, 2))],
    ("bfloat16", 128): [("sm90", (128, 2, 3)), ("sm90", (128, 2, 2)), ("sm90", (192, 2, 2)),
                        ("sm90", (64, 2, 4))],
    ("bfloat16", 192): [("sm90", (64, 2, 2)), ("sm90", (64, 2, 3))],
    ("float32", 64): [("sm90", (128, 2, 2)), ("sm90", (128, 2, 3)), ("sm90", (64, 2, 2)), ("sm90", (64, 2, 4)),
                      (64, 64, 32, 4, 64), (128, 64, 32, 8, 64)],
    ("float32", 128): [("sm90", (64, 2, 2)), (128, 64, 32, 8, 128), (96, 64, 32, 6, 128), (128, 32, 32, 8, 128),
                       (128, 64, 32, 8, 64)],
    ("float64", 64): [(64, 32, 32, 4, 64), (64, 32, 16, 4, 64), (128, 32, 16, 8, 64)],
    ("float64", 128): [(128, 16, 16, 8, 128), (128, 16, 8, 8, 128), (96, 16, 16, 6, 128), (128, 16, 16, 8, 64),
                       (64, 32, 16, 4, 128)],
    ("tf32", 64): [("sm90", (128, 3, 2)), ("sm90", (128, 2, 2)), ("sm90", (128, 3, 3)), ("sm90", (64, 3, 4))],
    ("tf32", 128): [("sm90", (128, 2, 3)), ("sm90", (128, 2, 2)), ("sm90", (64, 2, 4)), ("sm90", (64, 3, 3))],
}
# (On Hopper the fp32 wide tiles time fwd_sm90.cu, whose table stays in front: they are
# for other GPUs.)
# The Hopper table each dtype's ("sm90", tile) candidates replace.
SM90_TABLES = {"tf32": _kernels.FWD_SM90_TF32_TILES, "float32": _kernels.FWD_SM90_F32_TILES}


def tune(dtype, d, candidates):
    """Time each forward tile candidate for (dtype, d); prints TFLOP/s per candidate, at
    the grid's sequence lengths from 2k for 16-bit dtypes and at the wide dtypes' own."""
    import cupy as cp

    import cupyflash

    seqlens = (2048, 4096, 16384) if dtype in _kernels.HALF_DTYPES else (1024, 4096)
    precision = "tf32" if dtype == "tf32" else "highest"
    array_dtype = "float32" if dtype == "tf32" else dtype
    print(f"tuning {dtype} d={d}")
    # The Hopper candidates compiled at once, in parallel (precompile builds every Hopper
    # tile of a table), rather than one by one at their first calls.
    hopper = tuple(c[1] for c in candidates if c[0] == "sm90")
    if hopper:
        SM90_TABLES.get(dtype, _kernels.FWD_SM90_TILES)[d] = hopper
        cupyflash.precompile(dtypes=[array_dtype], head_dims=[d], workers=os.cpu_count())
    for tile in candidates:
        if tile[0] == "sm90":
            tile = tile[1]
            SM90_TABLES.get(dtype, _kernels.FWD_SM90_TILES)[d] = (tile,)
        elif dtype not in _kernels.HALF_DTYPES:
            _kernels.FWD_WIDE_TILES[dtype][d] = (tile,)
        else:   # an sm80 tile: no Hopper tile in front of it
            tile = tile[1]
            _kernels.FWD_SM90_TILES.pop(d, None)
            _kernels.FWD_SM80_TILES[d] = (tile,)
        _cuda._FORWARD_PLANS.clear()   # the plans chosen from the tables before
        for causal in (False, True):
            for N in seqlens:
                H, B = bench.HIDDEN // d, bench.TOKENS // N
                q, k, v = (cp.random.standard_normal((B, H, N, d), dtype=cp.float32).astype(array_dtype)
                           for _ in range(3))
                try:
                    ms = bench.time_ms(lambda: cupyflash.attention(q, k, v, causal=causal, precision=precision),
                                       repeat=10)
                    print(f"  tile {tile} causal={int(causal)} N={N}: "
                          f"{bench.flops(B, H, N, d, causal, 'fwd') / ms / 1e9:7.1f} TFLOP/s", flush=True)
                except Exception as exc:
                    print(f"  tile {tile}: {type(exc).__name__}: {exc}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--tune" in argv:
        only = argv[argv.index("--tune") + 1:]   # dtypes to tune; all when none are named
        for (dtype, d), candidates in TUNE_CANDIDATES.items():
            if not only or dtype in only:
                tune(dtype, d, candidates)
        return 0
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
