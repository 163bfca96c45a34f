"""GPU time of each launch of a forward call (CUDA events around every kernel launch), and
the call's wall time, to see what a short call's time goes to: e.g. fp32 on Hopper, whose
forward follows two passes that write q, k and v as fp16 halves (split_f32.cu).

    python bench/forward_launch_times.py --dtype float32 --head-dim 64 --seqlen 1024 [--causal] [--precision tf32]

B N = 16k and H d = 2048 as in the grid; (B, H, N, d) arrays, the API's default layout.
"""

import argparse
import collections
import time

import cupy as cp

import cupyflash
from cupyflash import _cuda


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--precision", default="highest")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    B, H = 16384 // a.seqlen, 2048 // a.head_dim
    q, k, v = (cp.random.standard_normal((B, H, a.seqlen, a.head_dim), dtype=cp.float32).astype(a.dtype)
               for _ in range(3))
    call = lambda: cupyflash.attention(q, k, v, causal=a.causal, precision=a.precision)  # noqa: E731
    call()
    cp.cuda.Device().synchronize()
    times = collections.defaultdict(list)
    launch = _cuda._launch

    def timed(variant, *args):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch(variant, *args)
        end.record()
        times[variant.name_expression].append((start, end))

    _cuda._launch = timed
    t0 = time.perf_counter()
    for _ in range(a.reps):
        call()
    cp.cuda.Device().synchronize()
    wall = (time.perf_counter() - t0) / a.reps
    _cuda._launch = launch
    total = 0.0
    for name, events in times.items():
        ms = sum(cp.cuda.get_elapsed_time(s, e) for s, e in events) / a.reps
        total += ms
        print(f"{ms * 1e3:9.1f} us  {name}")
    print(f"{total * 1e3:9.1f} us  launches, {wall * 1e6:9.1f} us  wall per call")


if __name__ == "__main__":
    main()
