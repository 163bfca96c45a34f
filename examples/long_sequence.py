"""Exact attention over one long sequence, forward and backward, checked in float64.

On a GPU (default: 131072 tokens, 16 heads, d = 128, bf16, causal) it reports the time,
TFLOP/s and peak device memory of each phase; without a GPU it runs a smaller problem
on the NumPy backend and says so. Either way it checks a random sample of output rows
against a float64 computation of the same rows, and prints how much memory the
N x N score matrix it never built would have taken.

    python examples/long_sequence.py [--seqlen N] [--heads H] [--head-dim d] [--dtype bfloat16]
    python examples/long_sequence.py --seqlen 1048576     # a million tokens on a GPU

Inputs are drawn where the attention runs (on the GPU with CuPy's generator), so a long
GPU run does not wait minutes for the host to draw them; only the checked rows and one
head's keys and values come back to the host for the float64 check.
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
from cupyflash.bench import peak_memory_hook  # noqa: E402

TOLERANCE = {"bfloat16": 1e-2, "float16": 3e-3, "float32": 1e-5, "float64": 1e-12}


def parse_args(on_gpu):
    where = "GPU found" if on_gpu else "no GPU: NumPy backend"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog=f"Defaults are this machine's ({where}).")
    p.add_argument("--seqlen", type=int, default=131072 if on_gpu else 16384, help="tokens N (default: %(default)s)")
    p.add_argument("--heads", type=int, default=16 if on_gpu else 2, help="heads H (default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=128 if on_gpu else 64, help="head dim d (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16" if on_gpu else "float32",
                   choices=sorted(TOLERANCE), help="dtype of q, k, v (default: %(default)s)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="full attention (default: causal)")
    p.add_argument("--no-backward", dest="backward", action="store_false",
                   help="forward pass only (default: forward and backward)")
    p.add_argument("--check-rows", type=int, default=16, help="rows compared with float64 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (default: %(default)s)")
    return p.parse_args()


def numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Phase:
    """Wall time (after a device sync) and, on a GPU, the peak device memory that the
    phase's own allocations held at once (its outputs and workspace; the inputs, allocated
    before, are not counted)."""

    def __init__(self, name, xp):
        self.name, self.xp = name, xp
        self.on_gpu = xp is not np

    def __enter__(self):
        print(f"  {self.name} ...", end="", flush=True)
        if self.on_gpu:
            self.xp.cuda.Device().synchronize()
            self.memory = peak_memory_hook()
            self.memory.__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.on_gpu:
            self.xp.cuda.Device().synchronize()
        self.seconds = time.perf_counter() - self.t0
        extra = ""
        if self.on_gpu:
            self.memory.__exit__(*exc)
            extra = f", peak device memory allocated {self.memory.peak / 2**30:.3f} GiB"
        print(f" {self.seconds:.3f} s{extra}", flush=True)


def rate(flops, seconds):
    per_second = flops / seconds
    return f"{per_second / 1e12:.1f} TFLOP/s" if per_second >= 1e12 else f"{per_second / 1e9:.1f} GFLOP/s"


def to_host(x):
    return x.get() if hasattr(x, "get") else x


def reference_rows(q, k, v, rows, head, scale, causal):
    """float64 softmax(q k^T) v for some rows of one head, from the (rounded) inputs,
    which may be on the GPU: only those rows and the head's keys and values are copied."""
    qh = to_host(q[0, head, rows]).astype(np.float64)
    kh, vh = (to_host(x[0, head]).astype(np.float64) for x in (k, v))
    s = qh @ kh.T * scale
    if causal:  # with Nq == Nk, row i sees keys j <= i
        s[np.arange(kh.shape[0])[None, :] > rows[:, None]] = -np.inf
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(axis=1, keepdims=True)) @ vh


def main():
    on_gpu = _cuda.gpu_available()
    args = parse_args(on_gpu)
    if on_gpu:
        import cupy as xp
        name = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"]
        where = f"GPU: {name.decode() if isinstance(name, bytes) else name}"
    else:
        xp = np
        where = "no GPU found: NumPy backend, smaller default size"
    N, H, d, dtype = args.seqlen, args.heads, args.head_dim, numpy_dtype(args.dtype)
    print(f"cupyflash {cupyflash.__version__} on {where}")
    print(f"exact attention: 1 x {H} heads x {N} tokens x d={d}, {args.dtype}, "
          f"{'causal' if args.causal else 'full'}")
    scores_bytes = H * N * N * 4
    print(f"  a materialised fp32 score matrix would need {scores_bytes / 2**30:,.1f} GiB")

    rng = xp.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal((1, H, N, d), dtype=np.float32).astype(dtype) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    flops = 4.0 * H * N * N * d / (2 if args.causal else 1)

    with Phase("forward", xp) as fwd:
        o, ctx = cupyflash.attention_forward(q, k, v, causal=args.causal)
    print(f"    {rate(flops, fwd.seconds)}" + (" (a first run includes compiling the kernel)" if on_gpu else ""))
    if args.backward:
        do = rng.standard_normal(o.shape, dtype=np.float32).astype(dtype)
        try:
            with Phase("backward", xp) as bwd:
                dq, dk, dv = cupyflash.attention_backward(do, ctx)
            print(f"    {rate(2.5 * flops, bwd.seconds)}; gradients finite: "
                  f"{all(bool(xp.isfinite(g.astype(np.float32)).all()) for g in (dq, dk, dv))}")
        except NotImplementedError as exc:
            print(f"\n  backward skipped: {exc}")

    pick = np.random.default_rng(args.seed)
    rows = np.sort(pick.choice(N, size=min(args.check_rows, N), replace=False))
    head = int(pick.integers(H))
    ref = reference_rows(q, k, v, rows, head, scale, args.causal)
    got = to_host(o[0, head, rows]).astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    ok = err < TOLERANCE[args.dtype]
    print(f"  check: {len(rows)} random rows of head {head} against float64: relative error "
          f"{err:.2e} ({'ok' if ok else 'TOO LARGE'}, limit {TOLERANCE[args.dtype]:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
