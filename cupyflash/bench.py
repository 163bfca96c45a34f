"""``python -m cupyflash.bench``: attention speed and memory on this GPU, cupyflash beside its peers.

Grid (flash-attn's benchmark): B*N = 16384 tokens, H*d = 2048, N from 512 to 16384, d in
{64, 128}, causal on and off, fp16 and bf16, plus fp32/fp64 rows (fp32 forward also with
precision="tf32", impl "cupyflash-tf32"). TFLOP/s counts
4*B*H*N^2*d for the forward (half for causal) and 2.5x that for the backward. Peers are
measured in the same process on the same GPU: torch SDPA's flash (FlashAttention-2),
cudnn, efficient and math backends when torch is importable, and a naive CuPy attention.
Times are medians of CUDA event timings of back-to-back calls after warm-up, each run
started one call ahead so that every timed call's host work overlaps the GPU's work on
the call before (the steady state of a loop of calls); memory is the peak of allocations
made during one call, inputs excluded.

    python -m cupyflash.bench --out results.json --plot     # the grid; JSON and PNG plots
    python -m cupyflash.bench --seqlens 4096 16384 --head-dims 128 --dtypes bfloat16
    python -m cupyflash.bench --plot-only results.json      # plots from saved results, no GPU
    python -m cupyflash.bench --mods --out mods.json        # the modifier rows instead of the grid
    python -m cupyflash.bench --cpu --out cpu.json          # the NumPy backend beside CPU peers
                                                            # (also what runs without a usable GPU)

The JSON holds ``gpu``, ``date``, ``commit``, ``versions``, ``compile`` and ``rows`` (one
per implementation, pass and case: impl, pass, dtype, d, causal, N, B, H, ms, tflops,
peak_mem_bytes; ms, tflops and memory are null where the case failed). Plots need
matplotlib (``pip install cupyflash[bench]``). CuPy and torch are imported only when
measuring, so ``--help`` and ``--plot-only`` run anywhere.

``--mods`` measures the attention modifiers instead of the dense grid, bfloat16 (see
``--mods-dtypes``) at ``--head-dims`` and N in ``--mods-seqlens`` (4096, 16384), same
B*N and H*d, forward and backward. Each row carries a ``variant``, ``visible_pairs`` (the
(query, key) pairs its mask leaves visible, summed over batch and query heads) and
TFLOP/s counted on those pairs (4 d per pair forward, 2.5 times that backward), and
``speedup_vs_dense`` (the dense cupyflash call's ms over the row's, same causal flag):

- ``dense``, causal and not: the baselines;
- ``window left=256 right=0``, ``window left=2048 right=0``: causal sliding windows;
- ``varlen 8 seqs``: 8 packed sequences of random lengths (at least 256) summing to B*N,
  causal (the row lists them);
- ``seqlens_k``: key padding, each batch entry keeping a random N/2 .. N keys;
- ``gqa 8:1``: k and v with H/8 heads (torch SDPA cuDNN with enable_gqa beside it);
- ``block_sparse density=x``: a random block mask (block 128, each row of blocks keeping
  round(x * blocks) blocks, one pattern per head) at x = 1, 1/2, 1/4, 1/8;
- ``dropout p=0.1`` (torch SDPA flash and efficient with dropout beside it);
- ``softcap 30``; ``alibi`` (causal, geometric slopes);
- ``bias (Nq,Nk)``: one bias broadcast over batch and heads (torch SDPA cuDNN and
  efficient with the same float mask beside it).
Non-causal unless said.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import __version__

TOKENS, HIDDEN = 16384, 2048
PEERS = ("torch-flash", "torch-cudnn", "torch-efficient", "torch-math", "naive-cupy")
TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION", "torch-math": "MATH"}
# The peer measured beside cupyflash for the fp16/bf16 grid and for each wide dtype (the
# only torch backends that take fp32 and fp64 respectively).
HALF_PEERS = ("torch-flash", "torch-cudnn", "torch-efficient", "naive-cupy")
WIDE_PEERS = {"float32": "torch-efficient", "float64": "torch-math"}


# --------------------------------------------------------------------------- measuring


def time_ms(fn, repeat=7, warmup=3, calls=5, ahead=True):
    """Median milliseconds per call of `fn` on the GPU: CUDA events around `calls`
    back-to-back calls, `repeat` times after warm-up. Back to back, as an application
    issues them and as flash-attn's own benchmark times them: the host's Python work
    before a launch then overlaps the previous call's GPU work. (With events around
    each call and a synchronization between calls, that host time shows as GPU idle
    time: 0.13 ms of a 0.96 ms forward at N = 2048, bench/NOTES.md.) With `ahead` each
    run starts one call ahead: an untimed call, then the start event behind its kernels,
    so that the first timed call's Python overlaps that call's GPU work as every later
    one's does, and the run measures the steady state of a loop of calls: where the host
    takes longer per call than the GPU, the difference shows, as in the loop. Without
    it (the method before session 36) the first call's host time (0.1-0.5 ms of Python)
    counted as GPU time, a fifth of it per call, which moved short calls by up to ~20%
    (bench/NOTES.md, session 36)."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        if ahead:
            fn()
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / calls)
    return float(np.median(times))


