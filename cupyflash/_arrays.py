"""Array namespaces and layouts: NumPy on the host, CuPy on a GPU, foreign arrays adopted.

Everything that depends on which library holds an array lives here, so that the checks and
the API stay free of ``if numpy ... else cupy``. CuPy is imported only when a GPU array or
the GPU backend shows up: the NumPy backend works, and imports fast, without it.

The layout helpers turn the user's arrays into the (B, H, N, d) views that both backends
take, and back; they copy only where no view exists (see ``bhsd_view``).
"""

import contextlib
import functools
import importlib
import math
import sys
import zlib

import ml_dtypes
import numpy as np

HOST = "numpy"
DEVICE = "cupy"

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))

# DLPack device types (dlpack.h): where a foreign array's memory lives.
_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13


def accumulation_dtype(dtype):
    """The dtype the backends compute in, which is also the LSE dtype: fp64 for fp64, else fp32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@functools.cache
def cupy_module():
    """The cupy module, or None where it is not installed (imported on first need only)."""
    try:
        return importlib.import_module("cupy")
    except ImportError:
        return None


def _loaded_cupy():
    # An object can only be a cupy.ndarray if cupy was imported already; looking in
    # sys.modules keeps NumPy-only callers from paying for the cupy import.
    return sys.modules.get("cupy")


def _dlpack_device_type(x):
    try:
        return int(x.__dlpack_device__()[0])
    except Exception:  # a foreign object's protocol method may fail in any way
        return None


def kind_of(x):
    """HOST for host arrays, DEVICE for GPU arrays (CuPy or foreign), None for non-arrays.

    Foreign objects are classified without being converted, so that mixed inputs are
    reported before anything touches the GPU.
    """
    if isinstance(x, np.ndarray):
        return HOST
    cp = _loaded_cupy()
    if cp is not None and isinstance(x, cp.ndarray):
        return DEVICE
    if hasattr(x, "__cuda_array_interface__"):
        return DEVICE
    if hasattr(x, "__dlpack__"):
        device_type = _dlpack_device_type(x)
        if device_type == _DLPACK_CPU:
            return HOST
        if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            return DEVICE
    return None


def adopt(x, name):
    """``x`` as a numpy.ndarray or cupy.ndarray sharing its memory (``kind_of(x)`` not None)."""
    if isinstance(x, np.ndarray):
        return x
    cp = _loaded_cupy()
    if cp is not None and isinstance(x, cp.ndarray):
        return x
    if kind_of(x) == HOST:
        return np.from_dlpack(x)
    cp = cupy_module()
    if cp is None:
        raise TypeError(
            f"{name} is a GPU array ({type(x).__module__}.{type(x).__qualname__}) but cupy is "
            "not installed; install cupyflash[cuda12] or cupyflash[cuda13]"
        )
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)
    return cp.from_dlpack(x)


def device_of(x):
    """The CUDA device id of a cupy array, None for a numpy array."""
    return None if isinstance(x, np.ndarray) else x.device.id


def current_device():
    """CuPy's current CUDA device id (where host arrays go for the GPU backend)."""
    return cupy_module().cuda.runtime.getDevice()


def on_device(device):
    """Context manager making ``device`` current; nothing for host work (device None)."""
    if device is None:
        return contextlib.nullcontext()
    return cupy_module().cuda.Device(device)


def namespace(kind):
    return np if kind == HOST else cupy_module()


def empty(shape, dtype, kind):
    """A new C-contiguous array on the host or, for DEVICE, on the current device."""
    return namespace(kind).empty(shape, dtype=dtype)


def move(x, kind, device):
    """``x`` itself when it already is of ``kind``, else a copy on the host or on ``device``."""
    if kind_of(x) == kind:
        return x
    cp = cupy_module()
    if kind == HOST:
        return cp.asnumpy(x)
    with cp.cuda.Device(device):
        return cp.asarray(x)


def device_copy_of_index(x, device):
    """A GPU copy of a small host int32 index array (cu_seqlens, seqlens_k), shared by
    every call with the same contents: the kernels only read it. The copy is queued on
    the stream current at the first call; a later call on any stream waits for it."""
    copy, ready = _index_copies(np.ascontiguousarray(x, np.int32).tobytes(), int(device))
    cupy_module().cuda.get_current_stream().wait_event(ready)
    return copy


@functools.lru_cache(maxsize=64)
def _index_copies(data: bytes, device: int):
    cp = cupy_module()
    with cp.cuda.Device(device):
        copy = cp.asarray(np.frombuffer(data, np.int32))
        ready = cp.cuda.Event(disable_timing=True)
        ready.record()
    return copy, ready


def read_only(x):
    """A read-only view of a host array (a context must not be a way to write the inputs);
    GPU arrays have no such flag and come back as they are."""
    if not isinstance(x, np.ndarray):
        return x
    view = x.view()
    view.flags.writeable = False
    return view


def has_contiguous_last_axis(x):
    # Strides of a length-1 axis, or of an empty array (NumPy makes them 0), address nothing.
    return x.shape[-1] == 1 or x.size == 0 or x.strides[-1] == x.dtype.itemsize


