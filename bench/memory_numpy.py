"""Peak memory of the NumPy backend against the N x N matrix that naive attention needs.

Each measurement runs in a fresh child process (``spawn``, not ``fork``, so the child
inherits none of this process's pages) and reads the high-water mark of its resident
set, ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, once after the inputs exist and once
after the attention; the difference is what the attention itself added at its peak.

Run from the repository root (or with cupyflash installed)::

    PYTHONPATH=. python bench/memory_numpy.py                 # N = 32768, d = 64, fp32
    PYTHONPATH=. python bench/memory_numpy.py --seqlen 8192 --heads 4 --causal --backward
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time

import numpy as np

MIB = 2**20


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def measure(args: argparse.Namespace) -> dict:
    """Runs in the child: build the inputs, run the pass, report the RSS high-water marks."""
    from cupyflash._reference import attention_backward, attention_forward

    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def tensor(n, dim):
        # Drawn directly in the target dtype: a float64 temporary would raise the baseline.
        return rng.standard_normal((args.batch, args.heads, n, dim), dtype=dtype)

    q, k, v = (tensor(args.seqlen, args.headdim) for _ in range(3))
    options = dict(scale=args.headdim ** -0.5, causal=args.causal,
                   block_q=args.block_q, block_k=args.block_k)
    if args.backward:
        o, lse = attention_forward(q, k, v, **options)
        do = tensor(args.seqlen, args.headdim)
    baseline = peak_rss_bytes()
    start = time.perf_counter()
    if args.backward:
        attention_backward(do, q, k, v, o, lse, **options)
    else:
        attention_forward(q, k, v, **options)
    seconds = time.perf_counter() - start
    return {"baseline": baseline, "peak": peak_rss_bytes(), "seconds": seconds}


def _child(args, queue):
    queue.put(measure(args))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=32768, help="Nq = Nk")
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true",
                        help="measure the backward pass; its baseline already holds o, lse, "
                             "dO and the forward's own (small) high-water mark")
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=128)
    args = parser.parse_args(argv)

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(args, queue))
    child.start()
    result = queue.get()
    child.join()

    itemsize = np.dtype(args.dtype).itemsize
    n, bh = args.seqlen, args.batch * args.heads
    inputs = 3 * bh * n * args.headdim * itemsize
    matrix = bh * n * n * itemsize
    pass_name = "backward" if args.backward else "forward"
    print(f"NumPy backend {pass_name}: B={args.batch} H={args.heads} N={n} "
          f"d={args.headdim} {args.dtype} causal={args.causal} "
          f"blocks={args.block_q}x{args.block_k}  ({result['seconds']:.1f} s)")
    print(f"  peak RSS of the child process     {result['peak'] / MIB:10.1f} MiB")
    print(f"  of which before the attention     {result['baseline'] / MIB:10.1f} MiB "
          f"(interpreter, NumPy, q/k/v = {inputs / MIB:.1f} MiB)")
    print(f"  added by the attention at peak    "
          f"{(result['peak'] - result['baseline']) / MIB:10.1f} MiB")
    print(f"  one N x N {args.dtype} score matrix {matrix / MIB:10.1f} MiB "
          f"({matrix / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
