"""The GPU backend: which kernel instantiation serves a problem on this device, and how it
is launched.

Every kernel is a C++ template in ``kernels_cu/``; `cupyflash._kernels` lists the
instantiations and their tiles. This module picks, for a call's options (dtype, head dim,
the device's shared memory), the first candidate that fits, compiles it through
``_nvrtc`` on first use, loads it with ``cupy.RawModule`` and launches it on CuPy's
current stream with the contract's parameters. Importing this module never imports
CuPy: the NumPy backend and the build check must work without it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _arrays, _mods, _nvrtc, _params, _philox, _tma
from ._kernels import (BACKWARD_MODES, BWD_ROW_PAD, BWD_SM90, BWD_SM90_SUB_M, CPP_TYPE, FWD_SM90, GRAD_DK, GRAD_DQ,
                       GRAD_DQ_ORDERED, HALVES_MAX_COLS, HALVES_MAX_PASS, HALVES_ROWS, HEAD_DIMS, MIN_COMPUTE_CAPABILITY, MODE_BIAS,
                       MODE_DENSE, MODE_TF32, MODES,
                       BackwardPlan, Variant, backward_mode, backward_plan, bwd_sm90_persistent, bwd_sm90_softcap_dbias,
                       bwd_sm90_splits_units, forward_variants, forward_variants_for, halves_passes, padded_head_dim,
                       q_split_chunk_rows, sm90_rows_box, sm90_unit_split)
from ._validate import check_flag

MAX_GRID_YZ = 65535   # grid y (heads) and z (batch) extents


# --------------------------------------------------------------------------- device side


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """CuPy importable, NVRTC loadable and at least one CUDA device present (asked once
    per process: the answer does not change while it runs; `_gpu_status` says why not)."""
    from ._gpu_status import why_not_usable

    return why_not_usable() is None


def unsupported_reason(dtype, d: int, dv: int, *, heads: int = 1, device=None,
                       mods=_mods.NONE) -> str | None:
    """Why the GPU kernels cannot run this case on ``device`` (default: the current
    one), or None when they can. The API asks before it allocates anything, so that
    backend="auto" falls back to NumPy and backend="cuda" fails with this reason."""
    name = np.dtype(dtype).name
    if name not in CPP_TYPE:
        return f"dtype {name} has no GPU kernel"
    if max(d, dv) > HEAD_DIMS[-1]:
        return f"head dim {max(d, dv)} > {HEAD_DIMS[-1]}"
    if heads > MAX_GRID_YZ:
        return f"{heads} query heads: the kernels take at most {MAX_GRID_YZ} per call"
    if mods.varlen and len(mods.cu_seqlens_q) - 1 > MAX_GRID_YZ:
        return f"{len(mods.cu_seqlens_q) - 1} sequences: the kernels take at most {MAX_GRID_YZ} per call"
    import cupy

    device_id = cupy.cuda.Device().id if device is None else int(device)
    cc = _compute_capability(device_id)
    if cc < MIN_COMPUTE_CAPABILITY:
        return (f"GPU {device_id} has compute capability {cc // 10}.{cc % 10}; the kernels "
                f"need {MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10} or newer")
    return None


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id: int) -> int:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return 10 * props["major"] + props["minor"]


@functools.lru_cache(maxsize=None)
def _device_info(device_id: int) -> tuple[str, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return _nvrtc.target_for(str(_compute_capability(device_id))), int(props["sharedMemPerBlockOptin"])


@functools.lru_cache(maxsize=None)
def _load_module(variant: Variant, device_id: int):
    """The variant's cubin loaded on the device: its module and its kernel, ready to launch."""
    import cupy

    arch, _ = _device_info(device_id)
    compiled = _nvrtc.compile_kernel(variant.source, variant.name_expression, arch)
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(path=str(compiled.binary_path))
        kernel = module.get_function(compiled.lowered_name)
        if variant.total_smem > 48 * 1024:   # static + dynamic past the default needs the opt-in
            kernel.max_dynamic_shared_size_bytes = variant.smem_bytes
    return module, kernel


def _load(variant: Variant, device_id: int):
    return _load_module(variant, device_id)[1]


def _choose(variants: list[Variant], device_id: int) -> Variant:
    arch, smem_limit = _device_info(device_id)
    for v in variants:
        if v.builds_for(arch) and v.total_smem <= smem_limit:
            return v
    raise RuntimeError(f"no kernel tile fits this GPU's {smem_limit} bytes of shared memory per block")


