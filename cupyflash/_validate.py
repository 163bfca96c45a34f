"""Every argument check of the public API, made before any memory is allocated or kernel launched.

A failure raises TypeError (wrong kind of object or dtype) or ValueError (right kind, wrong
value or shape) with a message that starts with the argument's name and says what was
expected. Nothing here needs a GPU: foreign GPU arrays are classified before they are
adopted, so mixed host/device inputs are reported without touching a device.
"""

import math
import numbers
from dataclasses import dataclass

import numpy as np

# Dropout draws one byte per score (cupyflash/_philox.py): p resolves to multiples of 1/256.
DROPOUT_LEVELS = 256

from . import _arrays

MAX_HEAD_DIM = 256
LAYOUTS = ("bhsd", "bshd")
BACKENDS = ("auto", "cuda", "numpy")
PRECISIONS = ("highest", "tf32")

_ARRAY_TYPES = "a numpy.ndarray, a cupy.ndarray, or an object with __cuda_array_interface__ or __dlpack__"
_DTYPE_NAMES = ", ".join(dt.name for dt in _arrays.SUPPORTED_DTYPES)
_LOG2E = math.log2(math.e)
_WHERE = {_arrays.HOST: "host (NumPy)", _arrays.DEVICE: "GPU"}


@dataclass(frozen=True)
class Options:
    """The keyword options of one call, checked; ``scale`` None means 1/sqrt(d)."""

    causal: bool
    scale: float | None
    window: tuple | None
    dropout_p: float
    seed: int | None
    block_mask: object
    bias: object
    alibi_slopes: object
    softcap: float
    layout: str
    deterministic: bool
    backend: str
    block_size: tuple = (128, 128)
    seqlens_k: object = None
    device_memory_limit: int | None = None
    progress: object = None
    precision: str = "highest"


@dataclass(frozen=True)
class Problem:
    """What the API needs to know of one attention problem to place and allocate it."""

    kind: str  # _arrays.HOST or _arrays.DEVICE
    device: int | None  # CUDA device of GPU inputs
    dtype: np.dtype
    batch: int  # B: the leading dims merged, 0 for an empty batch
    head_dim: int
    value_dim: int
    lead: tuple = ()  # q's batch (leading) dims
    heads: int = 1  # Hq
    q_len: int = 1  # Nq
    k_len: int = 1  # Nk


def check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def _check_choice(value, name, choices):
    listed = ", ".join(map(repr, choices))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, one of {listed}, got {value!r} ({type(value).__name__})")
    if value not in choices:
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


def _check_real(value, name):
    # bool is a numbers.Real, but True as a probability or scale is a bug, not a number.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_int(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_int_in(value, name, lo, hi=None, *, hi_text=None):
    """An integer in [lo, hi) (or >= lo without hi), else TypeError/ValueError naming it."""
    value = _check_int(value, name)
    if hi is None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and not lo <= value < hi:
        raise ValueError(f"{name} must be in [{lo}, {hi_text or hi}), got {value}")
    return value


def _check_optional_array(value, name):
    if value is not None and _arrays.kind_of(value) is None:
        raise TypeError(f"{name} must be None or an array ({_ARRAY_TYPES}), got {type(value).__name__}")
    return value


_MAX_WINDOW = 2**31 - 1


def _check_window(window):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of integers, got {window!r}")
    left, right = (_check_int(w, "window") for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= 0, or -1 for unbounded, got {(left, right)}")
    if max(left, right) > _MAX_WINDOW:
        # The kernels take the sides as int32; a side as long as the sequence already
        # sees all of it, so no valid call needs more.
        raise ValueError(f"window sides must be at most 2**31 - 1 (-1 for unbounded), "
                         f"got {(left, right)}")
    return left, right


def _check_block_size(block_size):
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(pair) != 2:
        raise TypeError(f"block_size must be an integer or a pair of integers, got {block_size!r}")
    pair = tuple(_check_int(b, "block_size") for b in pair)
    if any(b < 16 or b % 16 for b in pair):
        raise ValueError(f"block_size must be multiples of 16, at least 16, got {block_size!r}")
    return pair


def check_dropout_p(p, name: str) -> float:
    """A dropout probability: 0, or one that rounds to 1 .. 255 of the draw's 256 levels
    (cupyflash/_philox.py draws it at 8-bit resolution)."""
    p = _check_real(p, name)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p!r}")
    if p > 0 and not 1 <= round(p * DROPOUT_LEVELS) < DROPOUT_LEVELS:
        raise ValueError(f"{name} must be 0 or in [1/512, 1 - 1/512): dropout is drawn at 8-bit "
                         f"resolution (rounded to a multiple of 1/256), got {p!r}")
    return p


