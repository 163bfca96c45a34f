"""Every bad argument raises TypeError or ValueError naming it, before any work is done."""

import dataclasses
import math
import re
import warnings

import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _validate


def _qkv(rng, q_shape=(2, 4, 5, 8), k_shape=(2, 2, 6, 8), v_shape=None, dtype=np.float32):
    v_shape = k_shape if v_shape is None else v_shape
    return tuple(rng.standard_normal(s).astype(dtype) for s in (q_shape, k_shape, v_shape))


class _FakeGpuArray:
    """Looks like a GPU array (it has __cuda_array_interface__) without needing a GPU: the
    checks must reject mixing it with host arrays before anything tries to read it."""

    def __init__(self, shape=(2, 4, 5, 8)):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (0, False),
                                         "version": 3, "strides": None}


class _ForeignDlpack:
    """An object with DLPack methods only, reporting a device type cupyflash does not know."""

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be converted")

    def __dlpack_device__(self):
        return (4, 0)  # kDLOpenCL


# Not arrays ---------------------------------------------------------------------------


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("bad", [[[1.0, 2.0]], 3.0, None, "q", np.float32(1.0), _ForeignDlpack()])
def test_not_an_array(rng, position, bad):
    args = list(_qkv(rng))
    args[position] = bad
    name = "qkv"[position]
    with pytest.raises(TypeError, match=f"^{name} must be an array"):
        cf.attention(*args)


# Placement ----------------------------------------------------------------------------


@pytest.mark.parametrize("position", [1, 2])
def test_gpu_array_mixed_with_host_arrays(rng, position):
    args = list(_qkv(rng))
    args[position] = _FakeGpuArray(args[position].shape)
    name = "qkv"[position]
    with pytest.raises(TypeError, match=f"^{name} is a GPU array but q is a host"):
        cf.attention(*args)


def test_host_array_mixed_with_gpu_query(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="^k is a host .* but q is a GPU array"):
        cf.attention(_FakeGpuArray(), k, v)


@pytest.mark.gpu
def test_cupy_mixed_with_numpy(rng):
    import cupy

    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="^v is a host .* but q is a GPU array"):
        cf.attention(cupy.asarray(q), cupy.asarray(k), v)


@pytest.mark.gpu
@pytest.mark.parametrize("position", [1, 2])
def test_arrays_on_different_gpus(rng, position):
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    arrays = []
    for i, x in enumerate(_qkv(rng)):
        with cupy.cuda.Device(1 if i == position else 0):
            arrays.append(cupy.asarray(x))
    name = "qkv"[position]
    with pytest.raises(ValueError, match=f"^{name} is on GPU 1 but q is on GPU 0"):
        cf.attention(*arrays)


# dtypes -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.complex64, np.bool_, np.float128
                                   if hasattr(np, "float128") else np.uint16])
def test_unsupported_dtype(rng, dtype):
    q, k, v = (x.astype(dtype) for x in _qkv(rng))
    with pytest.raises(TypeError, match="^q must have dtype float16, bfloat16, float32, float64"):
        cf.attention(q, k, v)