def precompile(*, dtypes=None, head_dims=None, device=None, workers=None, options=False) -> list[str]:
    """Compile and load, ahead of time, the kernels that calls on ``device`` will use.

    Compiles in parallel processes, so this is much faster than letting the first calls
    compile their kernels one by one; the cubins land in the on-disk cache.

    Parameters
    ----------
    dtypes : iterable of dtype-like, optional
        Default: float16, bfloat16, float32, float64.
    head_dims : iterable of int, optional
        Head dims to prepare (each maps to its padded instantiation). Default: all.
    device : int, optional
        CUDA device id. Default: the current device.
    workers : int, optional
        Compiler processes. Default: one per CPU.
    options : bool, default False
        Also the kernels that serve calls with options beyond ``causal`` (window,
        dropout, block_mask, bias, alibi_slopes, softcap, seqlens_k, varlen).

    Returns
    -------
    list of str
        The template instantiations now loaded (forward and backward).
    """
    import cupy

    device_id = cupy.cuda.Device().id if device is None else int(device)
    if isinstance(dtypes, str) or not isinstance(dtypes, (type(None), list, tuple, set)):
        dtypes = (dtypes,)
    names = []
    for t in dtypes or CPP_TYPE:
        try:
            name = t if t in CPP_TYPE else np.dtype(t).name
        except TypeError:
            name = repr(t)
        if name not in CPP_TYPE:
            raise ValueError(f"dtypes: {name} is not one of {sorted(CPP_TYPE)}")
        names.append(name)
    if isinstance(head_dims, (int, np.integer)):
        head_dims = (head_dims,)
    for d in head_dims or HEAD_DIMS:
        if not isinstance(d, (int, np.integer)) or not 1 <= d <= HEAD_DIMS[-1]:
            raise ValueError(f"head_dims: each must be an integer in [1, {HEAD_DIMS[-1]}], got {d!r}")
    dims = sorted({padded_head_dim(int(d), int(d)) for d in (head_dims or HEAD_DIMS)})
    options = check_flag(options, "options")
    modes = MODES if options else (MODE_DENSE,)
    backward_modes = BACKWARD_MODES if options else (MODE_DENSE,)
    arch, _ = _device_info(device_id)
    wanted = {}
    for name in names:
        # fp32: the precision="tf32" kernels beside (MODE_TF32)
        tf32 = tuple(m | MODE_TF32 for m in modes) if name == "float32" else ()
        for D in dims:
            chosen = []
            for mode in modes + tf32:
                variants = forward_variants(name, D, mode)
                chosen.append(_choose(variants, device_id))
                # and the Hopper tiles a block mask may select (forward_variants_for)
                chosen += [v for v in variants[1:] if v.family is FWD_SM90 and v.builds_for(arch)]
                if name == "float32" and any(v.family is FWD_SM90 for v in chosen):
                    chosen += halves_passes(mode, chunked=True) + halves_passes(mode)   # and varlen's
            for mode in backward_modes:
                for deterministic in (False, True):
                    plan = device_backward_plan(name, D, deterministic, mode, device_id)
                    chosen += [plan.prep, *([plan.convert] if plan.convert else [])]
                    chosen += [_choose(candidates, device_id) for _, candidates in plan.kv]
                    chosen += [_choose(plan.dq, device_id)] if plan.dq else []
            wanted.update((v.name_expression, v) for v in chosen)
    _nvrtc.compile_many([(v.source, v.name_expression, arch) for v in wanted.values()], workers)
    for v in wanted.values():
        _load(v, device_id)
    return list(wanted)


def _batch_part(x, b0: int, b1: int):
    """Batch entries [b0, b1) of an array whose first axis is the batch; None and arrays
    broadcast over the batch (first axis 1) as they are."""
    return x if x is None or x.shape[0] == 1 else x[b0:b1]


def _in_batch_slices(launch, arrays, mods, **options) -> bool:
    """Run ``launch`` over slices of the batch that fit the grid's z extent; False (and
    nothing run) when the batch fits whole. Every array's first axis is the batch, and so
    is that of the per-batch option arrays (in ``mods`` and array-valued ``options``);
    the Philox streams move on so that entry b of a slice draws what entry b0 + b of
    the whole batch draws. (Varlen launches take one sequence per z extent:
    unsupported_reason refuses more sequences than fit.)"""
    batch = arrays[0].shape[0]
    if batch <= MAX_GRID_YZ or mods.varlen:
        return False
    heads = arrays[0].shape[1]
    for b0 in range(0, batch, MAX_GRID_YZ):
        b1 = min(batch, b0 + MAX_GRID_YZ)
        part_mods = dataclasses.replace(
            mods, **{name: _batch_part(getattr(mods, name), b0, b1)
                     for name in ("block_mask", "bias", "alibi_slopes", "seqlens_k")},
            rng_offset=(mods.rng_offset + b0 * heads) % 2**64)
        launch(*(x[b0:b1] for x in arrays), mods=part_mods,
               **{k: _batch_part(v, b0, b1) if hasattr(v, "shape") else v for k, v in options.items()})
    return True


def _mods_scalars(params: _params.Params, mods) -> None:
    """The contract's ModsParams fields that hold for every call of a signature: the
    options' scalars and the strides of their arrays (`cupyflash._mods`)."""
    block_q, block_k = mods.block_size
    dropout = mods.dropout_p > 0
    # The block mask's rows are contiguous: three strides.
    bmask_strides = dict(zip(("bmask_sb", "bmask_sh", "bmask_sq"), _params.element_strides(mods.block_mask, 3)))
    bias_strides = dict(zip(("bias_sb", "bias_sh", "bias_sq", "bias_sk"), _params.element_strides(mods.bias, 4)))
    params.mods(
        win_left=mods.window[0], win_right=mods.window[1], block_q=block_q, block_k=block_k,
        **bmask_strides, **bias_strides, alibi_sb=_params.element_strides(mods.alibi_slopes, 1)[0],
        softcap=mods.softcap, drop_threshold=_philox.dropout_threshold(mods.dropout_p) if dropout else 0,
        drop_scale=_philox.dropout_scale(mods.dropout_p) if dropout else 1.0)


