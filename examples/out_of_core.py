"""Exact causal attention on host arrays larger than a given device memory (streamed).

q, k, v live in host memory (NumPy); `cupyflash.attention(..., device_memory_limit=...)`
streams query and key chunks through at most that many bytes of GPU memory and merges
the chunks' results exactly. The script prints the plan (chunks, bytes moved against the
least possible), the time and TFLOP/s, and checks sampled output rows against a float64
NumPy computation of those rows. Without a GPU it runs a small case with the same chunked
algorithm on the NumPy backend, and says so.

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


def reference_rows(q, k, v, rows, scale):
    """float64 causal attention of the sampled (head, row) pairs (Nq == Nk)."""
    out = []
    for h, i in rows:
        s = (k[0, h, :i + 1].astype(np.float64) @ q[0, h, i].astype(np.float64)) * scale
        p = np.exp(s - s.max())
        out.append(p @ v[0, h, :i + 1].astype(np.float64) / p.sum())
    return np.array(out)


def main(argv=None):
    on_gpu = _cuda.gpu_available()
    args = parse_args(on_gpu, argv)
    backend = "cuda" if on_gpu else "numpy"
    print(f"{'GPU' if on_gpu else 'no GPU: the streamed algorithm on the NumPy backend (small case)'}; "
          f"N = {args.seqlen}, H = {args.heads}, d = {args.head_dim}, {args.dtype}, causal")
    rng = np.random.default_rng(args.seed)
    shape = (1, args.heads, args.seqlen, args.head_dim)
    dtype = numpy_dtype(args.dtype)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(3))
    host_bytes = 4 * q.nbytes   # q, k, v and o
    plan = cupyflash.streaming_plan(q, k, v, causal=True, device_memory_limit=args.device_memory_limit)
    print(f"host arrays (q, k, v, o): {host_bytes / 2**20:.0f} MiB; device limit "
          f"{args.device_memory_limit / 2**20:.0f} MiB ({plan.device_bytes / 2**20:.0f} MiB used); "
          f"the in-memory call would take {plan.in_memory_bytes / 2**20:.0f} MiB")
    print(f"chunks of {plan.query_chunk} rows, {plan.pairs} (query, key) chunk pairs; copies "
          f"{(plan.h2d_bytes + plan.d2h_bytes) / 2**20:.0f} MiB, {plan.traffic_ratio:.2f}x the least")

    start = time.perf_counter()
    o = cupyflash.attention(q, k, v, causal=True, backend=backend,
                            device_memory_limit=args.device_memory_limit)
    seconds = time.perf_counter() - start
    flop = 4.0 * args.heads * args.seqlen ** 2 * args.head_dim / 2
    print(f"forward: {seconds:.3f} s, {flop / seconds / 1e12:.2f} TFLOP/s (copies included)")

    picks = [(int(rng.integers(args.heads)), int(i)) for i in
             rng.choice(args.seqlen, size=min(args.check_rows, args.seqlen), replace=False)]
    ref = reference_rows(q, k, v, picks, 1 / math.sqrt(args.head_dim))
    got = np.array([o[0, h, i].astype(np.float64) for h, i in picks])
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    ok = err <= TOLERANCE[args.dtype]
    print(f"{len(picks)} sampled rows against float64: relative error {err:.2e} "
          f"({'within' if ok else 'ABOVE'} the {args.dtype} limit {TOLERANCE[args.dtype]:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
