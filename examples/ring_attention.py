"""Causal attention over one sequence spread across GPUs (ring attention), checked in float64.

Start one process per GPU with the launcher (it sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, as torchrun does; torchrun works too):

    python -m cupyflash.distributed.launch --nproc 4 examples/ring_attention.py [--seqlen N]

Each rank draws the same whole sequence (bf16, 16 heads, d = 128; default 32768 tokens
per GPU), keeps its zigzag shard (chunks r and 2R-1-r of 2R), runs ring attention forward
and backward over NCCL, and checks a sample of its output rows against a float64
computation over the whole sequence. NCCL must be available to CuPy
(``pip install nvidia-nccl-cu12``).

Without the launcher it says what it needs and runs the same algorithm on R simulated
ranks in this process (`LocalRing`, default 4): on one GPU if there is one, else on the
NumPy backend with a smaller problem:

    python examples/ring_attention.py --simulate 4
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout too

from cupyflash import bench, distributed as dist  # noqa: E402
from cupyflash._gpu_status import why_not_usable  # noqa: E402

TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-5}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, help="tokens per rank (default: 32768 on GPUs, 512 on the CPU)")
    p.add_argument("--heads", type=int, default=16, help="heads H (default: %(default)s)")
    p.add_argument("--simulate", type=int, default=4, metavar="R",
                   help="without the launcher: simulated ranks (default: %(default)s)")
    p.add_argument("--check-rows", type=int, default=8,
                   help="rows per rank compared in float64 (default: %(default)s)")
    return p.parse_args()


def float64_rows(q_rows, rows, k, v, scale):
    """Causal attention of the given global rows over the whole (H, N, d) k, v, in float64."""
    q_rows, k, v = (np.asarray(x, np.float64) for x in (q_rows, k, v))
    s = scale * np.einsum("hrd,hnd->hrn", q_rows, k)
    s = np.where(np.arange(k.shape[1])[None, None, :] <= np.asarray(rows)[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hrn,hnd->hrd", p / p.sum(-1, keepdims=True), v)


def rank_job(comm, whole, n, args, xp, dtype):
    """One rank's work: shard, ring forward and backward, check sampled rows. Returns
    (forward s, backward s, worst relative error)."""
    q, k, v, do = (dist.zigzag_shard(x, comm.rank, comm.size, -2) for x in whole)
    sync = (lambda: None) if xp is np else xp.cuda.get_current_stream().synchronize
    start = time.perf_counter()
    o, ctx = dist.ring_attention_forward(q, k, v, comm, causal=True)
    sync()
    mid = time.perf_counter()
    dist.ring_attention_backward(do, ctx)
    sync()
    end = time.perf_counter()
    # Global positions of this rank's rows: chunks r and 2R-1-r of length n / 2.
    half = n // 2
    first, second = dist.zigzag_chunks(comm.rank, comm.size)
    positions = np.concatenate([first * half + np.arange(half), second * half + np.arange(half)])
    pick = np.random.default_rng(comm.rank).choice(n, size=min(args.check_rows, n), replace=False)
    host = (lambda x: x) if xp is np else xp.asnumpy
    K, V = (host(x[0]) for x in whole[1:3])
    idx = xp.asarray(pick)
    ref = float64_rows(host(q[0][:, idx]), positions[pick], K, V, q.shape[-1] ** -0.5)
    got = np.asarray(host(o[0][:, idx]), np.float64)
    return mid - start, end - mid, np.linalg.norm(got - ref) / np.linalg.norm(ref)


def report(world, n, heads, times, err, dtype, where):
    fwd, bwd = times
    total = n * world
    per_gpu = lambda ps, s: bench.flops(1, heads, total, 128, True, ps) / world / s / 1e12   # noqa: E731
    print(f"{where}: {world} ranks x {n} tokens = {total} causal, {heads} heads, d = 128, {dtype}")
    print(f"forward {fwd * 1e3:.1f} ms ({per_gpu('fwd', fwd):.1f} TFLOP/s per rank), "
          f"backward {bwd * 1e3:.1f} ms ({per_gpu('bwd', bwd):.1f} TFLOP/s per rank)")
    ok = err < TOLERANCE[dtype]
    print(f"sampled rows vs float64: relative error {err:.2e} (limit {TOLERANCE[dtype]:g}) "
          f"{'OK' if ok else 'FAILED'}")
    return ok


def draw(xp, n_total, heads, dtype):
    rng = xp.random.default_rng(0) if xp is not np else np.random.default_rng(0)   # same on every rank
    shape = (1, heads, n_total, 128)
    return [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(4)]


def main():
    args = parse_args()
    gpu_reason = why_not_usable()
    if "RANK" in os.environ:   # started by the launcher (or torchrun): one rank per process
        import cupy as cp
        comm = dist.from_env()
        n = args.seqlen or 32768
        whole = draw(cp, n * comm.size, args.heads, "bfloat16")
        fwd, bwd, err = rank_job(comm, whole, n, args, cp, "bfloat16")
        ok = err < TOLERANCE["bfloat16"]
        if comm.rank == 0:
            ok = report(comm.size, n, args.heads, (fwd, bwd), err, "bfloat16", "NCCL ring") and ok
        else:
            print(f"rank {comm.rank}: relative error {err:.2e} {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1

    count = 0 if gpu_reason else __import__("cupy").cuda.runtime.getDeviceCount()
    print(f"Not started by a launcher. For ring attention over NCCL run\n"
          f"    python -m cupyflash.distributed.launch --nproc N {sys.argv[0]}\n"
          f"with N <= the GPUs of this machine ({count}; at least 2 make it worthwhile, and NCCL "
          f"must be available to CuPy). Now: {args.simulate} simulated ranks in this process.\n")
    if gpu_reason is None:
        import cupy as cp
        xp, dtype, n, where = cp, "bfloat16", args.seqlen or 4096, "LocalRing on one GPU"
    else:
        xp, dtype, n, where = np, "float32", args.seqlen or 512, f"LocalRing, NumPy backend ({gpu_reason})"
    whole = draw(xp, n * args.simulate, min(args.heads, 4) if xp is np else args.heads, dtype)
    results = dist.LocalRing(args.simulate).run(
        lambda comm: rank_job(comm, whole, n, args, xp, dtype))
    # Simulated ranks share one device, so the slowest rank's time is the ring's.
    times = (max(r[0] for r in results), max(r[1] for r in results))
    ok = report(args.simulate, n, whole[0].shape[1], times, max(r[2] for r in results), dtype, where)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
