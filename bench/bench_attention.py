"""Attention speed on the flash-attn benchmark grid, cupyflash beside its peers.

Grid: B*N = 16384 tokens, H*d = 2048, N from 512 to 16384, d in {64, 128}, causal on
and off, fp16 and bf16 (plus fp32/fp64 rows). TFLOP/s counts 4*B*H*N^2*d for the forward
(half for causal) and 2.5x that for the backward. Peers are measured in the same process
on the same GPU: torch SDPA's flash (FlashAttention-2), cudnn, efficient and math
backends when torch is importable, and a naive CuPy attention. Times are medians of CUDA
event timings after warm-up; memory is the peak of allocations made during one call,
inputs excluded.

    python bench/bench_attention.py --out bench/results/<gpu>-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _cuda  # noqa: E402

TOKENS, HIDDEN = 16384, 2048


class PeakMemory(cp.cuda.MemoryHook):
    """Peak bytes held by CuPy allocations made while the hook is active."""

    name = "PeakMemory"

    def __init__(self):
        self.current = self.peak = 0

    def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
        self.current += mem_size
        self.peak = max(self.peak, self.current)

    def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
        self.current -= mem_size


def time_ms(fn, repeat=20, warmup=3):
    """Median milliseconds of `fn` on the GPU (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def cupy_peak(fn):
    fn()
    cp.cuda.Device().synchronize()
    hook = PeakMemory()
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
    """softmax(scale q k^T) v with the full score matrix, in CuPy."""
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
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return torch, SDPBackend, sdpa_kernel
    except Exception:
        return None, None, None


TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION", "torch-math": "MATH"}


def bench_case(dtype, d, causal, N, passes, peers, rows, naive_max_n):
    torch, SDPBackend, sdpa_kernel = _torch()
    H, B = HIDDEN // d, TOKENS // N
    scale = 1.0 / math.sqrt(d)
    tdtype = getattr(torch, dtype) if torch else None
    if torch:
        gen = torch.Generator(device="cuda").manual_seed(N * d + causal)
        tq, tk, tv, tdo = (torch.randn(B, H, N, d, device="cuda", dtype=tdtype, generator=gen) for _ in range(4))
        q, k, v, do = (cp.from_dlpack(t) for t in (tq, tk, tv, tdo))
    else:
        rng = cp.random.default_rng(N)
        q, k, v, do = (rng.standard_normal((B, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(4))

    def record(impl, pass_, ms, peak):
        tf = flops(B, H, N, d, causal, pass_) / (ms * 1e-3) / 1e12 if ms else None
        rows.append(dict(impl=impl, dtype=dtype, d=d, causal=causal, N=N, B=B, H=H,
                         ms=ms, tflops=tf, peak_mem_bytes=peak, **{"pass": pass_}))
        print(f"{impl:16} {pass_:4} {dtype:9} d={d:3} causal={int(causal)} N={N:6}  "
              f"{'%9.3f ms' % ms if ms else '   failed  '}  {'%7.1f TFLOP/s' % tf if tf else ''}", flush=True)

    def guarded(impl, pass_, run, peak_fn):
        try:
            ms = time_ms(run)
            record(impl, pass_, ms, peak_fn(run))
        except Exception as exc:  # a peer that cannot run this case is recorded, not fatal
            print(f"{impl} {pass_}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            record(impl, pass_, None, None)

    if "fwd" in passes:
        guarded("cupyflash", "fwd", lambda: cupyflash.attention(q, k, v, causal=causal, scale=scale), cupy_peak)
    if "bwd" in passes:
        try:
            o, ctx = cupyflash.attention_forward(q, k, v, causal=causal, scale=scale)
            guarded("cupyflash", "bwd", lambda: cupyflash.attention_backward(do, ctx), cupy_peak)
        except NotImplementedError as exc:
            print(f"cupyflash bwd: {exc}")
    for impl in peers:
        if impl == "naive-cupy":
            if N <= naive_max_n and "fwd" in passes:
                guarded(impl, "fwd", lambda: naive_attention(q, k, v, scale, causal), cupy_peak)
            continue
        if torch is None:
            continue
        backend = getattr(SDPBackend, TORCH_BACKENDS[impl])
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd():
            with sdpa_kernel(backend):
                return sdpa(tq, tk, tv, is_causal=causal, scale=scale)

        if "fwd" in passes:
            guarded(impl, "fwd", fwd, lambda f: torch_peak(torch, f))
        if "bwd" in passes:
            try:
                xs = [t.detach().requires_grad_() for t in (tq, tk, tv)]
                with sdpa_kernel(backend):
                    out = sdpa(*xs, is_causal=causal, scale=scale)
                guarded(impl, "bwd", lambda: torch.autograd.grad(out, xs, tdo, retain_graph=True),
                        lambda f: torch_peak(torch, f))
            except Exception as exc:
                print(f"{impl} bwd: {type(exc).__name__}: {str(exc)[:200]}")
                record(impl, "bwd", None, None)


def compile_times():
    """First-call compile time of one instantiation (cold cache) and its cached load."""
    import os
    import tempfile

    from cupyflash import _nvrtc
    old = os.environ.get("CUPYFLASH_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CUPYFLASH_CACHE_DIR"] = tmp
        try:
            arch, _ = _cuda._device_info(cp.cuda.Device().id)
            v = _cuda.forward_variants("bfloat16", 128)[0]
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


def tune(dtype, d, candidates, seqlens=(4096, 16384)):
    """Time each forward tile candidate for (dtype, d); prints TFLOP/s per candidate."""
    print(f"tuning {dtype} d={d}")
    for tile in candidates:
        _cuda.FWD_SM80_TILES[d] = (tile,)
        for causal in (False, True):
            for N in seqlens:
                H, B = HIDDEN // d, TOKENS // N
                q, k, v = (cp.random.standard_normal((B, H, N, d), dtype=cp.float32).astype(dtype) for _ in range(3))
                try:
                    ms = time_ms(lambda: cupyflash.attention(q, k, v, causal=causal), repeat=10)
                    print(f"  tile {tile} causal={int(causal)} N={N}: {flops(B, H, N, d, causal, 'fwd') / ms / 1e9:7.1f} TFLOP/s", flush=True)
                except Exception as exc:
                    print(f"  tile {tile}: {type(exc).__name__}: {exc}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    p.add_argument("--wide-dtypes-seqlens", type=int, nargs="*", default=[1024, 4096],
                   help="N for the fp32/fp64 rows (empty to skip them)")
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"])
    p.add_argument("--naive-max-n", type=int, default=8192)
    p.add_argument("--tune", action="store_true", help="sweep forward tile shapes instead")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    if args.tune:
        tune("bfloat16", 64, [(128, 64, 4, 64), (128, 64, 4, 32), (128, 128, 4, 32)])
        tune("bfloat16", 128, [(128, 64, 4, 32), (128, 32, 4, 32), (128, 128, 4, 32), (128, 64, 4, 64)])
        return
    rows = []
    peers = ["torch-flash", "torch-cudnn", "torch-efficient", "naive-cupy"]
    for dtype in args.dtypes:
        for d in args.head_dims:
            for causal in (False, True):
                for N in args.seqlens:
                    bench_case(dtype, d, causal, N, args.passes, peers, rows, args.naive_max_n)
    for dtype, peer in (("float32", "torch-efficient"), ("float64", "torch-math")):
        for d in args.head_dims:
            for N in args.wide_dtypes_seqlens:
                bench_case(dtype, d, False, N, args.passes, [peer], rows, 0)

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    torch = _torch()[0]
    result = {
        "gpu": gpu, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "versions": {"cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
                     "driver": cp.cuda.runtime.driverGetVersion(), "torch": getattr(torch, "__version__", None),
                     "python": platform.python_version()},
        "compile": compile_times(),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    summary(rows)


def summary(rows):
    """cupyflash's TFLOP/s and its ratio to torch's flash backend, per case."""
    index = {(r["impl"], r["pass"], r["dtype"], r["d"], r["causal"], r["N"]): r for r in rows}
    print(f"\n{'pass':4} {'dtype':9} {'d':>3} {'c':>1} {'N':>6} {'cupyflash':>9} {'flash':>7} {'cudnn':>7} {'ratio':>6}")
    for (impl, pass_, dtype, d, causal, N), r in index.items():
        if impl != "cupyflash" or not r["tflops"]:
            continue
        peer = {p: index.get((p, pass_, dtype, d, causal, N), {}).get("tflops") for p in ("torch-flash", "torch-cudnn", "torch-efficient", "torch-math")}
        ref = peer["torch-flash"] or peer["torch-efficient"] or peer["torch-math"]
        fmt = lambda x: f"{x:7.1f}" if x else "      -"
        print(f"{pass_:4} {dtype:9} {d:3d} {int(causal)} {N:6d} {r['tflops']:9.1f} {fmt(peer['torch-flash'])} "
              f"{fmt(peer['torch-cudnn'])} {(r['tflops'] / ref if ref else float('nan')):6.2f}")


if __name__ == "__main__":
    main()
