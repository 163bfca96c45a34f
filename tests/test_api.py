"""The public API on the NumPy backend against the float64 oracle, and its contracts:
layouts, dtypes, array types, contexts and backend selection."""

import math
import re
import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import api
from oracle import naive_attention, naive_attention_grads

# Relative error norms against float64 computed from the same rounded inputs
# (tests/TOLERANCES.md gives the limits and their reasons).
TOLERANCE = {
    np.dtype(ml_dtypes.bfloat16): 1e-2,
    np.dtype(np.float16): 3e-3,
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float64): 1e-12,
}
DTYPES = list(TOLERANCE)
LSE_DTYPE = {dt: np.float64 if dt == np.float64 else np.float32 for dt in DTYPES}

# (layout, q shape, k shape, v shape, causal): heads, GQA/MQA, Nq != Nk both ways (with
# causal rows that see no key), dv != d, every bhsd rank, primes, N = 1, d at both limits.
CASES = [
    ("bhsd", (2, 3, 17, 16), (2, 3, 17, 16), (2, 3, 17, 16), False),
    ("bhsd", (2, 3, 17, 16), (2, 3, 17, 16), (2, 3, 17, 16), True),
    ("bhsd", (2, 4, 9, 32), (2, 2, 23, 32), (2, 2, 23, 8), True),
    ("bhsd", (1, 4, 13, 8), (1, 1, 5, 8), (1, 1, 5, 8), True),
    ("bhsd", (19, 24), (7, 24), (7, 40), False),
    ("bhsd", (4, 11, 16), (2, 11, 16), (2, 11, 16), True),
    ("bhsd", (2, 3, 2, 7, 8), (2, 3, 1, 9, 8), (2, 3, 1, 9, 8), False),
    ("bhsd", (1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1), True),
    ("bhsd", (1, 2, 5, 256), (1, 2, 3, 256), (1, 2, 3, 256), False),
    ("bshd", (2, 13, 4, 16), (2, 29, 2, 16), (2, 29, 2, 12), False),
    ("bshd", (2, 9, 2, 8), (2, 4, 2, 8), (2, 4, 2, 8), True),
]
CASE_IDS = [f"{c[0]}-q{'x'.join(map(str, c[1]))}-k{c[2][-2]}-dv{c[3][-1]}{'-causal' if c[4] else ''}"
            for c in CASES]


def _random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _oracle_view(x, layout):
    """The oracle's (B, H, N, d) convention (or (B, H, N) for an LSE) of a user-layout array."""
    x = np.asarray(x, np.float64)
    if layout == "bshd":
        return x.transpose(0, 2, 1, 3) if x.ndim == 4 else x
    return x.reshape(-1, *x.shape[-3:]) if x.ndim >= 3 else x[None, None]


def _oracle_lse_view(lse, layout):
    lse = np.asarray(lse, np.float64)
    if layout == "bshd":
        return lse
    return lse.reshape(-1, *lse.shape[-2:]) if lse.ndim >= 2 else lse[None, None]


def _rel_err(out, ref):
    out = np.asarray(out, np.float64)
    norm = np.linalg.norm(ref)
    return np.linalg.norm(out - ref) / (norm if norm else 1.0)


def _check_lse(lse, ref, tol):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    seen = np.isfinite(ref)
    assert _rel_err(lse[seen], ref[seen]) < tol


