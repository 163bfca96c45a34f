"""CPU tier: which arrays the Hopper forward can read through TMA tensor maps
(cupyflash/_tma.py). Arrays it cannot describe take the sm80 kernels, so a wrong answer
here is either a launch the copy engine rejects or a fast path thrown away."""

import types

import ml_dtypes
import numpy as np
import pytest

from cupyflash import _tma


def _view(shape, dtype=ml_dtypes.bfloat16, strides=None, ptr=1 << 20):
    """An object with what _tma reads of a CuPy (B, H, N, d) view: dtype, shape, byte
    strides and the data pointer."""
    dtype = np.dtype(dtype)
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(4))
    return types.SimpleNamespace(dtype=dtype, shape=shape, strides=strides, data=types.SimpleNamespace(ptr=ptr))


def test_contiguous_16bit_views_are_describable():
    assert _tma.describable(_view((2, 4, 1000, 64)))
    assert _tma.describable(_view((2, 4, 1000, 72), np.float16))   # 144-byte rows


def test_transformer_layout_is_describable():
    # (B, N, H, d) storage seen as (B, H, N, d): the head stride is below the row stride.
    B, N, H, d = 2, 300, 8, 128
    item = 2
    assert _tma.describable(_view((B, H, N, d), strides=(N * H * d * item, d * item, H * d * item, item)))


@pytest.mark.parametrize("why, view", [
    ("rows of 76 halves are 152 bytes", _view((1, 2, 10, 76), np.float16)),
    ("base not 16-byte aligned", _view((1, 2, 10, 64), ptr=(1 << 20) + 8)),
    ("no fp64 tensor maps in the kernels", _view((1, 2, 10, 64), np.float64)),
    ("a broadcast (stride 0) head axis", _view((1, 2, 10, 64), strides=(2560, 0, 128, 2))),
])
def test_views_the_copy_engine_cannot_read(why, view):
    assert not _tma.describable(view), why
    assert _tma.tensor_map(view, 64) is None


def test_fp32_rows_are_describable():
    # The fp32 forward on TF32 wgmma reads its tiles through tensor maps: 32 columns a box.
    assert _tma.describable(_view((1, 2, 10, 64), np.float32))
    assert not _tma.describable(_view((1, 2, 10, 70), np.float32)), "rows of 280 bytes"


def test_axes_of_extent_one_may_have_any_stride():
    assert _tma.describable(_view((1, 1, 10, 64), strides=(6, 10, 128, 2)))


def test_boxes_span_the_128_byte_swizzle_and_at_most_256_rows(monkeypatch):
    x = _view((1, 2, 10, 64))
    asked = []
    monkeypatch.setattr(_tma, "_encode", lambda *args: asked.append(args))
    _tma.tensor_map(x, 128)
    assert asked[0][-2:] == (128, 64)   # 64 columns of 2 bytes
    assert _tma.tensor_map(x, 512) is None


def test_no_driver_means_no_map(monkeypatch):
    monkeypatch.setattr(_tma, "_encoder", lambda: None)
    _tma._encode.cache_clear()
    assert _tma.tensor_map(_view((1, 2, 10, 64)), 64) is None
    _tma._encode.cache_clear()