def _mods_addresses(params: _params.Params, mods) -> None:
    """The ModsParams fields of one call: its option arrays' addresses (on the device),
    its Philox streams and, for a chunk pair of a streamed call, its place in the
    problem (the plan's fields say the call is its own problem: `_problem_scalars`)."""
    params.mods(
        cu_q=_params.address(mods.cu_seqlens_q), cu_k=_params.address(mods.cu_seqlens_k),
        seqlens_k=_params.address(mods.seqlens_k), bmask=_params.address(mods.block_mask),
        bias=_params.address(mods.bias), alibi=_params.address(mods.alibi_slopes),
        rng_seed=mods.seed, rng_offset=mods.rng_offset)
    if mods.dropout_p > 0:
        params.mods(rng_round_keys=_philox.round_keys(mods.seed))
    if mods.diagonal is not None:
        params.mods(row0=mods.row0, key0=mods.key0, diag=mods.diagonal)


def _problem_scalars(q, k, v, *, scale: float, causal: bool, mods) -> _params.Params:
    """The AttnParams fields every kernel of a call shares, less the addresses: sizes,
    scale, causal and the options' scalars."""
    Hq, Hk = q.shape[1], k.shape[1]
    # The kernels fold the scale into their exp2 (exp2(s * scale_log2 - max)) and need it
    # positive so that masked -inf scores stay -inf. The smallest normal float gives
    # exactly scale 0's result: every exp2 argument rounds to 0.
    scale_log2 = max(scale * math.log2(math.e), float(np.finfo(np.float32).tiny))
    params = _params.Params().set(
        group=Hq // Hk, nq=q.shape[2], nk=k.shape[2], d=q.shape[3], dim_v=v.shape[3],
        scale=scale, scale_log2=scale_log2, causal=int(bool(causal)))
    _mods_scalars(params, mods)
    # The call as its own problem, diagonal at its bottom-right corner (varlen sequences
    # take their own corners in the kernels and leave this 0).
    if not mods.varlen:
        params.mods(diag=k.shape[2] - q.shape[2])
    return params


def _grid_extents(q, k, mods) -> tuple[int, int, int]:
    """(batch entries, query rows, key rows) that the grid covers: under varlen one
    sequence per batch entry, as long as the longest."""
    if mods.varlen:
        return len(mods.cu_seqlens_q) - 1, mods.max_seqlen_q, mods.max_seqlen_k
    return q.shape[0], q.shape[2], k.shape[2]


@dataclasses.dataclass(frozen=True)
class _ForwardPlan:
    """What a forward call's signature (`_forward_signature`) decides, once: the kernel,
    its grid and the contract's fields less the addresses. A call copies ``params`` and
    adds its own addresses, tensor maps and work counter (`attention_forward`)."""

    variant: Variant
    grid: tuple
    params: _params.Params
    map_specs: tuple | None = None   # q, k, v tensor maps (`_tma.map_spec`) of fwd_sm90.cu
    bias_spec: tuple | None = None   # the bias's, where its tiles stream by TMA
    persistent: bool = False         # a zeroed work counter per launch
    # fp32 on fwd_sm90.cu: the passes that write q, k and v as fp16 halves first (its maps
    # then describe those, made per call: `_halves_of`); empty elsewhere.
    halves: tuple = ()


# Python's work per call (~0.3 ms on an H100's host: validation, the choice of kernels,
# ~60 contract fields) is as long as the kernel of a small call, and the GPU waits for it.
# Calls of one signature (`_signature`) share a plan, forward and backward.
_FORWARD_PLANS: dict = {}
_BACKWARD_PLANS: dict = {}
_MAX_PLANS = 256


def _signature(arrays, *, scale: float, causal: bool, mods) -> tuple:
    """Every input of a launch plan's decisions: the device, the options' scalars and the
    precision, and the layout of each array and option array (shape, strides, dtype and
    base alignment, which decides 16-byte copies and tensor maps), but no address, seed
    or Philox offset."""
    arrays = (*arrays, *(getattr(mods, name) for name in _mods.ARRAY_FIELDS))
    layouts = tuple(None if x is None else (x.shape, x.strides, x.dtype, x.data.ptr % 16) for x in arrays)
    # A placed call (a streamed chunk pair) runs the general kernels where the same call
    # unplaced may run the dense ones; its place itself is per call (`_mods_addresses`).
    return (arrays[0].device.id, scale, causal, layouts, mods.window, mods.softcap, mods.dropout_p,
            mods.block_size, mods.max_seqlen_q, mods.max_seqlen_k, mods.tf32, mods.diagonal is not None)


def _cached_plan(plans: dict, signature: tuple, make):
    """plans[signature], made by ``make()`` the first time; the cache forgets everything
    when full."""
    plan = plans.get(signature)
    if plan is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[signature] = make()
    return plan


