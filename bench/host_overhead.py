"""Split a forward call's time into the kernel's and the host's (Python) share.

    python bench/host_overhead.py [--seqlens 512 1024 2048] [--head-dims 64 128]

For each case: milliseconds per call of `cupyflash.attention` timed back to back (as the
benchmark does), of the bare kernel launch on preallocated outputs (`_cuda.attention_forward`),
and of torch SDPA's flash backend, plus the host time per `cupyflash.attention` call from
`cupyx.profiler.benchmark`. Where the first exceeds the second by about the host time, the
benchmark's row is bound by Python, not by the kernel.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
from cupyx.profiler import benchmark  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _cuda, _mods, bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
p.add_argument("--dtype", default="bfloat16")
a = p.parse_args()
torch, SDPBackend, sdpa_kernel = bench._torch()
print(f"{'d':>4} {'c':>2} {'N':>6} {'api ms':>8} {'kernel ms':>9} {'flash ms':>8} {'host ms':>8}  api/kernel/flash TFLOP/s")
for d in a.head_dims:
    for causal in (False, True):
        for N in a.seqlens:
            H, B = bench.HIDDEN // d, bench.TOKENS // N
            (q, k, v, _), (tq, tk, tv, _) = bench.make_inputs(a.dtype, (B, H, N, d), N)
            o, lse = cp.empty_like(q), cp.empty((B, H, N), cp.float32)
            scale = 1 / math.sqrt(d)
            api = bench.time_ms(lambda: cupyflash.attention(q, k, v, causal=causal))
            kernel = bench.time_ms(lambda: _cuda.attention_forward(q, k, v, o, lse, scale=scale, causal=causal,
                                                                   mods=_mods.NONE))
            host = benchmark(lambda: cupyflash.attention(q, k, v, causal=causal), n_repeat=50).cpu_times.mean() * 1e3
            flash = float("nan")
            if torch is not None:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    flash = bench.time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal))
            f = bench.flops(B, H, N, d, causal, "fwd") / 1e9
            print(f"{d:4d} {int(causal):2d} {N:6d} {api:8.3f} {kernel:9.3f} {flash:8.3f} {host:8.3f}  "
                  f"{f / api:.0f}/{f / kernel:.0f}/{f / flash:.0f}", flush=True)
