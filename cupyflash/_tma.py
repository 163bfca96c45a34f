"""Tensor maps for Hopper's tensor memory accelerator (kernels_cu/tma.cuh).

A tensor map is the 128-byte descriptor through which a TMA copy reads a box of a
tensor. The driver encodes it (``cuTensorMapEncodeTiled``); CuPy does not wrap that call,
so it is made here through ctypes on the driver library that CuPy itself runs on (no
further dependency). The kernels take the map by value as a ``__grid_constant__``
parameter; CuPy passes a NumPy void scalar of its bytes as such a struct.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import _arrays

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h).
_DATA_TYPE = {"float16": 6, "float32": 7, "bfloat16": 9}
_SWIZZLE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_INTERLEAVE_NONE = 0
_OOB_FILL_ZEROS = 0
MAP_BYTES = 128
SWIZZLE_BYTES = 128   # a box row spans the swizzle: 64 columns of 16-bit elements, 32 of fp32
# The copy engine's limits (CUDA driver API, cuTensorMapEncodeTiled): 16-byte aligned
# base and strides (arrays.rows_16b_aligned) below 2^40 bytes, boxes of at most 256
# elements per axis.
_MAX_STRIDE = 1 << 40
MAX_BOX = 256

_MAP_DTYPE = np.dtype((np.void, MAP_BYTES))


@functools.lru_cache(maxsize=None)
def _encoder():
    """cuTensorMapEncodeTiled from the driver library, or None where there is none."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def describable(x) -> bool:
    """Whether a (B, H, N, d) view of fp16, bf16 or fp32 elements can be read through a tensor map:
    base and every stride of an axis longer than one 16-byte aligned (the last axis is
    contiguous), strides below the engine's limit."""
    if x.dtype.name not in _DATA_TYPE or not _arrays.rows_16b_aligned(x):
        return False
    return all(n == 1 or 0 < st < _MAX_STRIDE for n, st in zip(x.shape[:3], x.strides[:3]))


def tensor_map(x, box_rows: int):
    """The tensor map of a (B, H, N, d) view for boxes of ``box_rows`` rows and one
    swizzle span of columns, with the 128-byte swizzle (kernels_cu/wgmma.cuh Swizzle128's
    panels), as a NumPy void scalar to pass as a kernel argument; None where the driver
    refuses it (or `describable` says no)."""
    spec = map_spec(x, box_rows)
    return None if spec is None else encode(x.data.ptr, spec)   # cached by map_spec


def map_spec(x, box_rows: int):
    """What a tensor map of ``x`` depends on besides its address (dtype, shape, strides,
    box), or None where `describable` says no or the driver refuses ``x``'s map: the same
    spec serves any view of the same layout whose base is 16-byte aligned (a launch plan
    keeps it, `encode` makes the map; ``x``'s own is cached)."""
    if not describable(x) or box_rows > MAX_BOX:
        return None
    spec = x.dtype.name, tuple(x.shape), tuple(x.strides), box_rows, SWIZZLE_BYTES // x.dtype.itemsize
    return None if encode(x.data.ptr, spec) is None else spec


def rows_map(rows, box: int):
    """The tensor map of the backward's row workspaces, one contiguous (2, B, Hq, nq_pad)
    fp32 array (lse2 then delta, kernels_cu/bwd.cuh), for boxes of ``box`` rows of one head
    and batch entry, without swizzle (bwd_sm90.cu loads a query tile's rows with its stage;
    a box must start 16-byte aligned, so the kernel starts it at the tile's first row
    rounded down to a multiple of 4: under varlen a sequence starts at any row); None
    where the driver refuses it."""
    return _encode(rows.data.ptr, rows.dtype.name, tuple(rows.shape), tuple(rows.strides), 1, box, _SWIZZLE_NONE)


def encode(ptr: int, spec):
    """The tensor map of the view at device address ``ptr`` with `map_spec` ``spec``;
    None where the driver refuses it."""
    return _encode(ptr, *spec)


# A map is a function of these arguments alone, and encoding one through ctypes costs tens
# of microseconds (H100 host: ~40 us, a third of a forward call's host time): calls that
# reuse buffers, as a training loop's do through CuPy's memory pool, reuse their maps.
@functools.lru_cache(maxsize=256)
def _encode(ptr: int, dtype_name: str, shape: tuple, strides: tuple, box_rows: int, box_cols: int,
            swizzle: int = _SWIZZLE_128B):
    encode = _encoder()
    if encode is None:
        return None
    B, H, N, d = shape
    # Axes innermost first: column, row, head, batch. An axis of extent 1 is never
    # stepped along, so any valid stride serves for it.
    steps_bytes = [st if n > 1 else 16 for n, st in zip((N, H, B), (strides[2], strides[1], strides[0]))]
    dims = (ctypes.c_uint64 * 4)(d, N, H, B)
    byte_strides = (ctypes.c_uint64 * 3)(*steps_bytes)
    box = (ctypes.c_uint32 * 4)(box_cols, box_rows, 1, 1)
    element_steps = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    # The driver writes the map to a 64-byte aligned address.
    buf = np.zeros(MAP_BYTES + 64, np.uint8)
    start = -buf.ctypes.data % 64
    out = buf[start:start + MAP_BYTES].view(_MAP_DTYPE)
    status = encode(out.ctypes.data, _DATA_TYPE[dtype_name], 4, ctypes.c_void_p(ptr), dims, byte_strides, box,
                    element_steps, _INTERLEAVE_NONE, swizzle, _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    return None if status != 0 else out[0]
