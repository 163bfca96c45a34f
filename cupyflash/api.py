"""The public functions: attention, its forward/backward pair, and the VJP form.

This file decides where a call runs and moves arrays there; the checks live in
`_validate`, the array namespaces and layouts in `_arrays`, the computation in
`_reference` (NumPy) and `_cuda` (GPU). Both backends share one interface: they take
(B, H, N, d) views of inputs and of preallocated outputs and write the outputs, so that
outputs are allocated once, in the caller's layout, whichever backend runs.
"""

import re
import textwrap
import types
from dataclasses import dataclass, field

from . import _arrays, _reference, _validate

__all__ = ["AttentionContext", "attention", "attention_backward", "attention_forward",
           "attention_vjp", "precompile"]

_OPTIONS_DOC = """\
causal : bool, default False
    Causal mask, aligned bottom-right as in flash-attn >= 2.1: query ``i`` sees key ``j``
    iff ``j <= i + Nk - Nq``. With ``Nq > Nk`` the first ``Nq - Nk`` queries see no key.
scale : float, optional
    Multiplies ``q @ k.T`` before the softmax; finite and non-negative. Default
    ``1 / sqrt(d)``.
window : (int, int), optional
    Sliding-window (left, right) extent. Not implemented yet: anything but None raises
    NotImplementedError.
dropout_p : float, default 0.0
    Dropout probability on the attention weights, in [0, 1). Not implemented yet: only 0.
seed : int, optional
    Dropout seed in [0, 2**64); accepted (and kept in the context) without dropout.
block_mask, bias, alibi_slopes : array, optional
    Block-sparse mask, additive score bias and ALiBi slopes. Not implemented yet:
    anything but None raises NotImplementedError.
softcap : float, default 0.0
    Soft-capping of the scores (0 turns it off). Not implemented yet: only 0.
layout : {"bhsd", "bshd"}, default "bhsd"
    "bhsd": arrays are ``(..., H, N, d)`` with any leading (batch) dims; the axis before
    N is the head axis and a 2-D ``(N, d)`` array is one head. "bshd": arrays are
    ``(B, N, H, d)``, as transformer code stores them.
deterministic : bool, default False
    Ask the GPU backward pass for run-to-run identical gradients (slower). The NumPy
    backend is always deterministic.
backend : {"auto", "cuda", "numpy"}, default "auto"
    "auto" runs on the GPU when a CUDA device is usable and the GPU kernels cover the
    dtype and head dims, else on the NumPy backend. "cuda" and "numpy" force one; "cuda"
    raises RuntimeError without a usable GPU and ValueError for a case its kernels do not
    cover."""

_INPUTS_DOC = """\
q : array, shape (..., Hq, Nq, d) or (B, Nq, Hq, d)
    Queries (see `layout`). NumPy or CuPy array, or any object with
    ``__cuda_array_interface__`` or ``__dlpack__`` (PyTorch, JAX), taken without a copy.
k : array, shape (..., Hk, Nk, d) or (B, Nk, Hk, d)
    Keys: same leading dims as q, ``Hq % Hk == 0`` (grouped-query / multi-query
    attention: query head ``h`` reads kv head ``h // (Hq // Hk)``).
v : array, shape (..., Hk, Nk, dv) or (B, Nk, Hk, dv)
    Values; ``dv`` may differ from ``d``. ``1 <= d, dv <= 256``, ``Nq, Nk >= 1``.
    q, k and v share one dtype: float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or
    float64, and must each have a contiguous last axis (other strides are free)."""

