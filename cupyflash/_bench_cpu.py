"""``python -m cupyflash.bench --cpu``: the NumPy backend beside CPU attentions, one process.

Implementations, each in the same process on the same inputs (B = 1, H = 4 by default):
``cupyflash`` (the NumPy backend on all threads, and on one, ``cupyflash-1t``), a naive
NumPy attention (the N x N scores, softmax and product; per head, to bound its memory),
and when importable JAX's ``jax.nn.dot_product_attention`` (jit) and torch's CPU
``scaled_dot_product_attention``. Passes: ``fwd`` and ``fwd+bwd`` (forward, then the
gradients of q, k, v). GFLOP/s count 4*B*H*N^2*d for the forward (half for causal) and
3.5x that for ``fwd+bwd``; ``rate`` in the JSON is the machine's fp32 matrix-product rate
(NumPy, 4096^2 matrices, all threads), measured in the same run.

This machine is shared with whatever else runs on it, so every sample records the CPU
time the rest of the machine took while it ran (``/proc/stat`` minus this process), and
a sample during which others held more than a tenth of a core is measured again (up to
a bound); ``foreign_cores`` in each row is that load, averaged over the kept samples.
``--load`` starts a busy process for the measurement instead (every row then has
``loaded: true``), to show how each implementation copes with a core taken away.

Cases whose N x N matrices would not fit in half the available memory are not run for
the peers that form them (the row says ``skipped``).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time

import numpy as np

MAX_FOREIGN = 0.1   # cores other processes may use during a kept sample


def _busy_seconds():
    """CPU seconds the whole machine has spent busy since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]   # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _sample(fn):
    """(seconds, foreign cores) of one call of ``fn``; other processes' load is measured
    only for calls of at least 50 ms, the counters' resolution allowing."""
    busy0, cpu0, t0 = _busy_seconds(), time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    foreign = 0.0
    if busy0 is not None and wall >= 0.05:
        foreign = max(0.0, (_busy_seconds() - busy0 - (time.process_time() - cpu0)) / wall)
    return wall, foreign


def time_call(fn, *, min_time=1.0, min_repeats=3, max_repeats=20, long_call=10.0):
    """(median seconds per call, foreign cores) of ``fn`` after one warm-up call.

    Repeats until ``min_time`` seconds and ``min_repeats`` kept samples; a sample is kept
    when the rest of the machine used at most `MAX_FOREIGN` cores during it. Gives up
    after ``max_repeats`` samples and keeps them all. A warm-up call of ``long_call``
    seconds or more that no other process disturbed is the one sample: such calls have
    nothing left to warm up, and repeating them would take minutes.
    """
    wall, foreign = _sample(fn)
    if wall >= long_call and foreign <= MAX_FOREIGN:
        return wall, foreign
    kept, everything, start = [], [], time.perf_counter()
    while len(everything) < max_repeats:
        wall, foreign = _sample(fn)
        everything.append((wall, foreign))
        if foreign <= MAX_FOREIGN:
            kept.append((wall, foreign))
        if len(kept) >= min_repeats and time.perf_counter() - start >= min_time:
            break
    samples = kept if len(kept) >= min_repeats else everything
    walls, foreigns = zip(*samples)
    return float(np.median(walls)), float(np.mean(foreigns))


def matmul_rate(n=4096):
    """fp32 GFLOP/s of NumPy's matrix product of two n x n matrices (all BLAS threads)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    seconds, _ = time_call(lambda: a @ b, min_time=0.5, max_repeats=5)
    return 2 * n ** 3 / seconds / 1e9


@contextlib.contextmanager
def threads(n):
    """cupyflash's NumPy backend on ``n`` threads (None: its default) inside the block."""
    from ._cpu_threads import ENV_THREADS

    old = os.environ.get(ENV_THREADS)
    if n is None:
        os.environ.pop(ENV_THREADS, None)
    else:
        os.environ[ENV_THREADS] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_THREADS, None)
        else:
            os.environ[ENV_THREADS] = old