def rows_16b_aligned(*arrays):
    """Every row start of these (B, H, N, d) device views 16-byte aligned: the base and
    the strides of the axes longer than one (so tiles may move in 16-byte copies, or
    through TMA tensor maps)."""
    for x in arrays:
        if x.data.ptr % 16:
            return False
        for extent, stride in zip(x.shape[:3], x.strides[:3]):
            if extent > 1 and stride % 16:
                return False
    return True


def data_pointer(x):
    """The address of a numpy or cupy array's first element."""
    return x.__array_interface__["data"][0] if isinstance(x, np.ndarray) else x.data.ptr


def signature(x):
    """What identifies an array object's view of memory: replacing or reshaping it changes this."""
    return (type(x), x.shape, x.strides, x.dtype, data_pointer(x))


def fingerprint(x):
    """Checksum of a host array's contents (one pass over its bytes, O(size))."""
    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


# Below this many bytes in all, fingerprints are taken on the calling thread: handing
# them to the pool costs more than it saves.
_PARALLEL_FINGERPRINT_BYTES = 2 << 20


def fingerprints(arrays: dict) -> dict:
    """`fingerprint` of each named host array, on the NumPy backend's threads when they
    are large (zlib releases the GIL while it checksums): a call's inputs are checksummed
    before its forward and again before its backward, ~3 GB/s on one core."""
    if sum(x.nbytes for x in arrays.values()) < _PARALLEL_FINGERPRINT_BYTES:
        return {name: fingerprint(x) for name, x in arrays.items()}
    from . import _cpu_threads

    names = list(arrays)
    sums = [None] * len(names)

    def take(i):
        sums[i] = fingerprint(arrays[names[i]])

    _cpu_threads.run([functools.partial(take, i) for i in range(len(names))])
    return dict(zip(names, sums))


# Layouts ---------------------------------------------------------------------------------
#
# "bhsd": (..., H, N, d) with any leading dims; a 2-D (N, d) array is a single head.
# "bshd": (B, N, H, d).
# The backends take (B, H, N, d) views; the LSE is (..., H, Nq) for "bhsd" and (B, H, Nq)
# for "bshd", so that its axes always read batch, head, query.


def flat_view(flat, shape):
    """A C-contiguous view of ``shape`` at the start of a flat scratch buffer (one buffer
    serves chunks and calls of every size up to its own)."""
    return flat[:math.prod(shape)].reshape(shape)


def split_shape(shape, layout):
    """(leading dims, H, N, d) of a q/k/v/o shape whose rank was checked for ``layout``."""
    if layout == "bshd":
        batch, n, heads, d = shape
        return (batch,), heads, n, d
    if len(shape) == 2:
        return (), 1, shape[0], shape[1]
    return tuple(shape[:-3]), shape[-3], shape[-2], shape[-1]


def lse_shape(q_shape, layout):
    if layout == "bhsd":
        return tuple(q_shape[:-1])
    batch, n, heads, _ = q_shape
    return (batch, heads, n)


def _merge_leading(x, count):
    """View of ``x`` with its first ``count`` axes merged into one, or None where the
    strides make that impossible without a copy."""
    if count == 1:   # nothing to merge (the common (B, H, N, d) case): no new view
        return x
    shape, strides = x.shape[:count], x.strides[:count]
    # Axes of length 1 take no part in addressing, whatever their stride.
    used = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if any(outer_s != inner_n * inner_s for (_, outer_s), (inner_n, inner_s) in zip(used, used[1:])):
        return None
    stride = used[-1][1] if used else 0
    as_strided = namespace(kind_of(x)).lib.stride_tricks.as_strided
    return as_strided(x, (math.prod(shape), *x.shape[count:]), (stride, *x.strides[count:]))


def _batched(x, core_ndim):
    """(B, *core) view of an array whose last ``core_ndim`` axes are the per-batch core, the
    first of them (the head axis) optional; leading axes merge into B."""
    if x.ndim < core_ndim:
        return x[None, None]
    if x.ndim == core_ndim:
        return x[None]
    return merge_batch(x, core_ndim)


def merge_batch(x, core_ndim):
    """(B, *core) view of an array with one or more leading axes before its last
    ``core_ndim`` axes, merged into B; a contiguous copy where no view exists."""
    merged = _merge_leading(x, x.ndim - core_ndim)
    if merged is None:
        # Leading axes that no single stride describes (e.g. x[:, :3] of a (4, 6, ...)
        # array): for q, k, v the one case where the backends get a copy of a user's array.
        merged = _merge_leading(namespace(kind_of(x)).ascontiguousarray(x), x.ndim - core_ndim)
    return merged


def bhsd_view(x, layout):
    """(B, H, N, d) view of a q/k/v/o-shaped array in ``layout``.

    A copy only for "bhsd" arrays whose leading axes cannot be merged into one batch axis.
    """
    if layout == "bshd":
        return x.transpose(0, 2, 1, 3)
    return _batched(x, 3)


def lse_bhs_view(lse, layout):
    """(B, H, Nq) view of an LSE array of shape ``lse_shape(q.shape, layout)``."""
    return lse if layout == "bshd" else _batched(lse, 2)
