"""The cost of ``deterministic=True`` in the backward pass: TFLOP/s of the backward with dQ
added by atomics (the default) and with the deterministic dQ kernel, same inputs, same run.

    python bench/deterministic_cost.py [--dtypes bfloat16 float32] [--seqlens 4096 16384]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupyflash  # noqa: E402
from cupyflash import bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32", "float64"])
p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
a = p.parse_args()
print(f"{'dtype':9} {'d':>4} {'c':>2} {'N':>6} {'atomic':>8} {'determ.':>8}  cost")
for dtype in a.dtypes:
    wide = dtype in ("float32", "float64")
    for d in a.head_dims:
        for causal in (False, True):
            for N in a.seqlens if not wide else a.seqlens[:1]:
                H, B = bench.HIDDEN // d, bench.TOKENS // N
                (q, k, v, do), _ = bench.make_inputs(dtype, (B, H, N, d), N)
                f = bench.flops(B, H, N, d, causal, "bwd") / 1e9
                tf = []
                for det in (False, True):
                    o, ctx = cupyflash.attention_forward(q, k, v, causal=causal, deterministic=det)
                    tf.append(f / bench.time_ms(lambda: cupyflash.attention_backward(do, ctx)))
                print(f"{dtype:9} {d:4d} {int(causal):2d} {N:6d} {tf[0]:8.1f} {tf[1]:8.1f}  {tf[0] / tf[1]:.2f}x time",
                      flush=True)
