"""Where a hanging Hopper kernel waits: run one forward (or backward) case built with
-DCUPYFLASH_WATCHDOG (kernels_cu/tma.cuh) and print the mbarrier waits that never end.

    python bench/hang_probe.py --dtype float32 --head-dim 128 --seqlen 17 [--causal] [--backward]
                               [--precision tf32] [--wait 8]

The watchdog build records, for each thread whose wait has spun for ~2^31 clocks, its
block, thread, the barrier's shared-memory address, the parity waited for and the
barrier's 64-bit state, into host-mapped memory that this script reads while the kernel
still hangs (a hung kernel never returns, and device printf needs it to). It prints the
distinct (barrier, parity, warp) waits of the first block reported, then exits without
waiting for the GPU. A barrier's address minus that of the kernel's first barrier
(Sm90FwdBarriers, Sm90BwdBarriers) names it; a state of 0 means the barrier's memory was
overwritten (in session 14, a TMA box written past its tile). Nothing is recorded for a
kernel that does not hang.
"""

import argparse
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _cuda, _nvrtc, bench  # noqa: E402

RECORDS, WORDS = 4096, 6   # tma.cuh's mbar_watchdog_log layout: a count, then 6 words a record

p = argparse.ArgumentParser()
p.add_argument("--dtype", default="float32")
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--seqlen", type=int, default=1024)
p.add_argument("--causal", action="store_true")
p.add_argument("--backward", action="store_true")
p.add_argument("--precision", default="highest")
p.add_argument("--wait", type=float, default=8.0, help="seconds to let the kernel run before reading the log")
a = p.parse_args()

_nvrtc.BASE_OPTIONS = _nvrtc.BASE_OPTIONS + ("-DCUPYFLASH_WATCHDOG",)   # a build of its own (cache key)
log = cp.cuda.alloc_pinned_memory(4 * (1 + WORDS * RECORDS))
words = np.frombuffer(log, np.uint32, 1 + WORDS * RECORDS)
words[:] = 0


def load(variant, device_id):
    """_cuda._load, pointing the module's watchdog at the host log."""
    module, kernel = _cuda._load_module(variant, device_id)
    with cp.cuda.Device(device_id):
        try:
            module.get_global("mbar_watchdog_log").copy_from_host(np.array([log.ptr], np.uint64).ctypes.data, 8)
        except Exception:   # a kernel without mbarriers has no watchdog
            pass
    return kernel


_cuda._load = load
d, N = a.head_dim, a.seqlen
(q, k, v, do), _ = bench.make_inputs(a.dtype, (1, 4, N, d), 0)
o, ctx = cupyflash.attention_forward(q, k, v, causal=a.causal, precision=a.precision)
if a.backward:
    cupyflash.attention_backward(do, ctx)
time.sleep(a.wait)
count = int(words[0])
if count == 0:
    cp.cuda.runtime.deviceSynchronize()
    print("no wait outlived the watchdog: the kernels finished")
    sys.exit(0)
records = words[1:1 + WORDS * min(count, RECORDS)].reshape(-1, WORDS)
first = records[0][0]
waits = collections.Counter((int(r[2]), int(r[3]), int(r[1]) // 32, int(r[5]) << 32 | int(r[4]))
                            for r in records if r[0] == first)
print(f"{count} threads waiting; block {first}:")
for (address, parity, warp, state), threads in sorted(waits.items()):
    print(f"  barrier at {address} parity {parity}: warp {warp} ({threads} threads), state {state:016x}")
sys.stdout.flush()
os._exit(1)   # the kernel still runs: do not wait for it