def _problem(rng, case, dtype):
    layout, q_shape, k_shape, v_shape, causal = case
    q, k, v = (_random(rng, s, dtype) for s in (q_shape, k_shape, v_shape))
    return layout, q, k, v, causal


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: dt.name)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_attention_matches_oracle(rng, case, dtype):
    layout, q, k, v, causal = _problem(rng, case, dtype)
    o, lse = cf.attention(q, k, v, causal=causal, layout=layout, return_lse=True, backend="numpy")
    ref_o, ref_lse = naive_attention(*(_oracle_view(x, layout) for x in (q, k, v)),
                                     scale=1 / math.sqrt(q.shape[-1]), causal=causal)
    assert _rel_err(_oracle_view(o, layout), ref_o) < TOLERANCE[dtype]
    _check_lse(_oracle_lse_view(lse, layout), ref_lse, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: dt.name)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_oracle(rng, case, dtype):
    layout, q, k, v, causal = _problem(rng, case, dtype)
    o, ctx = cf.attention_forward(q, k, v, causal=causal, layout=layout, backend="numpy")
    do = _random(rng, o.shape, dtype)
    grads = cf.attention_backward(do, ctx)
    refs = naive_attention_grads(*(_oracle_view(x, layout) for x in (do, q, k, v)),
                                 scale=1 / math.sqrt(q.shape[-1]), causal=causal)
    for grad, ref in zip(grads, refs):
        assert _rel_err(_oracle_view(grad, layout), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("causal", [False, True])
def test_custom_scale(rng, causal):
    q, k, v = (_random(rng, (2, 2, 7, 8), np.float64) for _ in range(3))
    o, ctx = cf.attention_forward(q, k, v, scale=0.3, causal=causal, backend="numpy")
    assert ctx.scale == 0.3
    ref_o, _ = naive_attention(q, k, v, scale=0.3, causal=causal)
    assert _rel_err(o, ref_o) < 1e-12


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = (_random(rng, (1, 1, 3, 9), np.float32) for _ in range(3))
    assert cf.attention_forward(q, k, v, backend="numpy")[1].scale == 1 / 3


def test_scale_zero_averages_the_values(rng):
    q, k, v = (_random(rng, (2, 1, 4, 8), np.float64) for _ in range(3))
    o = cf.attention(q, k, v, scale=0, backend="numpy")
    np.testing.assert_allclose(o, np.broadcast_to(v.mean(axis=-2, keepdims=True), o.shape), rtol=1e-14)


def test_rows_without_keys_give_zero_output_and_minus_inf_lse(rng):
    q = _random(rng, (1, 2, 6, 8), np.float32)
    k, v = (_random(rng, (1, 2, 2, 8), np.float32) for _ in range(2))
    o, ctx = cf.attention_forward(q, k, v, causal=True, backend="numpy")
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[:, :, :4], 0)
    np.testing.assert_array_equal(ctx.lse[:, :, :4], -np.inf)
    assert np.isfinite(ctx.lse[:, :, 4:]).all()
    dq, dk, dv = cf.attention_backward(np.ones_like(o), ctx)
    np.testing.assert_array_equal(dq[:, :, :4], 0)
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))


# Layouts and strides ------------------------------------------------------------------


