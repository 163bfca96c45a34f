"""What a unit of the Hopper backward costs beside its tiles (#15: the band rows).

The persistent key-block kernel (kernels_cu/bwd_sm90.cu) runs units of one key block, each
walking the query tiles that see it. A call's time on S SMs is about (a U + b T) / S for U
units and T tiles: b is a tile's cost, a a unit's fixed cost (claim, K and V, the last dQ,
the epilogue) plus, since B N is the same in every point, the call's passes over whole
tensors (the pre-pass, the dQ workspace's zeroing and conversion) shared out over its
units: bench/backward_timeline.py tells those apart (on an H200 at 9ad9163 they were
nearly all of a). Two series fit a and b by least squares:

- dense, non-causal, B N fixed (the grid's 16k tokens): U stays 128 H while T = U N / BLOCK_M
  grows with N; no tile is masked;
- a causal window (w, 0) at N = 16k: U fixed again, T grows with w; each unit has the
  same count of masked sub-tiles (the diagonal's and the window edge's), so its a is the
  dense a plus those sub-tiles' extra cost.

    python bench/unit_costs.py [--head-dims 64 128] [--dtype bfloat16]

Prints per series: the fit (a, b in microseconds), each point's reading and the fit's
residual, and b against the dense b. Timing only; no peers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupyflash  # noqa: E402
from cupyflash import _cuda, _kernels, bench  # noqa: E402

DENSE_SEQLENS = (256, 512, 1024, 2048, 4096, 16384)
WINDOWS = (128, 256, 512, 1024, 2048, 4096)
WINDOW_SEQLEN = 16384


def tiles_seen(N, block_n, block_m, window=None):
    """Units (key blocks) and the query tiles they walk, of one (batch, head): all of
    them dense, those meeting rows [k0, k0 + block_n - 1 + w] under a causal window w."""
    units = tiles = 0
    for k0 in range(0, N, block_n):
        units += 1
        if window is None:
            tiles += -(-N // block_m)
        else:
            last = min(N - 1, k0 + block_n - 1 + window)
            tiles += last // block_m - k0 // block_m + 1
    return units, tiles


def fit(points, sms):
    """Least squares of ms * sms = a U + b T over ``points`` [(U, T, ms)]: (a, b) in us and
    the residuals (us of SM time)."""
    A = np.array([[u, t] for u, t, _ in points], dtype=float)
    y = np.array([ms for _, _, ms in points]) * 1e3 * sms
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    return a, b, y - A @ np.array([a, b])


def backward_ms(q, k, v, do, **options):
    _, ctx = cupyflash.attention_forward(q, k, v, **options)
    return bench.time_ms(lambda: cupyflash.attention_backward(do, ctx))


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    sms = _cuda._sm_count(0)
    for d in a.head_dims:
        block_m, consumers = _kernels.BWD_SM90_KV_TILES[d][0]
        block_n = 64 * consumers
        H = bench.HIDDEN // d
        series = {"dense": [], "window": []}
        for N in DENSE_SEQLENS:
            B = bench.TOKENS // N
            (q, k, v, do), _ = bench.make_inputs(a.dtype, (B, H, N, d), N + d)
            u, t = tiles_seen(N, block_n, block_m)
            series["dense"].append((f"N={N}", u * B * H, t * B * H, backward_ms(q, k, v, do)))
        (q, k, v, do), _ = bench.make_inputs(a.dtype, (1, H, WINDOW_SEQLEN, d), d)
        for w in WINDOWS:
            u, t = tiles_seen(WINDOW_SEQLEN, block_n, block_m, w)
            series["window"].append((f"w={w}", u * H, t * H, backward_ms(q, k, v, do, causal=True, window=(w, 0))))
        b_dense = None
        for name, points in series.items():
            a_us, b_us, residual = fit([(u, t, ms) for _, u, t, ms in points], sms)
            b_dense = b_dense or b_us
            print(f"d={d} {name}: unit {a_us:.2f} us, tile {b_us:.3f} us ({b_us / b_dense:.2f}x dense's tile), "
                  f"{sms} SMs, tile {block_m} queries x {block_n} keys")
            for (label, u, t, ms), r in zip(points, residual):
                print(f"    {label:8} units {u:6d} tiles {t:7d} ({t / u:6.1f} a unit) {ms:8.3f} ms  "
                      f"residual {r / 1e3 / sms:+.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
