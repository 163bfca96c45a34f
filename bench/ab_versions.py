"""A/B of the dense forward (or backward): this checkout's cupyflash against another
version's, in one process on the same inputs, beside torch SDPA's cuDNN and flash
backends (kernel work: a change must not slow the dense call beyond run-to-run noise).

    python bench/ab_versions.py OLD [--backward] [--head-dims 64 128] [--option softcap] [--dtype float32]
                                [--precision tf32]
        # OLD: a directory with that version's cupyflash/ and kernels_cu/
        # (git archive <commit> cupyflash kernels_cu | tar -x -C OLD)

``--option`` times an option's call instead (the benchmark's --mods parameters; TFLOP/s
counted as for the dense call of that causal flag, so only the new/old column means
anything), without the peers.

Each case is timed A, B, A, B (back-to-back calls, bench.time_ms), so the spread between the
two readings of one version shows the noise.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupyflash  # noqa: E402
from cupyflash import bench  # noqa: E402


def load_version(root: Path, name: str = "cupyflash_old"):
    """The cupyflash package under ``root`` imported as ``name`` (its kernels from root/kernels_cu)."""
    spec = importlib.util.spec_from_file_location(name, root / "cupyflash" / "__init__.py",
                                                  submodule_search_locations=[str(root / "cupyflash")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _option_kwargs(option, q):
    """The keyword arguments of an option, as `python -m cupyflash.bench --mods` passes it;
    of options joined by "+" (e.g. "softcap+dropout": the option kernels), all of them."""
    import cupy as cp
    import numpy as np

    if "+" in option:
        return {k: v for part in option.split("+") for k, v in _option_kwargs(part, q).items()}
    H, N = q.shape[1], q.shape[2]
    if option == "softcap":
        return dict(softcap=bench.MOD_SOFTCAP)
    if option == "alibi":
        return dict(alibi_slopes=cp.asarray((2.0 ** (-8.0 * (np.arange(H) + 1) / H)).astype(np.float32)))
    if option in ("bias", "dbias"):   # dbias: the bias's gradient asked for too (_runs)
        return dict(bias=cp.random.default_rng(N).standard_normal((N, N), dtype=cp.float32).astype(q.dtype))
    if option in ("window2048", "window256"):
        return dict(window=(int(option[len("window"):]), 0))
    if option == "dropout":
        return dict(dropout_p=bench.MOD_DROPOUT, seed=0)
    if option == "deterministic":
        return dict(deterministic=True)
    if option in ("block1", "block8"):   # a block mask that hides nothing (the walk's own cost), or 7/8
        n_blocks = -(-N // bench.MOD_BLOCK)
        density = 1.0 if option == "block1" else 0.125
        mask = bench.random_block_mask(np.random.default_rng(0), H, n_blocks, n_blocks, density)
        return dict(block_mask=cp.asarray(mask), block_size=bench.MOD_BLOCK)
    if option == "seqlens_k":
        return dict(seqlens_k=np.full(q.shape[0], N - N // 4, np.int32))
    return {}


OPTIONS = ("dense", "softcap", "alibi", "bias", "dbias", "window2048", "window256", "dropout", "deterministic",
           "block1", "block8", "seqlens_k", "varlen")


def _option_name(name: str) -> str:
    """--option: one of OPTIONS, or several joined by "+" (varlen alone)."""
    parts = name.split("+")
    if any(p not in OPTIONS for p in parts) or (len(parts) > 1 and "varlen" in parts):
        raise argparse.ArgumentTypeError(
            f"{name!r}: one of {', '.join(OPTIONS)}, or several joined by '+' (not varlen)")
    return name


def _varlen_runs(module, q, k, v, do, causal, backward, options):
    """The --mods row's varlen call: the batch's B N tokens as bench.VARLEN_SEQS packed
    sequences of random lengths (the same for every version: seeded by the shape)."""
    import numpy as np

    N, d = q.shape[2:]
    (q, k, v, do), cu, longest, _ = bench.varlen_packed((q, k, v, do), np.random.default_rng(N * d))
    args = (q, k, v, cu, cu, longest, longest)
    if not backward:
        return lambda: module.varlen_attention(*args, causal=causal, **options)
    _, ctx = module.varlen_attention_forward(*args, causal=causal, **options)
    return lambda: module.attention_backward(do, ctx)


def _runs(module, q, k, v, do, causal, backward, options, option="dense"):
    """The call to time: the forward, or the backward of one forward pass."""
    if option == "varlen":
        return _varlen_runs(module, q, k, v, do, causal, backward, options)
    if not backward:
        return lambda: module.attention(q, k, v, causal=causal, **options)
    _, ctx = module.attention_forward(q, k, v, causal=causal, **options)
    return_dbias = "dbias" in option.split("+")
    return lambda: module.attention_backward(do, ctx, return_dbias=return_dbias)


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("old", type=Path)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--option", type=_option_name, default="dense")
    p.add_argument("--dtype", default="bfloat16", help="fp32/fp64: no peers (torch's flash and cuDNN take 16-bit)")
    p.add_argument("--precision", default="highest", help='fp32: "tf32" for one TF32 product (the forward)')
    a = p.parse_args(argv)
    old = load_version(a.old.resolve())
    pass_ = "bwd" if a.backward else "fwd"
    torch, SDPBackend, sdpa_kernel = bench._torch()
    print(f"{a.option}")
    print(f"{pass_}: {'d':>3} {'c':>1} {'N':>6} {'new':>7} {'old':>7} {'new':>7} {'old':>7} {'cudnn':>7} {'flash':>7}  "
          f"new/old new/cudnn old/cudnn (TFLOP/s)")
    for d in a.head_dims:
        for causal in (False, True):
            for N in a.seqlens:
                H, B = bench.HIDDEN // d, bench.TOKENS // N
                (q, k, v, do), (tq, tk, tv, tdo) = bench.make_inputs(a.dtype, (B, H, N, d), N + d)
                flop = bench.flops(B, H, N, d, causal, pass_)
                tf = lambda run: flop / bench.time_ms(run) / 1e9   # noqa: E731
                options = {**_option_kwargs(a.option, q), "precision": a.precision}
                runs = {"new": _runs(cupyflash, q, k, v, do, causal, a.backward, options, a.option),
                        "old": _runs(old, q, k, v, do, causal, a.backward, options, a.option)}
                readings = [(name, tf(runs[name])) for name in ("new", "old", "new", "old")]
                peers = [tf(bench._torch_runs(torch, getattr(SDPBackend, backend), tq, tk, tv, tdo,
                                              is_causal=causal)[pass_]())
                         if a.option == "dense" and a.dtype in ("bfloat16", "float16") else float("nan")
                         for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION")]
                new = max(r for n, r in readings if n == "new")
                old_best = max(r for n, r in readings if n == "old")
                print(f"{pass_}: {d:3d} {int(causal)} {N:6d} " + " ".join(f"{r:7.1f}" for _, r in readings) +
                      f" {peers[0]:7.1f} {peers[1]:7.1f}  {new / old_best:7.3f} {new / peers[0]:9.3f} "
                      f"{old_best / peers[0]:9.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
