"""Streamed attention (`device_memory_limit`, cupyflash/streaming.py): the planner's sizes
and byte counts, its errors, and the streamed result against the in-memory one. The CPU
tier runs the chunked algorithm on the NumPy backend (the host as the "device"); the GPU
tests stream host arrays through the GPU with a tiny limit (many chunks)."""

import ctypes
import sys
import types

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _mods, _philox, _rng, streaming
from oracle import naive_attention, naive_attention_grads, naive_visible
from test_reference import assert_close

TOL = {np.float64: 1e-12, np.float32: 1e-5}  # tests/TOLERANCES.md


def _inputs(rng, dtype, *, b=2, hq=4, hk=2, nq=300, nk=517, d=16, dv=24, layout="bhsd"):
    if layout == "bhsd":
        shapes = [(b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, dv), (b, hq, nq, dv)]
    else:
        shapes = [(b, nq, hq, d), (b, nk, hk, d), (b, nk, hk, dv), (b, nq, hq, dv)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _limit_for(q, k, v, chunk, *, causal=False, layout="bhsd", backward=True, bias_shape=None,
               mask_shape=None, block_size=(128, 128), seqlens=False, alibi_shape=None):
    """The device_memory_limit whose forward plan has ``chunk``-row chunks; with
    ``backward``, the most of that and what the backward needs for ``chunk``-row query and
    key chunks (a context's forward checks both; the backward may then pick other sizes)."""
    from cupyflash import _arrays
    views = [_arrays.bhsd_view(x, layout) for x in (q, k, v)]
    block_size = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    mods = _mods.Modifiers(block_size=block_size,
                           bias=None if bias_shape is None else np.empty(bias_shape, q.dtype),
                           block_mask=None if mask_shape is None else np.empty(mask_shape, np.uint8),
                           seqlens_k=np.empty(1, np.int32) if seqlens else None,
                           alibi_slopes=None if alibi_shape is None else np.empty(alibi_shape))
    # With a dlse row per query and the bias gradient: what a context's forward checks its
    # backward against.
    g = streaming.geometry(*(x.shape for x in views), q.dtype, mods, causal=causal, dlse=backward,
                           dbias=backward)
    rows = lambda n: min(chunk, n)  # noqa: E731
    need = max(sum(streaming.device_buffers(g, rows(g.q_len), rows(g.k_len), back).values())
               for back in {False, backward})
    return need + 1


# Planner -------------------------------------------------------------------------------------


def test_plan_chunks_fit_and_grow_with_the_limit(rng):
    q, k, v, _ = _inputs(rng, np.float32, nq=1000, nk=1000)
    sizes = []
    for chunk in (128, 256, 384, 1024):
        limit = _limit_for(q, k, v, chunk, backward=False)
        plan = cf.streaming_plan(q, k, v, device_memory_limit=limit)
        assert plan.query_chunk == min(chunk, 1000) and plan.key_chunk == plan.query_chunk
        assert plan.device_bytes <= limit == plan.device_memory_limit
        assert plan.device_bytes == sum(plan.buffers.values())
        sizes.append(plan.query_chunk)
    assert sizes == sorted(sizes)
    # One chunk of everything: every byte crosses once.
    assert plan.pairs == 1 and plan.h2d_bytes + plan.d2h_bytes == plan.min_bytes
    assert plan.traffic_ratio == 1.0


def test_plan_byte_counts(rng):
    b, hq, hk, nq, nk, d, dv = 2, 4, 2, 640, 640, 16, 24
    q, k, v, _ = _inputs(rng, np.float32, b=b, hq=hq, hk=hk, nq=nq, nk=nk, d=d, dv=dv)
    plan = cf.streaming_plan(q, k, v, device_memory_limit=_limit_for(q, k, v, 256, backward=False))
    # Non-causal, three query and three key chunks: each query chunk reads every key chunk
    # (three keys cycle through two slots, so none stays resident).
    assert plan.query_bounds == ((0, 256), (256, 512), (512, 640)) and plan.pairs == 9
    assert plan.h2d_bytes == q.nbytes + 3 * (k.nbytes + v.nbytes)
    assert plan.d2h_bytes == b * hq * nq * (dv * 4 + 4)                       # o and lse
    assert plan.min_bytes == q.nbytes + k.nbytes + v.nbytes + b * hq * nq * (dv * 4 + 4)
    # The backward: per pair its query chunk's q, dO, LSE and row term up and its dq back;
    # per key chunk k, v up and dk, dv back once.
    rows_up = q.nbytes + b * hq * nq * (dv + 2) * 4
    back = cf.streaming_plan(q, k, v, device_memory_limit=_limit_for(q, k, v, 256), backward=True)
    assert back.query_bounds == ((0, 128), (128, 256), (256, 384), (384, 512), (512, 640))
    assert back.key_bounds == ((0, 384), (384, 640)) and back.pairs == 10
    assert back.h2d_bytes == 2 * rows_up + k.nbytes + v.nbytes
    assert back.d2h_bytes == 2 * q.nbytes + k.nbytes + v.nbytes
    assert back.min_bytes == rows_up + q.nbytes + 2 * (k.nbytes + v.nbytes)   # dq, dk, dv once
    R, K = b * hq * 128, b * hk * 384
    assert back.buffers["kernel workspaces"] == 2 * R * 4 + R * (d + 8) * 4 + 4 * b * hq * 2
    assert back.buffers["dk, dv sums"] == K * (d + dv) * 4
    assert back.buffers["dq of a pair (2 slots)"] == 2 * R * d * 4
    # All keys in one chunk and every query chunk uploaded once: the least bytes.
    whole = cf.streaming_plan(q, k, v, device_memory_limit=_limit_for(q, k, v, 384), backward=True)
    assert whole.key_bounds == ((0, 640),) and whole.h2d_bytes + whole.d2h_bytes == whole.min_bytes


@pytest.mark.parametrize("nq, nk", [(640, 640), (640, 1000), (1000, 640), (200, 1000)])
def test_causal_plan_pairs_are_visible_hidden_or_diagonal(rng, nq, nk):
    q, k, v, _ = _inputs(rng, np.float32, nq=nq, nk=nk)
    plan = cf.streaming_plan(q, k, v, causal=True,
                             device_memory_limit=_limit_for(q, k, v, 256, causal=True, backward=False))
    off = nk - nq
    computed = {(s.row, s.key): s.causal for s in plan.steps}
    for i, (q0, q1) in enumerate(plan.query_bounds):
        for j, (k0, k1) in enumerate(plan.key_bounds):
            assert k1 - k0 <= 256
            visible = np.tril(np.ones((nq, nk), bool), k=off)[q0:q1, k0:k1]
            if not visible.any():
                assert (i, j) not in computed
            elif visible.all():
                assert computed[(i, j)] is False
            else:   # the diagonal pair: its keys end where the chunk's reach ends
                assert computed[(i, j)] is True and k1 == q1 + off


def _computed_pairs(plan, visible):
    """The plan's steps against a (Nq, Nk) visibility matrix: every pair with a visible
    score is computed once and no other is; yields (step, its visible block, the query
    chunk's bounds, the key chunk's bounds) of each computed pair, for the caller's checks."""
    computed = {(s.row, s.key): s for s in plan.steps}
    assert len(computed) == plan.pairs
    for i, (q0, q1) in enumerate(plan.query_bounds):
        for j, (k0, k1) in enumerate(plan.key_bounds):
            seen = visible[q0:q1, k0:k1]
            if not seen.any():
                assert (i, j) not in computed
            else:
                yield computed[(i, j)], seen, (q0, q1), (k0, k1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk, hq, hk", [(1000, 1000, 4, 4), (700, 1300, 4, 2), (1300, 700, 6, 1),
                                            (100, 1500, 2, 2)])