@contextlib.contextmanager
def busy_process(enabled):
    """A second process spinning on one core for the duration of the block (if enabled;
    the block gets its Popen, else None). It spins only while this process is its
    parent, so that a benchmark killed by a signal that skips the ``finally`` below
    (SIGTERM) leaves no process spinning behind."""
    if not enabled:
        yield None
        return
    spin = f"import os\nwhile os.getppid() == {os.getpid()}:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)   # let it start spinning
        yield proc
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- implementations


def _naive_probabilities(q, k, scale, hidden):
    """softmax(scale q k^T) of one head with the whole score matrix, ``hidden`` masked."""
    s = q @ k.T
    s *= scale
    if hidden is not None:
        s[hidden] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def naive_forward(q, k, v, scale, causal):
    """softmax(scale q k^T) v with the whole score matrix, one head at a time."""
    o = np.empty_like(q)
    n = q.shape[-2]
    hidden = np.triu(np.ones((n, n), bool), 1) if causal else None
    for idx in np.ndindex(q.shape[:-2]):
        o[idx] = _naive_probabilities(q[idx], k[idx], scale, hidden) @ v[idx]
    return o


def naive_forward_backward(q, k, v, do, scale, causal):
    """The forward and the gradients by the textbook formulas, one head at a time."""
    grads = [np.empty_like(x) for x in (q, k, v)]
    n = q.shape[-2]
    hidden = np.triu(np.ones((n, n), bool), 1) if causal else None
    for idx in np.ndindex(q.shape[:-2]):
        p = _naive_probabilities(q[idx], k[idx], scale, hidden)
        o = p @ v[idx]
        grads[2][idx] = p.T @ do[idx]
        dp = do[idx] @ v[idx].T
        dp -= (do[idx] * o).sum(axis=-1, keepdims=True)
        ds = np.multiply(dp, p, out=dp)
        grads[0][idx] = ds @ k[idx] * scale
        grads[1][idx] = ds.T @ q[idx] * scale
    return grads


def naive_runs(q, k, v, do, scale, causal):
    return (lambda: naive_forward(q, k, v, scale, causal),
            lambda: naive_forward_backward(q, k, v, do, scale, causal))


def cupyflash_runs(q, k, v, do, scale, causal):
    import cupyflash

    def fwd():
        return cupyflash.attention(q, k, v, causal=causal, scale=scale, backend="numpy")

    def fwd_bwd():
        o, ctx = cupyflash.attention_forward(q, k, v, causal=causal, scale=scale, backend="numpy")
        return cupyflash.attention_backward(do, ctx)

    return fwd, fwd_bwd


def jax_runs(q, k, v, do, scale, causal):
    """JAX's dot_product_attention, jitted, on (B, N, H, d) arrays (its layout)."""
    import jax
    import jax.numpy as jnp

    qj, kj, vj, doj = (jnp.asarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, do))

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal)

    fwd_jit = jax.jit(attend)
    grads_jit = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
    return (lambda: fwd_jit(qj, kj, vj).block_until_ready(),
            lambda: jax.block_until_ready(grads_jit(qj, kj, vj, doj)))


def torch_runs(q, k, v, do, scale, causal):
    """torch's scaled_dot_product_attention on the CPU (its default backend choice)."""
    import torch
    import torch.nn.functional as F

    qt, kt, vt, dot = (torch.from_numpy(x) for x in (q, k, v, do))

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    def fwd_bwd():
        leaves = [x.detach().requires_grad_() for x in (qt, kt, vt)]
        o = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
        return torch.autograd.grad(o, leaves, dot)

    return fwd, fwd_bwd


def _importable(name):
    try:
        __import__(name)
    except Exception:
        return False
    return True