def peak_memory_hook():
    """A cupy.cuda.MemoryHook whose ``peak`` is the most bytes that CuPy allocations made
    while it is active (``with hook: ...``) held at once."""
    import cupy as cp

    # Defined here because its base class comes from cupy, imported only when measuring.
    class PeakMemory(cp.cuda.MemoryHook):
        name = "PeakMemory"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.current += mem_size
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.current -= mem_size

    return PeakMemory()


def cupy_peak(fn):
    """Peak bytes held by CuPy allocations made during one call of `fn` (after a warm call)."""
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    hook = peak_memory_hook()
    with hook:
        fn()
        cp.cuda.Device().synchronize()
    return hook.peak


def torch_peak(torch, fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def naive_attention(q, k, v, scale, causal):
    """softmax(scale q k^T) v with the full score matrix, in CuPy. CuPy's matmul has no
    bfloat16 kernel, so bf16 inputs are multiplied in fp32, as a CuPy user would."""
    import cupy as cp

    if q.dtype.name == "bfloat16":
        q, k, v = (x.astype(cp.float32) for x in (q, k, v))
    s = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * scale
    if causal:
        n = s.shape[-1]
        s = cp.where(cp.tri(n, dtype=bool), s, -cp.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cp.matmul(p.astype(q.dtype), v)


def flops(B, H, N, d, causal, pass_):
    f = 4.0 * B * H * N * N * d / (2 if causal else 1)
    return f * (2.5 if pass_ == "bwd" else 1.0)


def _torch():
    """(torch, SDPBackend, sdpa_kernel), or Nones where torch is missing or has no CUDA."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return torch, SDPBackend, sdpa_kernel
    except Exception:
        return None, None, None


def make_inputs(dtype, shape, seed):
    """q, k, v, do of ``shape`` as CuPy arrays, and the torch tensors they view (Nones
    without torch): made by torch where it is importable, so that every implementation
    reads the same memory."""
    import cupy as cp

    torch = _torch()[0]
    if torch:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tensors = [torch.randn(*shape, device="cuda", dtype=getattr(torch, dtype), generator=gen)
                   for _ in range(4)]
        return [cp.from_dlpack(t) for t in tensors], tensors
    rng = cp.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(4)], [None] * 4


def make_row(impl, pass_, dtype, d, causal, N, B, H, ms, peak, flop, **extra):
    """One result row: the grid's fields, TFLOP/s from ``flop`` (None where ``ms`` is),
    then ``extra`` (the modifier rows' variant, speedup_vs_dense)."""
    tf = flop / (ms * 1e-3) / 1e12 if ms else None
    return dict(impl=impl, dtype=dtype, d=d, causal=causal, N=N, B=B, H=H, ms=ms, tflops=tf,
                peak_mem_bytes=peak, **{"pass": pass_}, **extra)


def _print_row(row):
    ms, tf = row["ms"], row["tflops"]
    print(f"{row['impl']:16} {row['pass']:4} {row['dtype']:9} d={row['d']:3} causal={int(row['causal'])} "
          f"N={row['N']:6}  {'%9.3f ms' % ms if ms else '   failed  '}  {'%7.1f TFLOP/s' % tf if tf else ''}"
          f"{'  ' + row['variant'] if row.get('variant') else ''}", flush=True)


def bench_case(dtype, d, causal, N, passes, peers, rows, naive_max_n, rounds=1):
    """Measure cupyflash and `peers` on one case; append a row per (impl, pass) to `rows`.
    With `rounds` > 1 every implementation is timed once a round, in turn, and a row
    holds the median of its readings (ms) and their range (ms_min, ms_max): a drift of
    the GPU's clocks over the case then falls on all of them alike (bench/NOTES.md,
    session 37: one reading of a backward cell ranges over +-3-5% within a run)."""
    import cupyflash

    torch, SDPBackend, sdpa_kernel = _torch()
    H, B = HIDDEN // d, TOKENS // N
    scale = 1.0 / math.sqrt(d)
    (q, k, v, do), (tq, tk, tv, tdo) = make_inputs(dtype, (B, H, N, d), N * d + causal)
    timed = []   # (impl, pass, run, peak_fn), in the order each round times them

    def record(impl, pass_, readings, peak):
        ms = float(np.median(readings)) if readings else None
        extra = dict(ms_min=min(readings), ms_max=max(readings), rounds=len(readings)) if rounds > 1 and readings else {}
        rows.append(make_row(impl, pass_, dtype, d, causal, N, B, H, ms, peak, flops(B, H, N, d, causal, pass_),
                             **extra))
        _print_row(rows[-1])

    def failed(impl, pass_, exc):   # a case an implementation cannot run is recorded, not fatal
        print(f"{impl} {pass_}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        record(impl, pass_, [], None)

    if "fwd" in passes:
        timed.append(("cupyflash", "fwd", lambda: cupyflash.attention(q, k, v, causal=causal, scale=scale), cupy_peak))
        if dtype == "float32":   # the forward with precision="tf32" (impl "cupyflash-tf32")
            timed.append(("cupyflash-tf32", "fwd",
                          lambda: cupyflash.attention(q, k, v, causal=causal, scale=scale, precision="tf32"),
                          cupy_peak))
    if "bwd" in passes:
        try:
            o, ctx = cupyflash.attention_forward(q, k, v, causal=causal, scale=scale)
            timed.append(("cupyflash", "bwd", lambda: cupyflash.attention_backward(do, ctx), cupy_peak))
        except NotImplementedError as exc:
            print(f"cupyflash bwd: {exc}")
    for impl in peers:
        if impl == "naive-cupy":
            if N <= naive_max_n and "fwd" in passes:
                timed.append((impl, "fwd", lambda: naive_attention(q, k, v, scale, causal), cupy_peak))
            continue
        if torch is None:
            continue
        backend = getattr(SDPBackend, TORCH_BACKENDS[impl])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        torch_peak_of = lambda f: torch_peak(torch, f)  # noqa: E731

        def fwd(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(tq, tk, tv, is_causal=causal, scale=scale)

        if "fwd" in passes:
            timed.append((impl, "fwd", fwd, torch_peak_of))
        if "bwd" in passes:
            try:
                xs = [t.detach().requires_grad_() for t in (tq, tk, tv)]
                with sdpa_kernel(backend):
                    out = sdpa(*xs, is_causal=causal, scale=scale)
                timed.append((impl, "bwd", lambda out=out, xs=xs: torch.autograd.grad(out, xs, tdo, retain_graph=True),
                               torch_peak_of))
            except Exception as exc:
                failed(impl, "bwd", exc)

    readings = [[] for _ in timed]
    errors = [None] * len(timed)
    for _ in range(rounds):
        for i, (_, _, run, _) in enumerate(timed):
            if errors[i] is None:
                try:
                    readings[i].append(time_ms(run))
                except Exception as exc:
                    errors[i] = exc
    for (impl, pass_, run, peak_fn), ms, exc in zip(timed, readings, errors):
        if exc is not None:
            failed(impl, pass_, exc)
            continue
        try:
            peak = peak_fn(run)
        except Exception as exc:
            failed(impl, pass_, exc)
            continue
        record(impl, pass_, ms, peak)


# --------------------------------------------------------------------------- modifiers (--mods)

MOD_DENSITIES = (1.0, 0.5, 0.25, 0.125)
MOD_BLOCK = 128
MOD_DROPOUT = 0.1
MOD_WINDOWS = (256, 2048)   # causal sliding windows (left, 0)
MOD_GQA = 8                 # query heads per kv head
MOD_SOFTCAP = 30.0
VARLEN_SEQS = 8
VARLEN_MIN = 256


def random_block_mask(rng, heads, n_q_blocks, n_k_blocks, density):
    """A (1, heads, n_q_blocks, n_k_blocks) bool block mask, one random pattern per head,
    each row of blocks keeping exactly max(1, round(density * n_k_blocks)) blocks, so that
    every query tile does the same work and the fraction of kept blocks is ``density``
    (as closely as the block count allows)."""
    keep = max(1, round(density * n_k_blocks))
    order = np.argsort(rng.random((heads, n_q_blocks, n_k_blocks)), axis=-1)
    mask = np.zeros((heads, n_q_blocks, n_k_blocks), dtype=bool)
    np.put_along_axis(mask, order[..., :keep], True, axis=-1)
    return mask[None]


def varlen_lengths(rng, count, total, minimum=VARLEN_MIN):
    """``count`` random sequence lengths, each >= ``minimum``, summing to ``total``."""
    if count * minimum > total:
        raise ValueError(f"{count} sequences of at least {minimum} do not fit in {total} tokens")
    spare = total - count * minimum
    lengths = minimum + np.floor(rng.dirichlet(np.ones(count)) * spare).astype(np.int64)
    lengths[rng.integers(count)] += total - lengths.sum()
    return lengths


def add_backward_case_arguments(parser, seqlen):
    """The options of a tool that times one backward call of the grid's shape (B N =
    TOKENS, H d = HIDDEN): --seqlen, --head-dim, --dtype, --causal, --window."""
    parser.add_argument("--seqlen", type=int, default=seqlen)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, default=None,
                        help="a causal window of this many keys (left extent, right 0)")


def backward_case(args):
    """(q, k, v, do) and the attention options of the call `add_backward_case_arguments`'
    ``args`` describe (a window implies causal)."""
    d, N = args.head_dim, args.seqlen
    (q, k, v, do), _ = make_inputs(args.dtype, (TOKENS // N, HIDDEN // d, N, d), N + d)
    options = dict(causal=args.causal or args.window is not None)
    if args.window is not None:
        options["window"] = (args.window, 0)
    return (q, k, v, do), options


def add_backward_peer_argument(parser):
    """--peer: a torch SDPA backend (a key of TORCH_BACKENDS) runs the backward call of
    `backward_call` instead of cupyflash."""
    parser.add_argument("--peer", choices=list(TORCH_BACKENDS), default=None,
                        help="time this torch SDPA backend's backward instead of cupyflash's")


def backward_call(args, parser):
    """A callable that runs one backward of the case `args` describes
    (`add_backward_case_arguments`, `add_backward_peer_argument`): cupyflash's, or the
    torch backend's that args.peer names, its forward run once here; and the case's
    (B, H, N, d) and options."""
    import cupyflash

    (q, k, v, do), options = backward_case(args)
    if args.peer is None:
        _, ctx = cupyflash.attention_forward(q, k, v, **options)
        return (lambda: cupyflash.attention_backward(do, ctx)), q.shape, options
    torch, SDPBackend, _ = _torch()
    if torch is None:
        parser.error("--peer needs torch with CUDA")
    if options.get("window") is not None:
        parser.error("--peer takes no --window")
    t = [torch.from_dlpack(x) for x in (q, k, v, do)]
    backend = getattr(SDPBackend, TORCH_BACKENDS[args.peer])
    return _torch_runs(torch, backend, *t, is_causal=options["causal"])["bwd"](), q.shape, options


def varlen_packed(tensors, rng):
    """(B, H, N, d) tensors' B N tokens as the ``varlen`` row's VARLEN_SEQS packed sequences
    of random lengths: the (B N, H, d) views, cu_seqlens, the longest length and the lengths.
    The index arrays stay on the host, as the API's docs advise: from the device the API
    reads them back before the launch, a synchronisation per call."""
    B, H, N, d = tensors[0].shape
    lengths = varlen_lengths(rng, VARLEN_SEQS, B * N)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    packed = [x.transpose(0, 2, 1, 3).reshape(B * N, H, d) for x in tensors]
    return packed, cu, int(lengths.max()), lengths


def visible_pairs(nq, nk, *, causal=False, window=(-1, -1)):
    """How many (query, key) pairs a (nq, nk) attention with ``causal`` and ``window``
    sees (bottom-right aligned, as cupyflash masks them)."""
    i = np.arange(nq, dtype=np.int64)
    diag = i + nk - nq
    left, right = window
    lo = np.maximum(diag - left, 0) if left >= 0 else np.zeros_like(i)
    hi = np.full_like(i, nk - 1)
    if causal:
        hi = np.minimum(hi, diag)
    if right >= 0:
        hi = np.minimum(hi, diag + right)
    return int(np.maximum(hi - lo + 1, 0).sum())


def pair_flops(pairs, heads, d, pass_):
    """FLOPs of attention over ``pairs`` visible (query, key) pairs per head: 4 d per pair
    forward, 2.5 times that backward (the grid's convention)."""
    return 4.0 * pairs * heads * d * (2.5 if pass_ == "bwd" else 1.0)


def _measure(rows, run_factory, *, impl, pass_, dtype, d, causal, N, B, H, flop, variant,
             baseline_ms=None, peak_fn=None, **extra):
    """Time ``run_factory()`` (which sets up, e.g. the forward a backward needs, and
    returns the call to time), append its row (with ``extra``), return its ms (None
    where it failed)."""
    ms = peak = None
    try:
        run = run_factory()
        ms = time_ms(run)
        peak = (peak_fn or cupy_peak)(run)
    except Exception as exc:  # recorded as a failed row, not fatal
        print(f"{impl} {pass_} {variant}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        ms = peak = None
    speedup = baseline_ms / ms if baseline_ms and ms else None
    rows.append(make_row(impl, pass_, dtype, d, causal, N, B, H, ms, peak, flop,
                         variant=variant, speedup_vs_dense=speedup, **extra))
    _print_row(rows[-1])
    return ms


def _cupyflash_runs(q, k, v, do, **opts):
    """(forward factory, backward factory) of cupyflash.attention with ``opts``."""
    import cupyflash

    def fwd():
        return lambda: cupyflash.attention(q, k, v, **opts)

    def bwd():
        _, ctx = cupyflash.attention_forward(q, k, v, **opts)
        return lambda: cupyflash.attention_backward(do, ctx)

    return {"fwd": fwd, "bwd": bwd}


def _torch_runs(torch, backend, tq, tk, tv, tdo, **sdpa_opts):
    """(forward factory, backward factory) of torch SDPA on ``backend`` with ``sdpa_opts``."""
    from torch.nn.attention import sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fwd():
        def run():
            with sdpa_kernel(backend):
                return sdpa(tq, tk, tv, **sdpa_opts)
        return run

    def bwd():
        xs = [t.detach().requires_grad_() for t in (tq, tk, tv)]
        with sdpa_kernel(backend):
            out = sdpa(*xs, **sdpa_opts)
        return lambda: torch.autograd.grad(out, xs, tdo, retain_graph=True)

    return {"fwd": fwd, "bwd": bwd}


def bench_mods_case(dtype, d, N, passes, peers, rows):
    """Every modifier variant at one (dtype, d, N) beside the dense call with the same
    causal flag, and beside torch SDPA where torch has the option; TFLOP/s on the
    visible (query, key) pairs, ``visible_pairs`` summed over batch and query heads."""
    import cupy as cp

    torch, SDPBackend, _ = _torch()
    H, B = HIDDEN // d, TOKENS // N
    scale = 1.0 / math.sqrt(d)
    (q, k, v, do), (tq, tk, tv, tdo) = make_inputs(dtype, (B, H, N, d), N * d + 5)
    case = dict(dtype=dtype, d=d, N=N, B=B, H=H)
    rng = np.random.default_rng(N * d)
    dense = {}

    def measure(variant, causal, pairs, runs, *, impl="cupyflash", baseline=True, peak_fn=None, **extra):
        """Rows of ``runs`` (per pass); ``pairs``: visible pairs over the batch and heads."""
        for pass_ in passes:
            ms = _measure(rows, runs[pass_], impl=impl, pass_=pass_, causal=causal, variant=variant,
                          flop=pair_flops(pairs, 1, d, pass_), visible_pairs=pairs, peak_fn=peak_fn,
                          baseline_ms=dense.get((causal, pass_)) if baseline else None, **case, **extra)
            if variant == "dense" and impl == "cupyflash":
                dense[causal, pass_] = ms

    def cupyflash_variant(variant, causal, pairs, inputs=(q, k, v, do), **opts):
        measure(variant, causal, pairs, _cupyflash_runs(*inputs, causal=causal, scale=scale, **opts))

    def torch_variant(variant, causal, pairs, impls, *inputs, **sdpa_opts):
        for impl in impls:
            if torch is None or impl not in peers:
                continue
            backend = getattr(SDPBackend, TORCH_BACKENDS[impl])
            measure(variant, causal, pairs, _torch_runs(torch, backend, *inputs, scale=scale, is_causal=causal,
                                                        **sdpa_opts),
                    impl=impl, baseline=False, peak_fn=lambda f: torch_peak(torch, f))

    full = B * H * N * N
    causal_pairs = B * H * visible_pairs(N, N, causal=True)
    for causal in (False, True):
        cupyflash_variant("dense", causal, causal_pairs if causal else full)
    for left in MOD_WINDOWS:
        window = (left, 0)
        cupyflash_variant(f"window left={left} right=0", True,
                          B * H * visible_pairs(N, N, causal=True, window=window), window=window)

    packed, cu, longest, lengths = varlen_packed((q, k, v, do), rng)

    def varlen_runs():
        import cupyflash

        def fwd():
            return lambda: cupyflash.varlen_attention(*packed[:3], cu, cu, longest, longest, causal=True, scale=scale)

        def bwd():
            _, ctx = cupyflash.varlen_attention_forward(*packed[:3], cu, cu, longest, longest, causal=True,
                                                        scale=scale)
            return lambda: cupyflash.attention_backward(packed[3], ctx)
        return {"fwd": fwd, "bwd": bwd}

    measure(f"varlen {VARLEN_SEQS} seqs", True, H * sum(int(n) * (int(n) + 1) // 2 for n in lengths),
            varlen_runs(), seq_lengths=lengths.tolist())

    seqlens = rng.integers(N // 2, N + 1, size=B).astype(np.int32)
    cupyflash_variant("seqlens_k", False, H * N * int(seqlens.sum()), seqlens_k=seqlens)

    kv_heads = H // MOD_GQA
    kg, vg = k[:, :kv_heads], v[:, :kv_heads]
    cupyflash_variant(f"gqa {MOD_GQA}:1", False, full, inputs=(q, kg, vg, do))
    if torch is not None:
        torch_variant(f"gqa {MOD_GQA}:1", False, full, ("torch-cudnn",), tq, tk[:, :kv_heads], tv[:, :kv_heads],
                      tdo, enable_gqa=True)

    n_blocks = -(-N // MOD_BLOCK)
    for density in MOD_DENSITIES:
        mask = random_block_mask(rng, H, n_blocks, n_blocks, density)
        kept = B * int(mask.sum()) * MOD_BLOCK * MOD_BLOCK
        cupyflash_variant(f"block_sparse density={density:g}", False, kept, block_mask=cp.asarray(mask),
                          block_size=MOD_BLOCK)

    variant = f"dropout p={MOD_DROPOUT:g}"
    cupyflash_variant(variant, False, full, dropout_p=MOD_DROPOUT, seed=0)
    torch_variant(variant, False, full, ("torch-flash", "torch-efficient"), tq, tk, tv, tdo, dropout_p=MOD_DROPOUT)

    cupyflash_variant(f"softcap {MOD_SOFTCAP:g}", False, full, softcap=MOD_SOFTCAP)
    slopes = cp.asarray((2.0 ** (-8.0 * (np.arange(H) + 1) / H)).astype(np.float32))
    cupyflash_variant("alibi", True, causal_pairs, alibi_slopes=slopes)

    bias = cp.random.default_rng(N).standard_normal((N, N), dtype=cp.float32).astype(dtype)
    cupyflash_variant("bias (Nq,Nk)", False, full, bias=bias)
    if torch is not None:
        tbias = torch.from_dlpack(bias)
        torch_variant("bias (Nq,Nk)", False, full, ("torch-cudnn", "torch-efficient"), tq, tk, tv, tdo,
                      attn_mask=tbias.expand(B, H, N, N))
    del bias


def run_mods(args):
    """The modifier rows (``--mods``) the command line asks for; returns the rows."""
    rows = []
    for dtype in args.mods_dtypes:
        for d in args.head_dims:
            for N in args.mods_seqlens:
                bench_mods_case(dtype, d, N, args.passes, args.peers, rows)
    return rows


def compile_times():
    """First-call compile time of one instantiation (cold cache) and its cached load."""
    import cupy as cp

    from . import _cuda, _kernels, _nvrtc

    old = os.environ.get("CUPYFLASH_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUPYFLASH_CACHE_DIR"] = tmp
        try:
            arch, _ = _cuda._device_info(cp.cuda.Device().id)
            v = _kernels.forward_variants("bfloat16", 128)[0]
            t0 = time.perf_counter()
            _nvrtc.compile_kernel(v.source, v.name_expression, arch)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            _nvrtc.compile_kernel(v.source, v.name_expression, arch)
            cached = time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ["CUPYFLASH_CACHE_DIR"]
            else:
                os.environ["CUPYFLASH_CACHE_DIR"] = old
    return {"instantiation": v.name_expression, "cold_compile_s": cold, "cached_load_s": cached}


def gpu_name():
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def checkout_commit():
    """The commit of the checkout cupyflash runs from, "-dirty" with uncommitted changes to
    tracked files; "unknown" outside a git checkout (e.g. an installed wheel)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    try:
        # An installed copy may sit inside some other repository (a virtualenv in a
        # project): only a checkout of cupyflash itself has cupyflash's commit.
        toplevel = git("rev-parse", "--show-toplevel").stdout.strip()
        head = git("rev-parse", "--verify", "--quiet", "HEAD")
        if not toplevel or Path(toplevel).resolve() != root or head.returncode:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except OSError:  # no git
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def versions():
    import cupy as cp

    torch = _torch()[0]
    return {"cupyflash": __version__, "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "driver": cp.cuda.runtime.driverGetVersion(),
            "torch": getattr(torch, "__version__", None), "python": platform.python_version()}


def run_grid(args):
    """Every case the command line asks for, in order; returns the rows."""
    rows = []
    half_peers = [p for p in HALF_PEERS if p in args.peers]
    for dtype in args.dtypes:
        for d in args.head_dims:
            for causal in (False, True):
                for N in args.seqlens:
                    bench_case(dtype, d, causal, N, args.passes, half_peers, rows, args.naive_max_n,
                               args.rounds)
    for dtype, peer in WIDE_PEERS.items():
        for d in args.head_dims:
            for N in args.wide_dtypes_seqlens:
                bench_case(dtype, d, False, N, args.passes, [peer] if peer in args.peers else [], rows, 0,
                           args.rounds)
    return rows


# --------------------------------------------------------------------------- reporting


def summary(rows):
    """cupyflash's TFLOP/s and its ratio to torch's flash backend (or the peer that runs
    the dtype), per case."""
    index = {(r["impl"], r["pass"], r["dtype"], r["d"], r["causal"], r["N"]): r
             for r in rows if not r.get("variant")}
    print(f"\n{'pass':4} {'dtype':9} {'d':>3} {'c':>1} {'N':>6} {'cupyflash':>9} {'flash':>7} {'cudnn':>7} {'ratio':>6}")
    for (impl, pass_, dtype, d, causal, N), r in index.items():
        if impl != "cupyflash" or not r["tflops"]:
            continue
        peer = {p: index.get((p, pass_, dtype, d, causal, N), {}).get("tflops") for p in TORCH_BACKENDS}
        ref = peer["torch-flash"] or peer["torch-efficient"] or peer["torch-math"]

        def fmt(x):
            return f"{x:7.1f}" if x else "      -"

        print(f"{pass_:4} {dtype:9} {d:3d} {int(causal)} {N:6d} {r['tflops']:9.1f} {fmt(peer['torch-flash'])} "
              f"{fmt(peer['torch-cudnn'])} {(r['tflops'] / ref if ref else float('nan')):6.2f}")


def mods_summary(rows):
    """The modifier rows as a table: cupyflash's TFLOP/s per visible pair, its ratio to the
    dense call with the same causal flag (per visible pair) and its wall time over the
    dense call's, then each torch peer of the same variant and cupyflash's ratio to it."""
    key = lambda r: (r["pass"], r["dtype"], r["d"], r["N"], r["causal"])
    dense = {key(r): r for r in rows if r.get("variant") == "dense" and r["impl"] == "cupyflash"}
    peers = {}
    for r in rows:
        if r["impl"] != "cupyflash" and r.get("variant"):
            peers.setdefault((*key(r), r["variant"]), []).append(r)

    def fmt(x, spec):
        return format(x, spec) if x else "-".rjust(len(format(0.0, spec)))

    print(f"\n{'pass':4} {'dtype':9} {'d':>3} {'c':>1} {'N':>6} {'variant':26} {'TFLOP/s':>7} {'/dense':>6} "
          f"{'time/d':>6}  peers (TFLOP/s, cupyflash/peer)")
    for r in rows:
        if r["impl"] != "cupyflash" or not r.get("variant"):
            continue
        base = dense.get(key(r), {})
        per_pair = r["tflops"] / base["tflops"] if r["tflops"] and base.get("tflops") else None
        wall = r["ms"] / base["ms"] if r["ms"] and base.get("ms") else None
        peer_text = "  ".join(f"{p['impl']} {fmt(p['tflops'], '.1f')} "
                              f"{fmt(r['tflops'] / p['tflops'] if r['tflops'] and p['tflops'] else None, '.2f')}x"
                              for p in peers.get((*key(r), r["variant"]), []))
        print(f"{r['pass']:4} {r['dtype']:9} {r['d']:3d} {int(r['causal'])} {r['N']:6d} {r['variant']:26} "
              f"{fmt(r['tflops'], '7.1f')} {fmt(per_pair, '6.2f')} {fmt(wall, '6.2f')}  {peer_text}")


def write_plots(result, prefix):
    """PNG plots of `result` (the JSON's dict) beside `prefix`; returns their paths, or
    None (after saying why) without matplotlib."""
    try:
        from . import _bench_plots
    except ImportError as exc:
        print(f"no plots: matplotlib is not installed ({exc}); pip install 'cupyflash[bench]'",
              file=sys.stderr)
        return None
    paths = _bench_plots.plot_results(result, prefix)
    for path in paths:
        print(f"plot written to {path}")
    return paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cupyflash.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384],
                   metavar="N", help="sequence lengths (B = 16384 / N)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], metavar="D",
                   help="head dims (H = 2048 / d)")
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"],
                   choices=["float16", "bfloat16", "float32", "float64"], help="dtypes of the main grid")
    p.add_argument("--wide-dtypes-seqlens", type=int, nargs="*", default=[1024, 4096], metavar="N",
                   help="N for the fp32/fp64 rows (none: skip them)")
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                   help="implementations measured beside cupyflash (none: cupyflash alone)")
    p.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="time every implementation of a grid case R times, in turn, and keep the median "
                        "and the range (default 1: one reading each; the --mods rows take one)")
    p.add_argument("--naive-max-n", type=int, default=8192,
                   help="largest N for naive-cupy (its N x N matrix runs out of memory)")
    p.add_argument("--mods", action="store_true",
                   help="measure the modifier rows (block-sparse, dropout, window, varlen) instead of the grid")
    p.add_argument("--mods-seqlens", type=int, nargs="+", default=[4096, 16384], metavar="N",
                   help="N of the --mods rows (B = 16384 / N)")
    p.add_argument("--mods-dtypes", nargs="+", default=["bfloat16"],
                   choices=["float16", "bfloat16", "float32", "float64"], help="dtypes of the --mods rows")
    p.add_argument("--out", type=Path, metavar="JSON", help="write the results here")
    p.add_argument("--commit", help="record this as the commit (default: the checkout's own, "
                   "\"unknown\" where the code is not a git checkout, e.g. a copy on a GPU host)")
    p.add_argument("--plot", action="store_true", help="also write PNG plots beside --out")
    p.add_argument("--plot-only", type=Path, nargs="+", metavar="JSON",
                   help="plot saved results (PNGs beside each file) and measure nothing")
    from . import _bench_cpu
    _bench_cpu.add_arguments(p)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be 1 or more")
    if args.plot and not args.out:
        p.error("--plot writes the plots beside the results: give --out too")
    return args


def _gpu_usable():
    from . import _cuda   # importing _cuda never imports CuPy
    return _cuda.gpu_available()


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        written = [write_plots(json.loads(path.read_text()), path.with_suffix("")) for path in args.plot_only]
        return 0 if all(written) else 1

    if args.cpu or not _gpu_usable():
        if not args.cpu:
            print("no usable CUDA GPU here: running the CPU benchmark (--cpu) instead", file=sys.stderr)
        from . import _bench_cpu
        return _bench_cpu.main(args, commit=args.commit or checkout_commit())

    rows = run_mods(args) if args.mods else run_grid(args)
    result = {
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or checkout_commit(),
        "versions": versions(),
        "compile": compile_times(),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.mods:
        mods_summary(rows)
    else:
        summary(rows)
    if args.plot and not write_plots(result, args.out.with_suffix("")):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