@pytest.mark.parametrize("chunk", [128, 256, 640])
def test_backward_plan_keeps_key_chunks_resident(rng, causal, nq, nk, hq, hk, chunk):
    """Key chunks outside, each uploaded once and a whole number of query chunks long (or
    every key); every visible pair computed once, with its keys clipped where its query
    chunk's reach ends; the buffers within the limit."""
    q, k, v, _ = _inputs(rng, np.float32, b=1, hq=hq, hk=hk, nq=nq, nk=nk)
    limit = _limit_for(q, k, v, chunk, causal=causal)
    plan = cf.streaming_plan(q, k, v, causal=causal, device_memory_limit=limit, backward=True)
    assert plan.device_bytes <= limit and plan.device_bytes == sum(plan.buffers.values())
    if len(plan.query_bounds) > 1 and len(plan.key_bounds) > 1:
        assert plan.key_chunk % plan.query_chunk == 0
    keys = [s.key for s in plan.steps]
    assert keys == sorted(keys) and sum(s.key_upload for s in plan.steps) == len(set(keys))
    off = nk - nq
    visible = np.tril(np.ones((nq, nk), bool), k=off) if causal else np.ones((nq, nk), bool)
    for s, seen, (q0, q1), (k0, _) in _computed_pairs(plan, visible):
        assert not seen[:, s.key_stop - k0:].any()   # nothing visible past the stop
        assert s.causal == (not seen[:, :s.key_stop - k0].all())
        if s.causal:   # the local call's bottom-right alignment is the global one
            assert s.key_stop == q1 + off
    # The flags the host sums rely on: each chunk's first and last pair in execution order.
    for flag_first, flag_last, of in (("row_first", "row_last", "row"), ("key_first", "key_last", "key")):
        order = [getattr(s, of) for s in plan.steps]
        for t, s in enumerate(plan.steps):
            assert getattr(s, flag_first) == (order.index(order[t]) == t)
            assert getattr(s, flag_last) == (t == len(order) - 1 - order[::-1].index(order[t]))


@pytest.mark.parametrize("causal, window", [(True, (100, 0)), (True, (200, 300)), (False, (0, 150)),
                                            (False, (200, 50)), (False, (40, 40)), (True, (0, 0))])
@pytest.mark.parametrize("nq, nk", [(640, 640), (300, 1000), (1000, 300)])
@pytest.mark.parametrize("backward", [False, True])
def test_window_plan_skips_empty_pairs(rng, causal, window, nq, nk, backward):
    """Pairs the band leaves empty are never computed, and their chunks never copied for
    them; a computed pair's keys end where its query chunk's reach does."""
    q, k, v, _ = _inputs(rng, np.float32, b=1, nq=nq, nk=nk)
    limit = _limit_for(q, k, v, 128, causal=causal, backward=backward)
    plan = cf.streaming_plan(q, k, v, causal=causal, window=window, device_memory_limit=limit,
                             backward=backward)
    below_diagonal = naive_visible(nq, nk, causal=True)
    assert plan.pairs < len(plan.query_bounds) * len(plan.key_bounds)
    for s, part, (q0, q1), (k0, _) in _computed_pairs(plan, naive_visible(nq, nk, causal=causal, window=window)):
        assert not part[:, s.key_stop - k0:].any() and part[:, s.key_stop - k0 - 1].any()
        # A causal call where the diagonal crosses the pair's keys.
        assert s.causal == (causal and not below_diagonal[q0:q1, k0:s.key_stop].all())
    # The calls take the problem's coordinates, so keys are cut where queries are.
    assert all(k0 % 128 == 0 for k0, _ in plan.key_bounds)
    # Chunks go up for the steps that use them only: the same cuts without the window
    # (one wider than both lengths) compute every pair it skips, and move no fewer bytes
    # (a skipped pair saves its key chunk's upload unless a neighbour keeps it resident).
    wide = cf.streaming_plan(q, k, v, causal=causal, window=(nq + nk, nq + nk), device_memory_limit=limit,
                             backward=backward)
    assert wide.key_bounds == plan.key_bounds and wide.query_bounds == plan.query_bounds
    assert {(s.row, s.key) for s in wide.steps} >= {(s.row, s.key) for s in plan.steps}
    assert plan.h2d_bytes <= wide.h2d_bytes
    assert {s.key for s in plan.steps if s.key_upload} == {s.key for s in plan.steps}


def test_options_cut_causal_keys_where_the_queries_are_cut(rng):
    """A causal call without options runs the dense kernels, whose diagonal is the call's
    own corner: its key cuts follow each query chunk's reach (shifted by Nk - Nq). With
    an option the calls are placed in the problem and the keys are cut on the 128-row
    multiples the query chunks start on (dropout's Philox blocks need aligned origins)."""
    q, k, v, _ = _inputs(rng, np.float32, nq=300, nk=517)
    limit = _limit_for(q, k, v, 128, causal=True, backward=False, alibi_shape=(1, 4))
    dense = cf.streaming_plan(q, k, v, causal=True, device_memory_limit=limit)
    assert [k0 for k0, _ in dense.key_bounds] == [0, 89, 217, 345, 473]   # 517 - 300 = 217
    for options in (dict(softcap=2.0), dict(dropout_p=0.1), dict(alibi_slopes=np.ones(4)),
                    dict(window=(50, 0)), dict(seqlens_k=np.array([517, 400]))):
        placed = cf.streaming_plan(q, k, v, causal=True, device_memory_limit=limit, **options)
        assert [k0 for k0, _ in placed.key_bounds] == [0, 128, 256, 384, 512], options


def test_a_plan_draws_no_random_streams(rng):
    q, k, v, _ = _inputs(rng, np.float32, nq=64, nk=64)
    cf.manual_seed(5)
    before = _rng.claim_streams(0)
    cf.streaming_plan(q, k, v, dropout_p=0.3, device_memory_limit=10**8)
    assert _rng.claim_streams(0) == before


def test_backward_plan_at_a_million_tokens():
    """bench/streaming.py's N = 1M row (bf16, d = 128, H = 16, causal, limit 1/8 of the
    in-memory call), within the limit: the backward moves about 90 GiB, 3.2x its least
    (298 GiB, 10.6x, when each pair sent its fp32 dk and dv partials back and took o up)."""
    import ml_dtypes
    # Only shapes, dtype and strides are read: one element stands for the whole array.
    x = np.lib.stride_tricks.as_strided(np.zeros(1, ml_dtypes.bfloat16), (1, 16, 1 << 20, 128), (0, 0, 0, 2))
    unbounded = cf.streaming_plan(x, x, x, causal=True, backward=True, device_memory_limit=2**62)
    limit = unbounded.in_memory_bytes // 8
    plan = cf.streaming_plan(x, x, x, causal=True, backward=True, device_memory_limit=limit)
    assert plan.device_bytes <= limit and plan.key_chunk == 4 * plan.query_chunk
    assert plan.traffic_ratio < 3.3
    # dk, dv back once, as few bytes as can be, and each pair's dq in bf16.
    pair_dq = sum((q1 - q0) * 16 * 128 * 2 for q0, q1 in (plan.query_bounds[s.row] for s in plan.steps))
    assert plan.d2h_bytes == 2 * x.size * 2 + pair_dq


def test_too_small_a_limit_is_named_before_anything_is_allocated(rng, monkeypatch):
    q, k, v, _ = _inputs(rng, np.float32)
    from cupyflash import _arrays

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the error")

    monkeypatch.setattr(_arrays, "empty", no_allocation)
    monkeypatch.setattr(streaming, "_Slot", no_allocation)
    with pytest.raises(ValueError, match=r"device_memory_limit=1000 bytes is too small.*pass at least"):
        cf.attention(q, k, v, backend="numpy", device_memory_limit=1000)
    # A context's forward checks its backward's need too.
    limit = _limit_for(q, k, v, 128, backward=False)
    with pytest.raises(ValueError, match="device_memory_limit"):
        cf.attention_forward(q, k, v, backend="numpy", device_memory_limit=limit)
    with pytest.raises(ValueError, match="device_memory_limit"):
        cf.streaming_plan(q, k, v, device_memory_limit=1000)


