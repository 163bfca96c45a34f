"""Streamed attention (device_memory_limit) against the in-memory call on host arrays, and
a run past the GPU's memory.

Rows of --seqlen: bf16, d = 128, H = 16, B = 1, causal. The streamed call gets
device_memory_limit = 1/8 of the device bytes the in-memory forward+backward takes
(`StreamingPlan.in_memory_bytes` of the backward plan, which the forward checks too); the
in-memory call ("dense") runs beside it. Both start from NumPy arrays and return NumPy
arrays, so both times include the copies.

--past-memory: N = 4194304, H = 8 (bf16, d = 128, causal), forward and backward with the
default device_memory_limit: the in-memory call would need q, k, v, o, dO, dq, dk, dv
(64 GiB) and a 16 GiB fp32 dQ workspace, more than an 80 GB GPU has, so the call streams
through the free device memory by itself. No dense rows. Host memory: the eight arrays
(64 GiB) and the backward's fp32 sums of dq (16 GiB at most).

Inputs are drawn on the GPU (CuPy's generator, fp32 rounded to bf16) and copied into host
arrays head by head (NumPy's generator takes minutes at these sizes). Times are wall clock
(the calls synchronise: their results are host arrays), the best of --repeat after a
warm-up: --warmup full calls each variant once at the measured size first; small runs
each variant once at N = 8192 (compiles the kernels, fills CuPy's pools), for sizes
where one call takes tens of seconds; none skips it. TFLOP/s counts
`cupyflash.bench.flops` (causal: half of 4 N^2 d per head).

Streamed rows are checked: o, lse and dq of --check-rows sampled query rows per head
(the last row among them) recomputed in float64 on the GPU from the host arrays, head by
head, against the streamed results (relative error norms over the sampled rows). dk and
dv are not checked: each key's gradient sums over every query row, a float64 whole pass.

    python bench/streaming.py --seqlen 131072 262144 --out bench/results/streaming.json
    python bench/streaming.py --seqlen 1048576 --warmup small --repeat 1 --out ...json
    python bench/streaming.py --past-memory --warmup small --repeat 1 --out ...json

Rows: gpu, date, commit, dtype, head_dim, heads, seqlen, causal, pass ("fwd" | "bwd"),
variant ("streamed limit=1/8" | "streamed, default limit" | "dense"), tflops, ms,
h2d_bytes, d2h_bytes, min_bytes, device_memory_limit; streamed rows add checked_rows and
o_rel_err, lse_rel_err (fwd) or dq_rel_err, dk_dv_checked = false (bwd). A dense row's
bytes are what that call copies (its backward reuses the device copies of q, k, v, o and
lse that its forward made); null ms where it runs out of device memory. The bytes of a
streamed call with the default limit are those of its plan under the free device memory
just before the call.
"""

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import cupyflash as cf  # noqa: E402
from cupyflash import _arrays, bench, streaming  # noqa: E402

DTYPE, HEAD_DIM, HEADS, BATCH, FRACTION = "bfloat16", 128, 16, 1, 8
PAST_MEMORY_SEQLEN, PAST_MEMORY_HEADS = 4194304, 8
SMALL_SEQLEN = 8192


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[32768], help="N (default: %(default)s)")
    p.add_argument("--past-memory", action="store_true",
                   help=f"only the run past the GPU's memory: N = {PAST_MEMORY_SEQLEN}, H = {PAST_MEMORY_HEADS}")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per case, best kept (default: %(default)s)")
    p.add_argument("--warmup", choices=["full", "small", "none"], default="full",
                   help="before timing: each call once at the measured size, at N = "
                        f"{SMALL_SEQLEN}, or not at all (default: %(default)s)")
    p.add_argument("--check-rows", type=int, default=4,
                   help="query rows per head checked in float64 (default: %(default)s)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--commit", help="the commit to record (default: this checkout's, from git)")
    return p.parse_args(argv)