@pytest.mark.parametrize("position", [1, 2])
@pytest.mark.parametrize("other", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_dtype_mismatch(rng, position, other):
    args = list(_qkv(rng))
    args[position] = args[position].astype(other)
    name = "qkv"[position]
    with pytest.raises(TypeError, match=f"^{name} has dtype .* but q has float32"):
        cf.attention(*args)


# Shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, shapes, message", [
    ("q", [(8,), (6, 8), (6, 8)], "at least 2-D"),
    ("k", [(2, 4, 5, 8), (2, 6, 8), (2, 2, 6, 8)], "as many dimensions as q"),
    ("v", [(2, 4, 5, 8), (2, 2, 6, 8), (2, 1, 2, 6, 8)], "as many dimensions as q"),
    ("k", [(2, 4, 5, 8), (3, 2, 6, 8), (3, 2, 6, 8)], r"batch \(leading\) dimensions \(3,\) but q has \(2,\)"),
    ("v", [(2, 3, 4, 5, 8), (2, 3, 2, 6, 8), (2, 1, 2, 6, 8)], "batch"),
    ("q", [(2, 0, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8)], "at least one head"),
    ("k", [(2, 4, 5, 8), (2, 0, 6, 8), (2, 0, 6, 8)], "at least one head"),
    ("v", [(2, 4, 5, 8), (2, 2, 6, 8), (2, 1, 6, 8)], "has 1 heads but k has 2"),
    ("q", [(2, 3, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8)], "has 3 heads, not a multiple of k's 2"),
    ("q", [(2, 1, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8)], "has 1 heads, not a multiple"),
    ("q", [(2, 4, 0, 8), (2, 2, 6, 8), (2, 2, 6, 8)], r"at least one query \(Nq >= 1\)"),
    ("k", [(2, 4, 5, 8), (2, 2, 0, 8), (2, 2, 0, 8)], r"at least one key \(Nk >= 1\)"),
    ("v", [(2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 7, 8)], "has 7 keys but k has 6"),
    ("k", [(2, 4, 5, 8), (2, 2, 6, 16), (2, 2, 6, 8)], "has head dimension 16 but q has 8"),
    ("q", [(2, 4, 5, 257), (2, 2, 6, 257), (2, 2, 6, 8)], "head dimension must be between 1 and 256, got 257"),
    ("q", [(2, 4, 5, 0), (2, 2, 6, 0), (2, 2, 6, 8)], "head dimension .* got 0"),
    ("v", [(2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 300)], "head dimension must be between 1 and 256, got 300"),
    ("v", [(2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 0)], "head dimension .* got 0"),
])
def test_bad_shapes_bhsd(name, shapes, message):
    q, k, v = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=f"^{name} .*{message}"):
        cf.attention(q, k, v)


@pytest.mark.parametrize("name, shapes, message", [
    ("q", [(2, 5, 4), (2, 6, 2, 8), (2, 6, 2, 8)], "4-D"),
    ("k", [(2, 5, 4, 8), (2, 2, 6, 8, 1), (2, 6, 2, 8)], "4-D"),
    ("v", [(2, 5, 4, 8), (2, 6, 2, 8), (6, 2, 8)], "4-D"),
    ("k", [(2, 5, 4, 8), (3, 6, 2, 8), (3, 6, 2, 8)], "batch"),
    ("q", [(2, 5, 3, 8), (2, 6, 2, 8), (2, 6, 2, 8)], "has 3 heads, not a multiple of k's 2"),
    ("v", [(2, 5, 4, 8), (2, 6, 2, 8), (2, 6, 4, 8)], "has 4 heads but k has 2"),
    ("v", [(2, 5, 4, 8), (2, 6, 2, 8), (2, 5, 2, 8)], "has 5 keys but k has 6"),
])
def test_bad_shapes_bshd(name, shapes, message):
    q, k, v = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=f"^{name} .*{message}"):
        cf.attention(q, k, v, layout="bshd")


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("step", [2, -1])
def test_non_contiguous_last_axis(rng, position, step):
    args = list(_qkv(rng))
    wide = np.repeat(args[position], 2, axis=-1)
    args[position] = wide[..., ::2] if step == 2 else args[position][..., ::-1]
    name = "qkv"[position]
    with pytest.raises(ValueError, match=f"^{name} must have a contiguous last axis"):
        cf.attention(*args)


