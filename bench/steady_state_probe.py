"""What the first call's host time did to bench.time_ms: each case timed the benchmark's
way since session 36 (each run started one call ahead: `ahead`) and the way before (the
first timed call's Python before any GPU work: `old`), and the host's time per call.

    python bench/steady_state_probe.py [--seqlens 1024 4096] [--head-dims 64 128]

Cases: fp32 (default and precision="tf32"), fp64 and bf16 forwards, and torch SDPA's peer
for each dtype (efficient, math, flash). Host time per call: `cupyx.profiler.benchmark`'s
CPU time, as bench/host_overhead.py takes it. (Session 36's log, `…-dbb3f3c-steady-state-probe.log`,
timed its "busy" column with a 5 ms spin before each run instead of a call ahead: the same
wherever the host's time per call is below the GPU's, and too fast where it is not; and
took the host's time as the wall time of issuing calls behind such a spin.)
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyx.profiler import benchmark  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
a = p.parse_args()
torch, SDPBackend, sdpa_kernel = bench._torch()


def host_ms(fn):
    return benchmark(fn, n_repeat=20).cpu_times.mean() * 1e3


CASES = [("float32", "highest"), ("float32", "tf32"), ("float64", "highest"), ("bfloat16", "highest")]
PEER = {"float32": "EFFICIENT_ATTENTION", "float64": "MATH", "bfloat16": "FLASH_ATTENTION"}
print(f"{'case':28} {'old ms':>8} {'ahead ms':>8} {'old/ahead':>9} {'host ms':>8}  TFLOP/s old / ahead")
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
                # old, ahead, old, ahead: the better of two readings each, so that the order
                # favours neither
                old, ahead = (min(x) for x in zip(*[(bench.time_ms(fn, ahead=False), bench.time_ms(fn))
                                                    for _ in range(2)]))
                print(f"{name + ' ' + dtype + f' d={d} N={N}':28} {old:8.3f} {ahead:8.3f} {old / ahead:9.3f} "
                      f"{host_ms(fn):8.3f}  {flop / old / 1e9:7.1f} / {flop / ahead / 1e9:7.1f}", flush=True)
