"""Run one forward (or backward) case a few times, for ncu, and print the cubin that serves it.

    python bench/profile_case.py --dtype bfloat16 --head-dim 128 --seqlen 16384 [--causal] [--backward]
                                 [--softcap 30] [--dropout 0.1] [--window 256] [--alibi] [--bias]
                                 [--seqlens-k 0.75] [--block-density 0.125] [--precision tf32]

With ``--backward`` the forward runs once and the backward ``--repeat`` times; profile
its key-block kernel with ``ncu -k regex:flash_bwd_dkdv``, the forward's with
``-k regex:flash_fwd``. ``--ptx`` prints the path of its PTX too (bench/fp64_profile.sh
turns it into a SASS opcode count).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _cuda, _kernels, _nvrtc, bench  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--seqlen", type=int, default=16384)
p.add_argument("--causal", action="store_true")
p.add_argument("--backward", action="store_true")
p.add_argument("--deterministic", action="store_true", help="the backward's ordered dQ")
p.add_argument("--repeat", type=int, default=5)
p.add_argument("--ptx", action="store_true", help="also print the path of its PTX")
p.add_argument("--softcap", type=float, default=None, help="an option, to profile its kernels")
p.add_argument("--dropout", type=float, default=0.0, help="an option, to profile its kernels")
p.add_argument("--window", type=int, default=None, help="an option (left extent, right 0), to profile its kernels")
p.add_argument("--alibi", action="store_true", help="an option (geometric slopes), to profile its kernels")
p.add_argument("--bias", action="store_true", help="an option (an (N, N) bias), to profile its kernels")
p.add_argument("--seqlens-k", type=float, default=None, help="an option: that fraction of the keys")
p.add_argument("--block-density", type=float, default=None, help="an option: a random block mask (128 blocks)")
p.add_argument("--precision", default="highest", help='fp32: "tf32" for one TF32 product (the Hopper forward)')
a = p.parse_args()
H, B = 2048 // a.head_dim, 16384 // a.seqlen
options = {k: v for k, v in (("softcap", a.softcap), ("dropout_p", a.dropout),
                             ("window", a.window and (a.window, 0))) if v}
if a.alibi:   # the benchmark's slopes
    options["alibi_slopes"] = cp.asarray(2.0 ** (-8.0 * (cp.arange(H, dtype=cp.float32) + 1) / H))
if a.bias:
    options["bias"] = cp.random.standard_normal((a.seqlen, a.seqlen), dtype=cp.float32).astype(a.dtype)
if a.seqlens_k is not None:
    options["seqlens_k"] = np.full(B, int(a.seqlen * a.seqlens_k), np.int32)
if a.block_density is not None:
    n_blocks = -(-a.seqlen // bench.MOD_BLOCK)
    options["block_mask"] = cp.asarray(bench.random_block_mask(np.random.default_rng(0), H, n_blocks, n_blocks,
                                                               a.block_density))
    options["block_size"] = bench.MOD_BLOCK
q, k, v, do = (cp.random.standard_normal((B, H, a.seqlen, a.head_dim), dtype=cp.float32).astype(a.dtype)
               for _ in range(4))
D = _kernels.padded_head_dim(a.head_dim, a.head_dim)
mode = (_kernels.MODE_EXT | (_kernels.MODE_BIAS if a.bias else 0)) if options else _kernels.MODE_DENSE
if a.precision == "tf32":
    mode |= _kernels.MODE_TF32
if a.backward:
    plan = _cuda.device_backward_plan(q.dtype.name, D, a.deterministic, mode, 0)
    variant = _cuda._choose(plan.kv[0][1], 0)
else:
    variant = _cuda._choose(_kernels.forward_variants(q.dtype.name, D, mode), 0)
compiled = _nvrtc.compile_kernel(variant.source, variant.name_expression, _cuda._device_info(0)[0])
print(f"{variant.name_expression}: regs={compiled.registers}")
print(compiled.binary_path)
if a.ptx:   # for `ptxas -arch=sm_90a` and `nvdisasm -c` (the device's cuobjdump cannot read NVRTC's cubins)
    arch = _cuda._device_info(0)[0].replace("sm_", "compute_")
    print(_nvrtc.compile_kernel(variant.source, variant.name_expression, arch).binary_path)
if a.backward:
    _, ctx = cupyflash.attention_forward(q, k, v, causal=a.causal, deterministic=a.deterministic, **options)
for _ in range(a.repeat):
    if a.backward:
        cupyflash.attention_backward(do, ctx)
    else:
        cupyflash.attention(q, k, v, causal=a.causal, precision=a.precision, **options)
cp.cuda.Device().synchronize()
