"""precision="tf32"'s forward error against a float64 reference, this checkout beside
another version (OLD, as bench/ab_versions.py takes it), on the same inputs: the relative
error norm of o and the largest LSE error, for standard-normal q, k, v scaled by AMP.

    python bench/tf32_error.py [OLD]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash  # noqa: E402

CASES = ((64, 1000, False, 1.0), (128, 1000, False, 1.0), (128, 1000, True, 1.0), (128, 4096, False, 1.0),
         (64, 1000, False, 3.0), (128, 1000, True, 3.0))


def main(argv):
    versions = {"new": cupyflash}
    if argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ab_versions import load_version
        versions["old"] = load_version(Path(argv[0]))
    rng = np.random.default_rng(0)
    print("   d      N causal amp  " + "  ".join(f"{name:>9} o {name:>7} lse" for name in versions))
    for d, n, causal, amp in CASES:
        q, k, v = ((rng.standard_normal((1, 4, n, d)) * (amp if i < 2 else 1.0)).astype(np.float32)
                   for i in range(3))
        ref, ref_lse = cupyflash.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal,
                                           return_lse=True, backend="numpy")
        cells = []
        for module in versions.values():
            o, lse = module.attention(*(cp.asarray(x) for x in (q, k, v)), causal=causal, precision="tf32",
                                      return_lse=True)
            err = np.linalg.norm(cp.asnumpy(o) - ref) / np.linalg.norm(ref)
            cells.append(f"{err:11.2e} {np.abs(cp.asnumpy(lse) - ref_lse).max():11.2e}")
        print(f"{d:4d} {n:6d} {int(causal):6d} {amp:3.0f}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
