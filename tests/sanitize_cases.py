"""Small odd shapes through every GPU kernel, for compute-sanitizer (not a pytest file).

    compute-sanitizer --tool memcheck  python tests/sanitize_cases.py
    compute-sanitizer --tool racecheck python tests/sanitize_cases.py float16 float32

Optional arguments restrict the dtypes (racecheck is slow).

Exits non-zero if any output is NaN; the sanitizer reports memory errors and races.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

import cupyflash  # noqa: E402

SHAPES = ((1, 1, 32), (17, 33, 72), (129, 65, 128), (65, 129, 256))


def main():
    rng = np.random.default_rng(0)
    bad = 0
    dtypes = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
    for dtype in [dtypes[name] for name in sys.argv[1:]] or dtypes.values():
        for nq, nk, d in SHAPES:
            for causal in (False, True):
                q = cp.asarray(rng.standard_normal((1, 4, nq, d)).astype(dtype))
                k, v = (cp.asarray(rng.standard_normal((1, 2, nk, d)).astype(dtype)) for _ in range(2))
                o, vjp = cupyflash.attention_vjp(q, k, v, causal=causal, backend="cuda")
                grads = vjp(cp.asarray(rng.standard_normal(o.shape).astype(dtype)))
                for x in (o, *grads):
                    bad += bool(cp.isnan(x.astype(np.float32)).any())
    cp.cuda.runtime.deviceSynchronize()
    print(f"sanitize cases done, {bad} outputs with NaN")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
