"""Attention over several GPUs: TFLOP/s per GPU of ring attention and of the one-process split.

bf16, d = 128, H = 16, B = 1, causal; N per GPU from the command line (the sequence is
N * gpus long). Two ways to run it:

    # ring attention, one process per GPU over NCCL (rank 0 prints and writes the rows)
    python -m cupyflash.distributed.launch --nproc 4 bench/distributed.py --seqlen-per-gpu 8192 \
        --out bench/results/ring.json
    # multi_device_attention from one process over the listed GPUs
    python bench/distributed.py --devices 0 1 2 3 --seqlen-per-gpu 8192 --out bench/results/devices.json

Each case also gets a single-GPU row: the plain `cupyflash.attention` call on one GPU's
shard alone (N per GPU, causal), ``gpus = 1``, so the per-GPU rate of the split can be
read against the rate of its local work; with --single-whole also one over the whole
sequence (N = seqlen, timed once), for the split's speed-up over one GPU. Times are the
median of --repeat calls after a warm-up, each call synchronised (every device, and for
the ring every rank, since the exchanges make the ranks wait for one another); TFLOP/s per
GPU counts `cupyflash.bench.flops` of the whole sequence (causal: half of 4 N^2 d per head, 2.5x
that backward) divided by the number of GPUs.

Rows: gpu, date, commit, dtype, head_dim, N (per GPU), seqlen (whole sequence), causal,
pass ("fwd" | "bwd"), tflops (per GPU), ms, gpus, variant ("ring" | "devices" | "single").
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import cupyflash as cf  # noqa: E402
from cupyflash import bench  # noqa: E402
from cupyflash import distributed as dist  # noqa: E402

DTYPE, HEAD_DIM, HEADS, BATCH, CAUSAL = "bfloat16", 128, 16, 1, True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen-per-gpu", type=int, nargs="+", default=[8192],
                   help="N per GPU (default: %(default)s)")
    p.add_argument("--devices", type=int, nargs="+",
                   help="run multi_device_attention over these GPUs (without the launcher's RANK)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per case (default: %(default)s)")
    p.add_argument("--single-whole", action="store_true",
                   help="also time one GPU over the whole sequence (once, without a warm-up: the "
                        "shard's rows have compiled the kernels; the first allocation of its buffers "
                        "is in the time, milliseconds against seconds at 1M tokens), for the speed-up")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--commit", help="record this as the commit (default: the checkout's own)")
    return p.parse_args(argv)


def median_ms(fn, sync, repeat, warm_up=True):
    if warm_up:   # kernels compiled, pools filled
        fn()
        sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def inputs(n, seed=0):
    """q, k, v, dO of n tokens, drawn on the current GPU (on the host, 1M tokens took
    a minute a rank; the values do not change the timings)."""
    import cupy as cp
    rng = cp.random.default_rng(seed)
    shape = (BATCH, HEADS, n, HEAD_DIM)
    return [rng.standard_normal(shape, dtype=cp.float32).astype(DTYPE) for _ in range(4)]


def make_row(meta, *, n, gpus, variant, pass_, ms):
    flop = bench.flops(BATCH, HEADS, n * gpus, HEAD_DIM, CAUSAL, pass_) / gpus
    return dict(meta, dtype=DTYPE, head_dim=HEAD_DIM, N=n, seqlen=n * gpus, causal=CAUSAL,
                tflops=flop / (ms * 1e-3) / 1e12, ms=ms, gpus=gpus, variant=variant,
                **{"pass": pass_})


def single_rows(meta, n, repeat, warm_up=True):
    """The plain call on one GPU over n tokens: a shard's work without any split or, with
    n the whole sequence, the time that a speed-up is counted against."""
    import cupy as cp
    q, k, v, do = inputs(n)
    sync = cp.cuda.get_current_stream().synchronize
    state = {}

    def fwd():
        state["o"], state["ctx"] = cf.attention_forward(q, k, v, causal=CAUSAL)

    ms = median_ms(fwd, sync, repeat, warm_up)
    rows = [make_row(meta, n=n, gpus=1, variant="single", pass_="fwd", ms=ms)]
    ms = median_ms(lambda: cf.attention_backward(do, state["ctx"]), sync, repeat, warm_up)
    rows.append(make_row(meta, n=n, gpus=1, variant="single", pass_="bwd", ms=ms))
    return rows


def ring_rows(meta, comm, n, repeat):
    import cupy as cp
    world = comm.size
    # Each rank draws its own shard (the ring's correctness is the tests' business).
    q, k, v, do = inputs(n, seed=comm.rank)
    sync = cp.cuda.get_current_stream().synchronize
    state = {}

    def fwd():
        state["o"], state["ctx"] = dist.ring_attention_forward(q, k, v, comm, causal=CAUSAL)

    rows = [make_row(meta, n=n, gpus=world, variant="ring", pass_="fwd",
                     ms=median_ms(fwd, sync, repeat))]
    ms = median_ms(lambda: dist.ring_attention_backward(do, state["ctx"]), sync, repeat)
    rows.append(make_row(meta, n=n, gpus=world, variant="ring", pass_="bwd", ms=ms))
    return rows


def devices_rows(meta, devices, n, repeat):
    import cupy as cp
    gpus = len(devices)
    q, k, v, do = inputs(n * gpus)

    def sync():
        for d in devices:
            with cp.cuda.Device(d):
                cp.cuda.get_current_stream().synchronize()

    state = {}

    def fwd():
        state["o"], state["vjp"] = dist.multi_device_attention_vjp(q, k, v, devices=devices, causal=CAUSAL)

    rows = [make_row(meta, n=n, gpus=gpus, variant="devices", pass_="fwd",
                     ms=median_ms(fwd, sync, repeat))]
    ms = median_ms(lambda: state["vjp"](do), sync, repeat)
    rows.append(make_row(meta, n=n, gpus=gpus, variant="devices", pass_="bwd", ms=ms))
    return rows


def main(argv=None):
    args = parse_args(argv)
    import cupy as cp
    ring = "RANK" in os.environ
    if not ring and not args.devices:
        sys.exit("say where to run: start it with python -m cupyflash.distributed.launch --nproc N "
                 "bench/distributed.py ..., or pass --devices 0 1 ... for multi_device_attention")
    comm = dist.from_env() if ring else None
    if not ring:
        count = cp.cuda.runtime.getDeviceCount()
        if max(args.devices) >= count:
            sys.exit(f"--devices {args.devices} needs GPUs up to {max(args.devices)}, this machine has {count}")
        cp.cuda.Device(args.devices[0]).use()
    lead = comm is None or comm.rank == 0
    meta = {"gpu": bench.gpu_name(), "date": datetime.date.today().isoformat(),
            "commit": args.commit or bench.checkout_commit()}
    rows = []
    for n in args.seqlen_per_gpu:
        found = (ring_rows(meta, comm, n, args.repeat) if ring
                 else devices_rows(meta, args.devices, n, args.repeat))
        if lead:
            found += single_rows(meta, n, args.repeat)
            if args.single_whole:
                gpus = comm.size if ring else len(args.devices)
                found += single_rows(meta, n * gpus, 1, warm_up=False)
            for r in found:
                print(json.dumps(r), flush=True)
        rows += found
    if lead and args.out:
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
