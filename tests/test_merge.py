"""`merge_attention` and `attention_backward(..., dlse=)`: attention over key parts, merged,
against the float64 oracle over all keys (NumPy backend; the CuPy path in the gpu test)."""

import numpy as np
import pytest

import cupyflash as cf
from oracle import naive_attention, naive_attention_grads
from test_reference import assert_close

TOL = {np.float64: 1e-12, np.float32: 1e-5}  # tests/TOLERANCES.md


def _parts(rng, dtype, *, b=2, h=3, nq=37, cuts=(0, 11, 12, 50), d=24, layout="bhsd", blind_row=True):
    """q, k, v over all keys and a bias hiding some (row, part) pairs entirely: query 3
    sees no key of part 0; with ``blind_row`` query 5 sees no key at all (the oracle
    gives NaN there, so the gradient checks leave it out)."""
    nk = cuts[-1]
    shape = (lambda n: (b, h, n, d)) if layout == "bhsd" else (lambda n: (b, n, h, d))
    q, k, v = (rng.standard_normal(shape(n)).astype(dtype) for n in (nq, nk, nk))
    bias = np.zeros((nq, nk), dtype)
    bias[3, cuts[0]:cuts[1]] = -np.inf
    if blind_row:
        bias[5, :] = -np.inf
    return q, k, v, bias


def _key_slice(x, lo, hi, layout):
    return x[:, :, lo:hi] if layout == "bhsd" else x[:, lo:hi]


def _bhsd(x, layout):
    return np.asarray(x, np.float64) if layout == "bhsd" else np.asarray(x, np.float64).transpose(0, 2, 1, 3)


# The oracle's logsumexp warns on the row that sees no key (and returns -inf, as it should).
ORACLE_NO_KEY_ROW = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")