def _proc_field(path, key):
    """The text after ``key:`` on its line of a /proc file, or None (not there, not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _available_bytes():
    value = _proc_field("/proc/meminfo", "MemAvailable")
    return None if value is None else int(value.split()[0]) * 1024


def versions():
    out = {"numpy": np.__version__}
    for name in ("jax", "torch", "threadpoolctl"):
        if _importable(name):
            out[name] = sys.modules[name].__version__
    try:
        from threadpoolctl import threadpool_info
        out["blas"] = [f"{i['internal_api']} {i['version']} {i.get('architecture', '')} "
                       f"({i['num_threads']} threads)"
                       for i in threadpool_info() if i["user_api"] == "blas"]
    except ImportError:
        pass
    # Settings that change the BLAS's kernels or threads (OPENBLAS_CORETYPE picks the
    # kernels: on the AVX-512 EPYC of bench/NOTES.md, Haswell's AVX2 ones ran single-thread
    # products at 0.6x the rate of SkylakeX's).
    out["environment"] = {k: v for k, v in sorted(os.environ.items())
                          if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "XLA_", "CUPYFLASH_"))}
    return out


def cpu_name():
    import platform
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()


def run(args):
    """Every CPU case the command line asks for; returns (rows, matmul GFLOP/s)."""
    import cupyflash

    rate = matmul_rate()
    print(f"fp32 matrix product (NumPy, 4096^2): {rate:.1f} GFLOP/s", flush=True)
    peers = [p for p in ("naive-numpy", "jax", "torch") if p in args.cpu_peers]
    peers = [p for p in peers if p == "naive-numpy" or _importable(p)]
    rows = []
    rng = np.random.default_rng(0)
    dtype = np.dtype(args.cpu_dtype)
    B, H, d = 1, args.cpu_heads, args.cpu_head_dim
    scale = 1 / math.sqrt(d)
    cases = [(causal, N, [rng.standard_normal((B, H, N, d), dtype=np.float32).astype(dtype)
                          for _ in range(4)])
             for causal in (False, True) for N in args.cpu_seqlens]
    every = cupyflash._cpu_threads.num_threads()
    makers = {"cupyflash": (cupyflash_runs, every), "cupyflash-1t": (cupyflash_runs, 1),
              "naive-numpy": (naive_runs, None), "jax": (jax_runs, None), "torch": (torch_runs, None)}
    # One implementation after the other, JAX and torch last: their thread pools keep
    # spinning for a while after a call, which would slow whatever runs next.
    impls = ["cupyflash", "cupyflash-1t"] + peers
    with busy_process(args.load):
        for impl in impls:
            make, n_threads = makers[impl]
            for causal, N, (q, k, v, do) in cases:
                if impl == "cupyflash-1t" and (every == 1 or N > args.cpu_one_thread_max_n):
                    continue
                flop = 4 * B * H * N * N * d / (2 if causal else 1)
                runs = make(q, k, v, do, scale, causal)
                for pass_, fn, factor in (("fwd", runs[0], 1.0), ("fwd+bwd", runs[1], 3.5)):
                    if pass_ not in args.cpu_passes:
                        continue
                    row = {"impl": impl, "pass": pass_, "dtype": dtype.name, "d": d,
                           "causal": causal, "N": N, "B": B, "H": H, "threads": n_threads,
                           "loaded": args.load, "seconds": None, "gflops": None,
                           "foreign_cores": None, "skipped": None}
                    # Naive NumPy and JAX hold whole N x N matrices: one (naive: per
                    # head) or H (JAX: all heads at once); two in the forward, four with
                    # the backward. torch's CPU SDPA runs a blockwise kernel.
                    need = (N * N * dtype.itemsize * (1 if impl == "naive-numpy" else H)
                            * (4 if factor > 1 else 2))
                    room = _available_bytes()
                    if impl in ("naive-numpy", "jax") and room and need > room / 2:
                        row["skipped"] = f"needs ~{need / 2**30:.0f} GiB of N x N matrices"
                    else:
                        try:
                            with threads(n_threads):
                                s, foreign = time_call(fn, min_time=args.cpu_min_time)
                            row.update(seconds=s, gflops=factor * flop / s / 1e9,
                                       foreign_cores=foreign)
                        except Exception as exc:  # a peer running out of memory, say
                            row["skipped"] = f"{type(exc).__name__}: {exc}"[:200]
                    rows.append(row)
                    _print_row(row)
    return rows, rate


def _print_row(r):
    s = f"{r['seconds']:9.4f}" if r["seconds"] else "        -"
    g = f"{r['gflops']:7.1f}" if r["gflops"] else "      -"
    f = f"{r['foreign_cores']:4.2f}" if r["foreign_cores"] is not None else "   -"
    print(f"{r['pass']:7} {r['dtype']:7} {r['d']:3d} {int(r['causal'])} {r['N']:6d} "
          f"{r['impl']:13} {s} s {g} GFLOP/s foreign {f} {r['skipped'] or ''}", flush=True)


def summary(rows, rate):
    """cupyflash's time and its speed-up over each peer, per case."""
    index = {(r["impl"], r["pass"], r["causal"], r["N"]): r["seconds"] for r in rows}
    peers = sorted({r["impl"] for r in rows} - {"cupyflash"})
    print(f"\nfp32 matmul rate {rate:.1f} GFLOP/s; speed-up of cupyflash over each "
          "(their time / its time; 1t: its own time on one thread over all threads)")
    print(f"{'pass':7} {'c':1} {'N':>6} {'cupyflash s':>11} {'GF/s':>6} {'rate':>5} "
          + " ".join(f"{p:>13}" for p in peers))
    for r in rows:
        if r["impl"] != "cupyflash" or not r["seconds"]:
            continue
        ratios = []
        for p in peers:
            other = index.get((p, r["pass"], r["causal"], r["N"]))
            ratios.append(f"{other / r['seconds']:13.2f}" if other else f"{'-':>13}")
        print(f"{r['pass']:7} {int(r['causal'])} {r['N']:6d} {r['seconds']:11.4f} "
              f"{r['gflops']:6.1f} {r['gflops'] / rate:5.2f} " + " ".join(ratios))