def test_a_refused_streamed_call_leaves_the_rng_where_it_was(rng):
    # Dropout without a seed claims its Philox streams only once nothing can refuse the
    # call: after a too-small limit the next call draws what it would have drawn.
    q, k, v, _ = _inputs(rng, np.float32)
    cf.manual_seed(5)
    with pytest.raises(ValueError, match="device_memory_limit"):
        cf.attention(q, k, v, dropout_p=0.3, backend="numpy", device_memory_limit=1000)
    after_refusal = cf.attention(q, k, v, dropout_p=0.3, backend="numpy")
    cf.manual_seed(5)
    clean = cf.attention(q, k, v, dropout_p=0.3, backend="numpy")
    np.testing.assert_array_equal(after_refusal, clean)


@pytest.mark.parametrize("limit, error", [(0, ValueError), (-5, ValueError), (1.5e9, TypeError),
                                          (True, TypeError), ("1GB", TypeError)])
def test_bad_limits_are_named(rng, limit, error):
    q, k, v, _ = _inputs(rng, np.float32, nq=8, nk=8)
    with pytest.raises(error, match="device_memory_limit"):
        cf.attention(q, k, v, backend="numpy", device_memory_limit=limit)


def test_bad_progress_is_named(rng, monkeypatch):
    q, k, v, _ = _inputs(rng, np.float32, nq=8, nk=8)
    with pytest.raises(TypeError, match="progress"):
        cf.attention(q, k, v, backend="numpy", device_memory_limit=10**8, progress=3)
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="progress='tqdm' needs the tqdm package"):
        cf.attention(q, k, v, backend="numpy", device_memory_limit=10**8, progress="tqdm")


# Streamed == in memory (NumPy backend) ---------------------------------------------------------


def _compare(rng, dtype, *, chunk=128, layout="bhsd", dlse=False, dbias=False, shapes=None, **options):
    """Streamed forward, LSE and gradients (with ``dbias``, the bias gradient too) against
    the in-memory call on the same inputs."""
    q, k, v, do = _inputs(rng, dtype, layout=layout, **(shapes or {}))
    before = [x.copy() for x in (q, k, v, do)]
    bias = options.get("bias")
    mask = options.get("block_mask")
    slopes = options.get("alibi_slopes")
    limit = _limit_for(q, k, v, chunk, causal=options.get("causal", False), layout=layout,
                       bias_shape=None if bias is None else (1,) * (4 - bias.ndim) + bias.shape,
                       mask_shape=None if mask is None else (1,) * (4 - mask.ndim) + mask.shape,
                       block_size=options.get("block_size", (128, 128)),
                       seqlens="seqlens_k" in options,
                       alibi_shape=None if slopes is None else (1,) * (2 - slopes.ndim) + slopes.shape)
    o_ref, ctx_ref = cf.attention_forward(q, k, v, layout=layout, backend="numpy", **options)
    o, ctx = cf.attention_forward(q, k, v, layout=layout, backend="numpy",
                                  device_memory_limit=limit, **options)
    assert ctx.streaming is not None and ctx_ref.streaming is None
    nq = ctx.lse.shape[-1]
    assert ctx.streaming.query_chunk % 128 == 0 or ctx.streaming.query_chunk == nq
    tol = TOL[dtype]
    assert_close(o, o_ref, tol)
    assert (np.isneginf(ctx.lse) == np.isneginf(ctx_ref.lse)).all()
    finite = np.isfinite(ctx_ref.lse)
    assert_close(ctx.lse[finite], ctx_ref.lse[finite], tol)
    g = rng.standard_normal(ctx.lse.shape).astype(dtype) if dlse else None
    grads = cf.attention_backward(do, ctx, dlse=g, return_dbias=dbias)
    grads_ref = cf.attention_backward(do, ctx_ref, dlse=g, return_dbias=dbias)
    # dk cancels to rounding noise where a row sees one key (softmax over one key has no
    # gradient): every gradient is measured against the size of dv, which does not cancel.
    size = np.linalg.norm(grads_ref[2].astype(np.float64))
    if dbias:   # against its own size (summed over keys without dlse, dS cancels: the tests pass dlse)
        assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
        assert_close(grads[3], grads_ref[3], tol)
    for got, ref in zip(grads, grads_ref):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        err = np.linalg.norm((got.astype(np.float64) - ref).ravel())
        assert err <= tol * max(np.linalg.norm(ref.astype(np.float64)), size)
    for x, y in zip((q, k, v, do), before):
        np.testing.assert_array_equal(x, y)
    return ctx


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(300, 517), (517, 300), (384, 384), (1, 7), (129, 1)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_streamed_equals_in_memory(rng, dtype, causal, nq, nk):
    ctx = _compare(rng, dtype, causal=causal, shapes=dict(nq=nq, nk=nk))
    if nq > 128 and nk > 128:
        assert ctx.streaming.pairs > 1


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_streamed_layouts_gqa_and_dlse(rng, layout):
    _compare(rng, np.float64, causal=True, layout=layout, dlse=True,
             shapes=dict(b=1, hq=6, hk=1, nq=400, nk=260))


@pytest.mark.parametrize("shape", [(300, 517), (4, 1, 517), (2, 4, 300, 517), (300, 1)],
                         ids=["NqNk", "head-broadcast", "full", "rows"])
def test_streamed_bias(rng, shape):
    bias = rng.standard_normal(shape)
    if shape[-2] > 3:
        bias[..., 3, :] = -np.inf   # a row that sees no key
    _compare(rng, np.float64, causal=True, bias=bias)


# Bias shapes (bhsd, B = 2, Hq = 4, Nq = 389, Nk = 517) broadcasting over each axis of the
# compact (Bb, Hb, Nqb, Nkb) bias, or none.
_BIAS_SHAPES = {"full": (2, 4, 389, 517), "over-batch": (1, 4, 389, 517), "over-heads": (2, 1, 389, 517),
                "over-rows": (2, 4, 1, 517), "over-keys": (2, 4, 389, 1), "over-batch-and-heads": (389, 517),
                "over-rows-and-keys": (4, 1, 1), "scalar": (1,)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(_BIAS_SHAPES.values()), ids=list(_BIAS_SHAPES))
def test_streamed_bias_gradient(rng, causal, shape):
    """The bias gradient streamed in chunks of 128 (slices shared by many pairs where the
    bias broadcasts, summed on the device over a key chunk or on the host over the
    pairs) against the in-memory call. dlse keeps dbias summed over keys from cancelling
    to rounding noise (sum_j dS_ij = dlse_i)."""
    bias = rng.standard_normal(shape)
    ctx = _compare(rng, np.float64, causal=causal, dlse=True, dbias=True, bias=bias,
                   shapes=dict(b=2, hq=4, hk=2, nq=389, nk=517))
    assert ctx.streaming.pairs > 3


@pytest.mark.parametrize("shape", ["full", "over-rows", "over-keys"])
def test_streamed_bias_gradient_float32(rng, shape):
    bias = rng.standard_normal(_BIAS_SHAPES[shape]).astype(np.float32)
    _compare(rng, np.float32, causal=True, dlse=True, dbias=True, bias=bias,
             shapes=dict(b=2, hq=4, hk=2, nq=389, nk=517))


def test_streamed_bias_gradient_against_the_oracle(rng):
    q, k, v, do = _inputs(rng, np.float64, nq=300, nk=400)
    bias = rng.standard_normal((4, 300, 400))
    limit = _limit_for(q, k, v, 128, causal=True, bias_shape=(1, 4, 300, 400))
    o, vjp = cf.attention_vjp(q, k, v, causal=True, bias=bias, backend="numpy", device_memory_limit=limit)
    scale = 1 / np.sqrt(q.shape[-1])
    refs = naive_attention_grads(do, q, k, v, scale=scale, causal=True, bias=bias)
    for got, ref in zip(vjp(do, return_dbias=True), refs):
        assert got.shape == ref.shape
        assert_close(got, ref, TOL[np.float64])


