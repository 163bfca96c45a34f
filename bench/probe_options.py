"""Where an option's forward time goes on the GPU: the API call back to back (as the
benchmark times it), the host's Python time per call, and the kernel alone (timed behind
a long matrix product, so the host's time before the launch is hidden), with persistent
Hopper forward CTAs and with one CTA per work tile. Kernel work:

    python bench/probe_options.py [d ...]            # bf16, N = 16384, B*N = 16384, H*d = 2048
    python bench/probe_options.py --tiles 128        # the option tiles of FWD_SM90_EXT/BIAS_TILES' candidates
    python bench/probe_options.py --once "window 256" 128   # one option a few times, for ncu
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _cuda, _kernels, bench  # noqa: E402

N = 16384
# Candidate tiles (BLOCK_N, CONSUMERS, STAGES) per (table, head dim), spill-free in the build check.
TILE_CANDIDATES = {
    ("dense", 64): [(128, 3, 2), (64, 3, 4), (64, 3, 3), (128, 2, 2)],
    ("ext", 64): [(128, 2, 3), (64, 3, 4), (64, 3, 3)],
    ("ext", 128): [(128, 2, 3), (128, 2, 2), (64, 2, 4)],
    ("bias", 64): [(128, 2, 3), (64, 2, 4)],
    ("bias", 128): [(64, 2, 4), (64, 2, 3)],
}


def options(d, H):
    rng = np.random.default_rng(0)
    blocks = -(-N // 128)
    lengths = bench.varlen_lengths(rng, bench.VARLEN_SEQS, N)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return {
        "dense": dict(),
        "dense causal": dict(causal=True),
        "window 256": dict(causal=True, window=(256, 0)),
        "window 2048": dict(causal=True, window=(2048, 0)),
        # Index arrays on the host: on the device the API reads them back (a synchronisation).
        "seqlens_k": dict(seqlens_k=np.array([N * 3 // 4], np.int32)),
        "seqlens_k (cupy)": dict(seqlens_k=cp.asarray(np.array([N * 3 // 4], np.int32))),
        "varlen 8 seqs": dict(varlen=(cu, int(lengths.max()))),
        "varlen (cupy cu)": dict(varlen=(cp.asarray(cu), int(lengths.max()))),
        "block density 1": dict(block_mask=cp.ones((1, H, blocks, blocks), bool), block_size=128),
        "block density 0.5": dict(block_mask=cp.asarray(bench.random_block_mask(rng, H, blocks, blocks, 0.5)),
                                  block_size=128),
        "block density 0.125": dict(block_mask=cp.asarray(bench.random_block_mask(rng, H, blocks, blocks, 0.125)),
                                    block_size=128),
        "dropout": dict(dropout_p=0.1, seed=0),
        "softcap": dict(softcap=30.0),
        "alibi causal": dict(causal=True, alibi_slopes=cp.asarray((2.0 ** -np.arange(1, H + 1)).astype(np.float32))),
        "bias": dict(bias=cp.random.standard_normal((N, N), dtype=cp.float32).astype(cp.float16)),
    }


def call(q, k, v, opts, dtype):
    """A function that runs the forward of one option (packed sequences for varlen)."""
    opts = {k_: (x.astype(dtype) if k_ == "bias" else x) for k_, x in opts.items()}
    if "varlen" in opts:
        cu, longest = opts.pop("varlen")
        packed = [x[0].transpose(1, 0, 2) for x in (q, k, v)]   # (total, H, d) views
        return lambda: cupyflash.varlen_attention(*packed, cu, cu, longest, longest, causal=True)
    return lambda: cupyflash.attention(q, k, v, **opts)


def kernel_ms(run, reps=5):
    """The call's GPU time with the host's time hidden behind a long product."""
    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        a @ a   # ~10 ms of GPU work queued ahead
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def host_us(run, reps=20):
    cp.cuda.Device().synchronize()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        t.append(time.perf_counter() - t0)
        cp.cuda.Device().synchronize()
    return 1e6 * float(np.median(t))


def probe(d, dtype="bfloat16"):
    """API, kernel (persistent Hopper forward and one CTA per work tile) and host times."""
    H = bench.HIDDEN // d
    q, k, v = (cp.random.standard_normal((1, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(3))
    print(f"\nbf16 d={d} N={N} H={H}: {'option':20} {'api ms':>8} {'kernel ms':>9} {'1 CTA/tile':>10} "
          f"{'host us':>8}", flush=True)
    for name, opts in options(d, H).items():
        run = call(q, k, v, opts, dtype)
        try:
            run()
            api = bench.time_ms(run)
            persistent = kernel_ms(run)
            _cuda.PERSISTENT_FORWARD = False
            try:
                per_tile = kernel_ms(run)
            finally:
                _cuda.PERSISTENT_FORWARD = True
            print(f"  {name:20} {api:8.3f} {persistent:9.3f} {per_tile:10.3f} {host_us(run):8.1f}", flush=True)
        except Exception as exc:
            print(f"  {name:20} {type(exc).__name__}: {str(exc)[:150]}", flush=True)


def tiles(d, dtype="bfloat16"):
    H = bench.HIDDEN // d
    q, k, v = (cp.random.standard_normal((1, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(3))
    cases = {"dense": [dict(), dict(causal=True)],
             "ext": [dict(causal=True, window=(2048, 0)), dict(dropout_p=0.1, seed=0), dict(softcap=30.0)],
             "bias": [dict(bias=cp.random.standard_normal((N, N), dtype=cp.float32).astype(dtype))]}
    table = {"dense": _kernels.FWD_SM90_TILES, "ext": _kernels.FWD_SM90_EXT_TILES, "bias": _kernels.FWD_SM90_BIAS_TILES}
    for (kind, dd), candidates in TILE_CANDIDATES.items():
        if dd != d:
            continue
        saved = table[kind][d]
        for tile in candidates:
            table[kind][d] = (tile,)
            ms = []
            for opts in cases[kind]:
                try:
                    ms.append(kernel_ms(lambda: cupyflash.attention(q, k, v, **opts)))
                except Exception as exc:
                    ms.append(float("nan"))
                    print(f"  {kind} {tile}: {type(exc).__name__}: {str(exc)[:150]}")
            print(f"  tiles {kind:5} d={d} {tile}: kernel ms " + " ".join(f"{m:7.3f}" for m in ms), flush=True)
        table[kind][d] = saved


def once(name, d, dtype="bfloat16", repeat=3):
    """Run one option's forward a few times (for ncu) and print the cubin that serves it."""
    from cupyflash import _nvrtc
    H = bench.HIDDEN // d
    q, k, v = (cp.random.standard_normal((1, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(3))
    opts = options(d, H)[name]
    run = call(q, k, v, opts, dtype)
    for _ in range(repeat):
        run()
    cp.cuda.Device().synchronize()
    mode = (_kernels.MODE_EXT | (_kernels.MODE_BIAS if "bias" in opts else 0)) if set(opts) - {"causal"} else 0
    variant = _cuda._choose(_kernels.forward_variants(dtype, _kernels.padded_head_dim(d, d), mode), 0)
    print(variant.name_expression, _nvrtc.compile_kernel(variant.source, variant.name_expression,
                                                         _cuda._device_info(0)[0]).binary_path)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--once":
        once(args[1], int(args[2]))
    elif args and args[0] == "--tiles":
        for d in map(int, args[1:] or ["64", "128"]):
            tiles(d)
    else:
        for d in map(int, args or ["128"]):
            probe(d)
