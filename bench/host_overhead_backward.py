"""Host (Python) time of a backward call, with the launch-plan cache and without it.

    python bench/host_overhead_backward.py [--seqlen 1024] [--head-dim 64] [--causal] [--window 256]

`cupyx.profiler.benchmark` of the vector-Jacobian product of one forward (cupyflash's
`attention_vjp`): CPU and GPU milliseconds per call, first with `_cuda._BACKWARD_PLANS`
as it is, then with every call planning afresh (what each call did before the cache).
Where the CPU time exceeds the GPU's, back-to-back calls are bound by Python.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyx.profiler import benchmark  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _cuda, bench  # noqa: E402

p = argparse.ArgumentParser()
bench.add_backward_case_arguments(p, seqlen=1024)
a = p.parse_args()
(q, k, v, do), options = bench.backward_case(a)
_, vjp = cupyflash.attention_vjp(q, k, v, **options)
for label in ("plan cache", "no cache"):
    if label == "no cache":
        _cuda._cached_plan = lambda plans, signature, make: make()
    result = benchmark(vjp, (do,), n_repeat=200, n_warmup=10)
    cpu, gpu = result.cpu_times.mean() * 1e3, result.gpu_times.mean() * 1e3
    print(f"{label:10} N={a.seqlen} d={a.head_dim} {options}: "
          f"host {cpu * 1e3:7.1f} us/call, GPU {gpu * 1e3:7.1f} us/call")