@pytest.mark.parametrize("shape", ["over-batch-and-heads", "over-keys", "scalar"])
def test_streamed_bias_gradient_is_deterministic(rng, shape):
    """Slices that many pairs add into are summed in the steps' order: two runs agree bit
    for bit."""
    q, k, v, do = _inputs(rng, np.float32, nq=389, nk=517)
    bias = rng.standard_normal(_BIAS_SHAPES[shape]).astype(np.float32)
    limit = _limit_for(q, k, v, 128, causal=True, bias_shape=(1,) * (4 - bias.ndim) + bias.shape)
    o, ctx = cf.attention_forward(q, k, v, causal=True, bias=bias, backend="numpy", device_memory_limit=limit)
    dlse = rng.standard_normal(ctx.lse.shape).astype(np.float32)
    first, second = (cf.attention_backward(do, ctx, dlse=dlse, return_dbias=True) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shape", ["full", "over-rows", "over-keys", "scalar"])
@pytest.mark.parametrize("causal", [False, True])
def test_bias_gradient_plan(rng, shape, causal):
    """The backward plan with the bias gradient: its slices are within the limit, and the
    bytes it sends back are each pair's slice (keys up to the pair's stop), or each key
    chunk's once where the bias broadcasts over rows."""
    q, k, v, _ = _inputs(rng, np.float64, nq=389, nk=517)
    bias = np.zeros(_BIAS_SHAPES[shape])
    compact = (1,) * (4 - bias.ndim) + bias.shape
    limit = _limit_for(q, k, v, 128, causal=causal, bias_shape=compact)
    without = cf.streaming_plan(q, k, v, causal=causal, bias=bias, device_memory_limit=limit, backward=True)
    plan = cf.streaming_plan(q, k, v, causal=causal, bias=bias, device_memory_limit=limit, backward=True,
                             return_dbias=True)
    assert plan.device_bytes <= limit and plan.device_bytes == sum(plan.buffers.values())
    bb, hb, nqb, nkb = compact
    rows, keys = lambda n: n if nqb > 1 else 1, lambda n: n if nkb > 1 else 1  # noqa: E731
    assert plan.buffers["dbias slices (2 slots)"] == 2 * bb * hb * rows(plan.query_chunk) * keys(plan.key_chunk) * 8
    assert "dbias slices (2 slots)" not in without.buffers
    if (plan.query_bounds, plan.key_bounds) == (without.query_bounds, without.key_bounds):
        if nqb == 1:
            sent = sum(keys(k1 - k0) for k0, k1 in {plan.key_bounds[s.key] for s in plan.steps})
        else:
            sent = sum(rows(q1 - q0) * keys(s.key_stop - plan.key_bounds[s.key][0])
                       for s in plan.steps for q0, q1 in [plan.query_bounds[s.row]])
        assert plan.d2h_bytes - without.d2h_bytes == bb * hb * sent * 8
    assert plan.min_bytes - without.min_bytes == bias.size * 8


def test_a_limit_too_small_for_the_bias_gradient_is_named(rng):
    """A context's forward with a bias checks that its backward fits with the gradient's
    slices too."""
    q, k, v, _ = _inputs(rng, np.float64, nq=389, nk=517)
    bias = rng.standard_normal((2, 4, 389, 517))
    limit = _limit_for(q, k, v, 128, bias_shape=bias.shape)
    cf.attention_forward(q, k, v, bias=bias, backend="numpy", device_memory_limit=limit)
    mods = _mods.Modifiers(bias=bias)
    g = streaming.geometry(q.shape, k.shape, v.shape, q.dtype, mods, causal=False, dlse=True)
    short = max(sum(streaming.device_buffers(g, 128, 128, back).values()) for back in (False, True)) + 1
    assert short < limit
    with pytest.raises(ValueError, match="device_memory_limit"):
        cf.attention_forward(q, k, v, bias=bias, backend="numpy", device_memory_limit=short)


def test_streamed_block_mask_skips_empty_pairs(rng):
    mask = np.zeros((4, 3, 5), bool)   # (Hq, query blocks, key blocks) of 128
    mask[:, 0, 0] = mask[:, 2, 4] = mask[1:, 1, 2] = True
    ctx = _compare(rng, np.float64, block_mask=mask)
    assert ctx.streaming.pairs == 3   # 3 x 5 pairs, only these hold a visible block


def test_streamed_block_mask_of_wider_blocks(rng):
    mask = rng.random((3, 3)) < 0.6    # blocks of 192 rows and keys: chunks of 384
    mask[:, 0] = True
    ctx = _compare(rng, np.float64, chunk=384, block_mask=mask, block_size=192, causal=True,
                   shapes=dict(nq=517, nk=517))
    assert ctx.streaming.query_chunk in (384, 517)   # multiples of lcm(128, 192), or all rows
    q, k, v, _ = _inputs(rng, np.float64, nq=517, nk=517)
    limit = _limit_for(q, k, v, 384, causal=True, backward=False, mask_shape=(1, 1, 3, 3), block_size=192)
    plan = cf.streaming_plan(q, k, v, causal=True, block_mask=mask, block_size=192, device_memory_limit=limit)
    assert plan.query_bounds == ((0, 384), (384, 517))
    with pytest.raises(ValueError, match="one chunk of 384 rows"):
        cf.streaming_plan(q, k, v, causal=True, block_mask=mask, block_size=192,
                          device_memory_limit=_limit_for(q, k, v, 256, causal=True, backward=False))


def test_streamed_causal_block_mask_with_any_diagonal(rng):
    """Nk - Nq = 217 is no multiple of the blocks: placed calls cut keys on the blocks."""
    mask = rng.random((4, 3, 5)) < 0.6   # (Hq, query blocks, key blocks) of 128
    mask[..., 0] = True
    ctx = _compare(rng, np.float64, causal=True, block_mask=mask, shapes=dict(nq=300, nk=517))
    assert all(k0 % 128 == 0 for k0, _ in ctx.streaming.key_bounds)


@pytest.mark.parametrize("causal, window", [(True, (100, 0)), (False, (150, 0)), (False, (0, 150)),
                                            (False, (60, 90)), (True, (200, 300)), (True, (0, 0))],
                         ids=["causal-left", "left", "right", "two-sided", "causal-two-sided", "diagonal"])
@pytest.mark.parametrize("nq, nk", [(300, 517), (517, 300), (640, 640)])
def test_streamed_window(rng, causal, window, nq, nk):
    """One-sided and two-sided windows, with and without causal, streamed in chunks of 128
    (forward and gradients) against the in-memory call: each pair's band is the
    problem's, whatever Nk - Nq and the cuts."""
    ctx = _compare(rng, np.float64, causal=causal, window=window, shapes=dict(nq=nq, nk=nk))
    assert ctx.streaming.pairs > 2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch-and-head"])
@pytest.mark.parametrize("nq, nk", [(300, 517), (517, 300)])
def test_streamed_alibi(rng, causal, per_batch, nq, nk):
    """ALiBi's distance |i + Nk - Nq - j| is the problem's in every pair (without causal
    a wrong diagonal changes the scores' shape along the row, not just a constant)."""
    slopes = rng.uniform(0.01, 0.3, (2, 4) if per_batch else (4,))
    ctx = _compare(rng, np.float64, causal=causal, alibi_slopes=slopes, shapes=dict(nq=nq, nk=nk))
    assert ctx.streaming.pairs > 2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(300, 517), (517, 300)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_streamed_dropout(rng, dtype, causal, nq, nk):
    """Dropout with a fixed seed: every pair draws the problem's bits from the call's one
    RNG offset, so the streamed call keeps exactly the in-memory call's scores."""
    ctx = _compare(rng, dtype, causal=causal, dropout_p=0.3, seed=2**40 + 3, shapes=dict(nq=nq, nk=nk))
    assert ctx.streaming.pairs > 2


@pytest.mark.parametrize("causal", [False, True])
def test_streamed_dropout_keeps_the_in_memory_mask(causal):
    """The keep mask itself, read out of the output: with q = 0 every visible key is equally
    likely and v_j = e_j, so o[i, j] = keep_ij / (1 - p) / (keys row i sees), nonzero
    exactly where the score is visible and kept."""
    b, hq, hk, nq, nk, p, seed = 2, 4, 2, 300, 256, 0.3, 12345
    q = np.zeros((b, hq, nq, 16))
    k = np.ones((b, hk, nk, 16))
    v = np.broadcast_to(np.eye(nk), (b, hk, nk, nk)).copy()
    limit = _limit_for(q, k, v, 128, causal=causal)
    o = cf.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, backend="numpy", device_memory_limit=limit)
    o_mem = cf.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, backend="numpy")
    assert cf.streaming_plan(q, k, v, causal=causal, dropout_p=p, device_memory_limit=limit).pairs > 3
    visible = naive_visible(nq, nk, causal=causal)
    for bi in range(b):
        for h in range(hq):
            keep = _philox.dropout_keep_mask(seed, 0, bi, h, nq, nk, p=p, heads=hq) & visible
            np.testing.assert_array_equal(o[bi, h] != 0, keep)
            np.testing.assert_array_equal(o_mem[bi, h] != 0, keep)
    assert_close(o, o_mem, TOL[np.float64])