def _plan_forward(q, k, v, o, *, scale: float, causal: bool, mods) -> _ForwardPlan:
    """The plan of this call's signature: the first forward variant that fits the device
    and can read the arrays, its grid and its scalar fields."""
    d, dv = q.shape[3], v.shape[3]
    device_id = q.device.id
    variants = forward_variants_for(q.dtype.name, padded_head_dim(d, dv), mods, causal=causal,
                                    rows=0 if mods.varlen else q.shape[2])
    variant = _choose(variants, device_id)
    batch, rows, _ = _grid_extents(q, k, mods)
    heads = q.shape[1]
    params = _problem_scalars(q, k, v, scale=scale, causal=causal, mods=mods)
    params.set(vec=int(_arrays.rows_16b_aligned(q, k, v, o)))
    # fp32 reaches the Hopper forward as fp16 halves, which the copy engine can always read.
    halves = q.dtype == np.float32 and variant.family is FWD_SM90
    specs = _sm90_map_specs(variant, q, k, v) if variant.family.tensor_maps and not halves else None
    blocks = math.ceil(rows / variant.block_m)
    # The next kernel in line where the copy engine cannot read the inputs, or where the
    # work tiles would not fit the Hopper forward's work numbers.
    if variant.family.tensor_maps and ((specs is None and not halves) or blocks * heads * batch > MAX_WORK_TILES):
        variant = _choose([c for c in variants if not c.family.tensor_maps], device_id)
        halves = False
    if not variant.family.tensor_maps:
        grid = (math.ceil(rows / variant.block_m) * variant.column_passes, heads, batch)
        return _ForwardPlan(variant, grid, params)
    bias_spec = _sm90_bias_spec(variant, mods.bias, q.shape[2], k.shape[2])
    if bias_spec is not None:
        params.mods(bias_tma=1)
    grid = _work_grid(params, blocks, heads, batch, device_id)
    # fp32's halves take a scale per chunk of rows but under varlen, whose tiles do not
    # start at a chunk (kernels_cu/halves.cuh).
    return _ForwardPlan(variant, grid, params, specs, bias_spec, PERSISTENT_FORWARD,
                        halves_passes(variant.mode, chunked=not mods.varlen) if halves else ())


def attention_forward(q, k, v, o, lse, *, scale: float, causal: bool, mods=_mods.NONE) -> None:
    """Launch the forward kernel: writes o (B, Hq, Nq, dv) and lse (B, Hq, Nq).

    Inputs are (B, H, N, d) CuPy views with a contiguous last axis (validated by the
    caller); ``mods`` holds the options beyond causal with its arrays on this device
    (see `cupyflash._mods`). Nothing is copied and the host does not wait for the GPU.
    """
    if not lse.flags.c_contiguous:   # the kernels index it as (B, Hq, Nq) rows
        raise ValueError("lse must be a C-contiguous (B, Hq, Nq) array")
    if _in_batch_slices(attention_forward, (q, k, v, o, lse), mods, scale=scale, causal=causal):
        return
    signature = (*_signature((q, k, v, o), scale=scale, causal=causal, mods=mods), PERSISTENT_FORWARD)
    plan = _cached_plan(_FORWARD_PLANS, signature,
                        lambda: _plan_forward(q, k, v, o, scale=scale, causal=causal, mods=mods))
    params = plan.params.copy()
    params.tensor("q", q).tensor("k", k).tensor("v", v).tensor("o", o).set(lse=lse.data.ptr)
    if mods.active:
        _mods_addresses(params, mods)
    if plan.halves:
        # Kept alive until the forward is queued (a buffer freed before would be the next
        # allocation's, the work counter's below). A kernel that splits q itself reads it
        # as fp32, its passes write k's and v's halves alone.
        variant, block_n = plan.variant, plan.variant.tile[0]
        boxes = {"k_map": (k, block_n), "v_map": (v, block_n)}
        if not variant.splits_q:
            boxes = {"q_map": (q, variant.block_m), **boxes}
        halves = _halves_maps(plan.halves, 1 if variant.mode & MODE_TF32 else 2, params, boxes, q=q,
                              first=1 if variant.splits_q else 0, chunk_words=True)
        if variant.splits_q:
            q_rows, q_map = _q_split_map(q, variant)
            params.set(q_map=q_map)
    if plan.map_specs is not None:
        specs = plan.map_specs + (() if plan.bias_spec is None else (plan.bias_spec,))
        params.set(**_tensor_maps(specs, (q, k, v, mods.bias), ("q_map", "k_map", "v_map", "bias_map")))
    if plan.persistent:
        import cupy

        counter = cupy.zeros(1, cupy.int32)   # freed to the pool, reused only after the launch (same stream)
        params.set(work_counter=counter.data.ptr)
    _launch(plan.variant, plan.grid, q.device.id, params)


