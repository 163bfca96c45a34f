"""Run one forward case a few times (for ncu) and print the cubin that serves it.

    python bench/profile_forward.py --dtype bfloat16 --head-dim 128 --seqlen 16384 [--causal]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _cuda, _nvrtc  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--seqlen", type=int, default=16384)
p.add_argument("--causal", action="store_true")
p.add_argument("--repeat", type=int, default=5)
a = p.parse_args()
H, B = 2048 // a.head_dim, 16384 // a.seqlen
q, k, v = (cp.random.standard_normal((B, H, a.seqlen, a.head_dim), dtype=cp.float32).astype(a.dtype) for _ in range(3))
variant = _cuda._choose(_cuda.forward_variants(q.dtype.name, _cuda.padded_head_dim(a.head_dim, a.head_dim)), 0)
compiled = _nvrtc.compile_kernel(variant.source, variant.name_expression, _cuda._device_info(0)[0])
print(f"{variant.name_expression}: regs={compiled.registers}")
print(compiled.binary_path)
for _ in range(a.repeat):
    cupyflash.attention(q, k, v, causal=a.causal)
cp.cuda.Device().synchronize()