def test_streamed_dropout_advances_the_rng_as_one_call(rng):
    """Without a seed a streamed call claims its streams once, as the in-memory call does:
    the same seed and offset, the same masks, and the next call starts after them."""
    q, k, v, _ = _inputs(rng, np.float64, nq=300, nk=300)
    limit = _limit_for(q, k, v, 128)
    runs = []
    for lim in (limit, None):
        cf.manual_seed(2024)
        runs.append([cf.attention_forward(q, k, v, dropout_p=0.2, backend="numpy", device_memory_limit=lim)
                     for _ in range(2)])
    streamed, in_memory = runs
    for (o, ctx), (o_ref, ref) in zip(streamed, in_memory):
        assert ctx.streaming is not None and ref.streaming is None
        assert (ctx.seed, ctx.rng_offset) == (ref.seed, ref.rng_offset)
        assert_close(o, o_ref, TOL[np.float64])
    assert streamed[1][1].rng_offset == streamed[0][1].rng_offset + 2 * 4   # B * Hq streams
    assert not np.allclose(streamed[0][0], streamed[1][0])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_streamed_options_together(rng, layout, dtype):
    """Window, ALiBi, dropout, softcap, a bias and its gradient, key padding, causal, GQA
    and dlse at once, on odd sizes cut into chunks of 128."""
    nq, nk = 389, 517
    bias = rng.standard_normal((nq, nk))
    bias[5, :] = -np.inf   # a row that sees no key
    ctx = _compare(rng, dtype, layout=layout, dlse=True, dbias=True, causal=True, window=(150, 0),
                   alibi_slopes=rng.uniform(0.01, 0.2, (2, 6)), dropout_p=0.25, seed=77, softcap=4.0,
                   seqlens_k=np.array([517, 401]), bias=bias.astype(dtype),
                   shapes=dict(b=2, hq=6, hk=2, nq=nq, nk=nk))
    assert ctx.streaming.pairs > 3


def test_streamed_seqlens_k_and_softcap(rng):
    seqlens = np.array([0, 333])
    ctx = _compare(rng, np.float64, seqlens_k=seqlens, softcap=5.0)
    # Key chunks past every entry's length are never computed (517 keys: chunks from 384 on).
    assert all(ctx.streaming.key_bounds[s.key][0] < 333 for s in ctx.streaming.steps)


def test_streamed_against_the_oracle(rng):
    """The streamed path against float64 attention itself, not only against the in-memory
    backend (which shares the backend's per-pair code)."""
    q, k, v, do = _inputs(rng, np.float64, nq=300, nk=400)
    limit = _limit_for(q, k, v, 128, causal=True)
    o, vjp = cf.attention_vjp(q, k, v, causal=True, backend="numpy", device_memory_limit=limit)
    scale = 1 / np.sqrt(q.shape[-1])
    ref_o, _ = naive_attention(q, k, v, scale=scale, causal=True)
    assert_close(o, ref_o, TOL[np.float64])
    for got, ref in zip(vjp(do), naive_attention_grads(do, q, k, v, scale=scale, causal=True)):
        assert_close(got, ref, TOL[np.float64])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b, hq, hk, nq, nk", [(1, 4, 4, 517, 517), (2, 6, 2, 300, 1000),
                                               (1, 4, 1, 1000, 300), (1, 2, 2, 100, 1100),
                                               (2, 2, 1, 1100, 129)],
                         ids=["square", "gqa-nq<nk", "mqa-nq>nk", "one-query-chunk", "few-keys"])
def test_streamed_gradients_with_many_chunks_against_the_oracle(rng, causal, b, hq, hk, nq, nk):
    """Gradients streamed through a limit that leaves chunks of 128-384 rows (many key
    chunks each passed by many query chunks; a query chunk summed over several key chunks
    on the host, a key chunk over several query chunks on the device) against float64
    attention itself."""
    q, k, v, do = _inputs(rng, np.float64, b=b, hq=hq, hk=hk, nq=nq, nk=nk)
    limit = _limit_for(q, k, v, 128, causal=causal)
    back = cf.streaming_plan(q, k, v, causal=causal, device_memory_limit=limit, backward=True)
    assert back.pairs >= 3
    o, vjp = cf.attention_vjp(q, k, v, causal=causal, backend="numpy", device_memory_limit=limit)
    scale = 1 / np.sqrt(q.shape[-1])
    assert_close(o, naive_attention(q, k, v, scale=scale, causal=causal)[0], TOL[np.float64])
    grads = vjp(do)
    for got, ref in zip(grads, naive_attention_grads(do, q, k, v, scale=scale, causal=causal)):
        assert got.shape == ref.shape
        assert_close(got, ref, TOL[np.float64])


def test_key_chunks_no_query_sees_get_zero_gradients(rng):
    """Key chunks past every entry's seqlens_k are never computed; their dk, dv are zero."""
    q, k, v, do = _inputs(rng, np.float64, b=2, nq=300, nk=1000)
    seqlens = np.array([200, 300])
    limit = _limit_for(q, k, v, 128, seqlens=True)
    o, vjp = cf.attention_vjp(q, k, v, seqlens_k=seqlens, backend="numpy", device_memory_limit=limit)
    plan = cf.streaming_plan(q, k, v, seqlens_k=seqlens, device_memory_limit=limit, backward=True)
    assert max(plan.key_bounds[s.key][1] for s in plan.steps) < 1000   # the last chunks never run
    dq, dk, dv = vjp(do)
    assert not dk[:, :, 300:].any() and not dv[:, :, 300:].any()
    assert not dk[0, :, 200:].any()
    ref = naive_attention_grads(do, q, k, v, scale=1 / np.sqrt(q.shape[-1]), causal=False, seqlens_k=seqlens)
    for got, want in zip((dq, dk, dv), ref):
        assert_close(got, want, TOL[np.float64])


# Varlen: groups of whole sequences in memory, a long sequence streamed -----------------------

# Query and key lengths per sequence: short ones that group, empty ones (no rows; no keys),
# a long one that streams in many chunks (Nq < Nk and Nq > Nk), and one with no query rows
# and too many keys to fit alone (set on the host).
_VARLEN_Q = [5, 60, 0, 40, 700, 3, 90, 1, 0, 389]
_VARLEN_K = [7, 80, 9, 0, 650, 3, 70, 1, 2000, 1517]


def _varlen_inputs(rng, dtype, hq=4, hk=2, d=16, dv=24):
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (_VARLEN_Q, _VARLEN_K))
    shapes = [(cu_q[-1], hq, d), (cu_k[-1], hk, d), (cu_k[-1], hk, dv), (cu_q[-1], hq, dv)]
    return [rng.standard_normal(x).astype(dtype) for x in shapes], cu_q, cu_k


def _varlen_limit(q, k, v, *, causal=False, alibi=False):
    """A limit whose chunks are 128 rows for the longest sequence (batch 1): the short ones
    group under it, the long ones stream."""
    hq, hk = q.shape[1], k.shape[1]
    views = [np.empty((1, h, n, x.shape[-1]), x.dtype) for x, h, n in ((q, hq, 700), (k, hk, 650), (v, hk, 650))]
    return _limit_for(*views, 128, causal=causal, alibi_shape=(1, hq) if alibi else None)


