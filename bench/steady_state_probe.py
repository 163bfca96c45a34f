"""What the first call's host time did to bench.time_ms: each case timed with the GPU kept
busy before the run (the benchmark's method since session 36) and without (before it),
and the host's time per call.

    python bench/steady_state_probe.py [--seqlens 1024 4096] [--head-dims 64 128]

Cases: fp32 (default and precision="tf32"), fp64 and bf16 forwards, and torch SDPA's peer
for each dtype (efficient, math, flash). Host time per call: the wall time of issuing 10
calls while the GPU is kept busy (no call waits for the GPU), over 10.
"""

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
a = p.parse_args()
torch, SDPBackend, sdpa_kernel = bench._torch()


def host_ms(fn, calls=10):
    fn()
    cp.cuda.Device().synchronize()
    bench.busy_gpu(200)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = (time.perf_counter() - t0) / calls * 1e3
    cp.cuda.Device().synchronize()
    return wall


CASES = [("float32", "highest"), ("float32", "tf32"), ("float64", "highest"), ("bfloat16", "highest")]
PEER = {"float32": "EFFICIENT_ATTENTION", "float64": "MATH", "bfloat16": "FLASH_ATTENTION"}
print(f"{'case':28} {'old ms':>8} {'busy ms':>8} {'old/busy':>8} {'host ms':>8}  TFLOP/s old / busy")
for d in a.head_dims:
    for N in a.seqlens:
        H, B = bench.HIDDEN // d, bench.TOKENS // N
        flop = bench.flops(B, H, N, d, False, "fwd")
        for dtype, precision in CASES:
            (q, k, v, _), (tq, tk, tv, _) = bench.make_inputs(dtype, (B, H, N, d), N)
            name = "cupyflash-tf32" if precision == "tf32" else "cupyflash"
            calls = {name: lambda: cupyflash.attention(q, k, v, scale=1 / math.sqrt(d), precision=precision)}
            if torch is not None and precision == "highest":
                backend = getattr(SDPBackend, PEER[dtype])

                def peer():
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, scale=1 / math.sqrt(d))
                calls[f"torch-{PEER[dtype].split('_')[0].lower()}"] = peer
            for name, fn in calls.items():
                old = bench.time_ms(fn, lead_ms=0)
                busy = bench.time_ms(fn)
                print(f"{name + ' ' + dtype + f' d={d} N={N}':28} {old:8.3f} {busy:8.3f} {old / busy:8.3f} "
                      f"{host_ms(fn):8.3f}  {flop / old / 1e9:7.1f} / {flop / busy / 1e9:7.1f}", flush=True)