def test_layouts_agree(rng):
    q, k, v = (_random(rng, s, np.float64) for s in ((2, 11, 4, 8), (2, 7, 2, 8), (2, 7, 2, 5)))
    o, ctx = cf.attention_forward(q, k, v, layout="bshd", causal=True, backend="numpy")
    do = _random(rng, o.shape, np.float64)
    grads = cf.attention_backward(do, ctx)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    o_t, ctx_t = cf.attention_forward(t(q), t(k), t(v), causal=True, backend="numpy")
    grads_t = cf.attention_backward(t(do), ctx_t)
    np.testing.assert_allclose(t(o), o_t, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(ctx.lse, ctx_t.lse, rtol=1e-13)
    for g, g_t in zip(grads, grads_t):
        np.testing.assert_allclose(t(g), g_t, rtol=1e-12, atol=1e-14)


def test_strided_inputs_match_contiguous_ones(rng):
    q_big = _random(rng, (2, 3, 4, 22, 8), np.float64)
    k_bshd = _random(rng, (2, 3, 9, 2, 8), np.float64)
    v_big = _random(rng, (2, 6, 2, 9, 5), np.float64)
    # q strided along N, k a head/sequence transpose, v with leading axes that no single
    # stride describes (the one case the API copies).
    q, k, v = q_big[:, :, :, ::2], k_bshd.swapaxes(-2, -3), v_big[:, :3]
    o, ctx = cf.attention_forward(q, k, v, causal=True, backend="numpy")
    do = _random(rng, o.shape, np.float64)
    grads = cf.attention_backward(do, ctx)
    contiguous = [np.ascontiguousarray(x) for x in (q, k, v)]
    o_c, ctx_c = cf.attention_forward(*contiguous, causal=True, backend="numpy")
    np.testing.assert_allclose(o, o_c, rtol=1e-13, atol=1e-15)
    for g, g_c in zip(grads, cf.attention_backward(do, ctx_c)):
        np.testing.assert_allclose(g, g_c, rtol=1e-12, atol=1e-14)


def test_strided_view_is_not_copied(rng):
    q_big = _random(rng, (2, 4, 30, 8), np.float32)
    q = q_big[:, :, ::3]
    k, v = (_random(rng, (2, 2, 6, 8), np.float32) for _ in range(2))
    _, ctx = cf.attention_forward(q, k, v, backend="numpy")
    assert np.shares_memory(ctx._saved[0], q_big)


@pytest.mark.parametrize("layout, q_shape, k_shape", [
    ("bhsd", (7, 8), (5, 8)),
    ("bhsd", (4, 7, 8), (2, 5, 8)),
    ("bhsd", (3, 2, 4, 7, 8), (3, 2, 1, 5, 8)),
    ("bshd", (3, 7, 4, 8), (3, 5, 2, 8)),
])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: dt.name)
def test_outputs_are_new_c_contiguous_arrays_in_the_input_layout(rng, layout, q_shape, k_shape, dtype):
    q, k = _random(rng, q_shape, dtype), _random(rng, k_shape, dtype)
    v = _random(rng, (*k_shape[:-1], 3), dtype)
    o, lse = cf.attention(q, k, v, layout=layout, return_lse=True, backend="numpy")
    o_f, ctx = cf.attention_forward(q, k, v, layout=layout, backend="numpy")
    grads = cf.attention_backward(_random(rng, o.shape, dtype), ctx)
    assert o.shape == o_f.shape == (*q_shape[:-1], 3)
    expected_lse = q_shape[:-1] if layout == "bhsd" else (q_shape[0], q_shape[2], q_shape[1])
    assert lse.shape == ctx.lse.shape == expected_lse
    assert lse.dtype == ctx.lse.dtype == LSE_DTYPE[dtype]
    np.testing.assert_array_equal(lse, ctx.lse)
    np.testing.assert_array_equal(o, o_f)
    for out, like in zip((o, o_f, *grads), (o, o, q, k, v)):
        assert type(out) is np.ndarray
        assert out.dtype == dtype and out.shape == like.shape
        assert out.flags.c_contiguous and out.flags.writeable and out.flags.owndata
    for out in (lse, o_f, *grads):
        assert not any(np.shares_memory(out, x) for x in (q, k, v))


def test_inputs_are_not_modified(rng):
    q, k, v = (_random(rng, s, np.float16) for s in ((2, 4, 9, 8), (2, 2, 5, 8), (2, 2, 5, 8)))
    do = _random(rng, (2, 4, 9, 8), np.float16)
    before = [x.copy() for x in (q, k, v, do)]
    cf.attention(q, k, v, causal=True, return_lse=True, backend="numpy")
    o, vjp = cf.attention_vjp(q, k, v, causal=True, backend="numpy")
    vjp(do)
    for x, x0 in zip((q, k, v, do), before):
        np.testing.assert_array_equal(x, x0)
        assert x.flags.writeable


