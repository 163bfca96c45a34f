"""Run one backward call of the grid's shape a few times, for an outside profiler (ncu,
compute-sanitizer) to pick its launches: cupyflash's, or a torch SDPA backend's with
--peer. Every call is alike; a profiler skips the first ones' launches (they build and warm).

    python bench/backward_call.py [--seqlen 2048] [--head-dim 64] [--causal] [--window 256]
        [--peer torch-cudnn] [--calls 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash import bench  # noqa: E402


def main(argv):
    import cupy as cp

    p = argparse.ArgumentParser()
    bench.add_backward_case_arguments(p, seqlen=2048)
    bench.add_backward_peer_argument(p)
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args(argv)
    call, _, _ = bench.backward_call(a, p)
    for _ in range(a.calls):
        call()
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
