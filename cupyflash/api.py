"""The public functions: attention, its forward/backward pair, and the VJP form.

This file decides where a call runs and moves arrays there; the checks live in
`_validate`, the array namespaces and layouts in `_arrays`, the computation in
`_reference` (NumPy) and `_cuda` (GPU). Both backends share one interface: they take
(B, H, N, d) views of inputs and of preallocated outputs and write the outputs, so that
outputs are allocated once, in the caller's layout, whichever backend runs.
"""

import dataclasses
import math
import re
import textwrap
import types
from dataclasses import dataclass, field

from . import _arrays, _mods, _reference, _rng, _validate, streaming, streaming_varlen
from ._rng import manual_seed

__all__ = ["AttentionContext", "attention", "attention_backward", "attention_forward",
           "attention_vjp", "manual_seed", "precompile", "streaming_plan", "varlen_attention",
           "varlen_attention_forward", "varlen_attention_vjp"]

_OPTIONS_DOC = """\
causal : bool, default False
    Causal mask, aligned bottom-right as in flash-attn >= 2.1: query ``i`` sees key ``j``
    iff ``j <= i + Nk - Nq``. With ``Nq > Nk`` the first ``Nq - Nk`` queries see no key.
scale : float, optional
    Multiplies ``q @ k.T`` before the softmax; finite and non-negative. Default
    ``1 / sqrt(d)``.
window : (int, int), optional
    Sliding-window attention: query ``i`` sees keys ``i + off - left <= j <= i + off +
    right`` (``off = Nk - Nq``, aligned bottom-right like causal); -1 leaves a side
    unbounded, so ``(-1, -1)`` (or None) is full attention. With ``causal`` both hold.
    Tiles outside the band are skipped, so the cost is ``O(N * (left + right))``.
dropout_p : float, default 0.0
    Dropout on the attention probabilities, 0 or in [1/512, 1 - 1/512). It is drawn
    at 8-bit resolution, as FlashAttention draws it: an entry is dropped with probability
    ``round(256 * dropout_p) / 256`` and a kept one is scaled by one over the probability
    of keeping it, so the output stays unbiased. The mask comes from Philox4x32-10 keyed by the seed and
    regenerated in the backward pass (nothing ``Nq x Nk`` is stored); the NumPy and GPU
    backends draw the same bits. The LSE is that of the softmax before dropout.
seed : int, optional
    Dropout seed in [0, 2**64): the same seed and inputs give the same mask. None draws
    from cupyflash's process-wide RNG (see `manual_seed`), each call taking fresh streams.
    Kept in the context (``ctx.seed``, ``ctx.rng_offset``) for the backward pass.
block_mask : array of bool or int, optional
    Block-sparse attention: broadcastable to ``(*batch, Hq, ceil(Nq / bq), ceil(Nk /
    bk))`` (batch = q's leading dims, ``(bq, bk) = block_size``); key block ``c`` is
    visible to query block ``r`` iff ``block_mask[..., r, c]`` is nonzero, and zero blocks
    are skipped in the forward and backward passes. Host or GPU array. See
    `cupyflash.block_sparse` for common patterns.
block_size : int or (int, int), default 128
    The (query, key) block size of `block_mask`, each a multiple of 16.
bias : array, optional
    Additive score bias (e.g. a relative-position bias or a float attention mask with
    ``-inf`` entries), broadcastable to ``(*batch, Hq, Nq, Nk)``, in q's dtype and on q's
    side (host or GPU). Broadcast axes stay broadcast (a ``(Hq, 1, Nk)`` bias is never
    expanded). Its gradient is ``attention_backward(..., return_dbias=True)``.
alibi_slopes : array, optional
    ALiBi: adds ``-slope * |i + Nk - Nq - j|`` to the scores; float array broadcastable to
    ``(*batch, Hq)``, host or GPU. The slopes get no gradient.
softcap : float, default 0.0
    Soft-capping of the scaled scores, ``softcap * tanh(s / softcap)`` (applied before
    bias and ALiBi, as in Gemma 2 and flash-attn); 0 turns it off.
seqlens_k : array of int, optional
    Key padding: batch entry ``b`` sees only its first ``seqlens_k[b]`` keys (values in
    [0, Nk], shape = q's batch dims). The causal and window alignment still use Nk.
    Host or GPU; the values are checked on the host, so a GPU array is copied back (a
    synchronisation per call: keep it in NumPy where calls should queue).
layout : {"bhsd", "bshd"}, default "bhsd"
    "bhsd": arrays are ``(..., H, N, d)`` with any leading (batch) dims; the axis before
    N is the head axis and a 2-D ``(N, d)`` array is one head. "bshd": arrays are
    ``(B, N, H, d)``, as transformer code stores them.
deterministic : bool, default False
    Ask the GPU backward pass for run-to-run identical gradients (slower). The NumPy
    backend is always deterministic. On the GPU the bias gradient is summed over the
    bias's broadcast axes with float atomics, so it is reproducible only for a bias with
    no broadcast axis (each element then gets one addition), whatever this flag.
backend : {"auto", "cuda", "numpy"}, default "auto"
    "auto" runs on the GPU when a CUDA device is usable and the GPU kernels cover the
    dtype and head dims, else on the NumPy backend. "cuda" and "numpy" force one; "cuda"
    raises RuntimeError without a usable GPU and ValueError for a case its kernels do not
    cover.
device_memory_limit : int, optional
    Host (NumPy) inputs on the GPU backend: stream them through at most this many bytes
    of device memory (`cupyflash.streaming`): query and key chunks go up in turn, each
    visible (query chunk, key chunk) pair runs as one call and the pairs are merged by
    their LSEs, exactly; copies run on their own stream beside the kernels. None streams
    only when the in-memory call would not fit in the free device memory (with a margin);
    otherwise nothing changes. With
    a bound too small for one 128-row chunk, ValueError names it before anything is
    allocated. Streamed: causal, GQA, window, alibi_slopes, dropout_p (the same mask as
    the in-memory call with that seed; without one the RNG advances as for one call),
    bias and its gradient (each pair's slice summed on the host in a fixed order),
    block_mask (chunks are multiples of its block size), seqlens_k, softcap, scale,
    deterministic: each pair's call takes the whole problem's rows, keys and diagonal,
    and pairs that the masks leave empty are never copied. A context's forward checks
    that its backward fits too (with the bias gradient's slices, given a bias). Varlen
    calls take it too (`varlen_attention`). GPU (CuPy) inputs with a
    limit raise ValueError (they are on the device already). On the NumPy backend a limit
    runs the same chunked algorithm on the host (how it is tested without a GPU). The
    context of a streamed `attention_forward` streams its backward pass too, under the
    same limit. `cupyflash.streaming_plan` shows the chunks and bytes moved beforehand.
progress : callable or "tqdm", optional
    Streamed calls only: ``progress(done, total)`` is called with the number of
    (query chunk, key chunk) pairs completed, increasing, as the device finishes them
    (``done == total`` last); "tqdm" shows a tqdm bar (ImportError without tqdm). The
    context's backward pass reports to it too, from 0 again. Calls that do not stream
    never call it.
precision : {"highest", "tf32"}, default "highest"
    float32 inputs only (ValueError for other dtypes). "highest" computes at float32
    accuracy: the Hopper forward splits q, k and v (each scaled by a power of two) into
    fp16 high and low halves and runs each matrix product as three fp16 products on the
    tensor cores; elsewhere products run as three TF32 products (3xTF32). "tf32" lets the
    Hopper forward take the high halves' one product instead (operands rounded to 11
    significant bits, TF32's precision): about twice as fast, with relative errors of a
    few 1e-4 (``tests/TOLERANCES.md``). The backward pass, other GPUs and the NumPy
    backend compute at float32 accuracy either way (the gradients start from the
    forward's o and LSE, so they carry its error). On Hopper the backward's dense path
    (no score term, dropout or bias; head dims up to 128) runs on fp16 halves too, at
    float32 accuracy. The halves take as much device memory as q, k and v (half with
    "tf32"; the backward's, of q, k, v and dO) for the length of the call."""

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

    Made by `attention_forward` (or `varlen_attention_forward`), not by users; read-only.
    For NumPy inputs the arrays it holds are read-only views.

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
        "bhsd", "bshd", or "varlen" for packed `varlen_attention_forward` inputs.
    backend : str
        The backend that ran the forward pass and will run the backward: "cuda" or
        "numpy".
    device : int or None
        CUDA device of GPU inputs; None for host inputs.
    seed : int or None
        The dropout seed used (drawn from the process RNG when none was given); with
        ``dropout_p == 0`` the ``seed`` argument as given.
    rng_offset : int
        The first Philox stream of the call (0 for an explicit seed).
    window, dropout_p, block_mask, block_size, bias, alibi_slopes, softcap, seqlens_k
        The remaining options, as given (``block_size`` as a pair).
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        Varlen calls only (else None): the sequence boundaries, as host int32 arrays.
    streaming : StreamingPlan, VarlenPlan or None
        The plan of a streamed forward pass (``device_memory_limit``; a
        `cupyflash.streaming_varlen.VarlenPlan` for varlen calls); its backward pass
        streams too. None for an in-memory pass.

    Notes
    -----
    The forward inputs and output must stay unchanged until `attention_backward`. It
    raises ValueError where a change is detected: any of ``q, k, v, o, lse`` here replaced
    or reshaped (recorded shape, strides, dtype, data pointer), and, for NumPy inputs, any
    change to their contents or to ``o``'s (a checksum of their bytes, one pass over them
    in each direction). In-place writes to GPU arrays (and to the option arrays) are not
    detected: checksumming device memory would synchronise the stream.
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
    rng_offset: int
    block_mask: object = field(repr=False)
    block_size: tuple
    bias: object = field(repr=False)
    alibi_slopes: object = field(repr=False)
    softcap: float
    seqlens_k: object = field(repr=False)
    cu_seqlens_q: object = field(repr=False)
    cu_seqlens_k: object = field(repr=False)
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    # (B, H, N, d) views of q, k, v, o and the (B, H, Nq) LSE where the backend runs: the
    # arrays above themselves, or copies on the other side of the host/device boundary.
    _saved: tuple = field(repr=False)
    # The modifiers as the backend got them (compact, on its side).
    _modifiers: _mods.Modifiers = field(repr=False)
    _snapshot: _validate.Snapshot = field(repr=False)
    streaming: object = field(default=None, repr=False)
    # A streamed forward's device_memory_limit (None: the free memory at the backward)
    # and progress, for its backward pass.
    _memory_limit: int | None = field(default=None, repr=False)
    _progress: object = field(default=None, repr=False)

    def _tracked(self):
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o, "lse": self.lse}

    def _backend_view(self, x):
        """(B, H, N, d) view of a q/k/v/o-shaped array of this call."""
        if self.layout == "varlen":
            return _arrays.bhsd_view(x[None], "bshd")
        return _arrays.bhsd_view(x, self.layout)


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
    mods: _mods.Modifiers
    seed: int | None
    cu_seqlens: tuple | None = None   # varlen: the checked host copies (q, k)
    streaming: object = None          # the StreamingPlan of a streamed pass


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


