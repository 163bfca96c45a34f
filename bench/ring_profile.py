"""Where ring attention's time goes: NCCL's exchange rate, the ring's rows, each step's time.

One launch, one process per GPU, on the shapes of bench/distributed.py (bf16, d = 128,
H = 16, B = 1, causal):
- the exchanges alone: one sendrecv to the next rank of a K/V shard (the forward's message)
  and of its fp32 dK/dV sums (the backward's), for NCCL's rate between neighbours;
- ring attention's forward and backward (median of --repeat), beside the shard's
  single-GPU rows (bench/distributed.py's);
- with --timeline, each rank's steps of one forward and one backward call, timed by CUDA
  events on the compute stream (kernel calls, merges, sums, waits for an exchange).
NCCL's own variables (NCCL_MAX_P2P_NCHANNELS, ...) are read once per process: compare them
across launches; the rows record the NCCL_* environment. (2245752's version also switched
the exchanges' stream priority and SMs left free for NCCL: bench/NOTES.md, session 20.)

    python -m cupyflash.distributed.launch --nproc 2 bench/ring_profile.py \
        --seqlen-per-gpu 32768 --timeline --out ring-profile-2.json
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from cupyflash import bench  # noqa: E402
from cupyflash import distributed as dist  # noqa: E402
from cupyflash.distributed import ring  # noqa: E402

import distributed as rows_of  # noqa: E402  (bench/distributed.py: shapes, inputs, rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen-per-gpu", type=int, nargs="+", default=[32768])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeline", action="store_true",
                   help="also print each rank's steps of one call, as CUDA event times")
    p.add_argument("--out", type=Path)
    p.add_argument("--commit")
    return p.parse_args(argv)


def exchange_rows(meta, comm, n):
    """GB/s of one sendrecv to the next rank (bytes sent per second), alone on the GPU."""
    import cupy as cp
    shape = (rows_of.BATCH, rows_of.HEADS, n, rows_of.HEAD_DIM)
    stream = cp.cuda.Stream(non_blocking=True)
    out = []
    for what, dtype in (("kv", rows_of.DTYPE), ("dkdv_fp32", "float32")):
        send = [cp.ones(shape, dtype) for _ in range(2)]
        recv = [cp.empty(shape, dtype) for _ in range(2)]

        def once():
            comm.sendrecv(send, (comm.rank + 1) % comm.size, recv, (comm.rank - 1) % comm.size, stream)

        ms = rows_of.median_ms(once, stream.synchronize, 5)
        nbytes = sum(x.nbytes for x in send)
        out.append(dict(meta, N=n, gpus=comm.size, message=what, bytes=nbytes, ms=ms,
                        gb_per_s=nbytes / (ms * 1e-3) / 1e9))
    return out


class Timeline:
    """CUDA events on the compute stream after each of the ring's steps (kernel calls,
    merges, waits for an exchange), for one call: the time between two marks is what ran
    (or was waited for) since the previous one. Installed by patching the ring's calls."""

    def __init__(self):
        import cupy as cp
        self.cp, self.marks = cp, []

    def mark(self, label):
        event = self.cp.cuda.Event()
        event.record(self.cp.cuda.get_current_stream())
        self.marks.append((label, event))

    def wrap(self, owner, name, label, before=None):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if before:
                self.mark(before)
            result = original(*args, **kwargs)
            self.mark(label)
            return result
        setattr(owner, name, wrapped)
        return original

    def report(self):
        self.marks[-1][1].synchronize()
        start, rows = self.marks[0][1], []
        for (_, a), (label, b) in zip(self.marks, self.marks[1:]):
            rows.append((label, self.cp.cuda.get_elapsed_time(a, b), self.cp.cuda.get_elapsed_time(start, b)))
        return rows


def timeline(comm, q, k, v, do):
    """One forward and one backward call with their steps marked; prints this rank's (in
    one write, so that the ranks' lines do not interleave)."""
    from cupyflash import _cuda
    t = Timeline()
    patched = [(_cuda, "attention_forward", t.wrap(_cuda, "attention_forward", "fwd kernels")),
               (_cuda, "attention_backward", t.wrap(_cuda, "attention_backward", "bwd kernels")),
               (ring, "merge_into", t.wrap(ring, "merge_into", "merge")),
               (ring._Ring, "arrived", t.wrap(ring._Ring, "arrived", "waited for an exchange",
                                              before="(sums, copies) before a wait")),
               (ring, "_sums_home", t.wrap(ring, "_sums_home", "sums home"))]
    lines = []
    try:
        for pass_ in ("fwd", "bwd"):
            t.marks = []
            t.mark("start")
            if pass_ == "fwd":
                o, ctx = dist.ring_attention_forward(q, k, v, comm, causal=rows_of.CAUSAL)
            else:
                dist.ring_attention_backward(do, ctx)
            t.mark("end (outputs written)")
            lines += [f"rank {comm.rank} {pass_}: {label:32} {ms:7.2f} ms (at {at:7.2f})"
                      for label, ms, at in t.report()]
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def main(argv=None):
    args = parse_args(argv)
    import cupy as cp
    comm = dist.from_env()
    lead = comm.rank == 0
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    meta = {"gpu": bench.gpu_name(), "date": datetime.date.today().isoformat(),
            "commit": args.commit or bench.checkout_commit(), "nccl_env": nccl_env}
    found = []
    for n in args.seqlen_per_gpu:
        found += exchange_rows(meta, comm, n)
        q, k, v, do = rows_of.inputs(n, seed=comm.rank)
        sync = cp.cuda.get_current_stream().synchronize
        state = {}

        def fwd():
            state["o"], state["ctx"] = dist.ring_attention_forward(q, k, v, comm, causal=rows_of.CAUSAL)

        found.append(rows_of.make_row(meta, n=n, gpus=comm.size, variant="ring", pass_="fwd",
                                      ms=rows_of.median_ms(fwd, sync, args.repeat)))
        ms = rows_of.median_ms(lambda: dist.ring_attention_backward(do, state["ctx"]), sync, args.repeat)
        found.append(rows_of.make_row(meta, n=n, gpus=comm.size, variant="ring", pass_="bwd", ms=ms))
        if args.timeline:
            timeline(comm, q, k, v, do)
        if lead:
            found += rows_of.single_rows(meta, n, args.repeat)
    if lead:
        for r in found:
            print(json.dumps(r), flush=True)
        if args.out:
            args.out.write_text(json.dumps({**meta, "rows": found}, indent=1) + "\n")


if __name__ == "__main__":
    main()
