"""Merging attention results computed over disjoint sets of keys.

Attention over keys K = K_1 ∪ ... ∪ K_P (disjoint) is a weighted sum of the attention over
each part: with lse_p the log-sum-exp of a row's scores over K_p (``return_lse=True``),

    lse = log(sum_p exp(lse_p)),        o = sum_p exp(lse_p - lse) o_p,

exactly, in any order of the parts. So keys can be split over calls, devices or time (keys
that do not fit in memory, a sequence spread over GPUs) and the results merged here. A row
that saw no key in part p has lse_p = -inf and weight 0; a row that saw no key in any part
gets o = 0 and lse = -inf, as `attention` gives it.

The merge runs where the arrays are (NumPy on the host, CuPy on their GPU), computes in
float32 (float64 for float64 outputs) and returns o in the parts' dtype and lse in the
accumulation dtype. `merge_attention_vjp` also returns the merge's vector-Jacobian product,
so gradients flow back to each part's o_p and lse_p; the gradient of lse_p then goes into
that part's attention backward as ``attention_backward(..., dlse=...)``.
"""

import functools

import numpy as np

from . import _arrays, _validate

__all__ = ["merge_attention", "merge_attention_vjp"]


def _check(outs, lses, layout):
    """The parts adopted as NumPy or CuPy arrays, checked against part 0 (names in the
    messages: ``outs[p]``, ``lses[p]``); nothing is allocated before this passes."""
    layout = _validate._check_choice(layout, "layout", ("bhsd", "bshd"))
    for name, seq in (("outs", outs), ("lses", lses)):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__") or _arrays.kind_of(seq) is not None:
            raise TypeError(f"{name} must be a sequence of arrays (one per part), got {type(seq).__name__}")
    if len(outs) == 0:
        raise ValueError("outs must hold at least one part, got an empty sequence")
    if len(lses) != len(outs):
        raise ValueError(f"lses must hold one LSE per part: {len(outs)} outs but {len(lses)} lses")
    kind = _arrays.kind_of(outs[0])
    if kind is None:
        raise TypeError(f"outs[0] must be an array, got {type(outs[0]).__name__}")
    named = [(f"outs[{p}]", x) for p, x in enumerate(outs)] + [(f"lses[{p}]", x) for p, x in enumerate(lses)]
    arrays = _validate._adopt_same_kind(named, kind, "outs[0]")
    outs, lses = arrays[:len(outs)], arrays[len(outs):]
    first = outs[0]
    if first.dtype not in _arrays.SUPPORTED_DTYPES:
        raise TypeError(f"outs[0] must be float16, bfloat16, float32 or float64, got {first.dtype}")
    expected_ndim = 4 if layout == "bshd" else None
    if first.ndim < 2 or (expected_ndim and first.ndim != expected_ndim):
        want = "(B, N, H, dv)" if layout == "bshd" else "(..., H, N, dv) or (N, dv)"
        raise ValueError(f"outs[0] must be shaped {want} for layout={layout!r}, got shape {first.shape}")
    lse_shape = _arrays.lse_shape(first.shape, layout)
    lse_dtype = _arrays.accumulation_dtype(first.dtype)
    device = _arrays.device_of(first)
    for p, (o, lse) in enumerate(zip(outs, lses)):
        if kind == _arrays.DEVICE:
            _validate._check_device(f"outs[{p}]", o, device, "outs[0]")
            _validate._check_device(f"lses[{p}]", lse, device, "outs[0]")
        if o.dtype != first.dtype:
            raise TypeError(f"outs[{p}] must have the dtype of outs[0], {first.dtype}, got {o.dtype}")
        if o.shape != first.shape:
            raise ValueError(f"outs[{p}] must have the shape of outs[0], {first.shape}, got {o.shape}")
        if lse.dtype != lse_dtype:
            raise TypeError(f"lses[{p}] must be {lse_dtype} (the LSE dtype of {first.dtype} attention), "
                            f"got {lse.dtype}")
        if lse.shape != lse_shape:
            raise ValueError(f"lses[{p}] must have shape {lse_shape} for outs shaped {first.shape} "
                             f"(layout={layout!r}), got {lse.shape}")
    return outs, lses, layout, kind, device