def add_arguments(parser):
    """The ``--cpu`` options of ``python -m cupyflash.bench``."""
    g = parser.add_argument_group("CPU benchmark (--cpu; also what runs where no GPU is usable)")
    g.add_argument("--cpu", action="store_true",
                   help="benchmark the NumPy backend against CPU attentions instead of the GPU grid")
    g.add_argument("--cpu-seqlens", type=int, nargs="+", default=[1024, 4096, 16384], metavar="N",
                   help="sequence lengths (default: %(default)s)")
    g.add_argument("--cpu-heads", type=int, default=4, metavar="H", help="heads (default: %(default)s)")
    g.add_argument("--cpu-head-dim", type=int, default=64, metavar="D",
                   help="head dim (default: %(default)s)")
    g.add_argument("--cpu-dtype", default="float32", choices=["float32", "float64"],
                   help="dtype (default: %(default)s)")
    g.add_argument("--cpu-passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"],
                   help="passes (default: %(default)s)")
    g.add_argument("--cpu-peers", nargs="*", default=["naive-numpy", "jax", "torch"],
                   choices=["naive-numpy", "jax", "torch"],
                   help="implementations beside cupyflash, those importable (default: %(default)s)")
    g.add_argument("--cpu-one-thread-max-n", type=int, default=16384, metavar="N",
                   help="largest N also timed on one thread (default: %(default)s)")
    g.add_argument("--cpu-min-time", type=float, default=1.0, metavar="S",
                   help="seconds of kept samples per measurement, at least 3 (default: %(default)s)")
    g.add_argument("--load", action="store_true",
                   help="run a busy process beside the measurements (a loaded machine)")


def main(args, *, commit):
    """Run the CPU benchmark for parsed ``args``; write ``args.out`` if given."""
    import datetime
    import json
    import platform

    if args.plot:
        print("the CPU benchmark draws no plots; its table and JSON are the results",
              file=sys.stderr)
    rows, rate = run(args)
    result = {
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "python": platform.python_version(),
        "versions": versions(),
        "matmul_gflops": rate,
        "loadavg_at_end": os.getloadavg(),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    summary(rows, rate)
    return 0
