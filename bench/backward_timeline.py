"""Where a backward call's GPU time goes: every kernel and memset of back-to-back calls,
as CUPTI records them (torch.profiler sees CuPy's launches too), and the GPU's idle gaps.

    python bench/backward_timeline.py [--seqlen 2048] [--head-dim 64] [--causal] [--window 256] [--calls 20]
        [--peer torch-cudnn]

--peer profiles a torch SDPA backend's backward (a key of bench.TORCH_BACKENDS) on the
same tensors instead, so that its kernels and passes can be read beside cupyflash's.

Prints per activity (kernel or memset name, shortened) its mean microseconds per call,
share of the span and the GPU's idle time before it, then the span and the idle time per
call, and the host's time to queue a call (a loop of the same calls before the profiled
one, without the profiler). The profiler itself delays some launches: read the idle time beside an A/B by CUDA
events (bench/ab_versions.py), not alone (bench/NOTES.md, session 26). Timing only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash import bench  # noqa: E402


def main(argv):
    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser()
    bench.add_backward_case_arguments(p, seqlen=2048)
    p.add_argument("--calls", type=int, default=20)
    bench.add_backward_peer_argument(p)
    a = p.parse_args(argv)
    call, (B, H, N, d), options = bench.backward_call(a, p)
    for _ in range(3):
        call()
    cp.cuda.Device().synchronize()
    issue = time.perf_counter()   # the host's time to queue the calls, without the profiler
    for _ in range(a.calls):
        call()
    issue = time.perf_counter() - issue
    cp.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.calls):
            call()
        cp.cuda.Device().synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    total, gap_before = defaultdict(float), defaultdict(float)
    for before, e in zip([None] + events[:-1], events):
        name = e.name.split("<")[0][:60]
        total[name] += e.time_range.elapsed_us()
        if before is not None:
            gap_before[name] += e.time_range.start - before.time_range.end
    span = events[-1].time_range.end - events[0].time_range.start
    busy = sum(total.values())
    print(f"{a.peer or 'cupyflash'} B={B} H={H} N={N} d={d} {options}: {a.calls} calls, {len(events) / a.calls:.1f} activities a call")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        idle = gap_before[name] / a.calls
        print(f"  {us / a.calls:9.1f} us  {us / span:6.1%}  {name}  (idle before it {idle:.1f} us)")
    print(f"  span {span / a.calls:.1f} us a call, idle {(span - busy) / a.calls:.1f} us a call; "
          f"the host queued a call in {issue * 1e6 / a.calls:.1f} us (without the profiler)")


if __name__ == "__main__":
    main(sys.argv[1:])
