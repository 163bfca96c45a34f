"""Run one backward call of the grid's shape a few times, for an outside profiler (ncu,
compute-sanitizer) to pick its launches: cupyflash's, or a torch SDPA backend's with
--peer. The first calls build and warm; a profiler skips their launches.

    python bench/backward_call.py [--seqlen 2048] [--head-dim 64] [--causal] [--window 256]
        [--peer torch-cudnn] [--calls 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupyflash  # noqa: E402
from cupyflash import bench  # noqa: E402


def main(argv):
    import cupy as cp

    p = argparse.ArgumentParser()
    bench.add_backward_case_arguments(p, seqlen=2048)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--peer", choices=list(bench.TORCH_BACKENDS), default=None)
    a = p.parse_args(argv)
    (q, k, v, do), options = bench.backward_case(a)
    if a.peer is None:
        _, ctx = cupyflash.attention_forward(q, k, v, **options)
        call = lambda: cupyflash.attention_backward(do, ctx)  # noqa: E731
    else:
        import torch
        from torch.nn.attention import SDPBackend

        if options.get("window") is not None:
            p.error("--peer takes no --window")
        t = [torch.from_dlpack(x) for x in (q, k, v, do)]
        backend = getattr(SDPBackend, bench.TORCH_BACKENDS[a.peer])
        call = bench._torch_runs(torch, backend, *t, is_causal=options["causal"])["bwd"]()
    for _ in range(a.calls):
        call()
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