def best_ms(fn, repeat, warm, release):
    """Best time of ``fn`` over ``repeat`` calls (after one untimed call with ``warm``);
    ``release()`` drops the last call's results before the next, untimed (at N = 4M a
    second set of outputs would not fit in host memory)."""
    if warm:
        fn()
    times = []
    for _ in range(repeat):
        release()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def host_inputs(n, heads, seed=0):
    """q, k, v, dO: (B, heads, n, d) bf16 host arrays drawn on the GPU, one head at a time
    (a head's fp32 draw is the GPU memory it takes)."""
    import cupy as cp

    rng = cp.random.default_rng(seed)
    arrays = [np.empty((BATCH, heads, n, HEAD_DIM), _arrays.BFLOAT16) for _ in range(4)]
    for x in arrays:
        for b, h in np.ndindex(BATCH, heads):
            rng.standard_normal((n, HEAD_DIM), dtype=cp.float32).astype(x.dtype).get(out=x[b, h])
    return arrays


def sampled_row_errors(q, k, v, do, o, lse, dq, rows_per_head, seed=1):
    """Relative errors of o, lse and dq over sampled query rows of every head (causal,
    Nq = Nk), against float64 recomputed on the GPU from the host arrays one head at a
    time: a row's probabilities p over its keys, o = p V, lse, and
    dq = scale * sum_j p_j (dP_j - D) k_j with dP = V dO and D = p . dP."""
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    n, scale = q.shape[2], 1 / math.sqrt(q.shape[-1])
    rng = np.random.default_rng(seed)
    got, ref = {"o": [], "lse": [], "dq": []}, {"o": [], "lse": [], "dq": []}
    for b, h in np.ndindex(q.shape[:2]):
        keys = cp.asarray(k[b, h]).astype(cp.float64)
        values = cp.asarray(v[b, h]).astype(cp.float64)
        for i in sorted({n - 1, *rng.integers(0, n, rows_per_head - 1).tolist()}):
            qi, doi = (cp.asarray(x[b, h, i].astype(np.float64)) for x in (q, do))
            s = keys[:i + 1] @ qi * scale
            top = s.max()
            p = cp.exp(s - top)
            total = p.sum()
            p /= total
            dp = values[:i + 1] @ doi
            ds = p * (dp - p @ dp)
            ref["o"].append(cp.asnumpy(p @ values[:i + 1]))
            ref["lse"].append(float(top + cp.log(total)))
            ref["dq"].append(cp.asnumpy(scale * (ds @ keys[:i + 1])))
            got["o"].append(o[b, h, i].astype(np.float64))
            got["lse"].append(float(lse[b, h, i]))
            got["dq"].append(dq[b, h, i].astype(np.float64))
        del keys, values
        cp.get_default_memory_pool().free_all_blocks()
    errors = {f"{name}_rel_err": float(np.linalg.norm(np.subtract(got[name], ref[name]))
                                       / np.linalg.norm(ref[name])) for name in got}
    return errors, len(got["lse"])