@ORACLE_NO_KEY_ROW
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_merged_parts_equal_attention_over_all_keys(dtype, layout):
    rng = np.random.default_rng(7)
    cuts = (0, 11, 12, 50)
    q, k, v, bias = _parts(rng, dtype, cuts=cuts, layout=layout)
    before = [x.copy() for x in (q, k, v)]
    outs, lses = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        o, lse = cf.attention(q, _key_slice(k, lo, hi, layout), _key_slice(v, lo, hi, layout),
                              bias=bias[:, lo:hi], layout=layout, return_lse=True, backend="numpy")
        outs.append(o)
        lses.append(lse)
    assert np.isneginf(lses[0][:, :, 3]).all() and np.isneginf(lses[1][:, :, 5]).all()
    lses_before = [x.copy() for x in lses]
    o, lse = cf.merge_attention(outs, lses, layout=layout)
    scale = 1 / np.sqrt(q.shape[-1])
    ref_o, ref_lse = naive_attention(_bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout), scale=scale,
                                     causal=False, bias=bias.astype(np.float64))
    assert o.dtype == dtype and lse.dtype == dtype
    assert_close(_bhsd(o, layout), ref_o, TOL[dtype])
    assert_close(lse, ref_lse, TOL[dtype])
    assert (o[:, :, 5] == 0).all() if layout == "bhsd" else (o[:, 5] == 0).all()
    for x, y in zip((q, k, v, *lses), (*before, *lses_before)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gradients_through_the_merge_equal_those_over_all_keys(dtype):
    """merge_attention_vjp's douts and dlses, fed to each part's backward (dlse=), give the
    gradients of attention over all keys: dq summed over parts, dk and dv per part."""
    rng = np.random.default_rng(11)
    cuts = (0, 20, 21, 64)
    q, k, v, bias = _parts(rng, dtype, cuts=cuts, nq=29, blind_row=False)
    do = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(dtype)
    dlse = rng.standard_normal(q.shape[:-1]).astype(dtype)
    ctxs, outs, lses = [], [], []
    for lo, hi in zip(cuts, cuts[1:]):
        o, ctx = cf.attention_forward(q, k[:, :, lo:hi], v[:, :, lo:hi], bias=bias[:, lo:hi], backend="numpy")
        ctxs.append(ctx)
        outs.append(o)
        lses.append(ctx.lse)
    _, _, vjp = cf.merge_attention_vjp(outs, lses)
    douts, dlses = vjp(do, dlse)
    dq = sum(cf.attention_backward(g, ctx, dlse=gl)[0].astype(np.float64) for g, gl, ctx in zip(douts, dlses, ctxs))
    dk = np.concatenate([cf.attention_backward(g, c, dlse=gl)[1] for g, gl, c in zip(douts, dlses, ctxs)], axis=2)
    dv = np.concatenate([cf.attention_backward(g, c, dlse=gl)[2] for g, gl, c in zip(douts, dlses, ctxs)], axis=2)
    ref = _grads_with_lse(do, dlse, q, k, v, bias)
    for out, r in zip((dq, dk, dv), ref):
        assert np.isfinite(r).all()
        # Ten times the limit: each part's backward starts from douts rounded to the
        # dtype and the parts' gradients are summed afterwards, roundings the whole call has not.
        assert_close(out, r, TOL[dtype] * 10)


def _grads_with_lse(do, dlse, q, k, v, bias):
    """Gradients of sum(do * o) + sum(dlse * lse) in float64: the oracle's for the first
    term, plus dlse's through dS = P dlse (d lse_i / d s_ij = P_ij)."""
    f = lambda x: np.asarray(x, np.float64)   # noqa: E731
    scale = 1 / np.sqrt(q.shape[-1])
    dq, dk, dv = naive_attention_grads(f(do), f(q), f(k), f(v), scale=scale, causal=False, bias=f(bias))[:3]
    s = np.einsum("bhqd,bhkd->bhqk", f(q), f(k)) * scale + f(bias)
    top = np.max(s, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    p = np.exp(s - top)
    total = p.sum(-1, keepdims=True)
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    ds = p * f(dlse)[..., None] * scale
    return dq + ds @ f(k), dk + np.swapaxes(ds, -1, -2) @ f(q), dv


def test_dlse_against_finite_differences():
    """attention_vjp's dlse path on its own, in float64, against central differences of
    sum(h * lse) (a loss of the LSE alone: do = 0)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (5, 7, 7))
    h = rng.standard_normal((1, 2, 5))
    o, vjp = cf.attention_vjp(q, k, v, causal=True, backend="numpy")
    dq, dk, _ = vjp(np.zeros_like(o), dlse=h)
    step = 1e-6
    for x, grad in ((q, dq), (k, dk)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            x[idx] += step
            plus = np.sum(h * cf.attention(q, k, v, causal=True, return_lse=True, backend="numpy")[1])
            x[idx] -= 2 * step
            minus = np.sum(h * cf.attention(q, k, v, causal=True, return_lse=True, backend="numpy")[1])
            x[idx] += step
            numeric[idx] = (plus - minus) / (2 * step)
        # Central differences of step 1e-6: truncation ~1e-12, cancellation ~1e-10.
        np.testing.assert_allclose(grad, numeric, atol=1e-7, rtol=1e-6)


def test_one_part_is_returned_unchanged():
    rng = np.random.default_rng(0)
    o = rng.standard_normal((2, 4, 9, 16)).astype(np.float32)
    lse = rng.standard_normal((2, 4, 9)).astype(np.float32)
    mo, mlse = cf.merge_attention([o], [lse])
    np.testing.assert_allclose(mo, o, rtol=1e-6)
    np.testing.assert_allclose(mlse, lse, rtol=1e-6)


@pytest.mark.parametrize("outs, lses, layout, error, match", [
    ([], [], "bhsd", ValueError, "at least one part"),
    ([np.zeros((1, 2, 3, 4), np.float32)], [], "bhsd", ValueError, "one LSE per part"),
    ([np.zeros((1, 2, 3, 4), np.float32)] * 2, [np.zeros((1, 2, 3), np.float32)] * 2, "bxyz", ValueError, "layout"),
    ([np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 2, 3, 5), np.float32)],
     [np.zeros((1, 2, 3), np.float32)] * 2, "bhsd", ValueError, r"outs\[1\] must have the shape"),
    ([np.zeros((1, 2, 3, 4), np.float32), np.zeros((1, 2, 3, 4), np.float64)],
     [np.zeros((1, 2, 3), np.float32)] * 2, "bhsd", TypeError, r"outs\[1\] must have the dtype"),
    ([np.zeros((1, 2, 3, 4), np.float32)] * 2, [np.zeros((1, 2, 3), np.float64)] * 2, "bhsd", TypeError,
     r"lses\[0\] must be float32"),
    ([np.zeros((1, 2, 3, 4), np.float32)] * 2, [np.zeros((1, 2, 3), np.float32)] * 2, "bshd", ValueError,
     r"lses\[0\] must have shape \(1, 3, 2\)"),
    ([np.zeros((1, 2, 3, 4), np.int32)], [np.zeros((1, 2, 3), np.float32)], "bhsd", TypeError, "float16"),
    (np.zeros((1, 2, 3, 4), np.float32), [np.zeros((1, 2, 3), np.float32)], "bhsd", TypeError, "sequence"),
    ([np.zeros((1, 2, 3, 4), np.float32)], ["x"], "bhsd", TypeError, r"lses\[0\] must be an array"),
])
def test_bad_parts_are_named(outs, lses, layout, error, match):
    with pytest.raises(error, match=match):
        cf.merge_attention(outs, lses, layout=layout)


def test_bad_cotangents_are_named():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    o, vjp = cf.attention_vjp(q, q, q, backend="numpy")
    with pytest.raises(ValueError, match="dlse must have the shape of lse"):
        vjp(np.zeros_like(o), dlse=np.zeros((1, 2, 5), np.float32))
    with pytest.raises(TypeError, match="dlse must have a real floating dtype"):
        vjp(np.zeros_like(o), dlse=np.zeros((1, 2, 6), np.int64))
    _, _, merge_vjp = cf.merge_attention_vjp([o, o], [np.zeros((1, 2, 6), np.float32)] * 2)
    with pytest.raises(ValueError, match="dlse must have the shape of lse"):
        merge_vjp(np.zeros_like(o), np.zeros((1, 2), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_merge_and_dlse_on_the_gpu(dtype):
    """The CuPy path: parts on the GPU merged and differentiated, against the float64
    oracle over all keys (the GPU tolerances)."""
    import cupy as cp
    from gpu_cases import TOLERANCE, rel_err

    rng = np.random.default_rng(5)
    cuts = (0, 130, 131, 300)
    q, k, v, bias = _parts(rng, np.float32, cuts=cuts, nq=200, d=64, blind_row=False)
    do = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal(q.shape[:-1]).astype(np.float32)
    to_gpu = lambda x: cp.asarray(x).astype(dtype)   # noqa: E731
    qg, kg, vg, dog = (to_gpu(x) for x in (q, k, v, do))
    acc = np.float64 if dtype == "float64" else np.float32
    ctxs, outs, lses = [], [], []
    for lo, hi in zip(cuts, cuts[1:]):
        o, ctx = cf.attention_forward(qg, kg[:, :, lo:hi], vg[:, :, lo:hi], bias=to_gpu(bias[:, lo:hi]), backend="cuda")
        ctxs.append(ctx)
        outs.append(o)
        lses.append(ctx.lse)
    o, lse, vjp = cf.merge_attention_vjp(outs, lses)
    douts, dlses = vjp(dog, cp.asarray(dlse, acc))
    grads = [cf.attention_backward(g, c, dlse=gl) for g, gl, c in zip(douts, dlses, ctxs)]
    dq = sum(cp.asnumpy(g[0]).astype(np.float64) for g in grads)
    dk = np.concatenate([cp.asnumpy(g[1]).astype(np.float64) for g in grads], axis=2)
    dv = np.concatenate([cp.asnumpy(g[2]).astype(np.float64) for g in grads], axis=2)
    f = lambda x: cp.asnumpy(x).astype(np.float64)   # noqa: E731
    qr, kr, vr, dor, br = (f(x) for x in (qg, kg, vg, dog, to_gpu(bias)))
    ref_o, ref_lse = naive_attention(qr, kr, vr, scale=1 / 8, causal=False, bias=br)
    assert rel_err(f(o), ref_o) < TOLERANCE[dtype]
    finite = np.isfinite(ref_lse)
    assert (np.isneginf(cp.asnumpy(lse)) == ~finite).all()
    assert rel_err(cp.asnumpy(lse)[finite], ref_lse[finite]) < TOLERANCE[dtype]
    for out, r in zip((dq, dk, dv), _grads_with_lse(dor, dlse.astype(np.float64), qr, kr, vr, br)):
        assert np.isfinite(r).all()
        assert rel_err(out, r) < TOLERANCE[dtype] * 3   # the parts' extra roundings (above)