def _varlen_compare(rng, dtype, *, hq=4, hk=2, dlse=True, **options):
    (q, k, v, do), cu_q, cu_k = _varlen_inputs(rng, dtype, hq=hq, hk=hk)
    before = [x.copy() for x in (q, k, v, do)]
    limit = _varlen_limit(q, k, v, causal=options.get("causal", False), alibi="alibi_slopes" in options)
    args = (q, k, v, cu_q, cu_k, max(_VARLEN_Q), max(_VARLEN_K))
    o_ref, ctx_ref = cf.varlen_attention_forward(*args, backend="numpy", **options)
    calls = []
    o, ctx = cf.varlen_attention_forward(*args, backend="numpy", device_memory_limit=limit,
                                         progress=lambda done, total: calls.append((done, total)), **options)
    plan = ctx.streaming
    assert ctx_ref.streaming is None and plan.device_bytes <= limit
    assert [p.kind for p in plan.parts].count("streamed") >= 2 and "group" in [p.kind for p in plan.parts]
    assert calls == [(n, plan.pairs) for n in range(1, plan.pairs + 1)]
    # float16 and bfloat16 outputs and gradients are rounded to their dtype on both sides
    # (tests/TOLERANCES.md's limits for them).
    tol = {np.float64: TOL[np.float64], np.float32: TOL[np.float32], np.float16: 3e-3}.get(dtype, 1e-2)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert_close(o, o_ref, tol)
    assert (np.isneginf(ctx.lse) == np.isneginf(ctx_ref.lse)).all()
    finite = np.isfinite(ctx_ref.lse)
    assert_close(ctx.lse[finite], ctx_ref.lse[finite], tol)
    g = rng.standard_normal(ctx.lse.shape).astype(np.float32) if dlse else None
    calls.clear()
    grads = cf.attention_backward(do, ctx, dlse=g)
    back = cf.attention_backward(do, ctx_ref, dlse=g)
    total = calls[-1][1]
    assert calls == [(n, total) for n in range(1, total + 1)]
    size = np.linalg.norm(back[2].astype(np.float64))
    for got, ref in zip(grads, back):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        err = np.linalg.norm((got.astype(np.float64) - ref).ravel())
        assert err <= tol * max(np.linalg.norm(ref.astype(np.float64)), size)
    # The sequence with no query rows and 2000 keys ran nowhere: its key gradients are 0.
    keys = slice(cu_k[8], cu_k[9])
    assert not grads[1][keys].any() and not grads[2][keys].any()
    for x, y in zip((q, k, v, do), before):
        np.testing.assert_array_equal(x, y)
    return ctx


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hk", [(4, 2), (2, 2), (3, 1)], ids=["gqa", "mha", "mqa"])
def test_streamed_varlen_equals_in_memory(rng, causal, hq, hk):
    """Packed sequences, short and long, empty ones among them, streamed in groups and
    chunks against the in-memory varlen call: forward, LSE, dq, dk, dv (with dlse)."""
    _varlen_compare(rng, np.float64, causal=causal, hq=hq, hk=hk)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_streamed_varlen_dtypes(rng, dtype):
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    _varlen_compare(rng, np.dtype(dtype).type, causal=True)


def test_streamed_varlen_options(rng):
    """Window, ALiBi per sequence, dropout and softcap: a streamed sequence takes its own
    corner, its own row of slopes and its own dropout streams (``s * Hq`` past the call's
    offset), the groups theirs from their first sequence."""
    slopes = rng.uniform(0.01, 0.2, (len(_VARLEN_Q), 4))
    _varlen_compare(rng, np.float64, causal=True, window=(150, 20), alibi_slopes=slopes, dropout_p=0.25,
                    seed=2**40 + 9, softcap=3.0)


def test_streamed_varlen_dropout_without_a_seed(rng):
    """Without a seed the streamed call claims the call's streams once, as in memory."""
    (q, k, v, _), cu_q, cu_k = _varlen_inputs(rng, np.float64)
    limit = _varlen_limit(q, k, v)
    outs = []
    for lim in (limit, None):
        cf.manual_seed(7)
        outs.append(cf.varlen_attention(q, k, v, cu_q, cu_k, 700, 2000, dropout_p=0.3, backend="numpy",
                                        device_memory_limit=lim))
    assert_close(outs[0], outs[1], TOL[np.float64])


def test_varlen_plan_groups_what_fits(rng):
    """Parts cover the sequences in order; each group is as long as the limit allows (the
    next sequence would not fit), each streamed sequence would not fit alone, and every
    part's bytes are within the limit."""
    from cupyflash import streaming_varlen
    (q, k, v, _), cu_q, cu_k = _varlen_inputs(rng, np.float64)
    limit = _varlen_limit(q, k, v, causal=True)
    o, ctx = cf.varlen_attention_forward(q, k, v, cu_q, cu_k, 700, 2000, causal=True, backend="numpy",
                                         device_memory_limit=limit)
    for backward in (False, True):
        g = streaming.geometry((1, 4, cu_q[-1], 16), (1, 2, cu_k[-1], 16), (1, 2, cu_k[-1], 24), np.float64,
                               ctx._modifiers, causal=True)
        plan = streaming_varlen.plan_for(g, ctx._modifiers, limit, backward=backward)
        assert [p.first for p in plan.parts] == [0, *(p.stop for p in plan.parts[:-1])]
        assert plan.parts[-1].stop == len(_VARLEN_Q) and plan.device_bytes <= limit
        bytes_of = lambda a, b: streaming_varlen._group_bytes(g, cu_q, cu_k, a, b, backward)  # noqa: E731
        for part, after in zip(plan.parts, plan.parts[1:] + (None,)):
            assert part.device_bytes <= limit
            if part.kind == "group":
                assert part.device_bytes == bytes_of(part.first, part.stop)
                assert after is None or bytes_of(part.first, part.stop + 1) > limit
            else:
                assert part.stop == part.first + 1 and bytes_of(part.first, part.stop) > limit
            if part.kind == "streamed":
                assert part.plan.pairs > 1 and part.plan.device_bytes <= limit
        kinds = {p.first: p.kind for p in plan.parts}
        assert kinds[4] == kinds[9] == "streamed" and kinds[8] == "host"
        assert plan.pairs == sum(1 if p.kind == "group" else p.pairs for p in plan.parts)


def test_varlen_too_small_a_limit_is_named_before_anything_is_allocated(rng, monkeypatch):
    (q, k, v, _), cu_q, cu_k = _varlen_inputs(rng, np.float32)
    from cupyflash import _arrays

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the error")

    monkeypatch.setattr(_arrays, "empty", no_allocation)
    with pytest.raises(ValueError, match=r"device_memory_limit=20000 bytes is too small"):
        cf.varlen_attention(q, k, v, cu_q, cu_k, 700, 2000, backend="numpy", device_memory_limit=20000)
    with pytest.raises(TypeError, match="device_memory_limit"):
        cf.varlen_attention(q, k, v, cu_q, cu_k, 700, 2000, backend="numpy", device_memory_limit="1GB")


def test_pieces_cut_chunks_into_contiguous_parts(monkeypatch):
    monkeypatch.setattr(streaming, "_PIECE_BYTES", 1024)
    for shape in [(2, 3, 5, 8), (2, 3, 50, 8), (1, 2, 300), (3, 1, 7), (2, 2, 0, 8)]:
        chunk = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        covered = np.zeros(shape, int)
        for index in streaming._pieces(shape, 4):
            part = chunk[index]
            assert part.flags.c_contiguous and 0 < part.nbytes <= 1024
            covered[index] += 1
        assert (covered == 1).all()