def _row_axis(w, layout):
    """Per-row weights (the LSE's shape) broadcast against the outputs' shape."""
    if layout == "bshd":   # (B, H, N) against (B, N, H, dv)
        return w.transpose(0, 2, 1)[..., None]
    return w[..., None]


def _weights(lses, xp):
    """(lse, w): the merged LSE and each part's weight exp(lse_p - lse), stacked on axis
    0; rows that no part saw get lse = -inf and weights 0 (not NaN)."""
    stacked = xp.stack(lses)
    top = stacked.max(axis=0)
    top = xp.where(xp.isfinite(top), top, 0)   # -inf everywhere: exp(-inf - 0) = 0
    w = xp.exp(stacked - top)
    total = w.sum(axis=0)
    seen = total > 0
    lse = xp.where(seen, top + xp.log(xp.where(seen, total, 1)), -xp.inf).astype(stacked.dtype)
    w = w / xp.where(seen, total, 1)
    return lse, w


def merge_into(o_acc, lse_acc, o_part, lse_part, xp):
    """o_acc, lse_acc := the merge of themselves with a part over other keys, in place:
    the online form of `merge_attention` for (B, H, N, dv) accumulators in the
    accumulation dtype and (B, H, N) LSEs (streamed chunks, ring steps)."""
    lse, w = _weights([lse_acc, lse_part], xp)
    if isinstance(o_acc, np.ndarray):
        o_acc *= w[0][..., None]
        o_acc += w[1][..., None] * o_part
    else:   # one pass over o (as separate CuPy operations, four and a widened copy of the part)
        _gpu_kernels().merge_into(o_part, w[0][..., None], w[1][..., None], o_acc)
    lse_acc[...] = lse


def add_into(acc, part):
    """acc += part, in acc's (accumulation) dtype and in one pass: a 16-bit part is widened
    as it is read, not first copied to a wider temporary (the sums of partial gradients).
    NumPy or CuPy arrays, both on one side."""
    if isinstance(acc, np.ndarray):
        np.add(acc, part, out=acc)
    else:
        _gpu_kernels().add_into(part, acc)


class _GpuKernels:
    """The accumulators' elementwise updates on a GPU, each one CuPy kernel: the same
    arithmetic as the NumPy expressions above, in one pass over the (B, H, N, d) arrays
    (on an H200 at 32k rows x 16 heads x 128, the merge as separate CuPy operations took
    1.4 ms, the add with a widened copy 1.3 ms: bench/NOTES.md, session 20)."""

    def __init__(self):
        import cupy
        self.merge_into = cupy.ElementwiseKernel(
            "T part, A w_acc, A w_part", "A acc",
            "acc = acc * w_acc + w_part * static_cast<A>(part)", "cupyflash_merge_into")
        self.add_into = cupy.ElementwiseKernel(
            "T part", "A acc", "acc += static_cast<A>(part)", "cupyflash_add_into")


@functools.lru_cache(maxsize=None)
def _gpu_kernels():
    return _GpuKernels()


def _merge(outs, lses, layout, xp):
    lse, w = _weights(lses, xp)
    acc = lse.dtype
    o = xp.zeros(outs[0].shape, acc)
    for p, part in enumerate(outs):
        o += _row_axis(w[p], layout) * part.astype(acc)
    return o, lse, w