def _select_backend(requested, problem, mods):
    if requested == "numpy":
        return "numpy"
    cuda, why_not = _gpu_backend()
    if cuda is not None:
        why_not = cuda.unsupported_reason(problem.dtype, problem.head_dim, problem.value_dim,
                                          heads=problem.heads, device=problem.device, mods=mods)
        if why_not is not None and requested == "cuda":
            raise ValueError(f"backend='cuda' cannot run this case: {why_not}")
    elif requested == "cuda":
        raise RuntimeError(f"backend='cuda' needs a CUDA GPU, but {why_not}")
    return "numpy" if why_not else "cuda"


def _numpy_forward(q, k, v, o, lse, *, scale, causal, mods):
    acc = _arrays.accumulation_dtype(q.dtype)
    o_acc, lse_acc = _reference.attention_forward(
        *(x.astype(acc, copy=False) for x in (q, k, v)), scale=scale, causal=causal, mods=mods)
    o[...] = o_acc  # rounds to the input dtype
    lse[...] = lse_acc


def _numpy_backward(do, q, k, v, o, lse, dq, dk, dv, *, scale, causal, deterministic, mods,
                    dbias, dlse=None):
    del deterministic  # the NumPy backend always sums in one order
    acc = _arrays.accumulation_dtype(q.dtype)
    grads = _reference.attention_backward(
        *(x.astype(acc, copy=False) for x in (do, q, k, v, o)), lse, scale=scale, causal=causal,
        mods=mods, dbias=dbias, dlse=dlse)
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