class _FakeCupy(types.ModuleType):
    """The part of CuPy that `streaming._CudaMover` uses, over NumPy: "device" arrays are
    host arrays, copies are immediate memmoves between the addresses given, streams and
    events do nothing; ``events_done`` is what an event's ``done`` says (False: the work
    never seems finished until waited for). Other names are NumPy's."""

    def __init__(self, events_done):
        super().__init__("cupy")
        stream = types.SimpleNamespace(ptr=0, wait_event=lambda event: None, synchronize=lambda: None)

        def memcpy(dst, src, nbytes, kind, stream_ptr):
            ctypes.memmove(dst, src, nbytes)

        event = lambda **kw: types.SimpleNamespace(record=lambda stream=None: None,  # noqa: E731
                                                   synchronize=lambda: None, done=events_done)
        self.cuda = types.SimpleNamespace(
            get_current_stream=lambda: stream, Stream=lambda **kw: stream, Event=event,
            runtime=types.SimpleNamespace(memcpyAsync=memcpy, memcpyHostToDevice=1, memcpyDeviceToHost=2))

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.mark.parametrize("events_done", [True, False], ids=["downloads-at-once", "downloads-at-reclaim"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_shape", [None, (4, 700, 900), (2, 4, 1, 900), (1, 1, 700, 1)],
                         ids=["no-bias", "dbias-per-pair", "dbias-per-key-chunk", "dbias-summed-on-host"])
def test_gpu_copy_path_on_the_cpu(rng, monkeypatch, causal, events_done, bias_shape):
    """The GPU path's copies (chunks cut into pieces, pinned-buffer rings reused, downloads
    carried out as soon as ready or when their slot is needed again, in the order issued,
    their host sums split over threads) run on the CPU through `_FakeCupy`, with tiny
    pieces: the same results, bit for bit, as the NumPy "device", the bias gradient's
    slices included."""
    q, k, v, do = _inputs(rng, np.float32, b=2, hq=4, hk=2, nq=700, nk=900, d=16, dv=24)
    bias = None if bias_shape is None else rng.standard_normal(bias_shape).astype(np.float32)
    limit = _limit_for(q, k, v, 128, causal=causal,
                       bias_shape=None if bias is None else (1,) * (4 - bias.ndim) + bias.shape)
    dlse = rng.standard_normal((2, 4, 700)).astype(np.float32)

    def run():
        o, ctx = cf.attention_forward(q, k, v, causal=causal, bias=bias, backend="numpy",
                                      device_memory_limit=limit)
        return (o, ctx.lse, *cf.attention_backward(do, ctx, dlse=dlse, return_dbias=bias is not None))

    expected = run()
    fake = _FakeCupy(events_done)
    monkeypatch.setattr(streaming._arrays, "cupy_module", lambda: fake)
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=np.empty))
    monkeypatch.setattr(streaming, "mover", lambda backend: streaming._CudaMover())
    monkeypatch.setattr(streaming, "_PIECE_BYTES", 4000)   # row ranges of a head and runs of heads
    monkeypatch.setattr(streaming, "_PIECES", 2)
    monkeypatch.setattr(streaming, "_HOST_TASK_BYTES", 512)
    for got, want in zip(run(), expected):
        np.testing.assert_array_equal(got, want)


def test_progress_reports_increasing_counts(rng):
    q, k, v, do = _inputs(rng, np.float32, nq=520, nk=520)
    limit = _limit_for(q, k, v, 128, causal=True)
    calls = []
    o, ctx = cf.attention_forward(q, k, v, causal=True, backend="numpy", device_memory_limit=limit,
                                  progress=lambda done, total: calls.append((done, total)))
    total = ctx.streaming.pairs
    assert total == 15 and calls == [(n, total) for n in range(1, total + 1)]
    calls.clear()
    cf.attention_backward(do, ctx)
    total = cf.streaming_plan(q, k, v, causal=True, device_memory_limit=limit, backward=True).pairs
    assert calls == [(n, total) for n in range(1, total + 1)]
    calls.clear()
    cf.attention(q, k, v, backend="numpy", progress=lambda *a: calls.append(a))
    assert calls == []   # an in-memory call does not report


def test_progress_tqdm(rng):
    pytest.importorskip("tqdm")
    q, k, v, _ = _inputs(rng, np.float32, nq=300, nk=300)
    o = cf.attention(q, k, v, backend="numpy", device_memory_limit=_limit_for(q, k, v, 128),
                     progress="tqdm")
    assert_close(o, cf.attention(q, k, v, backend="numpy"), TOL[np.float32])


def test_empty_batch_and_gpu_arrays_without_gpu(rng):
    q, k, v, _ = _inputs(rng, np.float32, b=0, nq=8, nk=8)
    assert cf.attention(q, k, v, backend="numpy", device_memory_limit=10**6).shape == (0, 4, 8, 24)


# GPU: host arrays through a tiny device memory --------------------------------------------------


