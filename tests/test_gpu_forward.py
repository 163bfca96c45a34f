"""GPU tier: the forward kernels against the float64 NumPy reference.

Each case draws fresh random inputs, poisons the outputs with NaN before the launch (so
an element the kernel never wrote shows up), and compares the output and the LSE with
the reference computed in float64 from the same rounded inputs.
"""

import itertools

import numpy as np
import pytest

import cupyflash
from cupyflash import _reference

pytestmark = pytest.mark.gpu

TOLERANCE = {"bfloat16": 1e-2, "float16": 3e-3, "float32": 1e-5, "float64": 1e-12}
DTYPES = ("float16", "bfloat16", "float32", "float64")
HEAD_DIMS = (32, 64, 96, 128, 192, 256, 72)
SEQLENS = ((1, 1), (17, 17), (127, 129), (128, 128), (129, 127), (1000, 1000), (17, 1000),
           (1000, 17), (4097, 4097), (129, 4097))


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _cases():
    """A rotating sample of the full product: every dtype x head dim x causal, with the
    sequence lengths, GQA ratios and layouts cycled so each appears with each dtype."""
    combos = list(itertools.product(DTYPES, HEAD_DIMS, (False, True)))
    for i, (dtype, d, causal) in enumerate(combos):
        for j in range(2):
            nq, nk = SEQLENS[(3 * i + 5 * j) % len(SEQLENS)]
            group = (1, 4)[(i + j) % 2]
            layout = ("bhsd", "bshd")[(i // 2 + j) % 2]
            yield pytest.param(dtype, d, causal, nq, nk, group, layout,
                               id=f"{dtype}-d{d}-{'causal' if causal else 'full'}-{nq}x{nk}-g{group}-{layout}")


def _inputs(rng, dtype, d, nq, nk, group, layout, batch=2, kv_heads=2):
    import cupy as cp
    if nq * nk > 10**6:   # the float64 reference runs on the host: keep long cases to one head group
        batch = kv_heads = 1
    hq = kv_heads * group
    if layout == "bhsd":
        shapes = (batch, hq, nq, d), (batch, kv_heads, nk, d), (batch, kv_heads, nk, d)
    else:
        shapes = (batch, nq, hq, d), (batch, nk, kv_heads, d), (batch, nk, kv_heads, d)
    host = [rng.standard_normal(s).astype(_dtype(dtype)) for s in shapes]
    return host, [cp.asarray(x) for x in host]


def _bhsd64(x, layout):
    x = x.astype(np.float64)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _rel_err(out, ref):
    return np.linalg.norm((out - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-300)


@pytest.mark.parametrize("dtype,d,causal,nq,nk,group,layout", list(_cases()))
def test_forward_matches_reference(rng, dtype, d, causal, nq, nk, group, layout):
    import cupy as cp
    from cupyflash import _arrays, _cuda

    host, (q, k, v) = _inputs(rng, dtype, d, nq, nk, group, layout)
    scale = 1.0 / np.sqrt(d)
    o = cp.full((*q.shape[:-1], d), np.nan, dtype=q.dtype)
    lse = cp.full((q.shape[0], q.shape[1] if layout == "bhsd" else q.shape[2], nq), np.nan,
                  dtype=np.float64 if dtype == "float64" else np.float32)
    views = [_arrays.bhsd_view(x, layout) for x in (q, k, v, o)]
    _cuda.attention_forward(*views, lse, scale=scale, causal=causal)
    cp.cuda.runtime.deviceSynchronize()

    ref_o, ref_lse = _reference.attention_forward(*(_bhsd64(x, layout) for x in host),
                                                  scale=scale, causal=causal)
    out = _bhsd64(cp.asnumpy(o), layout)
    assert not np.isnan(out).any(), "unwritten or NaN output elements"
    assert _rel_err(out, ref_o) < TOLERANCE[dtype]

    got_lse = cp.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got_lse).any()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    lse_tol = 1e-12 if dtype == "float64" else 1e-5
    assert _rel_err(got_lse[finite], ref_lse[finite]) < lse_tol


def test_public_api_runs_on_gpu_and_returns_cupy(rng):
    import cupy as cp
    host, (q, k, v) = _inputs(rng, "float16", 64, 300, 200, 2, "bshd")
    o, lse = cupyflash.attention(q, k, v, causal=True, layout="bshd", return_lse=True, backend="cuda")
    assert isinstance(o, cp.ndarray) and o.dtype == q.dtype and o.shape == q.shape
    ref = cupyflash.attention(*(x.astype(np.float64) for x in host), causal=True, layout="bshd",
                              backend="numpy")
    assert _rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE["float16"]


def test_strided_inputs_without_alignment(rng):
    """Rows 76 elements apart (152 bytes, not a multiple of 16) and every other row: the
    kernels must take the element-wise copy path instead of 16-byte copies."""
    import cupy as cp
    from cupyflash import _cuda
    base = cp.asarray(rng.standard_normal((1, 3, 2 * 257, 76)).astype(np.float16))
    q = base[:, :, ::2, :72]
    k = base[:, :, 1::2, :72]
    v = cp.asarray(rng.standard_normal((1, 3, 257, 72)).astype(np.float16))
    assert not _cuda._rows_16b_aligned(q, k)
    o = cupyflash.attention(q, k, v, backend="cuda")
    ref = cupyflash.attention(*(cp.asnumpy(x).astype(np.float64) for x in (q, k, v)), backend="numpy")
    assert _rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE["float16"]


def test_runs_on_the_current_stream(rng):
    import cupy as cp
    host, (q, k, v) = _inputs(rng, "bfloat16", 128, 512, 512, 1, "bhsd")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        o = cupyflash.attention(q, k, v, backend="cuda")
        stream.synchronize()
    ref = cupyflash.attention(*(x.astype(np.float64) for x in host), backend="numpy")
    assert _rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_zero_averages_the_visible_values(rng, dtype):
    """scale = 0 makes every visible key equally likely: each row is the mean of the
    values it sees (the tensor-core kernel runs it with the smallest positive scale)."""
    import cupy as cp
    host, (q, k, v) = _inputs(rng, dtype, 64, 70, 90, 1, "bhsd")
    o = cupyflash.attention(q, k, v, scale=0.0, causal=True, backend="cuda")
    v64 = host[2].astype(np.float64)
    visible = np.arange(90)[None, :] <= np.arange(70)[:, None] + 20
    ref = np.einsum("ij,bhjd->bhid", visible / visible.sum(1, keepdims=True), v64)
    assert _rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE[dtype]
