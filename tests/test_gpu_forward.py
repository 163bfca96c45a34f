"""GPU tier: the forward kernels against the float64 NumPy reference.

Each case draws fresh random inputs, poisons the outputs with NaN before the launch (so
an element the kernel never wrote shows up), and compares the output and the LSE with
the reference computed in float64 from the same rounded inputs.
"""

import itertools

import numpy as np
import pytest
from gpu_cases import DTYPES, HEAD_DIMS, TOLERANCE, bhsd64, make_inputs, rel_err

import cupyflash
from cupyflash import _reference

pytestmark = pytest.mark.gpu

SEQLENS = ((1, 1), (17, 17), (127, 129), (128, 128), (129, 127), (1000, 1000), (17, 1000),
           (1000, 17), (4097, 4097), (129, 4097))


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


def _poisoned_forward(q, k, v, *, layout, causal):
    """The forward kernels straight into NaN-filled o and lse, (B, H, Nq) for both layouts."""
    import cupy as cp
    from cupyflash import _arrays, _cuda

    nq = q.shape[2] if layout == "bhsd" else q.shape[1]
    heads = q.shape[1] if layout == "bhsd" else q.shape[2]
    o = cp.full((*q.shape[:-1], v.shape[-1]), np.nan, dtype=q.dtype)
    lse = cp.full((q.shape[0], heads, nq), np.nan, dtype=_arrays.accumulation_dtype(q.dtype))
    views = [_arrays.bhsd_view(x, layout) for x in (q, k, v, o)]
    _cuda.attention_forward(*views, lse, scale=1.0 / np.sqrt(q.shape[-1]), causal=causal)
    cp.cuda.runtime.deviceSynchronize()
    return o, lse


def _check_forward(host, o, lse, dtype, layout, *, causal):
    """o and lse against the float64 reference on the same (rounded) inputs."""
    import cupy as cp

    scale = 1.0 / np.sqrt(host[0].shape[-1])
    ref_o, ref_lse = _reference.attention_forward(*(bhsd64(x, layout) for x in host),
                                                  scale=scale, causal=causal)
    out = bhsd64(cp.asnumpy(o), layout)
    assert not np.isnan(out).any(), "unwritten or NaN output elements"
    assert rel_err(out, ref_o) < TOLERANCE[dtype]

    got_lse = cp.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got_lse).any()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    lse_tol = 1e-12 if dtype == "float64" else 1e-5
    assert rel_err(got_lse[finite], ref_lse[finite]) < lse_tol


@pytest.mark.parametrize("dtype,d,causal,nq,nk,group,layout", list(_cases()))
def test_forward_matches_reference(rng, dtype, d, causal, nq, nk, group, layout):
    host, (q, k, v) = make_inputs(rng, dtype, d, nq, nk, group, layout)
    o, lse = _poisoned_forward(q, k, v, layout=layout, causal=causal)
    _check_forward(host, o, lse, dtype, layout, causal=causal)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dv", [24, 72, 136])
def test_value_dim_differs(rng, dtype, d, dv):
    """dv != d, smaller and larger (136 > 128 pads both to the 192 kernels)."""
    causal = dv != 72   # both masks, each with every dtype
    layout = "bshd" if d == 128 else "bhsd"
    host, (q, k, v) = make_inputs(rng, dtype, d, 129, 200, 2, layout, dv=dv)
    o, lse = _poisoned_forward(q, k, v, layout=layout, causal=causal)
    assert o.shape == (*q.shape[:-1], dv)
    _check_forward(host, o, lse, dtype, layout, causal=causal)


def test_public_api_runs_on_gpu_and_returns_cupy(rng):
    import cupy as cp
    host, (q, k, v) = make_inputs(rng, "float16", 64, 300, 200, 2, "bshd")
    o, lse = cupyflash.attention(q, k, v, causal=True, layout="bshd", return_lse=True, backend="cuda")
    assert isinstance(o, cp.ndarray) and o.dtype == q.dtype and o.shape == q.shape
    ref = cupyflash.attention(*(x.astype(np.float64) for x in host), causal=True, layout="bshd",
                              backend="numpy")
    assert rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE["float16"]


