"""What the GPU tests share: tolerances, dtypes and head dims, random inputs and the
float64 views and error norm they are judged by (test_gpu_forward.py, test_gpu_backward.py).

CuPy is imported inside the functions, so that collecting the tests needs no GPU.
"""

import numpy as np

# ‖out − ref‖/‖ref‖ against a float64 reference on the same inputs; the limits and why:
# tests/TOLERANCES.md.
# "tf32": float32 inputs with precision="tf32" (the Hopper forward on one TF32 product).
TOLERANCE = {"bfloat16": 1e-2, "float16": 3e-3, "float32": 1e-5, "float64": 1e-12, "tf32": 3e-3}
DTYPES = ("float16", "bfloat16", "float32", "float64")
HEAD_DIMS = (32, 64, 96, 128, 192, 256, 72)


def np_dtype(name):
    """The NumPy dtype of a dtype name, bfloat16 (ml_dtypes) included."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_inputs(rng, dtype, d, nq, nk, group, layout, *, dv=None, with_do=False, batch=2,
                kv_heads=2, max_pairs=10**6):
    """Host arrays (q, k, v, and do with ``with_do``) in ``dtype`` and their CuPy copies,
    in ``layout``, with ``kv_heads * group`` query heads. Cases of more than ``max_pairs``
    query-key pairs run with one batch and one kv head: the float64 reference runs on
    the host."""
    import cupy as cp
    dv = d if dv is None else dv
    if nq * nk > max_pairs:
        batch = kv_heads = 1
    hq = kv_heads * group
    if layout == "bhsd":
        shapes = [(batch, hq, nq, d), (batch, kv_heads, nk, d), (batch, kv_heads, nk, dv), (batch, hq, nq, dv)]
    else:
        shapes = [(batch, nq, hq, d), (batch, nk, kv_heads, d), (batch, nk, kv_heads, dv), (batch, nq, hq, dv)]
    host = [rng.standard_normal(s).astype(np_dtype(dtype)) for s in shapes[:4 if with_do else 3]]
    return host, [cp.asarray(x) for x in host]


def bhsd64(x, layout):
    """A host array in ``layout`` as a float64 (B, H, N, d) array."""
    x = np.asarray(x).astype(np.float64)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def rel_err(out, ref):
    """‖out − ref‖ / ‖ref‖ over all elements (a zero reference counts as 1e-300)."""
    return np.linalg.norm((out - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-300)