# The GPU cases' ALiBi slopes: powers of two, exact in the float32 the kernels take them in.
_GPU_SLOPES = np.array([2.0**-1, 2.0**-3, 2.0**-5, 2.0**-7], np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("case", ["causal-gqa", "dense-nq-ne-nk", "bias-seqlens", "block-mask",
                                  "window-causal", "window-two-sided", "alibi", "alibi-causal",
                                  "dropout-causal", "window-alibi-dropout-gqa", "window-dropout-nq-gt-nk"])
def test_streamed_gpu_equals_in_memory_gpu(dtype, case):
    """Streamed GPU calls (chunks of 128-256 rows) against the in-memory GPU call and the
    float64 oracle on the same rounded inputs, forward, LSE and gradients. With window,
    ALiBi and dropout every pair's kernels take the problem's coordinates (the diagonal,
    dropout's counters); Nk - Nq = 200 is no multiple of the tiles, and dropout is
    compared with the keep mask the oracle draws for the whole problem."""
    from gpu_cases import TOLERANCE, np_dtype, rel_err
    from test_mods_reference import keep_mask

    rng = np.random.default_rng(17)
    dt = np_dtype(dtype)
    # Nq > Nk under a causal window: the first 200 rows see no key, whole query chunks
    # are hidden, and the diagonal is negative.
    nq, nk = {"block-mask": (640, 640), "window-dropout-nq-gt-nk": (900, 700)}.get(case, (700, 900))
    gqa = case in ("causal-gqa", "window-alibi-dropout-gqa")
    q, k, v, do = (x.astype(dt) for x in _inputs(rng, np.float32, b=2, hq=4, hk=2 if gqa else 4,
                                                   nq=nq, nk=nk, d=64, dv=64))
    options = {}
    if case == "causal-gqa":
        options["causal"] = True
    elif case == "bias-seqlens":
        options.update(causal=True, bias=rng.standard_normal((4, nq, nk)).astype(dt),
                       seqlens_k=np.array([nk, 500]))
    elif case == "block-mask":
        mask = rng.random((4, 5, 5)) < 0.5
        mask[..., 0] = True
        options["block_mask"] = mask
    elif case == "window-causal":
        options.update(causal=True, window=(300, 0))
    elif case == "window-two-sided":
        options["window"] = (150, 250)
    elif case in ("alibi", "alibi-causal"):
        options.update(causal=case == "alibi-causal", alibi_slopes=_GPU_SLOPES)
    elif case == "dropout-causal":
        options.update(causal=True, dropout_p=0.2, seed=2**40 + 17)
    elif case == "window-alibi-dropout-gqa":
        options.update(causal=True, window=(400, 0), alibi_slopes=_GPU_SLOPES, dropout_p=0.15, seed=99)
    elif case == "window-dropout-nq-gt-nk":
        options.update(causal=True, window=(250, 0), dropout_p=0.2, seed=7)
    bias = options.get("bias")
    limit = _limit_for(q, k, v, 256, causal=options.get("causal", False),
                       bias_shape=None if bias is None else (1, *bias.shape),
                       mask_shape=None if "block_mask" not in options else (1, 4, 5, 5),
                       seqlens="seqlens_k" in options,
                       alibi_shape=(1, 4) if "alibi_slopes" in options else None)
    o_mem, ctx_mem = cf.attention_forward(q, k, v, backend="cuda", **options)
    o, ctx = cf.attention_forward(q, k, v, backend="cuda", device_memory_limit=limit, **options)
    assert isinstance(o, np.ndarray) and ctx.streaming is not None and ctx.streaming.pairs > 3
    f = lambda x: np.asarray(x).astype(np.float64)   # noqa: E731
    oracle_opts = {n: v_ for n, v_ in options.items() if n not in ("bias", "seed")}
    if bias is not None:
        oracle_opts["bias"] = f(bias)
    if "block_mask" in options:
        oracle_opts["block_size"] = (128, 128)
    if "dropout_p" in options:   # an explicit seed: the call's RNG offset is 0
        oracle_opts["keep"] = keep_mask(options["seed"], 0, 2, 4, nq, nk, options["dropout_p"])
    ref_o, ref_lse = naive_attention(f(q), f(k), f(v), scale=1 / 8, **{"causal": False, **oracle_opts})
    tol = TOLERANCE[dtype]
    assert rel_err(f(o), ref_o) < tol and rel_err(f(o_mem), ref_o) < tol
    finite = np.isfinite(ref_lse)
    assert (np.isneginf(ctx.lse) == ~finite).all()
    assert rel_err(f(ctx.lse)[finite], ref_lse[finite]) < tol
    grads = cf.attention_backward(do, ctx)
    grads_mem = cf.attention_backward(do, ctx_mem)
    refs = naive_attention_grads(f(do), f(q), f(k), f(v), scale=1 / 8, **{"causal": False, **oracle_opts})
    for got, mem, ref in zip(grads, grads_mem, refs[:3]):
        assert isinstance(got, np.ndarray) and got.dtype == dt
        # Three times the limit: each pair's gradients are rounded to the dtype before
        # they are summed over chunks (tests/test_merge.py makes the same allowance).
        assert rel_err(f(got), ref) < 3 * tol
        assert rel_err(f(mem), ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("shape", ["full", "over-batch-and-heads", "over-rows", "over-keys"])
@pytest.mark.parametrize("mask", ["causal", "two-sided-window"])
def test_streamed_gpu_bias_gradient(dtype, shape, mask):
    """The bias gradient of a streamed GPU backward (chunks of 128, GQA, dlse; causal, or a
    two-sided window that clips pairs on both sides) against the in-memory GPU call and
    the float64 NumPy backend on the same rounded inputs: each pair's kernels add into
    their slice, which the host sums over the pairs that share it (dlse keeps a gradient
    summed over keys from cancelling)."""
    from gpu_cases import TOLERANCE, np_dtype, rel_err

    rng = np.random.default_rng(29)
    dt = np_dtype(dtype)
    q, k, v, do = (x.astype(dt) for x in _inputs(rng, np.float32, b=2, hq=4, hk=2, nq=389, nk=517,
                                                   d=64, dv=64))
    bias = rng.standard_normal(_BIAS_SHAPES[shape]).astype(dt)
    dlse = rng.standard_normal((2, 4, 389)).astype(np.float32)
    opts = dict(causal=True) if mask == "causal" else dict(window=(150, 200))
    limit = _limit_for(q, k, v, 128, causal=mask == "causal", bias_shape=(1,) * (4 - bias.ndim) + bias.shape)
    o, ctx = cf.attention_forward(q, k, v, bias=bias, backend="cuda", device_memory_limit=limit, **opts)
    _, ctx_mem = cf.attention_forward(q, k, v, bias=bias, backend="cuda", **opts)
    assert ctx.streaming is not None and ctx.streaming.pairs > 3
    f = lambda x: np.asarray(x).astype(np.float64)   # noqa: E731
    _, ctx_ref = cf.attention_forward(f(q), f(k), f(v), bias=f(bias), backend="numpy", **opts)
    refs = cf.attention_backward(f(do), ctx_ref, dlse=f(dlse), return_dbias=True)
    grads = cf.attention_backward(do, ctx, dlse=dlse, return_dbias=True)
    grads_mem = cf.attention_backward(do, ctx_mem, dlse=dlse, return_dbias=True)
    tol = TOLERANCE[dtype]
    for got, mem, ref in zip(grads, grads_mem, refs):
        assert isinstance(got, np.ndarray) and got.dtype == dt and got.shape == ref.shape
        # Three times the limit, as above: the pairs' parts are rounded before their sums
        # (dbias's are not, but its slices sum many pairs' float atomics).
        assert rel_err(f(got), ref) < 3 * tol
        assert rel_err(f(got), f(mem)) < 3 * tol
    assert grads[3].shape == bias.shape


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("case", ["dense", "causal-gqa", "window-alibi-dropout-gqa"])
def test_streamed_gpu_varlen_equals_in_memory_gpu(dtype, case):
    """A streamed GPU varlen call (short sequences in groups run in memory, the long ones
    streamed in chunks of 128, empty ones set on the host) against the in-memory GPU call
    and the float64 NumPy backend on the same rounded inputs: forward, LSE and gradients
    (with dlse)."""
    from gpu_cases import TOLERANCE, np_dtype, rel_err

    rng = np.random.default_rng(31)
    dt = np_dtype(dtype)
    (q, k, v, do), cu_q, cu_k = _varlen_inputs(rng, np.float32, hq=4, hk=4 if case == "dense" else 2,
                                               d=64, dv=64)
    q, k, v, do = (x.astype(dt) for x in (q, k, v, do))
    options = {}
    if case == "causal-gqa":
        options["causal"] = True
    elif case == "window-alibi-dropout-gqa":
        slopes = _GPU_SLOPES[None] * 2.0 ** -np.arange(len(_VARLEN_Q), dtype=np.float32)[:, None]
        options.update(causal=True, window=(300, 0), alibi_slopes=slopes, dropout_p=0.15, seed=99)
    limit = _varlen_limit(q, k, v, causal=options.get("causal", False), alibi="alibi_slopes" in options)
    args = (cu_q, cu_k, max(_VARLEN_Q), max(_VARLEN_K))
    o, ctx = cf.varlen_attention_forward(q, k, v, *args, backend="cuda", device_memory_limit=limit, **options)
    o_mem, ctx_mem = cf.varlen_attention_forward(q, k, v, *args, backend="cuda", **options)
    kinds = [p.kind for p in ctx.streaming.parts]
    assert isinstance(o, np.ndarray) and "streamed" in kinds and "group" in kinds
    f = lambda x: np.asarray(x).astype(np.float64)   # noqa: E731
    ref_o, ctx_ref = cf.varlen_attention_forward(f(q), f(k), f(v), *args, backend="numpy", **options)
    tol = TOLERANCE[dtype]
    assert rel_err(f(o), ref_o) < tol and rel_err(f(o_mem), ref_o) < tol
    finite = np.isfinite(ctx_ref.lse)
    assert (np.isneginf(ctx.lse) == ~finite).all()
    assert rel_err(f(ctx.lse)[finite], ctx_ref.lse[finite]) < tol
    dlse = rng.standard_normal(ctx.lse.shape).astype(np.float32)
    grads = cf.attention_backward(do, ctx, dlse=dlse)
    grads_mem = cf.attention_backward(do, ctx_mem, dlse=dlse)
    refs = cf.attention_backward(f(do), ctx_ref, dlse=f(dlse))
    for got, mem, ref in zip(grads, grads_mem, refs):
        assert isinstance(got, np.ndarray) and got.dtype == dt and got.shape == ref.shape
        # Three times the limit, as above: a streamed sequence's pairs are rounded before
        # their sums.
        assert rel_err(f(got), ref) < 3 * tol
        assert rel_err(f(mem), ref) < 3 * tol


@pytest.mark.gpu
def test_gpu_arrays_with_a_limit_are_refused():
    import cupy as cp
    x = cp.zeros((1, 1, 8, 16), cp.float32)
    with pytest.raises(ValueError, match="device_memory_limit streams host"):
        cf.attention(x, x, x, device_memory_limit=10**6)


@pytest.mark.gpu
def test_gpu_progress_and_unchanged_inputs():
    rng = np.random.default_rng(3)
    q, k, v, do = (x.astype(np.float16) for x in _inputs(rng, np.float32, nq=600, nk=600, d=64, dv=64))
    before = [x.copy() for x in (q, k, v)]
    calls = []
    o, vjp = cf.attention_vjp(q, k, v, causal=True, backend="cuda",
                              device_memory_limit=_limit_for(q, k, v, 128, causal=True),
                              progress=lambda done, total: calls.append((done, total)))
    vjp(do)
    # Forward then backward (whose chunks may be smaller), each 1..total in order.
    restart = next(i for i in range(1, len(calls)) if calls[i][0] == 1)
    for part in (calls[:restart], calls[restart:]):
        assert part == [(n, part[0][1]) for n in range(1, part[0][1] + 1)]
    for x, y in zip((q, k, v), before):
        np.testing.assert_array_equal(x, y)