_CONVENTIONS_DOC = """\
Results are exact softmax attention, ``softmax(scale * q k^T) v``, computed blockwise
without an ``Nq x Nk`` matrix: accumulation in float32 (float64 for float64 inputs); the
output and gradients come back in the input dtype, the log-sum-exp (LSE, natural log of
the row's softmax denominator) in float32 (float64 for float64 inputs). A query row that
sees no key (causal with ``Nq > Nk``) gives output 0 and LSE ``-inf``, never NaN.

NumPy arrays in give NumPy arrays out; CuPy arrays in give CuPy arrays out, on the
inputs' device and the current stream. Foreign GPU arrays (PyTorch, JAX, ...) are viewed
through CuPy without a copy and results come back as CuPy arrays; foreign host arrays
with ``__dlpack__`` come back as NumPy arrays. When the backend is not where the arrays
are (NumPy arrays on the GPU backend, CuPy arrays on the NumPy backend), inputs are
copied to the backend and results copied back. Outputs are new C-contiguous arrays in the
caller's layout. q, k and v are never modified or copied, except "bhsd" inputs whose
leading axes have no common stride (e.g. ``x[:, :3]`` of a ``(4, 6, H, N, d)`` array),
which the backend gets a contiguous copy of."""


def _with_shared_doc(func):
    """Expand ``@name@`` lines of ``func``'s docstring into the shared text of that name, so
    the four entry points document their common parameters once."""
    parts = {"options": _OPTIONS_DOC, "inputs": _INPUTS_DOC, "conventions": _CONVENTIONS_DOC}
    func.__doc__ = re.sub(r"^([ \t]*)@(\w+)@$", lambda m: textwrap.indent(parts[m[2]], m[1]),
                          func.__doc__, flags=re.MULTILINE)
    return func


@dataclass(frozen=True, eq=False)
class AttentionContext:
    """What `attention_backward` needs from one `attention_forward` call.

    Made by `attention_forward`, not by users; read-only. For NumPy inputs the arrays it
    holds are read-only views.

    Attributes
    ----------
    q, k, v : array
        The inputs, in the caller's layout and array type (CuPy for foreign GPU arrays).
    o, lse : array
        The output and the log-sum-exp returned by the forward pass.
    scale : float
        The scale used (the default resolved to ``1 / sqrt(d)``).
    causal, deterministic : bool
    layout : str
    backend : str
        The backend that ran the forward pass and will run the backward: "cuda" or
        "numpy".
    device : int or None
        CUDA device of GPU inputs; None for host inputs.
    window, dropout_p, seed, block_mask, bias, alibi_slopes, softcap
        The remaining options, as given.

    Notes
    -----
    The forward inputs and output must stay unchanged until `attention_backward`. It
    raises ValueError where a change is detected: any of ``q, k, v, o, lse`` here replaced
    or reshaped (recorded shape, strides, dtype, data pointer), and, for NumPy inputs, any
    change to their contents or to ``o``'s (a checksum of their bytes, one pass over them
    in each direction). In-place writes to GPU arrays are not detected: checksumming
    device memory would synchronise the stream.
    """

    q: object = field(repr=False)
    k: object = field(repr=False)
    v: object = field(repr=False)
    o: object = field(repr=False)
    lse: object = field(repr=False)
    scale: float
    causal: bool
    layout: str
    backend: str
    deterministic: bool
    device: int | None
    window: tuple | None
    dropout_p: float
    seed: int | None
    block_mask: object = field(repr=False)
    bias: object = field(repr=False)
    alibi_slopes: object = field(repr=False)
    softcap: float
    # (B, H, N, d) views of q, k, v, o and the (B, H, Nq) LSE where the backend runs: the
    # arrays above themselves, or copies on the other side of the host/device boundary.
    _saved: tuple = field(repr=False)
    _snapshot: _validate.Snapshot = field(repr=False)

    def _tracked(self):
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o, "lse": self.lse}


@dataclass(frozen=True)
class _Forward:
    """One forward pass's results, before `attention_forward` wraps them in a context."""

    q: object
    k: object
    v: object
    o: object
    lse: object
    scale: float
    backend: str
    problem: _validate.Problem
    saved: tuple


