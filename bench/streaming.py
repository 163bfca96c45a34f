"""Streamed attention (device_memory_limit) against the in-memory call, on host arrays.

bf16, d = 128, H = 16, B = 1, causal; N from the command line. The streamed call gets
device_memory_limit = 1/8 of the device bytes the in-memory forward+backward takes
(`StreamingPlan.in_memory_bytes` of the backward plan, which the forward checks too). Both
variants start from NumPy arrays and return NumPy arrays, so both times include the
copies; the in-memory call ("dense") moves each input and output once. Times are wall
clock (the calls synchronise: their results are host arrays), the best of --repeat after
a warm-up. TFLOP/s counts `cupyflash.bench.flops` (causal: half of 4 N^2 d per head).

    python bench/streaming.py --seqlen 32768 65536 --out bench/results/streaming.json

Rows: gpu, date, commit, dtype, head_dim, seqlen, causal, pass ("fwd" | "bwd"), variant
("streamed limit=1/8" | "dense"), tflops, ms, h2d_bytes, d2h_bytes, min_bytes (null ms
where the dense call runs out of device memory).
"""

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import cupyflash as cf  # noqa: E402
from cupyflash import bench  # noqa: E402

DTYPE, HEAD_DIM, HEADS, BATCH, FRACTION = "bfloat16", 128, 16, 1, 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[32768], help="N (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per case, best kept (default: %(default)s)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--commit", help="the commit to record (default: this checkout's, from git)")
    return p.parse_args(argv)


def best_ms(fn, repeat):
    fn()   # warm-up: kernels compiled, pools filled
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def inputs(n, seed=0):
    import ml_dtypes
    rng = np.random.default_rng(seed)
    shape = (BATCH, HEADS, n, HEAD_DIM)
    return [rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(4)]


def run_case(n, repeat, meta):
    import cupy as cp

    q, k, v, do = inputs(n)
    back_plan = cf.streaming_plan(q, k, v, causal=True, backward=True, device_memory_limit=2**62)
    limit = back_plan.in_memory_bytes // FRACTION
    fwd_plan = cf.streaming_plan(q, k, v, causal=True, device_memory_limit=limit)
    back_plan = cf.streaming_plan(q, k, v, causal=True, backward=True, device_memory_limit=limit)
    rows = []

    def row(pass_, variant, ms, h2d, d2h, least):
        flop = bench.flops(BATCH, HEADS, n, HEAD_DIM, True, pass_)
        r = dict(meta, dtype=DTYPE, head_dim=HEAD_DIM, seqlen=n, causal=True, variant=variant,
                 tflops=flop / (ms * 1e-3) / 1e12 if ms else None, ms=ms, h2d_bytes=h2d,
                 d2h_bytes=d2h, min_bytes=least, **{"pass": pass_})
        print(json.dumps(r), flush=True)
        rows.append(r)

    state = {}

    def streamed_fwd():
        state["o"], state["ctx"] = cf.attention_forward(q, k, v, causal=True, device_memory_limit=limit)

    ms = best_ms(streamed_fwd, repeat)
    row("fwd", f"streamed limit=1/{FRACTION}", ms, fwd_plan.h2d_bytes, fwd_plan.d2h_bytes, fwd_plan.min_bytes)
    ms = best_ms(lambda: cf.attention_backward(do, state["ctx"]), repeat)
    row("bwd", f"streamed limit=1/{FRACTION}", ms, back_plan.h2d_bytes, back_plan.d2h_bytes, back_plan.min_bytes)
    state.clear()

    dense = {}

    def dense_fwd():
        dense["o"], dense["ctx"] = cf.attention_forward(q, k, v, causal=True, backend="cuda")

    for pass_, fn, plan in (("fwd", dense_fwd, fwd_plan),
                            ("bwd", lambda: cf.attention_backward(do, dense["ctx"]), back_plan)):
        try:
            ms = best_ms(fn, repeat)
        except cp.cuda.memory.OutOfMemoryError:
            ms = None
        row(pass_, "dense", ms, plan.min_bytes - _outputs(plan, n), _outputs(plan, n), plan.min_bytes)
    dense.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def _outputs(plan, n):
    """Bytes of a pass's outputs (what the in-memory call copies back)."""
    item = 2   # bf16
    if plan.backward:
        return 3 * BATCH * HEADS * n * HEAD_DIM * item
    return BATCH * HEADS * n * (HEAD_DIM * item + 4)


def main(argv=None):
    args = parse_args(argv)
    meta = {"gpu": bench.gpu_name(), "date": datetime.date.today().isoformat(),
            "commit": args.commit or bench.checkout_commit()}
    rows = [r for n in args.seqlen for r in run_case(n, args.repeat, meta)]
    if args.out:
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