def test_strided_inputs_without_alignment(rng):
    """Every other 76-element row of one buffer: q's rows are 304 bytes apart (a multiple
    of 16), but k starts 152 bytes into the buffer, so its rows are not 16-byte aligned and
    the kernels must take the element-wise copy path instead of 16-byte copies."""
    import cupy as cp
    from cupyflash import _arrays
    base = cp.asarray(rng.standard_normal((1, 3, 2 * 257, 76)).astype(np.float16))
    q = base[:, :, ::2, :72]
    k = base[:, :, 1::2, :72]
    v = cp.asarray(rng.standard_normal((1, 3, 257, 72)).astype(np.float16))
    assert not _arrays.rows_16b_aligned(q, k)
    o = cupyflash.attention(q, k, v, backend="cuda")
    ref = cupyflash.attention(*(cp.asnumpy(x).astype(np.float64) for x in (q, k, v)), backend="numpy")
    assert rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE["float16"]


def test_runs_on_the_current_stream(rng):
    import cupy as cp
    host, (q, k, v) = make_inputs(rng, "bfloat16", 128, 512, 512, 1, "bhsd")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        o = cupyflash.attention(q, k, v, backend="cuda")
        stream.synchronize()
    ref = cupyflash.attention(*(x.astype(np.float64) for x in host), backend="numpy")
    assert rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_zero_averages_the_visible_values(rng, dtype):
    """scale = 0 makes every visible key equally likely: each row is the mean of the
    values it sees (the tensor-core kernel runs it with the smallest positive scale)."""
    import cupy as cp
    host, (q, k, v) = make_inputs(rng, dtype, 64, 70, 90, 1, "bhsd")
    o = cupyflash.attention(q, k, v, scale=0.0, causal=True, backend="cuda")
    v64 = host[2].astype(np.float64)
    visible = np.arange(90)[None, :] <= np.arange(70)[:, None] + 20
    ref = np.einsum("ij,bhjd->bhid", visible / visible.sum(1, keepdims=True), v64)
    assert rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_hopper_forward_reads_through_tensor_maps(rng, layout):
    """On Hopper, dense 16-bit calls whose rows are 16-byte aligned run fwd_sm90.cu with
    TMA tensor maps in both layouts, not the sm80 fallback that unaligned rows take."""
    import cupy as cp
    from cupyflash import _arrays, _cuda, _kernels
    if _cuda._device_info(cp.cuda.Device().id)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    host, (q, k, v) = make_inputs(rng, "bfloat16", 128, 300, 301, 4, layout)
    views = [_arrays.bhsd_view(x, layout) for x in (q, k, v)]
    variant = _cuda._choose(_kernels.forward_variants("bfloat16", 128), cp.cuda.Device().id)
    assert variant.source == "fwd_sm90.cu"
    assert _cuda._sm90_map_specs(variant, *views) is not None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_calls_of_one_signature_share_a_plan_not_their_addresses(rng, dtype):
    """Calls whose arrays have one layout reuse one launch plan (`_cuda._FORWARD_PLANS`)
    but each reads its own inputs and writes its own outputs; a view of the same shape and
    strides whose rows are not 16-byte aligned gets a plan of its own (no 16-byte copies,
    no tensor maps) and is still right; with dropout and no seed, each call of a plan
    draws fresh streams."""
    import cupy as cp
    from cupyflash import _cuda

    def check(q, k, v, **options):
        o = cupyflash.attention(q, k, v, backend="cuda", **options)
        ref = cupyflash.attention(*(cp.asnumpy(x).astype(np.float64) for x in (q, k, v)),
                                  backend="numpy", **options)
        assert rel_err(cp.asnumpy(o).astype(np.float64), ref) < TOLERANCE[dtype]
        return o

    _cuda._FORWARD_PLANS.clear()
    for _ in range(3):
        _, (q, k, v) = make_inputs(rng, dtype, 64, 200, 333, 2, "bhsd")
        check(q, k, v, causal=True)
    assert len(_cuda._FORWARD_PLANS) == 1
    base = cp.asarray(rng.standard_normal((2, 4, 200 * 64 + 8)).astype(np.float32)).astype(dtype)
    aligned, unaligned = (base[:, :, s:s + 200 * 64].reshape(2, 4, 200, 64) for s in (0, 1))
    _, (q, k, v) = make_inputs(rng, dtype, 64, 200, 200, 1, "bhsd")
    check(aligned, k, v, causal=True)
    check(unaligned, k, v, causal=True)
    assert len(_cuda._FORWARD_PLANS) == 3
    first, second = (cupyflash.attention(q, k, v, dropout_p=0.5, backend="cuda") for _ in range(2))
    assert not cp.array_equal(first, second)