def _gpu_backend():
    """(the `_cuda` module, None) where GPU kernels can run, else (None, why not)."""
    try:
        from . import _cuda
    except ImportError as exc:
        return None, f"the GPU backend could not be loaded ({exc})"
    if _cuda.gpu_available():
        return _cuda, None
    if _arrays.cupy_module() is None:
        return None, "cupy is not installed (pip install cupyflash[cuda12] or cupyflash[cuda13])"
    return None, "there is no usable CUDA GPU (no device, or no driver/NVRTC)"


def _select_backend(requested, problem, heads):
    if requested == "numpy":
        return "numpy"
    cuda, why_not = _gpu_backend()
    if cuda is not None:
        why_not = cuda.unsupported_reason(problem.dtype, problem.head_dim, problem.value_dim,
                                          heads=heads, device=problem.device)
        if why_not is not None and requested == "cuda":
            raise ValueError(f"backend='cuda' cannot run this case: {why_not}")
    elif requested == "cuda":
        raise RuntimeError(f"backend='cuda' needs a CUDA GPU, but {why_not}")
    return "numpy" if why_not else "cuda"


def _numpy_forward(q, k, v, o, lse, *, scale, causal):
    acc = _arrays.accumulation_dtype(q.dtype)
    o_acc, lse_acc = _reference.attention_forward(
        *(x.astype(acc, copy=False) for x in (q, k, v)), scale=scale, causal=causal)
    o[...] = o_acc  # rounds to the input dtype
    lse[...] = lse_acc


def _numpy_backward(do, q, k, v, o, lse, dq, dk, dv, *, scale, causal, deterministic):
    del deterministic  # the NumPy backend always sums in one order
    acc = _arrays.accumulation_dtype(q.dtype)
    grads = _reference.attention_backward(
        *(x.astype(acc, copy=False) for x in (do, q, k, v, o)), lse, scale=scale, causal=causal)
    for out, grad in zip((dq, dk, dv), grads):
        out[...] = grad


_NUMPY_BACKEND = types.SimpleNamespace(attention_forward=_numpy_forward,
                                       attention_backward=_numpy_backward)


def _backend_module(backend):
    if backend == "numpy":
        return _NUMPY_BACKEND
    from . import _cuda
    return _cuda


def _where(backend, problem):
    """(array kind, CUDA device) where ``backend`` computes ``problem``."""
    if backend == "numpy":
        return _arrays.HOST, None
    device = problem.device if problem.kind == _arrays.DEVICE else _arrays.current_device()
    return _arrays.DEVICE, device


def _refuse_unimplemented(options):
    requested = [name for name, on in (
        ("window", options.window is not None),
        ("dropout_p", options.dropout_p != 0.0),
        ("block_mask", options.block_mask is not None),
        ("bias", options.bias is not None),
        ("alibi_slopes", options.alibi_slopes is not None),
        ("softcap", options.softcap != 0.0),
    ) if on]
    if requested:
        raise NotImplementedError(
            f"{', '.join(requested)}: not implemented yet; this option lands with "
            "masks/dropout support (pass its default for now)")


def _forward(q, k, v, options):
    q, k, v, problem = _validate.check_inputs(q, k, v, layout=options.layout)
    scale = _validate.resolve_scale(options.scale, problem.head_dim, problem.dtype)
    _refuse_unimplemented(options)
    backend = _select_backend(options.backend, problem, _arrays.split_shape(q.shape, options.layout)[1])
    kind, device = _where(backend, problem)
    layout = options.layout
    with _arrays.on_device(device):
        q_, k_, v_ = (_arrays.move(x, kind, device) for x in (q, k, v))
        o = _arrays.empty((*q.shape[:-1], problem.value_dim), problem.dtype, kind)
        lse = _arrays.empty(_arrays.lse_shape(q.shape, layout),
                            _arrays.accumulation_dtype(problem.dtype), kind)
        saved = (*(_arrays.bhsd_view(x, layout) for x in (q_, k_, v_, o)),
                 _arrays.lse_bhs_view(lse, layout))
        if problem.batch:  # an empty batch launches nothing
            _backend_module(backend).attention_forward(*saved, scale=scale, causal=options.causal)
    o_out, lse_out = (_arrays.move(x, problem.kind, problem.device) for x in (o, lse))
    return _Forward(q=q, k=k, v=v, o=o_out, lse=lse_out, scale=scale, backend=backend,
                    problem=problem, saved=saved)