def check_device_memory_limit(limit):
    """None, or a positive number of bytes."""
    if limit is None:
        return None
    limit = _check_int(limit, "device_memory_limit")
    if limit < 1:
        raise ValueError(f"device_memory_limit must be a positive number of bytes (or None), got {limit}")
    return limit


def check_progress(progress):
    """None, a callable ``progress(done, total)``, or "tqdm" where tqdm is installed."""
    if progress is None or callable(progress):
        return progress
    if isinstance(progress, str) and progress == "tqdm":
        import importlib.util
        if importlib.util.find_spec("tqdm") is None:
            raise ImportError("progress='tqdm' needs the tqdm package, which is not installed "
                              "(pip install tqdm); or pass a callable progress(done, total)")
        return progress
    raise TypeError(f"progress must be None, a callable progress(done, total) or 'tqdm', "
                    f"got {progress!r} ({type(progress).__name__})")


def check_options(*, causal, scale, window, dropout_p, seed, block_mask, bias, alibi_slopes,
                  softcap, layout, deterministic, backend, block_size=128, seqlens_k=None,
                  device_memory_limit=None, progress=None, precision="highest"):
    """The keyword options, type- and range-checked (scale without its default yet); the
    arrays only for being arrays: `check_modifiers` checks them against the inputs."""
    if scale is not None:
        scale = _check_real(scale, "scale")
        if scale < 0:
            raise ValueError(f"scale must be non-negative, got {scale!r}")
    dropout_p = check_dropout_p(dropout_p, "dropout_p")
    if seed is not None:
        seed = _check_int_in(seed, "seed", 0, 2**64, hi_text="2**64")
    softcap = _check_real(softcap, "softcap")
    if softcap < 0:
        raise ValueError(f"softcap must be non-negative (0 turns it off), got {softcap!r}")
    return Options(
        causal=check_flag(causal, "causal"),
        scale=scale,
        window=_check_window(window),
        dropout_p=dropout_p,
        seed=seed,
        block_mask=_check_optional_array(block_mask, "block_mask"),
        bias=_check_optional_array(bias, "bias"),
        alibi_slopes=_check_optional_array(alibi_slopes, "alibi_slopes"),
        softcap=softcap,
        layout=_check_choice(layout, "layout", LAYOUTS),
        deterministic=check_flag(deterministic, "deterministic"),
        backend=_check_choice(backend, "backend", BACKENDS),
        block_size=_check_block_size(block_size),
        seqlens_k=_check_optional_array(seqlens_k, "seqlens_k"),
        device_memory_limit=check_device_memory_limit(device_memory_limit),
        progress=check_progress(progress),
        precision=_check_choice(precision, "precision", PRECISIONS),
    )