def test_empty_batch(rng):
    q, k, v = (np.zeros((0, 3, 2, n, 8), np.float32) for n in (4, 5, 5))
    k, v = k[:, :, :1], v[:, :, :1]
    o, ctx = cf.attention_forward(q, k, v, causal=True, backend="numpy")
    assert o.shape == (0, 3, 2, 4, 8) and ctx.lse.shape == (0, 3, 2, 4)
    assert [g.shape for g in cf.attention_backward(o, ctx)] == [q.shape, k.shape, v.shape]


class _HostDlpack:
    """A foreign host array speaking only DLPack (as a CPU torch tensor or JAX array does)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_foreign_host_arrays_come_back_as_numpy(rng):
    q, k, v = (_random(rng, (2, 3, 5, 8), np.float32) for _ in range(3))
    o = cf.attention(*(_HostDlpack(x) for x in (q, k, v)), backend="numpy")
    assert type(o) is np.ndarray
    np.testing.assert_array_equal(o, cf.attention(q, k, v, backend="numpy"))


# Contexts and VJPs --------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_vjp_and_context_give_identical_gradients(rng, layout):
    q, k, v = (_random(rng, s, np.float32) for s in ((2, 6, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)))
    if layout == "bhsd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    o, ctx = cf.attention_forward(q, k, v, causal=True, layout=layout, backend="numpy")
    o_vjp, vjp = cf.attention_vjp(q, k, v, causal=True, layout=layout, backend="numpy")
    do = _random(rng, o.shape, np.float32)
    np.testing.assert_array_equal(o, o_vjp)
    np.testing.assert_array_equal(o, cf.attention(q, k, v, causal=True, layout=layout, backend="numpy"))
    for g, g_vjp in zip(cf.attention_backward(do, ctx), vjp(do)):
        np.testing.assert_array_equal(g, g_vjp)


def test_context_keeps_the_forward_pass(rng):
    q, k, v = (_random(rng, (2, 2, 5, 8), np.float32) for _ in range(3))
    o, ctx = cf.attention_forward(q, k, v, causal=True, layout="bhsd", deterministic=True, seed=7,
                                  backend="numpy")
    for saved, original in ((ctx.q, q), (ctx.k, k), (ctx.v, v), (ctx.o, o)):
        assert np.shares_memory(saved, original) and not saved.flags.writeable
    assert (ctx.causal, ctx.layout, ctx.backend, ctx.deterministic, ctx.seed) == (
        True, "bhsd", "numpy", True, 7)
    assert (ctx.window, ctx.dropout_p, ctx.block_mask, ctx.bias, ctx.alibi_slopes, ctx.softcap) == (
        None, 0.0, None, None, None, 0.0)
    assert ctx.device is None
    assert "causal=True" in repr(ctx)


def test_context_can_be_used_twice(rng):
    q, k, v = (_random(rng, (1, 2, 5, 8), np.float32) for _ in range(3))
    o, ctx = cf.attention_forward(q, k, v, deterministic=True, backend="numpy")
    do = _random(rng, o.shape, np.float32)
    for g1, g2 in zip(cf.attention_backward(do, ctx), cf.attention_backward(do, ctx)):
        np.testing.assert_array_equal(g1, g2)


# Options (each one against the oracle: test_mods_api.py) -------------------------------


def test_seed_without_dropout_is_accepted(rng):
    q, k, v = (_random(rng, (1, 1, 4, 8), np.float32) for _ in range(3))
    seeded = cf.attention(q, k, v, seed=123, dropout_p=0.0, backend="numpy")
    np.testing.assert_array_equal(seeded, cf.attention(q, k, v, backend="numpy"))


# Backends -----------------------------------------------------------------------------


def _gpu_usable():
    return api._gpu_backend()[0] is not None


@pytest.mark.skipif(_gpu_usable(), reason="tests the machine without a GPU")
def test_backend_cuda_without_gpu_raises(rng):
    q, k, v = (_random(rng, (1, 1, 4, 8), np.float32) for _ in range(3))
    with pytest.raises(RuntimeError, match="^backend='cuda' needs a CUDA GPU, but "):
        cf.attention(q, k, v, backend="cuda")


@pytest.mark.skipif(_gpu_usable(), reason="tests the machine without a GPU")
def test_backend_auto_without_gpu_runs_on_numpy(rng):
    q, k, v = (_random(rng, (1, 1, 4, 8), np.float32) for _ in range(3))
    o, ctx = cf.attention_forward(q, k, v)
    assert ctx.backend == "numpy"
    np.testing.assert_array_equal(o, cf.attention(q, k, v, backend="numpy"))


def test_case_the_kernels_do_not_cover(rng, monkeypatch):
    kernels = types.SimpleNamespace(unsupported_reason=lambda dtype, d, dv, **where: f"no kernel for d={d}")
    monkeypatch.setattr(api, "_gpu_backend", lambda: (kernels, None))
    q, k, v = (_random(rng, (1, 1, 4, 8), np.float32) for _ in range(3))
    assert cf.attention_forward(q, k, v)[1].backend == "numpy"
    with pytest.raises(ValueError, match="^backend='cuda' cannot run this case: no kernel for d=8"):
        cf.attention(q, k, v, backend="cuda")


def _run_python(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_works_without_cupy():
    out = _run_python(
        "import sys; sys.modules['cupy'] = None\n"  # makes `import cupy` fail
        "import numpy as np, cupyflash as cf\n"
        "x = np.random.default_rng(0).standard_normal((1, 2, 5, 8))\n"
        "o, ctx = cf.attention_forward(x, x, x, causal=True)\n"
        "cf.attention_backward(o, ctx)\n"
        "try:\n"
        "    cf.attention(x, x, x, backend='cuda')\n"
        "except RuntimeError as e:\n"
        "    print(ctx.backend, e)\n")
    assert out.startswith("numpy backend='cuda' needs a CUDA GPU")


def test_numpy_backend_does_not_import_cupy():
    out = _run_python(
        "import sys, numpy as np, cupyflash as cf\n"
        "x = np.ones((2, 5, 8), np.float32)\n"
        "o, ctx = cf.attention_forward(x, x, x, backend='numpy')\n"
        "cf.attention_backward(o, ctx)\n"
        "print('cupy' in sys.modules)\n")
    assert out.strip() == "False"


# Public surface -----------------------------------------------------------------------


def test_public_names():
    assert set(cf.__all__) == {"attention", "attention_forward", "attention_backward", "attention_vjp",
                               "AttentionContext", "precompile", "manual_seed", "varlen_attention",
                               "varlen_attention_forward", "varlen_attention_vjp", "block_sparse",
                               "local_global_block_mask", "butterfly_block_mask",
                               "block_mask_density", "merge_attention", "merge_attention_vjp",
                               "streaming", "streaming_plan", "__version__"}
    assert isinstance(cf.__version__, str)


@pytest.mark.parametrize("function", [cf.attention, cf.attention_forward, cf.attention_vjp],
                         ids=lambda f: f.__name__)
def test_docstrings_state_the_conventions(function):
    doc = function.__doc__
    for needle in ("Parameters", "Returns", "j <= i + Nk - Nq", "LSE ``-inf``", "float32 (float64",
                   "layout : {\"bhsd\", \"bshd\"}", "block_size : int", "seqlens_k : array"):
        assert needle in doc, needle
    assert not re.search(r"^\s*@\w+@$", doc, flags=re.MULTILINE)


# GPU: array types and placement (the kernels' numbers are tested beside the kernels) --


@pytest.mark.gpu
def test_cupy_in_cupy_out(rng):
    import cupy

    q, k, v = (_random(rng, (2, 4, 33, 64), np.float16) for _ in range(3))
    o, lse = cf.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
    assert isinstance(o, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert o.device.id == cupy.cuda.Device().id and o.dtype == np.float16 and lse.dtype == np.float32
    o_ref = cf.attention(q, k, v, causal=True, backend="numpy")
    assert _rel_err(cupy.asnumpy(o), np.asarray(o_ref, np.float64)) < TOLERANCE[np.dtype(np.float16)]


@pytest.mark.gpu
def test_numpy_in_numpy_out_on_the_gpu_backend(rng):
    q, k, v = (_random(rng, (2, 3, 17, 32), np.float32) for _ in range(3))
    o, ctx = cf.attention_forward(q, k, v, backend="cuda")
    assert type(o) is np.ndarray and type(ctx.lse) is np.ndarray and ctx.backend == "cuda"
    ref_o, _ = naive_attention(q, k, v, scale=32 ** -0.5, causal=False)
    assert _rel_err(o, ref_o) < TOLERANCE[np.dtype(np.float32)]


@pytest.mark.gpu
def test_cupy_in_cupy_out_on_the_numpy_backend(rng):
    import cupy

    q, k, v = (_random(rng, (2, 5, 3, 8), np.float32) for _ in range(3))
    args = [cupy.asarray(x) for x in (q, k, v)]
    o, ctx = cf.attention_forward(*args, layout="bshd", backend="numpy")
    grads = cf.attention_backward(cupy.ones_like(o), ctx)
    assert all(isinstance(x, cupy.ndarray) for x in (o, ctx.lse, *grads))
    np.testing.assert_array_equal(cupy.asnumpy(o), cf.attention(q, k, v, layout="bshd", backend="numpy"))


class _DlpackOnly:
    """A foreign GPU array reached through DLPack alone (no __cuda_array_interface__)."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, **kwargs):
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