class Case:
    """One problem size: its inputs, plans and rows (printed as they come with ``report``)."""

    def __init__(self, n, heads, meta, rows_per_check, report=True):
        self.n, self.heads, self.meta, self.rows_per_check = n, heads, meta, rows_per_check
        self.report = report
        self.q, self.k, self.v, self.do = host_inputs(n, heads)
        self.rows = []

    def plan(self, limit, backward=False):
        return cf.streaming_plan(self.q, self.k, self.v, causal=True, backward=backward,
                                 device_memory_limit=limit)

    def in_memory_bytes(self):
        return self.plan(2**62, backward=True).in_memory_bytes

    def row(self, pass_, variant, ms, h2d, d2h, least, limit, **extra):
        flop = bench.flops(BATCH, self.heads, self.n, HEAD_DIM, True, pass_)
        r = dict(self.meta, dtype=DTYPE, head_dim=HEAD_DIM, heads=self.heads, seqlen=self.n, causal=True,
                 variant=variant, tflops=flop / (ms * 1e-3) / 1e12 if ms else None, ms=ms, h2d_bytes=h2d,
                 d2h_bytes=d2h, min_bytes=least, device_memory_limit=limit, **extra, **{"pass": pass_})
        if self.report:
            print(json.dumps(r), flush=True)
        self.rows.append(r)

    def streamed(self, variant, limit, repeat, warm):
        """Streamed forward and backward rows under ``limit`` (None: the default), with
        the sampled-row check."""
        import cupy as cp

        state = {}

        def forward():
            state["o"], state["ctx"] = cf.attention_forward(self.q, self.k, self.v, causal=True, backend="cuda",
                                                            device_memory_limit=limit)

        def backward():
            state["grads"] = cf.attention_backward(self.do, state["ctx"])

        ms = best_ms(forward, repeat, warm, state.clear)
        fwd = state["ctx"].streaming
        assert fwd is not None, "the call did not stream"
        # The backward plans under the same limit: the given one, or the free memory now.
        back_limit = limit if limit is not None else streaming.free_device_budget(cp.cuda.Device().id)
        back = self.plan(back_limit, backward=True)
        ms_back = best_ms(backward, repeat, warm, lambda: state.pop("grads", None))
        errors, checked = sampled_row_errors(self.q, self.k, self.v, self.do, state["o"], state["ctx"].lse,
                                             state["grads"][0], self.rows_per_check)
        self.row("fwd", variant, ms, fwd.h2d_bytes, fwd.d2h_bytes, fwd.min_bytes, fwd.device_memory_limit,
                 checked_rows=checked, o_rel_err=errors["o_rel_err"], lse_rel_err=errors["lse_rel_err"])
        self.row("bwd", variant, ms_back, back.h2d_bytes, back.d2h_bytes, back.min_bytes, back_limit,
                 checked_rows=checked, dq_rel_err=errors["dq_rel_err"], dk_dv_checked=False)
        if self.report:
            print(f"# N = {self.n}, H = {self.heads}: {checked} sampled rows against float64: o "
                  f"{errors['o_rel_err']:.2e}, lse {errors['lse_rel_err']:.2e}, dq {errors['dq_rel_err']:.2e} "
                  "(bf16 limits in tests/TOLERANCES.md: 1e-2, 3e-2 for streamed gradients); dk and dv "
                  "not checked at this size (a float64 reference is a whole backward pass)", flush=True)
        state.clear()
        cp.get_default_memory_pool().free_all_blocks()

    def dense(self, repeat, warm):
        import cupy as cp

        state = {}

        def release():
            state.pop("grads", None)

        item = np.dtype(_arrays.BFLOAT16).itemsize
        array = BATCH * self.heads * self.n * HEAD_DIM * item
        lse = BATCH * self.heads * self.n * 4
        least = {"fwd": self.plan(2**62).min_bytes, "bwd": self.plan(2**62, backward=True).min_bytes}

        def forward():
            state["o"], state["ctx"] = cf.attention_forward(self.q, self.k, self.v, causal=True, backend="cuda")

        def backward():
            state["grads"] = cf.attention_backward(self.do, state["ctx"])

        # Forward: q, k, v up, o and lse back. Backward: dO up, dq, dk, dv back.
        for pass_, fn, h2d, d2h, drop in (("fwd", forward, 3 * array, array + lse, state.clear),
                                          ("bwd", backward, array, 3 * array, release)):
            try:
                ms = best_ms(fn, repeat, warm, drop)
            except cp.cuda.memory.OutOfMemoryError:
                ms = None
            self.row(pass_, "dense", ms, h2d, d2h, least[pass_], None)
            if ms is None:
                break
        state.clear()
        cp.get_default_memory_pool().free_all_blocks()


def warm_up_small(heads):
    """Each variant once at N = SMALL_SEQLEN (streamed in several chunks): kernels compiled,
    CuPy's memory and pinned pools filled."""
    small = Case(SMALL_SEQLEN, heads, {}, 1, report=False)
    small.streamed("warm-up", small.in_memory_bytes() // FRACTION, 1, False)
    small.dense(1, False)


def main(argv=None):
    args = parse_args(argv)
    meta = {"gpu": bench.gpu_name(), "date": datetime.date.today().isoformat(),
            "commit": args.commit or bench.checkout_commit()}
    heads = PAST_MEMORY_HEADS if args.past_memory else HEADS
    if args.warmup == "small":
        warm_up_small(heads)
    warm = args.warmup == "full"
    rows = []
    if args.past_memory:
        case = Case(PAST_MEMORY_SEQLEN, heads, meta, args.check_rows)
        print(f"# N = {case.n}, H = {heads}: the in-memory call would take "
              f"{case.in_memory_bytes() / 2**30:.1f} GiB of device memory", flush=True)
        case.streamed("streamed, default limit", None, args.repeat, warm)
        rows += case.rows
    else:
        for n in args.seqlen:
            case = Case(n, heads, meta, args.check_rows)
            case.streamed(f"streamed limit=1/{FRACTION}", case.in_memory_bytes() // FRACTION, args.repeat, warm)
            case.dense(args.repeat, warm)
            rows += case.rows
            del case
    if args.out:
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