def _float32_from_bytes(shape, strides, offset=0):
    """A float32 array over a byte buffer, with byte ``strides`` and start ``offset``:
    what CuPy and __cuda_array_interface__ arrays can describe too."""
    extent = 4 + sum((n - 1) * s for n, s in zip(shape, strides))  # bytes the view spans
    floats = np.zeros(offset + -(-extent // 4) * 4, np.uint8)[offset:].view(np.float32)
    return np.lib.stride_tricks.as_strided(floats, shape, strides)


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("strides", [(4 * 8 * 5 + 2, 4 * 8 * 5, 4 * 8, 4),  # batch stride
                                     (640, 160, 34, 4)])                    # row stride
def test_strides_not_multiples_of_the_item_size(rng, position, strides):
    args = list(_qkv(rng, (2, 2, 5, 8), (2, 2, 5, 8)))
    args[position] = _float32_from_bytes(args[position].shape, strides)
    name = "qkv"[position]
    with pytest.raises(ValueError, match=rf"^{name} must have strides that are multiples of its item size \(4 bytes\)"):
        cf.attention(*args)


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_start_address_not_aligned_to_the_item_size(rng, position, offset):
    args = list(_qkv(rng, (2, 2, 5, 8), (2, 2, 5, 8)))
    args[position] = _float32_from_bytes(args[position].shape, args[position].strides, offset)
    assert not args[position].flags.aligned
    name = "qkv"[position]
    with pytest.raises(ValueError, match=rf"^{name} must start at an address aligned to its item size \(4 bytes\)"):
        cf.attention(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("offset, strides, message", [
    (2, None, "start at an address aligned to its item size"),
    (0, (640, 160, 34, 4), "have strides that are multiples of its item size"),
])
def test_cupy_array_not_element_aligned(rng, offset, strides, message):
    import cupy

    q, k, v = (cupy.asarray(x) for x in _qkv(rng, (2, 2, 5, 8), (2, 2, 5, 8)))
    buffer = cupy.zeros(4096, cupy.uint8)
    odd = cupy.ndarray(k.shape, cupy.float32, memptr=buffer.data + offset, strides=strides or k.strides)
    with pytest.raises(ValueError, match=f"^k must {message}"):
        cf.attention(q, odd, v, backend="cuda")


def test_odd_strides_of_length_one_axes_are_accepted(rng):
    q, k, v = _qkv(rng, (1, 2, 5, 8), (1, 2, 5, 8))
    odd = [_float32_from_bytes(x.shape, (3, *x.strides[1:])) for x in (q, k, v)]
    for x, y in zip(odd, (q, k, v)):
        x[...] = y
    np.testing.assert_array_equal(cf.attention(*odd), cf.attention(q, k, v))


def test_size_one_last_axis_is_contiguous_whatever_its_stride(rng):
    q, k, v = _qkv(rng, (2, 4, 5, 1), (2, 2, 6, 1), (2, 2, 6, 1))
    strided = [np.repeat(x, 3, axis=-1)[..., :1] for x in (q, k, v)]
    np.testing.assert_array_equal(cf.attention(*strided), cf.attention(q, k, v))


# Options ------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_scale_not_finite(rng, scale):
    with pytest.raises(ValueError, match="^scale must be finite"):
        cf.attention(*_qkv(rng), scale=scale)


def test_scale_negative(rng):
    with pytest.raises(ValueError, match="^scale must be non-negative"):
        cf.attention(*_qkv(rng), scale=-0.5)


@pytest.mark.parametrize("scale", ["0.5", True, 1j, np.array([0.5]), [0.5]])
def test_scale_not_a_real_number(rng, scale):
    with pytest.raises(TypeError, match="^scale must be a real number"):
        cf.attention(*_qkv(rng), scale=scale)


@pytest.mark.parametrize("scale", [1.25e308, float(np.finfo(np.float64).max)])
def test_scale_overflowing_with_log2e(rng, scale):
    # The backends fold log2(e) into the scale; no accumulation dtype holds this product.
    with pytest.raises(ValueError, match="^scale must be at most about .* so that scale \\* log2\\(e\\) fits"):
        cf.attention(*_qkv(rng), scale=scale)


@pytest.mark.parametrize("dtype, accumulation", [(np.float16, np.float32), (ml_dtypes.bfloat16, np.float32),
                                                 (np.float32, np.float32), (np.float64, np.float64)])
def test_scale_limit_is_the_accumulation_dtype_max_over_log2e(dtype, accumulation):
    limit = float(np.finfo(accumulation).max) / math.log2(math.e)
    assert _validate.resolve_scale(0.999 * limit, 64, dtype) == 0.999 * limit
    message = (f"scale must be at most about {limit:.6g} for {np.dtype(dtype)} inputs, so that "
               f"scale * log2(e) fits in {np.dtype(accumulation)}, got")
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _validate.resolve_scale(1.001 * limit, 64, dtype)


def test_default_scale_is_one_over_sqrt_d():
    assert _validate.resolve_scale(None, 64, np.float16) == 0.125


@pytest.mark.parametrize("scale", [0, 2, np.float32(0.25), np.float64(0.0)])
def test_scale_accepts_real_numbers(rng, scale):
    cf.attention(*_qkv(rng), scale=scale)


@pytest.mark.parametrize("flag", ["causal", "deterministic", "return_lse"])
@pytest.mark.parametrize("value", [1, 0, "yes", None, np.array(True)])
def test_flags_must_be_bool(rng, flag, value):
    with pytest.raises(TypeError, match=f"^{flag} must be True or False"):
        cf.attention(*_qkv(rng), **{flag: value})


@pytest.mark.parametrize("function", [cf.attention_forward, cf.attention_vjp])
@pytest.mark.parametrize("flag", ["causal", "deterministic"])
def test_flags_must_be_bool_in_every_entry_point(rng, function, flag):
    with pytest.raises(TypeError, match=f"^{flag} must be True or False"):
        function(*_qkv(rng), **{flag: 1})


def test_numpy_bool_flags_are_accepted(rng):
    cf.attention(*_qkv(rng), causal=np.bool_(True), deterministic=np.bool_(False),
                 return_lse=np.bool_(False))


@pytest.mark.parametrize("option, value", [
    ("layout", "BHSD"), ("layout", "bsh"), ("backend", "gpu"), ("backend", "torch"),
])
def test_unknown_choice(rng, option, value):
    with pytest.raises(ValueError, match=f"^{option} must be one of"):
        cf.attention(*_qkv(rng), **{option: value})


@pytest.mark.parametrize("option, value", [
    ("layout", None), ("layout", 0), ("layout", b"bhsd"), ("backend", None), ("backend", ["cuda"]),
])
def test_choice_not_a_string(rng, option, value):
    with pytest.raises(TypeError, match=f"^{option} must be a string, one of"):
        cf.attention(*_qkv(rng), **{option: value})


@pytest.mark.parametrize("option, value, error, message", [
    ("window", 3, TypeError, "window must be None or a pair"),
    ("window", (1, 2, 3), TypeError, "window must be None or a pair"),
    ("window", (1.5, 2), TypeError, "window must be an integer"),
    ("window", (True, 2), TypeError, "window must be an integer"),
    ("dropout_p", "0.1", TypeError, "dropout_p must be a real number"),
    ("dropout_p", 1.0, ValueError, r"dropout_p must be in \[0, 1\)"),
    ("dropout_p", -0.1, ValueError, r"dropout_p must be in \[0, 1\)"),
    ("dropout_p", float("nan"), ValueError, "dropout_p must be finite"),
    # Dropout is drawn at 8-bit resolution: a p that rounds to no or to all dropout.
    ("dropout_p", 1e-3, ValueError, "dropout_p must be 0 or in \\[1/512, 1 - 1/512\\)"),
    ("dropout_p", 0.999, ValueError, "dropout_p must be 0 or .* at 8-bit resolution"),
    ("seed", 1.5, TypeError, "seed must be an integer"),
    ("seed", True, TypeError, "seed must be an integer"),
    ("seed", -1, ValueError, r"seed must be in \[0, 2\*\*64\)"),
    ("seed", 2**64, ValueError, r"seed must be in \[0, 2\*\*64\)"),
    ("block_mask", [[True]], TypeError, "block_mask must be None or an array"),
    ("bias", 0.5, TypeError, "bias must be None or an array"),
    ("alibi_slopes", (0.5, 0.25), TypeError, "alibi_slopes must be None or an array"),
    ("softcap", -1.0, ValueError, "softcap must be non-negative"),
    ("softcap", float("inf"), ValueError, "softcap must be finite"),
    ("softcap", "30", TypeError, "softcap must be a real number"),
])
def test_future_options_are_type_checked(rng, option, value, error, message):
    with pytest.raises(error, match=f"^{message}"):
        cf.attention(*_qkv(rng), **{option: value})


def test_bad_inputs_are_reported_before_unimplemented_options(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="^v has"):
        cf.attention(q, k, v[..., :3, :], window=(4, 0))


def test_bad_inputs_are_reported_before_backend_selection(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="^k has dtype"):
        cf.attention(q, k.astype(np.float64), v, backend="cuda")


# Backward -----------------------------------------------------------------------------


def _forward(rng):
    q, k, v = _qkv(rng)
    # The NumPy backend on every machine: some of these tests run the backward pass.
    o, ctx = cf.attention_forward(q, k, v, backend="numpy")
    return q, k, v, o, ctx


def test_do_not_an_array(rng):
    *_, o, ctx = _forward(rng)
    with pytest.raises(TypeError, match="^do must be an array"):
        cf.attention_backward(o.tolist(), ctx)


def test_do_wrong_shape(rng):
    *_, o, ctx = _forward(rng)
    with pytest.raises(ValueError, match=r"^do must have the shape of o, \(2, 4, 5, 8\), got \(2, 4, 5, 7\)"):
        cf.attention_backward(np.ones_like(o[..., :7]), ctx)


def test_do_wrong_shape_bshd(rng):
    q, k, v = (x.transpose(0, 2, 1, 3) for x in _qkv(rng))
    o, ctx = cf.attention_forward(q, k, v, layout="bshd")
    with pytest.raises(ValueError, match="^do must have the shape of o"):
        cf.attention_backward(np.ones_like(o).transpose(0, 2, 1, 3), ctx)


def test_do_wrong_dtype(rng):
    *_, o, ctx = _forward(rng)
    with pytest.raises(TypeError, match="^do must have the dtype of o, float32, got float64"):
        cf.attention_backward(np.ones(o.shape), ctx)


def test_do_wrong_array_kind(rng):
    *_, o, ctx = _forward(rng)
    with pytest.raises(TypeError, match="^do is a GPU array but the forward pass's q is a host"):
        cf.attention_backward(_FakeGpuArray(o.shape), ctx)


def test_do_non_contiguous_last_axis(rng):
    *_, o, ctx = _forward(rng)
    with pytest.raises(ValueError, match="^do must have a contiguous last axis"):
        cf.attention_backward(np.repeat(o, 2, axis=-1)[..., ::2], ctx)


def test_do_strides_not_multiples_of_the_item_size(rng):
    *_, o, ctx = _forward(rng)
    do = _float32_from_bytes(o.shape, (o.strides[0] + 2, *o.strides[1:]))
    with pytest.raises(ValueError, match=r"^do must have strides that are multiples of its item size"):
        cf.attention_backward(do, ctx)


def test_do_start_address_not_aligned(rng):
    *_, o, ctx = _forward(rng)
    do = _float32_from_bytes(o.shape, o.strides, offset=2)
    with pytest.raises(ValueError, match=r"^do must start at an address aligned to its item size"):
        cf.attention_backward(do, ctx)


@pytest.mark.parametrize("ctx", [None, {"q": 1}, (1, 2)])
def test_backward_needs_a_context(rng, ctx):
    with pytest.raises(TypeError, match="^ctx must be an AttentionContext"):
        cf.attention_backward(np.ones((2, 4, 5, 8), np.float32), ctx)


@pytest.mark.gpu
def test_do_on_another_gpu(rng):
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    o, ctx = cf.attention_forward(*(cupy.asarray(x) for x in _qkv(rng)))
    with cupy.cuda.Device(1):
        do = cupy.ones(o.shape, o.dtype)
    with pytest.raises(ValueError, match="^do is on GPU 1 but the forward pass's q is on GPU 0"):
        cf.attention_backward(do, ctx)


# A context whose saved arrays changed -------------------------------------------------


def test_context_is_read_only(rng):
    *_, ctx = _forward(rng)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.causal = True
    for name in ("q", "k", "v", "o", "lse"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(ctx, name)[...] = 0


@pytest.mark.parametrize("name", ["q", "k", "v", "o", "lse"])
def test_context_array_replaced(rng, name):
    *_, ctx = _forward(rng)
    replacement = np.array(getattr(ctx, name))  # same values, other memory
    object.__setattr__(ctx, name, replacement)  # what a frozen dataclass lets through
    with pytest.raises(ValueError, match=f"^ctx.{name} was replaced or reshaped"):
        cf.attention_backward(np.ones((2, 4, 5, 8), np.float32), ctx)


@pytest.mark.parametrize("name", ["q", "k", "v", "o", "lse"])
def test_context_array_reshaped_in_place(rng, name):
    *_, ctx = _forward(rng)
    saved = getattr(ctx, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # NumPy >= 2.5 deprecates this
        saved.shape = (saved.size,)
    with pytest.raises(ValueError, match=f"^ctx.{name} was replaced or reshaped"):
        cf.attention_backward(np.ones((2, 4, 5, 8), np.float32), ctx)


@pytest.mark.parametrize("name", ["q", "k", "v", "o"])
def test_numpy_array_modified_in_place(rng, name):
    q, k, v, o, ctx = _forward(rng)
    {"q": q, "k": k, "v": v, "o": o}[name][0, 0, 0, 0] += 1
    with pytest.raises(ValueError, match=f"^{name} \\(saved in ctx.{name}\\) was modified in place"):
        cf.attention_backward(np.ones_like(o), ctx)


def test_numpy_array_rewritten_with_same_values_is_fine(rng):
    q, k, v, o, ctx = _forward(rng)
    q[...] = q.copy()
    o[...] = o.copy()
    cf.attention_backward(np.ones_like(o), ctx)