# Modifiers ---------------------------------------------------------------------------------


def _compact(x, lead, core_ndim):
    """``x``, broadcastable to ``lead + core``, as ``(1 or B, *core')`` with B the product of
    ``lead`` and ``core'`` its own trailing axes (each 1 or full): a view where the leading
    axes merge, a copy of them broadcast where they cannot (some 1, some full)."""
    x = x.reshape((1,) * (len(lead) + core_ndim - x.ndim) + tuple(x.shape))
    if all(n == 1 for n in x.shape[:len(lead)]):
        return x.reshape((1, *x.shape[len(lead):]))
    xp = _arrays.namespace(_arrays.kind_of(x))
    return _arrays.merge_batch(xp.broadcast_to(x, (*lead, *x.shape[len(lead):])), core_ndim)


def _resolve_modifiers(options, problem, varlen=None):
    """The call's `_mods.Modifiers` in the compact form of `_mods`, on the caller's side
    (`_move_modifiers` takes it to the backend; `_claim_dropout_streams` its seed).

    Every check runs before any array is converted."""
    arrays = _validate.check_modifiers(
        options, problem, sequences=None if varlen is None else len(varlen[0]) - 1)
    lead, hq = problem.lead, problem.heads
    fields = {"window": options.window or (-1, -1), "softcap": options.softcap,
              "block_size": options.block_size, "tf32": options.precision == "tf32"}
    if varlen is not None:
        cu_q, cu_k, fields["max_seqlen_q"], fields["max_seqlen_k"] = varlen
        fields.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        lead = (len(cu_q) - 1,)   # the RNG's and ALiBi's batch entries are the sequences
    acc = _arrays.accumulation_dtype(problem.dtype)
    if "bias" in arrays:
        bias = _compact(arrays["bias"], lead, 3)
        if bias.shape[-1] > 1 and not _arrays.has_contiguous_last_axis(bias):
            bias = _arrays.namespace(problem.kind).ascontiguousarray(bias)
        fields["bias"] = bias
    if "block_mask" in arrays:
        mask = _compact(arrays["block_mask"], lead, 3)
        blocks = (-(-problem.q_len // options.block_size[0]), -(-problem.k_len // options.block_size[1]))
        xp = _arrays.namespace(_arrays.kind_of(mask))
        mask = xp.broadcast_to(mask, (*mask.shape[:2], *blocks))
        # The kernels read a byte per block, nonzero: on: a bool mask with contiguous rows
        # is that already (no copy, no kernel launched per call).
        if mask.dtype == bool and mask.strides[-1] == 1:
            fields["block_mask"] = mask.view(xp.uint8)
        else:
            fields["block_mask"] = (mask != 0).astype(xp.uint8)
    if "alibi_slopes" in arrays:
        slopes = _compact(arrays["alibi_slopes"], lead, 1)
        xp = _arrays.namespace(_arrays.kind_of(slopes))
        fields["alibi_slopes"] = xp.ascontiguousarray(
            xp.broadcast_to(slopes, (slopes.shape[0], hq)).astype(acc))
    if "seqlens_k" in arrays:
        fields["seqlens_k"] = arrays["seqlens_k"].reshape(-1).astype("int32")
    if options.dropout_p > 0:
        # Without a seed the streams are claimed by _claim_dropout_streams once nothing
        # can refuse the call any more; a plan reads neither the seed nor the offset.
        fields.update(dropout_p=options.dropout_p, seed=options.seed or 0)
    return _mods.Modifiers(**fields)


def _claim_dropout_streams(mods, options, problem, varlen=None):
    """``mods`` and the seed to report, with the call's Philox streams claimed from the
    process RNG where dropout has no seed: after every check and plan, so that a refused
    call leaves the RNG where it was."""
    if not mods.dropout_p or options.seed is not None:
        return mods, options.seed
    sequences = problem.lead if varlen is None else (len(varlen[0]) - 1,)
    seed, offset = _rng.claim_streams(max(1, math.prod(sequences)) * problem.heads)
    return dataclasses.replace(mods, seed=seed, rng_offset=offset), seed


def _move_modifiers(mods, kind, device):
    # Host index arrays (a few int32s) go to the GPU through a cache of their contents:
    # a call that repeats them (or passes the same cu_seqlens for q and k) uploads nothing.
    moved = {name: (_arrays.device_copy_of_index(getattr(mods, name), device)
                    if name in _mods.INDEX_FIELDS and kind == _arrays.DEVICE
                    and _arrays.kind_of(getattr(mods, name)) == _arrays.HOST
                    else _arrays.move(getattr(mods, name), kind, device))
             for name in _mods.ARRAY_FIELDS if getattr(mods, name) is not None}
    return dataclasses.replace(mods, **moved) if moved else mods   # mods are immutable


def _forward(q, k, v, options, varlen=None, *, gradients=False):
    """One forward pass; ``varlen`` is (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) unchecked, with q, k, v then (1, total, H, d) "bshd" views.
    ``gradients``: a backward pass may follow (the choice to stream counts its memory)."""
    q, k, v, problem = _validate.check_inputs(q, k, v, layout=options.layout)
    scale = _validate.resolve_scale(options.scale, problem.head_dim, problem.dtype)
    if varlen is not None:
        varlen = _validate.check_varlen(*varlen, problem)
    mods = _resolve_modifiers(options, problem, varlen)
    backend = _select_backend(options.backend, problem, mods)
    plan = None
    if problem.batch and (problem.kind == _arrays.HOST or options.device_memory_limit is not None):
        plan = streaming.choose(problem, mods, backend=backend, causal=options.causal,
                                kv_heads=_arrays.split_shape(k.shape, options.layout)[1],
                                limit=options.device_memory_limit, backward=gradients)
    mods, seed = _claim_dropout_streams(mods, options, problem, varlen)
    if plan is not None:
        return _streamed_forward(q, k, v, options, problem, scale, backend, mods, seed, plan, varlen)
    kind, device = _where(backend, problem)
    layout = options.layout
    with _arrays.on_device(device):
        mods = _move_modifiers(mods, kind, device)
        q_, k_, v_ = (_arrays.move(x, kind, device) for x in (q, k, v))
        o = _arrays.empty((*q.shape[:-1], problem.value_dim), problem.dtype, kind)
        lse = _arrays.empty(_arrays.lse_shape(q.shape, layout),
                            _arrays.accumulation_dtype(problem.dtype), kind)
        saved = (*(_arrays.bhsd_view(x, layout) for x in (q_, k_, v_, o)),
                 _arrays.lse_bhs_view(lse, layout))
        if problem.batch:  # an empty batch launches nothing
            _backend_module(backend).attention_forward(*saved, scale=scale, causal=options.causal,
                                                      mods=mods)
    o_out, lse_out = (_arrays.move(x, problem.kind, problem.device) for x in (o, lse))
    return _Forward(q=q, k=k, v=v, o=o_out, lse=lse_out, scale=scale, backend=backend,
                    problem=problem, saved=saved, mods=mods, seed=seed,
                    cu_seqlens=None if varlen is None else varlen[:2])


def _streamed_forward(q, k, v, options, problem, scale, backend, mods, seed, plan, varlen):
    """`_forward` for host inputs streamed through the device by ``plan`` (``varlen``: the
    checked boundaries and maxima of a varlen call)."""
    layout = options.layout
    mods = _move_modifiers(mods, _arrays.HOST, None)   # sliced per pair on the host
    o = _arrays.empty((*q.shape[:-1], problem.value_dim), problem.dtype, _arrays.HOST)
    lse = _arrays.empty(_arrays.lse_shape(q.shape, layout),
                        _arrays.accumulation_dtype(problem.dtype), _arrays.HOST)
    saved = (*(_arrays.bhsd_view(x, layout) for x in (q, k, v, o)), _arrays.lse_bhs_view(lse, layout))
    _streamer(mods).forward(*saved, plan=plan, scale=scale, causal=options.causal, mods=mods,
                            backend=backend, device=_where(backend, problem)[1], progress=options.progress)
    return _Forward(q=q, k=k, v=v, o=o, lse=lse, scale=scale, backend=backend, problem=problem,
                    saved=saved, mods=mods, seed=seed, streaming=plan,
                    cu_seqlens=None if varlen is None else varlen[:2])


def _streamer(mods):
    """The module that streams a call: varlen calls are cut between their sequences."""
    return streaming_varlen if mods.varlen else streaming


def _streamed_backward_plan(ctx, has_dlse, has_dbias):
    """The backward plan of a streamed context, under its forward's limit (or the free
    device memory now, where the forward chose to stream by itself)."""
    q, k, v = ctx._saved[:3]
    g = streaming.geometry(q.shape, k.shape, v.shape, q.dtype, ctx._modifiers, causal=ctx.causal,
                           dlse=has_dlse, dbias=has_dbias)
    limit = ctx._memory_limit
    if limit is None:
        limit = streaming.free_device_budget(_arrays.current_device())
    return _streamer(ctx._modifiers).plan_for(g, ctx._modifiers, limit, backward=True)


def _context(run, options, *, layout, user_arrays=None, varlen=None):
    """The context of a forward pass; ``user_arrays`` replaces (q, k, v, o, lse) for the
    caller (varlen's packed arrays instead of the batched views the pass ran on)."""
    arrays = user_arrays or (run.q, run.k, run.v, run.o, run.lse)
    # For NumPy inputs the context's arrays are read-only views: it must not become a way
    # to write the caller's arrays, and the checksums below must describe what it holds.
    q, k, v, o, lse = (_arrays.read_only(x) for x in arrays)
    mods = run.mods
    return AttentionContext(
        q=q, k=k, v=v, o=o, lse=lse, scale=run.scale, causal=options.causal, layout=layout,
        backend=run.backend, deterministic=options.deterministic, device=run.problem.device,
        window=options.window, dropout_p=options.dropout_p, seed=run.seed,
        rng_offset=mods.rng_offset, block_mask=options.block_mask,
        block_size=options.block_size, bias=options.bias, alibi_slopes=options.alibi_slopes,
        softcap=options.softcap, seqlens_k=options.seqlens_k,
        # The host copies the checks made (mods holds the GPU's: reading those back would
        # wait for the GPU).
        cu_seqlens_q=None if varlen is None else run.cu_seqlens[0],
        cu_seqlens_k=None if varlen is None else run.cu_seqlens[1],
        max_seqlen_q=mods.max_seqlen_q if varlen else None,
        max_seqlen_k=mods.max_seqlen_k if varlen else None,
        _saved=run.saved, _modifiers=mods,
        _snapshot=_validate.snapshot({"q": q, "k": k, "v": v, "o": o, "lse": lse}),
        streaming=run.streaming, _memory_limit=options.device_memory_limit,
        _progress=options.progress)


@_with_shared_doc
def attention(q, k, v, *, causal=False, scale=None, window=None, dropout_p=0.0, seed=None,
              block_mask=None, block_size=128, bias=None, alibi_slopes=None, softcap=0.0,
              seqlens_k=None, layout="bhsd", deterministic=False, return_lse=False,
              backend="auto", device_memory_limit=None, progress=None, precision="highest"):
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
    RuntimeError
        ``backend="cuda"`` without a usable GPU.

    Notes
    -----
    @conventions@

    See Also
    --------
    attention_forward, attention_vjp : the same with gradients.
    varlen_attention : packed sequences of different lengths.
    """
    return_lse = _validate.check_flag(return_lse, "return_lse")
    run = _forward(q, k, v, _validate.check_options(
        causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed,
        block_mask=block_mask, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap,
        layout=layout, deterministic=deterministic, backend=backend, block_size=block_size,
        seqlens_k=seqlens_k, device_memory_limit=device_memory_limit, progress=progress,
        precision=precision))
    return (run.o, run.lse) if return_lse else run.o


@_with_shared_doc
def attention_forward(q, k, v, *, causal=False, scale=None, window=None, dropout_p=0.0,
                      seed=None, block_mask=None, block_size=128, bias=None, alibi_slopes=None,
                      softcap=0.0, seqlens_k=None, layout="bhsd", deterministic=False,
                      backend="auto", device_memory_limit=None, progress=None, precision="highest"):
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
        Inputs, output, LSE (``ctx.lse``, shaped as `attention` returns it), options and
        RNG state, for `attention_backward`. Keep q, k, v and o unchanged until then (see
        `AttentionContext` for what is checked).

    Raises
    ------
    TypeError, ValueError, RuntimeError
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
        layout=layout, deterministic=deterministic, backend=backend, block_size=block_size,
        seqlens_k=seqlens_k, device_memory_limit=device_memory_limit, progress=progress,
        precision=precision)
    run = _forward(q, k, v, options, gradients=True)
    ctx = _context(run, options, layout=layout)
    return run.o, ctx


def _expand_dbias(dbias, ctx):
    """The compact bias gradient summed back to the shape and dtype of the user's bias."""
    bias = ctx.bias
    lead = _arrays.split_shape(ctx.q.shape, ctx.layout)[0]
    full = (*lead, *dbias.shape[1:])
    grad = dbias.reshape(full if dbias.shape[0] > 1 else (*(1,) * len(lead), *dbias.shape[1:]))
    padded = (1,) * (grad.ndim - bias.ndim) + tuple(bias.shape)
    axes = tuple(a for a in range(len(lead)) if padded[a] == 1 and grad.shape[a] > 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(bias.shape).astype(bias.dtype)


def attention_backward(do, ctx, *, return_dbias=False, dlse=None):
    """Gradients of attention with respect to q, k and v, from a saved forward pass.

    Parameters
    ----------
    do : array
        Gradient of the loss with respect to the forward output ``o``: its shape and
        dtype, on the same side (host or GPU, same device) as the forward inputs, with a
        contiguous last axis.
    ctx : AttentionContext
        From `attention_forward` or `varlen_attention_forward`. It may be used more than
        once; dropout regenerates the forward's mask from ``ctx.seed`` and
        ``ctx.rng_offset``.
    return_dbias : bool, default False
        Also return the gradient of the forward's ``bias`` (ValueError without one).
    dlse : array, optional
        Gradient of the loss with respect to the forward's LSE, where the loss uses it
        too (e.g. through `cupyflash.merge_attention` over key parts): the LSE's shape,
        a real floating dtype, on the same side as the forward inputs. None is zero.

    Returns
    -------
    dq, dk, dv : array
        Shaped like q, k and v in the forward layout, in their dtype and array type, new
        and C-contiguous. The gradient of a shared kv head (grouped-query attention) sums
        over the query heads that read it; query rows that see no key add nothing.
    dbias : array
        With ``return_dbias=True``: shaped, typed and placed like the forward's bias,
        summed over the axes it was broadcast along.

    Raises
    ------
    TypeError, ValueError
        A bad ``do``, ``ctx`` or ``return_dbias``, or a context whose saved arrays changed
        since the forward pass (see `AttentionContext`).
    """
    if not isinstance(ctx, AttentionContext):
        raise TypeError(f"ctx must be an AttentionContext from attention_forward, got {type(ctx).__name__}")
    return_dbias = _validate.check_flag(return_dbias, "return_dbias")
    if return_dbias and ctx.bias is None:
        raise ValueError("return_dbias=True needs a forward pass with a bias; this one had none")
    _validate.check_unchanged(ctx._tracked(), ctx._snapshot)
    user_kind = _arrays.kind_of(ctx.q)
    do = _validate.check_do(do, o=ctx.o, kind=user_kind, device=ctx.device)
    if dlse is not None:
        dlse = _validate.check_dlse(dlse, lse=ctx.lse, kind=user_kind, device=ctx.device)
    kind = _arrays.kind_of(ctx._saved[0])
    device = _arrays.device_of(ctx._saved[0])
    plan = None
    if ctx.streaming is not None and ctx._saved[0].shape[0]:
        plan = _streamed_backward_plan(ctx, dlse is not None, return_dbias)   # its errors come first
    with _arrays.on_device(device):
        do_ = _arrays.move(do, kind, device)
        if dlse is not None:
            dlse = _arrays.move(dlse, kind, device).astype(ctx._saved[-1].dtype)
            dlse = dlse[None] if ctx.layout == "varlen" else _arrays.lse_bhs_view(dlse, ctx.layout)
        grads = tuple(_arrays.empty(x.shape, x.dtype, kind) for x in (ctx.q, ctx.k, ctx.v))
        dbias = None
        if return_dbias:
            dbias = _arrays.namespace(kind).zeros(ctx._modifiers.bias.shape,
                                                  _arrays.accumulation_dtype(ctx.q.dtype))
        if plan is not None:
            _streamer(ctx._modifiers).backward(
                ctx._backend_view(do_), *ctx._saved, *(ctx._backend_view(g) for g in grads),
                plan=plan, scale=ctx.scale, deterministic=ctx.deterministic, mods=ctx._modifiers,
                backend=ctx.backend, dlse=dlse, dbias=dbias, progress=ctx._progress,
                device=None if ctx.backend == "numpy" else _arrays.current_device())
        elif ctx._saved[0].shape[0]:  # an empty batch launches nothing
            _backend_module(ctx.backend).attention_backward(
                ctx._backend_view(do_), *ctx._saved, *(ctx._backend_view(g) for g in grads),
                scale=ctx.scale, causal=ctx.causal, deterministic=ctx.deterministic,
                mods=ctx._modifiers, dbias=dbias, dlse=dlse)
        if return_dbias:
            grads = (*grads, _expand_dbias(dbias, ctx))
    return tuple(_arrays.move(g, user_kind, ctx.device) for g in grads)


def _vjp_of(ctx):
    def vjp(do, *, return_dbias=False, dlse=None):
        return attention_backward(do, ctx, return_dbias=return_dbias, dlse=dlse)
    return vjp


@_with_shared_doc
def attention_vjp(q, k, v, *, causal=False, scale=None, window=None, dropout_p=0.0, seed=None,
                  block_mask=None, block_size=128, bias=None, alibi_slopes=None, softcap=0.0,
                  seqlens_k=None, layout="bhsd", deterministic=False, backend="auto",
                  device_memory_limit=None, progress=None, precision="highest"):
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
        ``vjp(do, *, return_dbias=False) -> (dq, dk, dv[, dbias])``, as
        ``attention_backward(do, ctx, return_dbias=...)`` with the context of this forward
        pass (use `attention_forward` to reach the context or the LSE).

    Raises
    ------
    TypeError, ValueError, RuntimeError
        As `attention`.

    Notes
    -----
    @conventions@
    """
    o, ctx = attention_forward(
        q, k, v, causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed,
        block_mask=block_mask, block_size=block_size, bias=bias, alibi_slopes=alibi_slopes,
        softcap=softcap, seqlens_k=seqlens_k, layout=layout, deterministic=deterministic,
        backend=backend, device_memory_limit=device_memory_limit, progress=progress,
        precision=precision)
    return o, _vjp_of(ctx)


def streaming_plan(q, k, v, *, device_memory_limit, causal=False, window=None, block_mask=None,
                   block_size=128, bias=None, alibi_slopes=None, dropout_p=0.0, softcap=0.0,
                   seqlens_k=None, layout="bhsd", backward=False, return_dbias=False):
    """The chunks, device memory and copies of a streamed call, without running it.

    Parameters
    ----------
    q, k, v : array
        As for `attention` (only shapes and dtype are read, and the values of
        ``seqlens_k`` and ``block_mask``, which decide the pairs that are skipped).
    device_memory_limit : int
        The bound, in bytes.
    causal, window, block_mask, block_size, bias, alibi_slopes, dropout_p, softcap, seqlens_k, layout
        As for `attention`. A causal call with any other option cuts its key chunks
        where its query chunks start, one without where each query chunk's reach ends
        (`cupyflash.streaming`), so the options the call will take belong here too.
    backward : bool, default False
        The plan of the backward pass (without a ``dlse``) instead of the forward's.
    return_dbias : bool, default False
        The backward pass returns the bias gradient (ValueError without a bias or
        ``backward``): its slices take device memory and go back too.

    Returns
    -------
    StreamingPlan
        ``query_chunk``, ``key_chunk``, ``pairs``, ``device_bytes`` (at most the limit)
        and ``buffers`` (what they hold), ``h2d_bytes`` and ``d2h_bytes`` (the copies
        each way) against ``min_bytes`` (each input the device needs read once, each
        output written once; the backward keeps o on the host),
        and ``in_memory_bytes`` (the same call without streaming).

    Raises
    ------
    TypeError, ValueError
        Bad arguments, or a limit too small for one chunk (naming ``device_memory_limit``).
    """
    if device_memory_limit is None:
        raise TypeError("device_memory_limit must be a number of bytes, got None")
    # seed=0: a plan draws nothing, and must not advance the RNG (`manual_seed`).
    options = _validate.check_options(
        causal=causal, scale=None, window=window, dropout_p=dropout_p, seed=0, block_mask=block_mask,
        bias=bias, alibi_slopes=alibi_slopes, softcap=softcap, layout=layout, deterministic=False,
        backend="auto", block_size=block_size, seqlens_k=seqlens_k,
        device_memory_limit=device_memory_limit)
    backward = _validate.check_flag(backward, "backward")
    return_dbias = _validate.check_flag(return_dbias, "return_dbias")
    if return_dbias and (bias is None or not backward):
        raise ValueError("return_dbias=True is the plan of a backward pass with a bias: pass bias "
                         "and backward=True")
    q, k, v, problem = _validate.check_inputs(q, k, v, layout=layout)
    mods = _resolve_modifiers(options, problem)
    b, d, hk = problem.batch, problem.head_dim, _arrays.split_shape(k.shape, layout)[1]
    g = streaming.geometry((b, problem.heads, problem.q_len, d), (b, hk, problem.k_len, d),
                           (b, hk, problem.k_len, problem.value_dim), problem.dtype, mods,
                           causal=options.causal, dbias=return_dbias)
    return streaming.plan_for(g, mods, options.device_memory_limit, backward=backward)


# Varlen ------------------------------------------------------------------------------------


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    gradients=False, **options):
    options = _validate.check_options(block_mask=None, bias=None, layout="bshd", **options)
    q4, k4, v4 = _validate.check_varlen_inputs(q, k, v)
    run = _forward(q4, k4, v4, options, gradients=gradients,
                   varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    # The (1, total, H, d) views ran; the caller gets packed (total, H, d) arrays back.
    o, lse = run.o[0], run.lse[0]
    return options, run, (run.q[0], run.k[0], run.v[0], o, lse)


_VARLEN_DOC = """\
q : array, shape (total_q, Hq, d)
    Queries of all sequences packed along the first axis, as flash-attn's varlen API
    takes them; sequence ``s`` holds rows ``cu_seqlens_q[s] : cu_seqlens_q[s + 1]``.
k : array, shape (total_k, Hk, d)
v : array, shape (total_k, Hk, dv)
    Keys and values packed likewise; dtypes, GQA and strides as for `attention`.
cu_seqlens_q, cu_seqlens_k : 1-D integer array, shape (S + 1,)
    Cumulative sequence lengths: start at 0, non-decreasing, end at total_q / total_k.
    NumPy or CuPy; read on the host (a small copy, which for a CuPy array synchronises:
    pass NumPy arrays where calls should queue on the GPU without waiting).
max_seqlen_q, max_seqlen_k : int
    At least the longest query / key sequence (they size the GPU grid).
causal, scale, window, dropout_p, seed, alibi_slopes, softcap, deterministic, backend, precision
    As for `attention`, per sequence: each sequence is its own batch entry with its own
    lengths, so causal and window align at its own bottom-right corner, ALiBi slopes are
    broadcastable to (S, Hq) and the dropout mask counts rows and columns from the
    sequence's start. No sequence sees another's keys. (A bias, block mask or key padding
    have no packed form: the keyword does not exist here.)
device_memory_limit, progress
    As for `attention`: host inputs stream through at most this many bytes of device
    memory (`cupyflash.streaming_varlen`), cut between sequences: consecutive sequences
    that fit run as one in-memory varlen call (their packed rows go up, their outputs
    come back), and a sequence too long for the limit alone streams as a dense call over
    its rows, in chunk pairs, with the options as they apply to it. ``progress`` counts
    the groups and the streamed sequences' pairs. With None, host inputs stream only
    when the in-memory call would not fit in the free device memory."""


def _with_varlen_doc(func):
    func.__doc__ = func.__doc__.replace("    @varlen@\n", textwrap.indent(_VARLEN_DOC, "    ") + "\n")
    return func


@_with_varlen_doc
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, scale=None, window=None, dropout_p=0.0, seed=None,
                     alibi_slopes=None, softcap=0.0, deterministic=False, return_lse=False,
                     backend="auto", device_memory_limit=None, progress=None, precision="highest"):
    """Attention over packed sequences of different lengths (flash-attn's varlen API).

    Parameters
    ----------
    @varlen@
    return_lse : bool, default False
        Also return the log-sum-exp of each query row.

    Returns
    -------
    o : array, shape (total_q, Hq, dv)
        Packed like q. Rows of a sequence without keys are 0.
    lse : array, shape (Hq, total_q)
        Only with ``return_lse=True``; ``-inf`` for rows that see no key.

    Raises
    ------
    TypeError, ValueError
        For any bad argument, naming it, before anything is allocated or launched.
    RuntimeError
        ``backend="cuda"`` without a usable GPU.
    """
    return_lse = _validate.check_flag(return_lse, "return_lse")
    _, _, (_, _, _, o, lse) = _varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        scale=scale, window=window, dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
        softcap=softcap, deterministic=deterministic, backend=backend,
        device_memory_limit=device_memory_limit, progress=progress, precision=precision)
    return (o, lse) if return_lse else o


@_with_varlen_doc
def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             *, causal=False, scale=None, window=None, dropout_p=0.0, seed=None,
                             alibi_slopes=None, softcap=0.0, deterministic=False, backend="auto",
                             device_memory_limit=None, progress=None, precision="highest"):
    """Varlen attention forward pass that keeps what `attention_backward` needs.

    Parameters
    ----------
    @varlen@

    Returns
    -------
    o : array, shape (total_q, Hq, dv)
    ctx : AttentionContext
        With ``layout == "varlen"``; ``attention_backward(do, ctx)`` returns dq, dk, dv
        packed like q, k, v, and ``ctx.lse`` is (Hq, total_q).
    """
    options, run, arrays = _varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, gradients=True, causal=causal,
        scale=scale, window=window, dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
        softcap=softcap, deterministic=deterministic, backend=backend,
        device_memory_limit=device_memory_limit, progress=progress, precision=precision)
    ctx = _context(run, options, layout="varlen", user_arrays=arrays, varlen=True)
    return arrays[3], ctx


@_with_varlen_doc
def varlen_attention_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal=False, scale=None, window=None, dropout_p=0.0, seed=None,
                         alibi_slopes=None, softcap=0.0, deterministic=False, backend="auto",
                         device_memory_limit=None, progress=None, precision="highest"):
    """Varlen attention output and its vector-Jacobian product.

    Parameters
    ----------
    @varlen@

    Returns
    -------
    o : array, shape (total_q, Hq, dv)
    vjp : callable
        ``vjp(do) -> (dq, dk, dv)``, packed like q, k, v.
    """
    o, ctx = varlen_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        scale=scale, window=window, dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
        softcap=softcap, deterministic=deterministic, backend=backend,
        device_memory_limit=device_memory_limit, progress=progress, precision=precision)
    return o, _vjp_of(ctx)


def precompile(*, dtypes=None, head_dims=None, device=None, workers=None, options=False):
    from . import _cuda, _gpu_status
    why_not = _gpu_status.why_not_usable()
    if why_not is not None:
        raise RuntimeError(f"precompile builds kernels for a GPU of this machine, but {why_not}; "
                           "python -m cupyflash.build_check compiles them without one")
    return _cuda.precompile(dtypes=dtypes, head_dims=head_dims, device=device, workers=workers,
                            options=options)


def _precompile_doc():
    from . import _cuda   # importing _cuda never imports CuPy
    return _cuda.precompile.__doc__


precompile.__doc__ = _precompile_doc()