@_with_shared_doc
def attention(q, k, v, *, causal=False, scale=None, window=None, dropout_p=0.0, seed=None,
              block_mask=None, bias=None, alibi_slopes=None, softcap=0.0, layout="bhsd",
              deterministic=False, return_lse=False, backend="auto"):
    """Exact attention ``softmax(scale * q k^T) v``, FlashAttention style.

    Parameters
    ----------
    @inputs@
    @options@
    return_lse : bool, default False
        Also return the log-sum-exp of each query row.

    Returns
    -------
    o : array, shape (..., Hq, Nq, dv) or (B, Nq, Hq, dv)
        In the layout, dtype and array type of q.
    lse : array, shape (..., Hq, Nq) for "bhsd" or (B, Hq, Nq) for "bshd"
        Only with ``return_lse=True``: axes read batch, head, query in both layouts.
        float32 (float64 for float64 inputs); ``-inf`` for rows that see no key.

    Raises
    ------
    TypeError, ValueError
        For any bad argument, naming it, before anything is allocated or launched.
    NotImplementedError
        For options whose feature is not implemented yet.
    RuntimeError
        ``backend="cuda"`` without a usable GPU.

    Notes
    -----
    @conventions@

    See Also
    --------
    attention_forward, attention_vjp : the same with gradients.
    """
    return_lse = _validate.check_flag(return_lse, "return_lse")
    run = _forward(q, k, v, _validate.check_options(
        causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed,
        block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap,
        layout=layout, deterministic=deterministic, backend=backend))
    return (run.o, run.lse) if return_lse else run.o


@_with_shared_doc
def attention_forward(q, k, v, *, causal=False, scale=None, window=None, dropout_p=0.0,
                      seed=None, block_mask=None, bias=None, alibi_slopes=None, softcap=0.0,
                      layout="bhsd", deterministic=False, backend="auto"):
    """Attention forward pass that keeps what `attention_backward` needs.

    Parameters
    ----------
    @inputs@
    @options@

    Returns
    -------
    o : array, shape (..., Hq, Nq, dv) or (B, Nq, Hq, dv)
        As from `attention`.
    ctx : AttentionContext
        Inputs, output, LSE (``ctx.lse``, shaped as `attention` returns it) and options,
        for `attention_backward`. Keep q, k, v and o unchanged until then (see
        `AttentionContext` for what is checked).

    Raises
    ------
    TypeError, ValueError, NotImplementedError, RuntimeError
        As `attention`.

    Notes
    -----
    @conventions@

    Examples
    --------
    >>> o, ctx = attention_forward(q, k, v, causal=True)       # doctest: +SKIP
    >>> dq, dk, dv = attention_backward(do, ctx)                # doctest: +SKIP
    """
    options = _validate.check_options(
        causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed,
        block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap,
        layout=layout, deterministic=deterministic, backend=backend)
    run = _forward(q, k, v, options)
    # For NumPy inputs the context's arrays are read-only views: it must not become a way
    # to write the caller's arrays, and the checksums below must describe what it holds.
    q, k, v, o, lse = (_arrays.read_only(x) for x in (run.q, run.k, run.v, run.o, run.lse))
    ctx = AttentionContext(
        q=q, k=k, v=v, o=o, lse=lse, scale=run.scale, causal=options.causal, layout=layout,
        backend=run.backend, deterministic=options.deterministic, device=run.problem.device,
        window=options.window, dropout_p=options.dropout_p, seed=options.seed,
        block_mask=options.block_mask, bias=options.bias, alibi_slopes=options.alibi_slopes,
        softcap=options.softcap, _saved=run.saved,
        _snapshot=_validate.snapshot({"q": q, "k": k, "v": v, "o": o, "lse": lse}))
    return run.o, ctx