def _rows_16b_aligned_empty(shape, dtype):
    """An uninitialised (B, H, N, cols) array whose rows start 16 bytes apart, as TMA needs
    (the padding past ``cols`` is never read: the maps' extents stop at ``cols``)."""
    import cupy

    *lead, cols = shape
    pad = 16 // np.dtype(dtype).itemsize
    return cupy.empty((*lead, -(-cols // pad) * pad), dtype)[..., :cols]


def _q_split_map(q, variant: Variant) -> tuple:
    """The fp32 rows a forward that splits q itself reads (kernels_cu/fwd_sm90.cu QSplit)
    and their tensor map: q, or where the copy engine cannot describe q (rows not 16-byte
    aligned) a copy whose rows are, which the caller keeps until the kernel is queued."""
    box = q_split_chunk_rows(variant.head_dim)
    rows, q_map = q, _tma.tensor_map(q, box)
    if q_map is None:
        rows = _rows_16b_aligned_empty(q.shape, q.dtype)
        rows[...] = q
        q_map = _tma.tensor_map(rows, box)
    if q_map is None:
        raise RuntimeError("the driver refused the tensor map of q's fp32 rows")
    return rows, q_map


def _halves_maps(passes, planes: int, params: _params.Params, boxes: dict, *, q, first: int = 0,
                 chunk_words: bool = False) -> tuple:
    """fp32 on the Hopper kernels: the tensors of ``boxes`` ({map field: (q, k, v or dO,
    box rows)}, in that order, from tensor ``first`` on) as fp16 halves (`_halves_of`), and
    the map fields of ``params`` set to describe them. Returns what the caller keeps until
    its kernel is queued."""
    tensors, rows = zip(*boxes.values())
    halves, words = _halves_of(passes, planes, params, tensors, q=q, first=first, chunk_words=chunk_words)
    specs = _map_specs(*zip(halves, rows))
    if specs is None:
        raise RuntimeError("the driver refused a tensor map of fp16 halves")
    params.set(**_tensor_maps(specs, halves, tuple(boxes)))
    return halves, words


def _halves_of(passes, planes: int, params: _params.Params, tensors, *, q, first: int = 0,
               chunk_words: bool = False) -> tuple:
    """fp32 on the Hopper kernels: ``tensors`` (q, k, v, and for the backward dO, from
    tensor ``first`` on: the forward whose kernel splits q itself passes k and v) as fp16
    halves (kernels_cu/halves.cuh), written by ``passes`` (split_f32.cu) on the call's
    stream, and the words of their scales set in ``params``: the tensors' largest
    magnitudes (zeroed, for the passes that find them) and, with ``chunk_words`` (the
    forward), each chunk's. Returns (B, planes H, N, d) views of the arrays (rows padded to
    16 bytes, as TMA needs) and the words' arrays, whose memory returns to CuPy's pool once
    the caller drops them: kernels that reuse it later on this stream run after the
    caller's."""
    import cupy

    def halves_of(x):
        B, H, N, cols = x.shape
        if cols > HALVES_MAX_COLS:
            raise RuntimeError(f"fp16 halves take rows of at most {HALVES_MAX_COLS} elements, not {cols}")
        return _rows_16b_aligned_empty((B, planes * H, N, cols), np.float16)

    halves = tuple(halves_of(x) for x in tensors)
    k = tensors[1 - first]
    # A CTA of the passes a chunk of the longest array they write.
    chunks = math.ceil(max(q.shape[2] if first == 0 else 0, k.shape[2]) / HALVES_ROWS)
    words = []
    if any(v.name_expression == HALVES_MAX_PASS for v in passes):
        words.append(cupy.zeros(4, cupy.uint32))   # HALVES_Q, _K, _V, _DO (halves.cuh)
        params.set(halves_max=words[-1].data.ptr)
    if chunk_words:
        # halves.cuh halves_chunk_word: (batch entry, query head, tensor, chunk); the passes
        # write every word the kernel reads, so none is zeroed
        words.append(cupy.empty(q.shape[0] * q.shape[1] * 4 * chunks, cupy.uint32))
        params.set(halves_chunk_max=words[-1].data.ptr, halves_chunks=chunks)
    # The passes' grid (split_f32.cu): the arrays' own rows and batch (under varlen the
    # packed (1, H, total, d) arrays), a z-slice of the grid per tensor.
    names = ("q", "k", "v", "do")[first:]
    passes_params = params.copy().set(**{f"halves_{name}": x.data.ptr for name, x in zip(names, halves)},
                                      nq=q.shape[2], nk=k.shape[2], grid_heads=q.shape[1], grid_batch=q.shape[0],
                                      halves_first=first)
    grid = (chunks, q.shape[1], len(tensors) * q.shape[0])
    for variant in passes:
        _launch(variant, grid, q.device.id, passes_params)
    return halves, words


@dataclasses.dataclass(frozen=True)
class HalvesMaps:
    """A key-block launch's map specs where its tensor maps describe fp16 halves made per
    call (`_halves_of`): the bias's (`_tma.map_spec`, one) where it reads a bias
    (MODE_BIAS), which it reads as it lies in memory."""
    bias: tuple | None = None


def _tensor_maps(specs, arrays, names) -> dict:
    """The tensor-map fields ``names`` of one call: each array's map from its plan's spec
    (`_tma.map_spec`; encoded per address, and cached). Extra arrays and names past the
    specs are left out."""
    maps = {name: _tma.encode(x.data.ptr, spec) for name, x, spec in zip(names, arrays, specs)}
    if any(m is None for m in maps.values()):
        # The plan's own call encoded the same layouts; only a driver that changed its
        # mind gets here.
        raise RuntimeError("the driver refused a tensor map of a layout it took before")
    return maps


# The Hopper forward numbers its work tiles (query block, head, batch entry) in an int,
# with a flag bit beside (fwd_sm90.cu's work word).
MAX_WORK_TILES = 2**30 - 1
# Whether the Hopper forward runs persistent CTAs (one per SM, taking work tiles from a
# counter: the next tile's loads overlap the current one's epilogue) instead of one CTA
# per work tile.
PERSISTENT_FORWARD = True


def _work_grid(params: _params.Params, blocks: int, heads: int, batch: int, device_id: int) -> tuple:
    """The Hopper forward's grid over blocks x heads x batch work tiles (params.cuh):
    persistent CTAs (each launch then needs a zeroed work counter), or one CTA per tile."""
    tiles = blocks * heads * batch
    params.set(grid_m=blocks, grid_heads=heads, grid_batch=batch)
    return (min(tiles, _sm_count(device_id)),) if PERSISTENT_FORWARD else (tiles,)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def _sm90_bias_spec(variant: Variant, bias, nq: int, nk: int):
    """The tensor-map spec through which fwd_sm90.cu loads bias tiles beside K and V:
    for a 16-bit bias with whole rows (not broadcast over queries or keys) that TMA can
    describe; else None, and each thread loads its scores' bias itself (fp32 always)."""
    if bias is None or not variant.mode & MODE_BIAS or bias.dtype.itemsize != 2:
        return None
    if tuple(bias.shape[2:]) != (nq, nk):
        return None
    return _tma.map_spec(bias, variant.block_m)


def _map_specs(*boxes):
    """The tensor-map specs (`_tma.map_spec`) of (array, box rows) pairs, or None where a
    map of one of them cannot be made."""
    specs = tuple(_tma.map_spec(x, rows) for x, rows in boxes)
    return None if any(s is None for s in specs) else specs


def _sm90_map_specs(variant: Variant, q, k, v):
    """fwd_sm90.cu's tensor-map specs of q, k and v (boxes of the query tile's and the key
    tile's rows), or None where a map of one of them cannot be made."""
    block_n = variant.tile[0]
    return _map_specs((q, variant.block_m), (k, block_n), (v, block_n))


# --------------------------------------------------------------------------- backward
#
# The kernels of a backward pass are `_kernels.backward_plan`'s; here the device picks
# among their tiles and the launches run.


def device_backward_plan(dtype_name: str, D: int, deterministic: bool, mode: int, device_id: int) -> BackwardPlan:
    """backward_plan's kernels where every launch has a tile that fits the device; else
    (fp32/fp64 at the largest head dims on ~100 KB GPUs, whose double-buffered tensor-core
    tiles do not fit) the CUDA-core plan, which streams the head dim in chunks."""
    plan = backward_plan(dtype_name, D, deterministic, mode)
    arch, smem_limit = _device_info(device_id)
    launches = [candidates for _, candidates in plan.kv] + ([plan.dq] if plan.dq else [])
    if all(any(v.builds_for(arch) and v.total_smem <= smem_limit for v in c) for c in launches):
        return plan
    return backward_plan(dtype_name, D, deterministic, mode, cuda_cores=True)


@dataclasses.dataclass(frozen=True)
class _BackwardLaunchPlan:
    """What a backward call's signature decides, once: each launch's kernel and grid, the
    row workspaces' padding, the dQ workspace's row stride and the contract's fields less
    the addresses. A call allocates its workspaces, copies ``params`` and adds its own
    addresses and tensor maps (`attention_backward`)."""

    prep: tuple            # (variant, grid) of the pre-pass
    kv: tuple              # per key-block launch: (variant, grid, tensor-map specs or None)
    finish: tuple          # (variant, grid): the deterministic dQ kernel, or the dQ conversion
    nq_pad: int
    dq_ld: int             # 0: no dQ workspace (the dQ kernel computes dq)
    dq_turns: int          # turn counters of a key-block kernel that adds dQ in order (bwd.cuh DqTurns)
    work_counter: bool     # the Hopper key-block kernel's unit counter (bwd_sm90.cu Sm90BwdUnits)
    halves: tuple          # fp32 on it: the passes writing q, k, v and dO as fp16 halves first (split_f32.cu)
    split_units: int       # its units taken in pieces: a piece counter (after the unit counter) and
    split_floats: int      # the fp32 dK and dV sums (floats) of each, zeroed
    params: _params.Params


def _plan_backward(do, q, k, v, o, dq, dk, dv, *, scale, causal, deterministic, mods, dbias,
                   lse_grad: bool = False) -> _BackwardLaunchPlan:
    """The plan of this call's signature: the kernels of `device_backward_plan` that fit the
    device (the Hopper key-block kernel where its tensor maps can be made), their grids and
    the scalar fields. ``lse_grad``: the call passes a dlse, which fp32's Hopper kernel does
    not take (its dS scale is bounded by dO and V alone: kernels_cu/bwd_sm90.cu ds_scale),
    so such calls run the next kernel in line, as do bias calls that its kernel does not
    serve (`_sm90_bias_box`)."""
    B, Hq, Nq, d = q.shape
    Hk, dim_v = k.shape[1], v.shape[3]
    device_id = q.device.id
    D = padded_head_dim(d, dim_v)
    plan = device_backward_plan(q.dtype.name, D, bool(deterministic), backward_mode(mods, D, deterministic), device_id)
    # Under varlen a query tile of the last sequence reads up to a tile past the rows.
    nq_pad = -(-(Nq + (BWD_ROW_PAD if mods.varlen else 0)) // BWD_ROW_PAD) * BWD_ROW_PAD
    batch, rows, keys = _grid_extents(q, k, mods)
    params = _problem_scalars(q, k, v, scale=scale, causal=causal, mods=mods)
    params.set(nq_pad=nq_pad, vec=int(_arrays.rows_16b_aligned(q, k, v, o, do, dq, dk, dv)),
               **dict(zip(("dbias_sb", "dbias_sh", "dbias_sq", "dbias_sk"), _params.element_strides(dbias, 4))))
    kv = []
    split = (0, 0)
    for _, candidates in plan.kv:
        variant, specs = _choose(candidates, device_id), None
        if variant.family.tensor_maps:
            if q.dtype == np.float32:
                specs = None if lse_grad else _sm90_halves_specs(variant, q, k, mods, dbias)
            else:
                specs = _sm90_backward_map_specs(variant, q, k, v, do, mods, dbias)
            if specs is None:   # the next kernel in line
                variant = _choose([c for c in candidates if not c.family.tensor_maps], device_id)
            elif variant.mode & MODE_BIAS:
                params.mods(bias_tma=1)
        key_blocks = math.ceil(keys / variant.block_m)
        units = key_blocks * Hk * batch
        if variant.family is BWD_SM90:   # its units: (key block, kv head, batch entry)
            params.set(grid_n=key_blocks, grid_heads=Hq, grid_batch=batch, whole_units=units, unit_pieces=1)
        if bwd_sm90_persistent(variant):   # one CTA per SM, taking units from a counter
            ctas = min(units, _sm_count(device_id))
            if bwd_sm90_splits_units(variant) and not causal:   # every unit as long: the last round's in pieces
                whole, pieces = sm90_unit_split(units, ctas, (Hq // Hk) * math.ceil(rows / variant.tile[0]))
                params.set(whole_units=whole, unit_pieces=pieces)
                if pieces > 1:
                    split = (units - whole, 2 * variant.block_m * variant.head_dim)
            kv.append((variant, (ctas,), specs))
        else:
            kv.append((variant, (key_blocks, Hk, batch), specs))
    adds_dq = next((v for v, _, _ in kv if v.grads & GRAD_DQ), None)
    # The dQ workspace's rows: padded where the kernel that adds into it wants whole tiles.
    dq_ld = 0 if adds_dq is None else adds_dq.dq_ld or d
    # Ordered dQ: a counter per (batch entry, query head, query tile of the kernel).
    dq_turns = 0
    if adds_dq is not None and adds_dq.grads & GRAD_DQ_ORDERED:
        query_tiles = math.ceil(rows / adds_dq.tile[0])
        dq_turns = batch * Hq * query_tiles
        params.set(grid_m=query_tiles)   # (grid_heads, grid_batch: the Hopper kernel's units, above)
    params.set(dq_ld=dq_ld or d)
    if adds_dq is None:
        variant = _choose(plan.dq, device_id)
        finish = (variant, (math.ceil(rows / variant.block_m), Hq, batch))
    else:
        finish = (plan.convert, (math.ceil(Nq * d / plan.convert.block_m), Hq, B))
    prep = (plan.prep, (nq_pad // plan.prep.block_m, Hq, B))
    work_counter = any(bwd_sm90_persistent(variant) for variant, _, _ in kv)
    halves = halves_passes(MODE_DENSE) if any(isinstance(specs, HalvesMaps) for _, _, specs in kv) else ()
    return _BackwardLaunchPlan(prep, tuple(kv), finish, nq_pad, dq_ld, dq_turns, work_counter, halves, *split, params)


def attention_backward(do, q, k, v, o, lse, dq, dk, dv, *, scale, causal, deterministic,
                       mods=_mods.NONE, dbias=None, dlse=None) -> None:
    """Launch the backward kernels: writes every element of dq, dk and dv.

    Inputs are (B, H, N, d) CuPy views with a contiguous last axis (validated by the
    caller), ``lse`` the forward's (B, Hq, Nq) log-sum-exp and ``mods`` its options
    (`cupyflash._mods`); nothing is copied and the host does not wait for the GPU.
    ``dbias``, when not None, is the bias gradient's accumulator in the compact shape of
    ``mods.bias`` and the accumulation dtype, zeroed by the caller: the key-block kernels
    add dS into it with atomics (summing its broadcast axes). ``dlse``, when not None, is
    the loss's gradient with respect to the LSE ((B, Hq, Nq), the accumulation dtype): it
    is taken off the pre-pass's row term D (dS = P (dP - D + dlse)). Workspaces, allocated from
    CuPy's pool on the current stream: lse2 and delta, 2 * B * Hq * ceil(Nq / 128) * 128
    floats (doubles for fp64); where the key-block kernel adds dq (``deterministic=False``,
    and on Hopper both modes) also the dq accumulator, B * Hq * Nq * d floats (doubles;
    rows padded to D + 8 for bwd_sm90.cu, which adds whole tiles; D is the head dim its
    kernel is instantiated for, 128 for d = 96), and for its ordered additions one 4-byte
    turn counter per query tile; on Hopper without a causal band (d <= 128), the fp32 dK
    and dV sums of the units it splits (fewer than the SMs: 2 * 128 * D * 4 bytes each)
    and a counter each; fp32 on Hopper's dense path, the fp16 halves of q, k, v and dO (as
    many bytes as those) and four words. ``deterministic=True`` computes dq
    bitwise reproducibly (dbias too when the bias broadcasts over no axis).
    """
    import cupy

    if _in_batch_slices(attention_backward, (do, q, k, v, o, lse, dq, dk, dv), mods, scale=scale,
                        causal=causal, deterministic=deterministic, dbias=dbias, dlse=dlse):
        return
    lse = cupy.ascontiguousarray(lse)   # the pre-pass reads it as (B, Hq, Nq) rows
    signature = (*_signature((do, q, k, v, o, dq, dk, dv, dbias), scale=scale, causal=causal, mods=mods),
                 bool(deterministic), dlse is not None)
    plan = _cached_plan(_BACKWARD_PLANS, signature, lambda: _plan_backward(
        do, q, k, v, o, dq, dk, dv, scale=scale, causal=causal, deterministic=deterministic, mods=mods, dbias=dbias,
        lse_grad=dlse is not None))
    B, Hq, Nq, d = q.shape
    acc = _arrays.accumulation_dtype(q.dtype).type
    rows = cupy.empty((2, B, Hq, plan.nq_pad), acc)   # one array: bwd_sm90.cu reads both through one map
    lse2, delta = rows[0], rows[1]
    dq_accum = dq_turns = work_counter = kv_partial = None
    if plan.dq_ld:   # zeroed by the pre-pass (bwd_prep.cu)
        dq_accum = cupy.empty((B, Hq, Nq, plan.dq_ld), acc)
        if plan.dq_turns or plan.work_counter:   # the turn counters, the unit and piece counters: one memset
            counters = cupy.zeros(plan.dq_turns + plan.work_counter + plan.split_units, cupy.uint32)
            dq_turns = counters[:plan.dq_turns] if plan.dq_turns else None
            work_counter = counters[plan.dq_turns:] if plan.work_counter else None
        if plan.split_units:
            kv_partial = cupy.zeros(plan.split_units * plan.split_floats, cupy.float32)
    params = plan.params.copy()
    params.tensor("q", q).tensor("k", k).tensor("v", v).tensor("o", o).tensor("dout", do)
    params.tensor("dq", dq).tensor("dk", dk).tensor("dv", dv).set(
        lse=lse.data.ptr, lse2=lse2.data.ptr, delta=delta.data.ptr, dq_accum=_params.address(dq_accum))
    if mods.active:
        _mods_addresses(params, mods)
    device_id = q.device.id
    _launch(*plan.prep, device_id, params)
    if dlse is not None:   # on the same stream, before the key-block kernels read D
        # Under dropout the row carries its scale (kernels_cu/bwd.cuh): D / s - dlse / s.
        delta[..., :Nq] -= dlse if mods.dropout_p == 0 else dlse * (1.0 / _philox.dropout_scale(mods.dropout_p))
    for variant, grid, specs in plan.kv:
        # Null where the launch adds nothing into dq (or dbias: only the dK launch has dS).
        params.set(dq_accum=_params.address(dq_accum if variant.grads & GRAD_DQ else None),
                   dq_order=_params.address(dq_turns if variant.grads & GRAD_DQ else None),
                   dbias=_params.address(dbias if variant.grads & GRAD_DK else None),
                   work_counter=_params.address(work_counter if bwd_sm90_persistent(variant) else None),
                   kv_partial=_params.address(kv_partial))
        if isinstance(specs, HalvesMaps):
            # Kept alive until the kernel is queued (a buffer freed before would be the next
            # allocation's).
            block_m, block_n = variant.tile[0], variant.block_m
            halves = _halves_maps(plan.halves, 2, params, {"q_map": (q, block_m), "k_map": (k, block_n),
                                                           "v_map": (v, block_n), "dout_map": (do, block_m)}, q=q)
            if specs.bias is not None:
                params.set(**_tensor_maps(specs.bias, (mods.bias,), ("bias_map",)))
        elif specs is not None:
            params.set(**_tensor_maps(specs, (q, do, k, v, mods.bias),
                                      ("q_map", "dout_map", "k_map", "v_map", "bias_map")))
        if specs is not None:
            rows_map = _tma.rows_map(rows, sm90_rows_box(variant.tile[0]))
            if rows_map is None:
                raise RuntimeError("the CUDA driver refused the tensor map of the backward's row workspaces")
            params.set(rows_map=rows_map)
        _launch(variant, grid, device_id, params)
    params.set(dq_accum=_params.address(dq_accum))
    _launch(*plan.finish, device_id, params)


def _sm90_backward_map_specs(variant: Variant, q, k, v, do, mods, dbias):
    """bwd_sm90.cu's tensor-map specs of q and dO (boxes of its query tile's rows), of k
    and v (its key block's) and with MODE_BIAS of the bias (`_sm90_bias_box`); None where
    a map of one of them cannot be made, or for a bias call it does not serve."""
    block_m, block_n = variant.tile[0], variant.block_m
    boxes = [(q, block_m), (do, block_m), (k, block_n), (v, block_n)]
    if variant.mode & MODE_BIAS:
        bias = _sm90_bias_box(variant, q, k, mods, dbias)
        if bias is None:
            return None
        boxes.append(bias)
    return _map_specs(*boxes)


def _sm90_halves_specs(variant: Variant, q, k, mods, dbias):
    """fp32's bwd_sm90.cu specs: HalvesMaps (its q, k, v and dO maps describe the halves,
    made per call, and with MODE_BIAS the bias's as it lies), or None where the bias's map
    cannot be made or the kernel does not serve the bias call (`_sm90_bias_box`)."""
    if not variant.mode & MODE_BIAS:
        return HalvesMaps()
    box = _sm90_bias_box(variant, q, k, mods, dbias)
    bias = _map_specs(box) if box is not None else None
    return None if bias is None else HalvesMaps(bias)


def _sm90_bias_box(variant: Variant, q, k, mods, dbias):
    """The box of bwd_sm90.cu's bias map (the bias, a query sub-tile's rows), or None for a
    bias call that the kernel does not serve: a bias without whole (Nq, Nk) rows, or softcap
    beside it in the deterministic kernels (Sm90BwdKVTile::SOFTCAP_BIAS), or beside the
    bias's gradient (``dbias`` not None, which the kernel adds) where the kernel cannot add
    that in softcap's pass (`bwd_sm90_softcap_dbias`)."""
    bias = mods.bias
    whole_rows = tuple(bias.shape[2:]) == (q.shape[2], k.shape[2])
    softcap_unserved = mods.softcap > 0 and (variant.grads & GRAD_DQ_ORDERED or
                                             (dbias is not None and not bwd_sm90_softcap_dbias(variant)))
    if not whole_rows or softcap_unserved:
        return None
    return bias, BWD_SM90_SUB_M


def _launch(variant: Variant, grid: tuple, device_id: int, params: _params.Params) -> None:
    """One kernel launch on CuPy's current stream: its one argument, the contract."""
    _load(variant, device_id)(grid, (variant.threads,), (params.arg,), shared_mem=variant.smem_bytes)
