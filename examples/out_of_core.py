"""Exact causal attention and its gradients on host arrays larger than a given device
memory (streamed).

q, k, v live in host memory (NumPy); `cupyflash.attention_vjp(..., device_memory_limit=...)`
streams query and key chunks through at most that many bytes of GPU memory and merges
the chunks' results exactly, and its backward streams too. The script prints both plans
(chunks, bytes moved against the least possible), the times and TFLOP/s, and checks the
output and dq of sampled rows against a float64 NumPy computation of those rows. Without a
GPU it runs a small case with the same chunked algorithm on the NumPy backend, and says so.

    python examples/out_of_core.py                                   # GPU: 131072 tokens, 256 MiB
    python examples/out_of_core.py --seqlen 262144 --device-memory-limit 1073741824
"""

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout too

import cupyflash  # noqa: E402
from cupyflash import _cuda  # noqa: E402

TOLERANCE = {"bfloat16": 1e-2, "float16": 3e-3, "float32": 1e-5, "float64": 1e-12}


def parse_args(on_gpu, argv=None):
    where = "GPU found" if on_gpu else "no GPU: NumPy backend"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog=f"Defaults are this machine's ({where}).")
    p.add_argument("--seqlen", type=int, default=131072 if on_gpu else 8192, help="tokens N (default: %(default)s)")
    p.add_argument("--heads", type=int, default=16 if on_gpu else 2, help="heads H (default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=128 if on_gpu else 64, help="head dim d (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16" if on_gpu else "float32", choices=sorted(TOLERANCE),
                   help="dtype of q, k, v (default: %(default)s)")
    p.add_argument("--device-memory-limit", type=int, default=(256 << 20) if on_gpu else (2 << 20),
                   help="bytes of device memory the call may use (default: %(default)s)")
    p.add_argument("--check-rows", type=int, default=16, help="rows compared with float64 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    return p.parse_args(argv)


def numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def reference_rows(q, k, v, do, rows, scale):
    """float64 causal attention and dq of the sampled (head, row) pairs (Nq == Nk): a
    row's probabilities p, o = p V, and dq = scale * sum_j p_j (dP_j - D) k_j with
    dP = V dO and D = p . dP."""
    outs, dqs = [], []
    for h, i in rows:
        keys, values = (x[0, h, :i + 1].astype(np.float64) for x in (k, v))
        s = keys @ q[0, h, i].astype(np.float64) * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        dp = values @ do[0, h, i].astype(np.float64)
        outs.append(p @ values)
        dqs.append(scale * (p * (dp - p @ dp)) @ keys)
    return np.array(outs), np.array(dqs)


def describe(what, plan):
    print(f"{what}: chunks of {plan.query_chunk} query and {plan.key_chunk} key rows, {plan.pairs} "
          f"(query, key) chunk pairs, {plan.device_bytes / 2**20:.0f} MiB on the device; copies "
          f"{(plan.h2d_bytes + plan.d2h_bytes) / 2**20:.0f} MiB, {plan.traffic_ratio:.2f}x the least")


def main(argv=None):
    on_gpu = _cuda.gpu_available()
    args = parse_args(on_gpu, argv)
    backend = "cuda" if on_gpu else "numpy"
    print(f"{'GPU' if on_gpu else 'no GPU: the streamed algorithm on the NumPy backend (small case)'}; "
          f"N = {args.seqlen}, H = {args.heads}, d = {args.head_dim}, {args.dtype}, causal")
    rng = np.random.default_rng(args.seed)
    shape = (1, args.heads, args.seqlen, args.head_dim)
    dtype = numpy_dtype(args.dtype)
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(4))
    limit = args.device_memory_limit
    forward_plan = cupyflash.streaming_plan(q, k, v, causal=True, device_memory_limit=limit)
    backward_plan = cupyflash.streaming_plan(q, k, v, causal=True, device_memory_limit=limit, backward=True)
    print(f"host arrays (q, k, v, o, dO, dq, dk, dv): {8 * q.nbytes / 2**20:.0f} MiB; device limit "
          f"{limit / 2**20:.0f} MiB; the in-memory forward and backward would take "
          f"{backward_plan.in_memory_bytes / 2**20:.0f} MiB")
    describe("forward", forward_plan)
    describe("backward", backward_plan)

    flop = 4.0 * args.heads * args.seqlen ** 2 * args.head_dim / 2
    start = time.perf_counter()
    o, vjp = cupyflash.attention_vjp(q, k, v, causal=True, backend=backend, device_memory_limit=limit)
    seconds = time.perf_counter() - start
    print(f"forward: {seconds:.3f} s, {flop / seconds / 1e12:.2f} TFLOP/s (copies included)")
    start = time.perf_counter()
    dq, dk, dv = vjp(do)
    seconds = time.perf_counter() - start
    print(f"backward: {seconds:.3f} s, {2.5 * flop / seconds / 1e12:.2f} TFLOP/s (copies included)")

    picks = [(int(rng.integers(args.heads)), int(i)) for i in
             rng.choice(args.seqlen, size=min(args.check_rows, args.seqlen), replace=False)]
    ref_o, ref_dq = reference_rows(q, k, v, do, picks, 1 / math.sqrt(args.head_dim))
    status = 0
    # The streamed dq sums each key chunk's term after the kernels round it to the dtype:
    # three times the limit, as the GPU tests allow (tests/test_streaming.py).
    bounds = {"o": TOLERANCE[args.dtype], "dq": 3 * TOLERANCE[args.dtype]}
    for name, got, ref in (("o", o, ref_o), ("dq", dq, ref_dq)):
        rows = np.array([got[0, h, i].astype(np.float64) for h, i in picks])
        err = np.linalg.norm(rows - ref) / np.linalg.norm(ref)
        ok = err <= bounds[name]
        status |= not ok
        print(f"{name} of {len(picks)} sampled rows against float64: relative error {err:.2e} "
              f"({'within' if ok else 'ABOVE'} the {args.dtype} limit {bounds[name]:g})")
    return status


if __name__ == "__main__":
    sys.exit(main())