def resolve_scale(scale, head_dim, dtype=np.float64):
    """The scale to use: ``scale``, or 1/sqrt(head_dim) for None.

    The backends fold log2(e) into the scale in the accumulation dtype of ``dtype`` inputs,
    so a scale whose ``scale * log2(e)`` overflows there raises ValueError. The default
    float64 checks only against the widest accumulation dtype.
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    accumulation = _arrays.accumulation_dtype(dtype)
    with np.errstate(over="ignore"):  # the overflow is what is checked for
        folded = accumulation.type(scale * _LOG2E)
    if not math.isfinite(folded):
        limit = float(np.finfo(accumulation).max) / _LOG2E
        raise ValueError(
            f"scale must be at most about {limit:.6g} for {np.dtype(dtype)} inputs, so that "
            f"scale * log2(e) fits in {accumulation}, got {scale!r}"
        )
    return scale


def _adopt_same_kind(named, kind, reference):
    """Adopt each (name, x) as a numpy/cupy array after checking it is an array of ``kind``.

    ``reference`` names what fixed ``kind`` (e.g. "q"), for the mixed-placement message.
    """
    # Every object is classified before any is adopted: adopting a GPU array imports cupy
    # and may touch the device, which a call mixing host and GPU arrays must not get to.
    for name, x in named:
        x_kind = _arrays.kind_of(x)
        if x_kind is None:
            raise TypeError(f"{name} must be an array ({_ARRAY_TYPES}), got {type(x).__name__}")
        if x_kind != kind:
            raise TypeError(
                f"{name} is a {_WHERE[x_kind]} array but {reference} is a {_WHERE[kind]} array; "
                "arrays of one call must all be on the host or all on the GPU"
            )
    return [_arrays.adopt(x, name) for name, x in named]


def _check_device(name, x, device, reference):
    if _arrays.device_of(x) != device:
        raise ValueError(
            f"{name} is on GPU {_arrays.device_of(x)} but {reference} is on GPU {device}; "
            "arrays of one call must be on one device"
        )


def _check_contiguous_last_axis(name, x):
    if not _arrays.has_contiguous_last_axis(x):
        raise ValueError(
            f"{name} must have a contiguous last axis (stride {x.dtype.itemsize} bytes), got "
            f"strides {x.strides}; pass ascontiguousarray({name}) instead"
        )


def _check_element_aligned(name, x):
    # The backends address elements through typed pointers and element strides, so a
    # stride or a start address that is no multiple of the item size cannot be passed on.
    # NumPy calls such arrays unaligned; CuPy views and __cuda_array_interface__ arrays can
    # be so too. Strides of length-1 axes, and of empty arrays, address nothing.
    if x.size == 0:
        return
    item = x.dtype.itemsize
    if any(s % item for n, s in zip(x.shape, x.strides) if n != 1):
        raise ValueError(
            f"{name} must have strides that are multiples of its item size ({item} bytes), got "
            f"strides {x.strides}; pass {name}.copy() instead"
        )
    if _arrays.data_pointer(x) % item:
        raise ValueError(
            f"{name} must start at an address aligned to its item size ({item} bytes), got "
            f"address {_arrays.data_pointer(x):#x}; pass {name}.copy() instead"
        )


def check_inputs(q, k, v, *, layout):
    """q, k, v adopted as numpy/cupy arrays (never copied), and the Problem they describe."""
    kind = _arrays.kind_of(q)
    q, k, v = _adopt_same_kind([("q", q), ("k", k), ("v", v)], kind, "q")
    named = [("q", q), ("k", k), ("v", v)]
    device = _arrays.device_of(q)
    for name, x in named[1:]:
        _check_device(name, x, device, "q")

    if q.dtype not in _arrays.SUPPORTED_DTYPES:
        raise TypeError(f"q must have dtype {_DTYPE_NAMES}, got {q.dtype}")
    for name, x in named[1:]:
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; q, k and v must share one dtype")

    for name, x in named:
        if layout == "bshd" and x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, N, H, d) for layout='bshd', got shape {x.shape}")
        if x.ndim < 2:
            raise ValueError(f"{name} must be at least 2-D (..., N, d) for layout='bhsd', got shape {x.shape}")
    for name, x in named[1:]:
        if x.ndim != q.ndim:
            raise ValueError(f"{name} must have as many dimensions as q ({q.ndim}), got shape {x.shape}")

    (q_lead, q_heads, q_len, head_dim), (k_lead, k_heads, k_len, k_dim), (v_lead, v_heads, v_len, value_dim) = (
        _arrays.split_shape(x.shape, layout) for _, x in named
    )
    for name, lead in (("k", k_lead), ("v", v_lead)):
        if lead != q_lead:
            raise ValueError(f"{name} has batch (leading) dimensions {lead} but q has {q_lead}")
    for name, heads in (("q", q_heads), ("k", k_heads), ("v", v_heads)):
        if heads < 1:
            raise ValueError(f"{name} must have at least one head, got shape {dict(named)[name].shape}")
    if v_heads != k_heads:
        raise ValueError(f"v has {v_heads} heads but k has {k_heads}; k and v must have the same heads")
    if q_heads % k_heads:
        raise ValueError(
            f"q has {q_heads} heads, not a multiple of k's {k_heads} heads; grouped-query "
            "attention needs the k/v head count to divide the q head count"
        )
    if q_len < 1:
        raise ValueError(f"q must have at least one query (Nq >= 1), got shape {q.shape}")
    if k_len < 1:
        raise ValueError(f"k must have at least one key (Nk >= 1), got shape {k.shape}")
    if v_len != k_len:
        raise ValueError(f"v has {v_len} keys but k has {k_len}; k and v must have the same N")
    if k_dim != head_dim:
        raise ValueError(f"k has head dimension {k_dim} but q has {head_dim}; they must match")
    for name, dim in (("q", head_dim), ("v", value_dim)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} head dimension must be between 1 and {MAX_HEAD_DIM}, got {dim}")
    for name, x in named:
        _check_contiguous_last_axis(name, x)
        _check_element_aligned(name, x)

    problem = Problem(kind=kind, device=device, dtype=q.dtype, batch=math.prod(q_lead),
                      head_dim=head_dim, value_dim=value_dim, lead=tuple(q_lead),
                      heads=q_heads, q_len=q_len, k_len=k_len)
    return q, k, v, problem


def _check_broadcastable(name, x, target, described):
    shape = tuple(x.shape)
    padded = (1,) * (len(target) - len(shape)) + shape
    if len(shape) > len(target) or any(n not in (1, t) for n, t in zip(padded, target)):
        raise ValueError(f"{name} must be broadcastable to {described} = {tuple(target)}, got shape {shape}")


def _check_dtype_kind(name, x, kinds, expected):
    if x.dtype.kind not in kinds:
        raise TypeError(f"{name} must be {expected}, got dtype {x.dtype}")


def _host_copy(x):
    """A small array's values on the host, to check them (a copy, and for GPU arrays a
    synchronisation: used only for index arrays of B or S + 1 entries)."""
    return _arrays.move(x, _arrays.HOST, None)


def _adopt_anywhere(name, x):
    # Small modifier arrays may live on either side; the API moves them to the backend.
    return None if x is None else _arrays.adopt(x, name)


def check_modifiers(options, problem, *, sequences=None):
    """The option arrays adopted and checked against the inputs' shapes, as a dict.

    ``bias`` must be on q's side (it is as large as the scores and is not copied across);
    ``block_mask``, ``alibi_slopes`` and ``seqlens_k`` may be host or GPU arrays, and
    ``seqlens_k`` comes back as a host copy, checked. Varlen calls have no bias, block
    mask or key padding; their batch entries are the ``sequences`` packed sequences.
    """
    lead, hq, nq, nk = problem.lead, problem.heads, problem.q_len, problem.k_len
    if options.precision == "tf32" and problem.dtype != np.float32:
        raise ValueError(f"precision='tf32' applies to float32 inputs; q, k and v are {problem.dtype}")
    if sequences is not None:
        lead = (sequences,)
        for name in ("block_mask", "bias", "seqlens_k"):
            if getattr(options, name) is not None:
                raise ValueError(f"{name} does not combine with varlen attention (cu_seqlens)")
    out = {}
    if options.bias is not None:
        (bias,) = _adopt_same_kind([("bias", options.bias)], problem.kind, "q")
        if problem.kind == _arrays.DEVICE:
            _check_device("bias", bias, problem.device, "q")
        if bias.dtype != problem.dtype:
            raise TypeError(f"bias must have the dtype of q, {problem.dtype}, got {bias.dtype}")
        _check_broadcastable("bias", bias, (*lead, hq, nq, nk), "q's batch dims + (Hq, Nq, Nk)")
        out["bias"] = bias
    if options.block_mask is not None:
        mask = _adopt_anywhere("block_mask", options.block_mask)
        _check_dtype_kind("block_mask", mask, "biu", "a bool or integer array")
        bq, bk = options.block_size
        _check_broadcastable("block_mask", mask, (*lead, hq, -(-nq // bq), -(-nk // bk)),
                             f"q's batch dims + (Hq, ceil(Nq / {bq}), ceil(Nk / {bk}))")
        out["block_mask"] = mask
    if options.alibi_slopes is not None:
        slopes = _adopt_anywhere("alibi_slopes", options.alibi_slopes)
        if slopes.dtype not in _arrays.SUPPORTED_DTYPES:
            raise TypeError(f"alibi_slopes must be a float array ({_DTYPE_NAMES}), got dtype {slopes.dtype}")
        _check_broadcastable("alibi_slopes", slopes, (*lead, hq), "q's batch dims + (Hq,)")
        out["alibi_slopes"] = slopes
    if options.seqlens_k is not None:
        lengths = _adopt_anywhere("seqlens_k", options.seqlens_k)
        _check_dtype_kind("seqlens_k", lengths, "iu", "an integer array")
        if tuple(lengths.shape) != tuple(lead):
            raise ValueError(f"seqlens_k must have q's batch shape {tuple(lead)}, got shape {lengths.shape}")
        lengths = _host_copy(lengths)
        if lengths.size and (lengths.min() < 0 or lengths.max() > nk):
            raise ValueError(f"seqlens_k values must be in [0, Nk={nk}], got min {lengths.min()}, "
                             f"max {lengths.max()}")
        out["seqlens_k"] = lengths
    return out


def check_varlen_inputs(q, k, v):
    """Packed varlen q, k, v (total, H, d) adopted and viewed as a (1, total, H, d) batch."""
    q, k, v = _adopt_same_kind([("q", q), ("k", k), ("v", v)], _arrays.kind_of(q), "q")
    for name, x, total in (("q", q, "total_q"), ("k", k, "total_k"), ("v", v, "total_k")):
        if x.ndim != 3:
            raise ValueError(f"{name} must be 3-D ({total}, H, d) for varlen attention, got shape {x.shape}")
    return q[None], k[None], v[None]


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, problem):
    """Sequence boundaries (host int32 copies, see `_host_copy`) and checked maxima."""
    checked = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, problem.q_len),
                            ("cu_seqlens_k", cu_seqlens_k, problem.k_len)):
        if _arrays.kind_of(cu) is None:
            raise TypeError(f"{name} must be an integer array ({_ARRAY_TYPES}), got {type(cu).__name__}")
        cu = _host_copy(_arrays.adopt(cu, name))
        _check_dtype_kind(name, cu, "iu", "an integer array")
        if cu.ndim != 1 or cu.size < 2:
            raise ValueError(f"{name} must be 1-D with S + 1 >= 2 entries, got shape {cu.shape}")
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        if (np.diff(cu) < 0).any():
            raise ValueError(f"{name} must be non-decreasing")
        if cu[-1] != total:
            raise ValueError(f"{name} must end at the number of packed tokens, {total}, got {cu[-1]}")
        checked.append(cu.astype(np.int32))
    if checked[0].size != checked[1].size:
        raise ValueError(f"cu_seqlens_k has {checked[1].size} entries but cu_seqlens_q has "
                         f"{checked[0].size}; both must have S + 1")
    maxima = []
    for name, value, cu in (("max_seqlen_q", max_seqlen_q, checked[0]),
                            ("max_seqlen_k", max_seqlen_k, checked[1])):
        maxima.append(_check_int_in(value, name, int(np.diff(cu).max())))
    return (*checked, *maxima)


def check_do(do, *, o, kind, device):
    """``do`` adopted, checked against the forward output ``o`` and the context's placement."""
    (do,) = _adopt_same_kind([("do", do)], kind, "the forward pass's q")
    if kind == _arrays.DEVICE:
        _check_device("do", do, device, "the forward pass's q")
    if do.dtype != o.dtype:
        raise TypeError(f"do must have the dtype of o, {o.dtype}, got {do.dtype}")
    if do.shape != o.shape:
        raise ValueError(f"do must have the shape of o, {o.shape}, got {do.shape}")
    _check_contiguous_last_axis("do", do)
    _check_element_aligned("do", do)
    return do