def attention_backward(do, ctx):
    """Gradients of attention with respect to q, k and v, from a saved forward pass.

    Parameters
    ----------
    do : array
        Gradient of the loss with respect to the forward output ``o``: its shape and
        dtype, on the same side (host or GPU, same device) as the forward inputs, with a
        contiguous last axis.
    ctx : AttentionContext
        From `attention_forward`. It may be used more than once.

    Returns
    -------
    dq, dk, dv : array
        Shaped like q, k and v in the forward layout, in their dtype and array type, new
        and C-contiguous. The gradient of a shared kv head (grouped-query attention) sums
        over the query heads that read it; query rows that see no key add nothing.

    Raises
    ------
    TypeError, ValueError
        A bad ``do`` or ``ctx``, or a context whose saved arrays changed since the forward
        pass (see `AttentionContext`).
    """
    if not isinstance(ctx, AttentionContext):
        raise TypeError(f"ctx must be an AttentionContext from attention_forward, got {type(ctx).__name__}")
    _validate.check_unchanged(ctx._tracked(), ctx._snapshot)
    user_kind = _arrays.kind_of(ctx.q)
    do = _validate.check_do(do, o=ctx.o, kind=user_kind, device=ctx.device)
    kind = _arrays.kind_of(ctx._saved[0])
    device = _arrays.device_of(ctx._saved[0])
    with _arrays.on_device(device):
        do_ = _arrays.move(do, kind, device)
        grads = tuple(_arrays.empty(x.shape, x.dtype, kind) for x in (ctx.q, ctx.k, ctx.v))
        if ctx._saved[0].shape[0]:  # an empty batch launches nothing
            _backend_module(ctx.backend).attention_backward(
                _arrays.bhsd_view(do_, ctx.layout), *ctx._saved,
                *(_arrays.bhsd_view(g, ctx.layout) for g in grads),
                scale=ctx.scale, causal=ctx.causal, deterministic=ctx.deterministic)
    return tuple(_arrays.move(g, user_kind, ctx.device) for g in grads)


@_with_shared_doc
def attention_vjp(q, k, v, *, causal=False, scale=None, window=None, dropout_p=0.0, seed=None,
                  block_mask=None, bias=None, alibi_slopes=None, softcap=0.0, layout="bhsd",
                  deterministic=False, backend="auto"):
    """Attention output and its vector-Jacobian product, in the style of ``jax.vjp``.

    Parameters
    ----------
    @inputs@
    @options@

    Returns
    -------
    o : array
        As from `attention`.
    vjp : callable
        ``vjp(do) -> (dq, dk, dv)``, as ``attention_backward(do, ctx)`` with the context of
        this forward pass (use `attention_forward` to reach the context or the LSE).

    Raises
    ------
    TypeError, ValueError, NotImplementedError, RuntimeError
        As `attention`.

    Notes
    -----
    @conventions@
    """
    o, ctx = attention_forward(
        q, k, v, causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed,
        block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap,
        layout=layout, deterministic=deterministic, backend=backend)

    def vjp(do):
        return attention_backward(do, ctx)

    return o, vjp


def precompile(*, dtypes=None, head_dims=None, device=None, workers=None):
    from . import _cuda
    return _cuda.precompile(dtypes=dtypes, head_dims=head_dims, device=device, workers=workers)


def _precompile_doc():
    from . import _cuda   # importing _cuda never imports CuPy
    return _cuda.precompile.__doc__


precompile.__doc__ = _precompile_doc()