@pytest.mark.gpu
@pytest.mark.parametrize("wrap", [lambda t: t, _DlpackOnly], ids=["cuda_array_interface", "dlpack"])
def test_torch_gpu_tensors_are_taken_without_a_copy(rng, wrap):
    torch = pytest.importorskip("torch")
    import cupy

    arrays = [_random(rng, s, np.float32) for s in ((2, 4, 9, 16), (2, 2, 7, 16), (2, 2, 7, 16))]
    tensors = [torch.from_numpy(x).cuda() for x in arrays]
    o, ctx = cf.attention_forward(*(wrap(t) for t in tensors), causal=True)
    assert isinstance(o, cupy.ndarray) and isinstance(ctx.q, cupy.ndarray)
    assert [x.data.ptr for x in (ctx.q, ctx.k, ctx.v)] == [t.data_ptr() for t in tensors]
    ref_o, _ = naive_attention(*arrays, scale=0.25, causal=True)
    assert _rel_err(cupy.asnumpy(o), ref_o) < TOLERANCE[np.dtype(np.float32)]


def test_gpu_kernels_refuse_old_gpus_and_too_many_heads(monkeypatch):
    """The reasons backend="auto" falls back to NumPy (and "cuda" fails) for, before anything
    is allocated: GPUs older than compute capability 8.0 and more heads than the grid takes."""
    from cupyflash import _cuda
    monkeypatch.setattr(_cuda, "_compute_capability", lambda device_id: 75)
    assert "compute capability 7.5" in _cuda.unsupported_reason(np.float16, 64, 64, device=0)
    assert "65535" in _cuda.unsupported_reason(np.float16, 64, 64, heads=70000, device=0)
    assert "head dim 300" in _cuda.unsupported_reason(np.float32, 300, 64, device=0)
    monkeypatch.setattr(_cuda, "_compute_capability", lambda device_id: 90)
    assert _cuda.unsupported_reason(np.float16, 64, 64, device=0) is None


def test_scale_that_overflows_the_accumulation_type_is_refused(rng):
    q, k, v = (_random(rng, (1, 1, 4, 8), np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="scale"):
        cf.attention(q, k, v, scale=3e38)
    cf.attention(*(x.astype(np.float64) for x in (q, k, v)), scale=3e38)  # fine in float64