def check_dlse(dlse, *, lse, kind, device):
    """``dlse`` adopted, checked against the forward's LSE and the context's placement."""
    (dlse,) = _adopt_same_kind([("dlse", dlse)], kind, "the forward pass's q")
    if kind == _arrays.DEVICE:
        _check_device("dlse", dlse, device, "the forward pass's q")
    if dlse.dtype.kind != "f" and dlse.dtype != _arrays.BFLOAT16:
        raise TypeError(f"dlse must have a real floating dtype, got {dlse.dtype}")
    if dlse.shape != lse.shape:
        raise ValueError(f"dlse must have the shape of lse, {lse.shape}, got {dlse.shape}")
    return dlse


@dataclass(frozen=True)
class Snapshot:
    """What a context recorded about its saved arrays, to notice later changes."""

    signatures: dict
    fingerprints: dict  # host arrays only: checksumming GPU memory would need a sync


def snapshot(arrays):
    """Snapshot of the named saved arrays (a dict name -> array)."""
    return Snapshot(
        signatures={name: _arrays.signature(x) for name, x in arrays.items()},
        fingerprints=_arrays.fingerprints({name: x for name, x in arrays.items()
                                           if _arrays.kind_of(x) == _arrays.HOST}),
    )


def check_unchanged(arrays, snap):
    """Raise ValueError if a saved array was replaced, reshaped or (host arrays) rewritten."""
    for name, x in arrays.items():
        if _arrays.kind_of(x) is None or _arrays.signature(x) != snap.signatures[name]:
            raise ValueError(
                f"ctx.{name} was replaced or reshaped after attention_forward; the context no "
                "longer describes that forward pass"
            )
    now = _arrays.fingerprints({name: arrays[name] for name in snap.fingerprints})
    for name, fp in snap.fingerprints.items():
        if now[name] != fp:
            raise ValueError(
                f"{name} (saved in ctx.{name}) was modified in place after attention_forward, so "
                "its gradients would be wrong; keep q, k, v and o unchanged until "
                "attention_backward, or run attention_forward again"
            )
