"""cupyflash against one torch SDPA peer on the same tensors, in alternation: each round
times cupyflash, then the peer, then cupyflash again (bench.time_ms each), so that a drift
of the GPU's clocks over the run falls on both; prints every reading and the median ratio
per cell. A check of the grid's single readings (bench --passes bwd), not a replacement.

    python bench/peer_ratio_probe.py [--pass bwd] [--peer torch-cudnn] [--rounds 5]
        [--dtypes bfloat16 float16] [--head-dims 64 128] [--seqlens 2048 4096] [--causal 0 1]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash import bench  # noqa: E402


def main(argv):
    from torch.nn.attention import SDPBackend

    p = argparse.ArgumentParser()
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--peer", choices=list(bench.TORCH_BACKENDS), default="torch-cudnn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    a = p.parse_args(argv)
    torch = bench._torch()[0]
    backend = getattr(SDPBackend, bench.TORCH_BACKENDS[a.peer])
    print(f"{'case':34} {'cupyflash ms':>24} {a.peer + ' ms':>24} {'ratio (median)':>14}")
    for dtype in a.dtypes:
        for d in a.head_dims:
            for N in a.seqlens:
                B, H = bench.TOKENS // N, bench.HIDDEN // d
                (q, k, v, do), tensors = bench.make_inputs(dtype, (B, H, N, d), N + d)
                for causal in a.causal:
                    scale = 1 / math.sqrt(d)
                    ours = bench._cupyflash_runs(q, k, v, do, causal=bool(causal), scale=scale)[a.pass_]()
                    theirs = bench._torch_runs(torch, backend, *tensors, is_causal=bool(causal),
                                               scale=scale)[a.pass_]()
                    mine, peer, ratios = [], [], []
                    for _ in range(a.rounds):
                        x = bench.time_ms(ours)
                        y = bench.time_ms(theirs)
                        z = bench.time_ms(ours)
                        mine += [x, z]
                        peer.append(y)
                        ratios += [y / x, y / z]
                    case = f"{dtype} d={d} N={N} causal={causal}"
                    print(f"{case:34} {min(mine):7.3f}-{max(mine):7.3f} (med {np.median(mine):6.3f}) "
                          f"{min(peer):7.3f}-{max(peer):7.3f} (med {np.median(peer):6.3f}) "
                          f"{np.median(ratios):6.3f} [{min(ratios):.3f}-{max(ratios):.3f}]", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