def merge_attention(outs, lses, *, layout="bhsd"):
    """Merge attention results over disjoint key sets into the result over their union.

    Parameters
    ----------
    outs : sequence of arrays
        Part p's attention output o_p, all of one shape and dtype: ``(..., H, N, dv)``
        (a 2-D ``(N, dv)`` is one head) for ``layout="bhsd"``, ``(B, N, H, dv)`` for
        ``"bshd"``; float16, bfloat16, float32 or float64. NumPy or CuPy arrays (or
        anything `attention` takes), all on the host or all on one GPU.
    lses : sequence of arrays
        Part p's log-sum-exp, as ``attention(..., return_lse=True)`` returns it:
        ``(..., H, N)`` for "bhsd", ``(B, H, N)`` for "bshd"; float32 (float64 for
        float64 outputs); -inf for rows that saw no key of that part. For the outputs
        of `varlen_attention` (``o (total, H, dv)``, ``lse (H, total)``) pass
        ``o[None]`` and ``lse[None]`` with ``layout="bshd"``.
    layout : {"bhsd", "bshd"}, default "bhsd"

    Returns
    -------
    o : array
        The merged output, shaped and typed like each part's, new, on the parts' side.
    lse : array
        The merged log-sum-exp (float32, float64 for float64 outputs); -inf where no
        part saw a key (there o is 0).

    Raises
    ------
    TypeError, ValueError
        Parts of different shapes, dtypes or places, LSEs that do not match them, an
        empty sequence; named, before anything is allocated. The inputs are not modified.

    Examples
    --------
    >>> o1, lse1 = cf.attention(q, k[..., :4096, :], v[..., :4096, :], return_lse=True)
    >>> o2, lse2 = cf.attention(q, k[..., 4096:, :], v[..., 4096:, :], return_lse=True)
    >>> o, lse = cf.merge_attention([o1, o2], [lse1, lse2])   # attention over all keys
    """
    outs, lses, layout, kind, device = _check(outs, lses, layout)
    xp = _arrays.namespace(kind)
    with _arrays.on_device(device):
        o, lse, _ = _merge(outs, lses, layout, xp)
        return o.astype(outs[0].dtype), lse


def merge_attention_vjp(outs, lses, *, layout="bhsd"):
    """`merge_attention` and its vector-Jacobian product, in the style of ``jax.vjp``.

    Parameters are those of `merge_attention`.

    Returns
    -------
    o, lse : array
        As `merge_attention` returns them.
    vjp : callable
        ``vjp(do, dlse=None) -> (douts, dlses)``: given the gradient of a loss with respect
        to o (``do``, shaped and typed like o, on its side) and, optionally, to lse
        (``dlse``, the LSE's shape; None is zero), the gradients with respect to each
        part's output (lists in the parts' dtype) and LSE (accumulation dtype):

            douts[p] = w_p do,   dlses[p] = w_p (sum over dv of do (o_p - o) + dlse),

        with w_p = exp(lse_p - lse). Feed ``douts[p]`` and ``dlses[p]`` to part p's
        ``attention_backward(douts[p], ctx_p, dlse=dlses[p])``.
    """
    outs, lses, layout, kind, device = _check(outs, lses, layout)
    xp = _arrays.namespace(kind)
    with _arrays.on_device(device):
        o_acc, lse, w = _merge(outs, lses, layout, xp)
        o = o_acc.astype(outs[0].dtype)

    def vjp(do, dlse=None):
        do = _validate.check_do(do, o=o, kind=kind, device=device)
        if dlse is not None:
            (dlse,) = _validate._adopt_same_kind([("dlse", dlse)], kind, "outs[0]")
            if kind == _arrays.DEVICE:
                _validate._check_device("dlse", dlse, device, "outs[0]")
            if dlse.shape != lse.shape:
                raise ValueError(f"dlse must have the shape of lse, {lse.shape}, got {dlse.shape}")
        with _arrays.on_device(device):
            do_acc = do.astype(lse.dtype)
            douts, dlses = [], []
            for p, part in enumerate(outs):
                douts.append((_row_axis(w[p], layout) * do_acc).astype(part.dtype))
                along_row = (do_acc * (part.astype(lse.dtype) - o_acc)).sum(axis=-1)
                if layout == "bshd":
                    along_row = along_row.transpose(0, 2, 1)
                dlses.append(w[p] * (along_row if dlse is None else along_row + dlse.astype(lse.dtype)))
            return douts, dlses

    return o, lse, vjp
