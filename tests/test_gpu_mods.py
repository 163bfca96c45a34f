"""GPU tier for the attention modifiers (issue #5): sliding window, dropout, block-sparse
masks, additive bias, ALiBi, softcap, key padding (``seqlens_k``) and varlen, each alone
and in the combinations models use, forward (o, LSE) and backward (dq, dk, dv, dbias).

Every case runs ``backend="cuda"`` on fresh random inputs and compares it with
``backend="numpy"`` run in float64 on the same rounded inputs (the float64 reference of
tests/TOLERANCES.md; ``cupyflash/_mods.py`` states the semantics both follow), by the relative
error norm ‖out − ref‖/‖ref‖ with the usual tolerances. Rows that see no key must come
back as exact zeros (o and dq) with LSE ``-inf``; nothing may be NaN.

Poisoning: the public API allocates its outputs itself, so instead of pre-filled outputs
each test runs with a CuPy allocator that fills every new allocation with 0xFF bytes, a
NaN in all four dtypes: an output element no kernel wrote shows up as NaN. (A buffer a
kernel relies on being zero must be zeroed explicitly: ``cp.zeros`` still works.)

The dropout masks of the GPU and of the NumPy backend are bit-identical by design, so
dropout cases are compared like any other; `test_dropout_mask_is_philox_bit_for_bit`
reads the GPU's mask out of its output and compares it with `_philox.dropout_keep_mask`.

The new API names are looked up when a test runs, never at import: a missing name fails
that test on a GPU machine instead of skipping it, and collection works everywhere.

``CUPYFLASH_MODS_DRYRUN=1 pytest tests/test_gpu_mods.py`` runs every test on the CPU with
``backend="numpy"`` on the side under test too (no GPU marker, no poisoning): it checks
the tests themselves, shapes and calls, against the NumPy backend.

Budget: about 150 small cases; on an H100 the GPU side is milliseconds each, the time goes
to the float64 NumPy references (about a second in all per 10 cases) and to compiling the
modifier kernels the first time they are used.
"""

import os

import numpy as np
import pytest
from gpu_cases import DTYPES, TOLERANCE, np_dtype, rel_err

import cupyflash
from cupyflash import _kernels, _philox

DRY_RUN = os.environ.get("CUPYFLASH_MODS_DRYRUN") == "1"
BACKEND = "numpy" if DRY_RUN else "cuda"
if not DRY_RUN:
    pytestmark = pytest.mark.gpu

# Sequence lengths (Nq, Nk): 1, 17, 129 and 300, equal and not. No Nk = 1: with a single
# key the softmax is constant and dq = dk = 0 by cancellation (test_gpu_backward handles
# that case); the cases below keep such rows a small part of every gradient.
SHAPES = ((17, 17), (129, 129), (300, 300), (129, 300), (300, 129), (1, 17), (17, 129), (300, 17))
HEAD_DIMS = (64, 128, 64, 128, 72)
LAYOUTS = ("bhsd", "bshd")
GRAD_NAMES = ("dq", "dk", "dv", "dbias")


# --------------------------------------------------------------------------- plumbing


def _xp():
    if DRY_RUN:
        return np
    import cupy
    return cupy


def _dev(x):
    """A host array on the side under test (CuPy, or NumPy in a dry run); others as is."""
    return _xp().asarray(x) if isinstance(x, np.ndarray) else x


def _host(x):
    return x if isinstance(x, np.ndarray) else _xp().asnumpy(x)


@pytest.fixture(autouse=True)
def _poisoned_allocations():
    """Every CuPy allocation of the test is filled with 0xFF (NaN in every float dtype)."""
    if DRY_RUN:
        yield
        return
    import cupy as cp
    pool = cp.get_default_memory_pool()
    previous = cp.cuda.get_allocator()

    def malloc(size):
        mem = pool.malloc(size)
        if size:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem

    cp.cuda.set_allocator(malloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(previous)


def _qkv(rng, dtype, d, nq, nk, group, layout, *, batch=2, kv_heads=2, dv=None):
    """Host q, k, v, do in ``dtype`` and ``layout`` with ``kv_heads * group`` query heads."""
    dv = d if dv is None else dv
    hq = kv_heads * group
    if layout == "bhsd":
        shapes = [(batch, hq, nq, d), (batch, kv_heads, nk, d), (batch, kv_heads, nk, dv), (batch, hq, nq, dv)]
    else:
        shapes = [(batch, nq, hq, d), (batch, nk, kv_heads, d), (batch, nk, kv_heads, dv), (batch, nq, hq, dv)]
    return [rng.standard_normal(s).astype(np_dtype(dtype)) for s in shapes]


def _ref_options(opts):
    """The options of the float64 reference call: the bias upcast with the inputs; masks,
    lengths and the float32 ALiBi slopes as they are."""
    return {k: (v.astype(np.float64) if k == "bias" else v) for k, v in opts.items()}


def _forward_backward(fwd, inputs, do, opts, *, backend, backward=True, dbias=True):
    """``fwd(*inputs, **opts)`` (attention_forward or varlen_attention_forward), then
    attention_backward; every result as a host array, keyed o, lse, dq, dk, dv[, dbias]
    (dbias where there is a bias and ``dbias``)."""
    o, ctx = fwd(*inputs, backend=backend, **opts)
    out = {"o": o, "lse": ctx.lse}
    if backward:
        if opts.get("bias") is not None and dbias:
            grads = cupyflash.attention_backward(do, ctx, return_dbias=True)
        else:
            grads = cupyflash.attention_backward(do, ctx)
        out.update(zip(GRAD_NAMES, grads))
    return {k: _host(v) for k, v in out.items()}


def _run_both(fwd, host, opts, *, backward=True, dbias=True):
    """The case on the side under test (inputs and option arrays moved there) and its
    float64 NumPy-backend reference on the same rounded inputs."""
    *inputs, do = host
    got = _forward_backward(fwd, [_dev(x) for x in inputs], _dev(do),
                            {k: _dev(v) for k, v in opts.items()}, backend=BACKEND, backward=backward,
                            dbias=dbias)
    ref = _forward_backward(fwd, [x.astype(np.float64) for x in inputs], do.astype(np.float64),
                            _ref_options(opts), backend="numpy", backward=backward, dbias=dbias)
    return got, ref


def _row_mask(lse, o_shape):
    """``lse`` == -inf as a mask over o's leading axes: bshd's LSE is (B, H, Nq) for o's
    (B, Nq, H, dv); a varlen LSE may be (total, H), (H, total) or (1, H, total)."""
    m = np.isneginf(lse)
    want = tuple(o_shape[:-1])
    squeezed = m.reshape([n for n in m.shape if n != 1] or [1]) if m.size else m
    for cand in (m, m.swapaxes(-1, -2) if m.ndim >= 2 else m, m.T, squeezed.T):
        if cand.shape == want:
            return cand
    raise AssertionError(f"LSE shape {lse.shape} does not match o shape {o_shape}")


def _check(got, ref, dtype):
    """Every result of the case against its reference; rows without keys exact."""
    assert got.keys() == ref.keys()
    tol = TOLERANCE[dtype]
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape, f"{name}: shape {g.shape}, reference {r.shape}"
        if name == "lse":
            assert g.dtype == np.dtype(np.float64 if dtype == "float64" else np.float32)
        else:
            assert g.dtype == np_dtype(dtype), f"{name}: dtype {g.dtype}"
        g = g.astype(np.float64)
        assert not np.isnan(g).any(), f"{name}: unwritten or NaN elements"
        if name == "lse":
            assert np.array_equal(np.isneginf(g), np.isneginf(r)), "LSE: rows without keys differ"
            finite = np.isfinite(r)
            err = rel_err(g[finite], r[finite]) if finite.any() else 0.0
            assert err < (1e-12 if dtype == "float64" else 1e-5), f"LSE: relative error {err:.3g}"
        else:
            err = rel_err(g, r)
            assert err < tol, f"{name}: relative error {err:.3g} (tolerance {tol:g})"
    empty = _row_mask(ref["lse"], ref["o"].shape)
    assert np.all(got["o"][empty] == 0), "rows without keys must give o = 0"
    if "dq" in got:
        assert np.all(got["dq"][empty] == 0), "rows without keys must give dq = 0"


# --------------------------------------------------------------------------- option builders
# Each takes (rng, B, Hq, Nq, Nk) and returns the options as host arrays / values.


def _block_mask(rng, shape, nq, nk, block, *, density=0.5, empty_row=True):
    """A random block mask (``shape`` + blocks); with ``empty_row`` the first row of
    blocks is all zero (those queries see nothing)."""
    bq, bk = (block, block) if isinstance(block, int) else block
    m = rng.random((*shape, -(-nq // bq), -(-nk // bk))) < density
    if empty_row:
        m[..., 0, :] = False
    return m


def _seqlens(rng, b, nk):
    """Key lengths with a 0-length row, a full row and one in between."""
    lens = [0, nk] + [int(rng.integers(2, nk + 1)) if nk > 1 else 1 for _ in range(b - 2)]
    return np.array(lens[:b], dtype=np.int32)


def _slopes(shape):
    """ALiBi's geometric slopes 2^(-8 h / H) (float32), per batch entry scaled a little."""
    hq = shape[-1]
    s = 2.0 ** (-8.0 * (np.arange(hq) + 1) / hq)
    if len(shape) == 2:
        s = s[None, :] * (1.0 + 0.25 * np.arange(shape[0]))[:, None]
    return s.astype(np.float32)


def _bias(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np_dtype(dtype))


# (id, causal, forced GQA group or None, batch, builder(rng, B, Hq, nq, nk, dtype))
OPTION_CASES = (
    ("window-left", False, None, 2, lambda r, b, h, nq, nk, t: dict(window=(32, -1))),
    ("window-right", False, None, 2, lambda r, b, h, nq, nk, t: dict(window=(-1, 24))),
    ("window-both", False, None, 2, lambda r, b, h, nq, nk, t: dict(window=(40, 7))),
    ("window-causal-like", False, None, 2, lambda r, b, h, nq, nk, t: dict(window=(64, 0))),
    ("causal+window", True, None, 2, lambda r, b, h, nq, nk, t: dict(window=(48, 16))),
    ("causal+window-left", True, None, 2, lambda r, b, h, nq, nk, t: dict(window=(20, -1))),
    ("dropout", False, 1, 2, lambda r, b, h, nq, nk, t: dict(dropout_p=0.1, seed=1234)),
    ("dropout-causal", True, None, 2, lambda r, b, h, nq, nk, t: dict(dropout_p=0.3, seed=2**40 + 7)),
    ("dropout+gqa", False, 4, 2, lambda r, b, h, nq, nk, t: dict(dropout_p=0.2, seed=99)),
    ("block_mask-16", False, None, 2,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (b, h), nq, nk, 16), block_size=16)),
    ("block_mask-32x16-2d", False, None, 2,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (), nq, nk, (32, 16)), block_size=(32, 16))),
    ("block_mask-128-heads", False, None, 2,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (1, h), nq, nk, 128, density=0.7,
                                                            empty_row=False))),
    ("block_mask+causal", True, None, 2,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (b, 1), nq, nk, 16), block_size=16)),
    ("bias-full", False, None, 2, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (b, h, nq, nk), t))),
    ("bias-heads-3d", False, None, 2, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (h, nq, nk), t))),
    ("bias-keys", False, None, 2, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (b, 1, 1, nk), t))),
    ("bias-2d", False, None, 2, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (nq, nk), t))),
    ("bias+causal", True, None, 2, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (b, 1, nq, nk), t))),
    ("alibi-heads", False, None, 2, lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((h,)))),
    ("alibi-batch-heads", True, None, 2, lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((b, h)))),
    ("softcap", False, None, 2, lambda r, b, h, nq, nk, t: dict(softcap=1.0)),
    ("softcap+alibi+window", False, None, 2,
     lambda r, b, h, nq, nk, t: dict(softcap=2.0, alibi_slopes=_slopes((h,)), window=(64, 16))),
    ("seqlens_k", False, None, 3, lambda r, b, h, nq, nk, t: dict(seqlens_k=_seqlens(r, b, nk))),
    ("seqlens_k+causal", True, None, 3, lambda r, b, h, nq, nk, t: dict(seqlens_k=_seqlens(r, b, nk))),
)


def _option_params():
    """Every option case with every dtype; shape, head dim, GQA group, layout and
    deterministic mode rotate so each value meets each dtype and most options."""
    for i, (name, causal, group, batch, build) in enumerate(OPTION_CASES):
        for t, dtype in enumerate(DTYPES):
            nq, nk = SHAPES[(3 * i + 5 * t) % len(SHAPES)]
            d = HEAD_DIMS[(i + 2 * t) % len(HEAD_DIMS)]
            g = group or (1, 4)[(i + t) % 2]
            layout = LAYOUTS[(i // 2 + t) % 2]
            det = bool((i + t // 2) % 2)
            yield pytest.param(dtype, d, nq, nk, g, layout, det, causal, batch, build,
                               id=f"{name}-{dtype}-d{d}-{nq}x{nk}-g{g}-{layout}-{'det' if det else 'atomic'}")


@pytest.mark.parametrize("dtype,d,nq,nk,group,layout,deterministic,causal,batch,build", list(_option_params()))
def test_option_matches_reference(rng, dtype, d, nq, nk, group, layout, deterministic, causal, batch, build):
    host = _qkv(rng, dtype, d, nq, nk, group, layout, batch=batch)
    opts = build(rng, batch, 2 * group, nq, nk, dtype)
    opts.update(causal=causal, layout=layout, deterministic=deterministic)
    got, ref = _run_both(cupyflash.attention_forward, host, opts)
    _check(got, ref, dtype)


@pytest.mark.parametrize("dtype,d,nq,nk,layout,opts", [
    pytest.param("bfloat16", 128, 1500, 1500, "bshd",
                 dict(causal=True, window=(256, 0), block_size=128), id="bf16-causal-window256-blocks-1500"),
    pytest.param("float16", 64, 1100, 900, "bhsd", dict(window=(100, 50), dropout_p=0.15, seed=5),
                 id="fp16-window-dropout-1100x900"),
    pytest.param("float32", 128, 700, 1000, "bhsd", dict(causal=True, softcap=5.0), id="fp32-causal-softcap-700x1000"),
])
def test_longer_sequences(rng, dtype, d, nq, nk, layout, opts):
    """Many tiles per row and column, so that tile skipping (window, block-sparse) and the
    per-tile masks at both edges of a window all occur; one batch entry, two heads."""
    host = _qkv(rng, dtype, d, nq, nk, 1, layout, batch=1)
    opts = dict(opts, layout=layout)
    if "block_size" in opts:   # local + global: the first block column and a band
        nb = -(-nk // 128)
        m = np.eye(-(-nq // 128), nb, dtype=bool) | np.eye(-(-nq // 128), nb, k=-1, dtype=bool)
        m[:, 0] = True
        opts["block_mask"] = m
    got, ref = _run_both(cupyflash.attention_forward, host, opts)
    _check(got, ref, dtype)


# --------------------------------------------------------------------------- varlen

# Packed sequence lengths (q, k): an empty sequence, a 1-long one, lengths that are not
# multiples of 16; the second set has queries without keys and keys without queries.
VARLEN_LENGTHS = (
    ((17, 0, 129, 1, 45, 300), (17, 0, 129, 1, 45, 300)),
    ((5, 33, 200, 0, 70, 1), (0, 100, 150, 9, 70, 31)),
)
# (id, causal, options builder(n_sequences, Hq))
VARLEN_CASES = (
    ("plain", False, lambda s, h: {}),
    ("causal", True, lambda s, h: {}),
    ("causal+dropout", True, lambda s, h: dict(dropout_p=0.2, seed=77)),
    ("window+softcap+alibi", False, lambda s, h: dict(window=(32, 8), softcap=3.0, alibi_slopes=_slopes((s, h)))),
    ("causal+alibi", True, lambda s, h: dict(alibi_slopes=_slopes((h,)))),
)


def _packed(rng, dtype, d, lens_q, lens_k, group, *, kv_heads=2, dv=None):
    """Packed host q (total_q, Hq, d), k, v (total_k, Hk, d / dv), do and cu_seqlens."""
    dv = d if dv is None else dv
    hq = kv_heads * group
    tq, tk = sum(lens_q), sum(lens_k)
    t = np_dtype(dtype)
    q, k, v, do = (rng.standard_normal(s).astype(t)
                   for s in ((tq, hq, d), (tk, kv_heads, d), (tk, kv_heads, dv), (tq, hq, dv)))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lens)]).astype(np.int32) for lens in (lens_q, lens_k))
    return [q, k, v, do], cu_q, cu_k


def _varlen_params():
    for i, (name, causal, build) in enumerate(VARLEN_CASES):
        for t, dtype in enumerate(DTYPES):
            lens = (i + t) % len(VARLEN_LENGTHS)
            d = HEAD_DIMS[(2 * i + t) % len(HEAD_DIMS)]
            group = (1, 4)[(i + t) % 2]
            det = bool((i + t) // 2 % 2)
            yield pytest.param(dtype, d, lens, group, det, causal, build,
                               id=f"{name}-{dtype}-d{d}-lens{lens}-g{group}-{'det' if det else 'atomic'}")


@pytest.mark.parametrize("dtype,d,lens,group,deterministic,causal,build", list(_varlen_params()))
def test_varlen_matches_reference(rng, dtype, d, lens, group, deterministic, causal, build):
    lens_q, lens_k = VARLEN_LENGTHS[lens]
    host, cu_q, cu_k = _packed(rng, dtype, d, lens_q, lens_k, group)
    opts = build(len(lens_q), 2 * group)
    opts.update(causal=causal, deterministic=deterministic)

    def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
        return cupyflash.varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                  max(lens_q), max(lens_k), **kw)

    got, ref = _run_varlen(fwd, host, cu_q, cu_k, opts)
    _check(got, ref, dtype)


def _run_varlen(fwd, host, cu_q, cu_k, opts):
    """As `_run_both`, with the cu_seqlens arrays on each side next to q, k, v."""
    q, k, v, do = host
    got = _forward_backward(fwd, [_dev(x) for x in (q, k, v, cu_q, cu_k)], _dev(do),
                            {k_: _dev(v_) for k_, v_ in opts.items()}, backend=BACKEND)
    ref = _forward_backward(fwd, [x.astype(np.float64) for x in (q, k, v)] + [cu_q, cu_k],
                            do.astype(np.float64), _ref_options(opts), backend="numpy")
    return got, ref


def test_varlen_entry_points_agree(rng):
    """varlen_attention (with return_lse) and varlen_attention_vjp give what
    varlen_attention_forward + attention_backward give, bit for bit."""
    lens_q, lens_k = VARLEN_LENGTHS[1]
    host, cu_q, cu_k = _packed(rng, "float16", 64, lens_q, lens_k, 2)
    q, k, v, do, cu_q, cu_k = (_dev(x) for x in (*host, cu_q, cu_k))
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    kw = dict(causal=True, window=(16, -1), deterministic=True, backend=BACKEND)
    o, ctx = cupyflash.varlen_attention_forward(*args, **kw)
    grads = cupyflash.attention_backward(do, ctx)
    o2, lse2 = cupyflash.varlen_attention(*args, return_lse=True, **kw)
    o3, vjp = cupyflash.varlen_attention_vjp(*args, **kw)
    grads3 = vjp(do)
    for a, b in [(o, o2), (ctx.lse, lse2), (o, o3), *zip(grads, grads3)]:
        assert np.array_equal(_host(a), _host(b), equal_nan=True)


# --------------------------------------------------------------------------- dropout bits


def _uniform_identity_inputs(dtype, b, hk, group, nq, nk, d, layout):
    """q = 0 (every visible key equally likely) and v_j = e_j (dv = d >= nk): o[i, j] is
    P_ij * keep_ij / (1 - p), so the output spells out the keep mask."""
    assert nk <= d
    t = np_dtype(dtype)
    q = np.zeros((b, hk * group, nq, d), t)
    k = np.ones((b, hk, nk, d), t)
    v = np.broadcast_to(np.eye(nk, d, dtype=t), (b, hk, nk, d)).copy()
    if layout == "bshd":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("dtype,d,nk,nq,layout,causal,p", [
    ("float16", 64, 64, 300, "bhsd", False, 0.1),
    ("bfloat16", 128, 128, 129, "bshd", False, 0.5),
    ("float32", 128, 100, 257, "bhsd", True, 0.25),
    ("float64", 64, 37, 80, "bshd", False, 0.9),
])
def test_dropout_mask_is_philox_bit_for_bit(dtype, d, nk, nq, layout, causal, p):
    b, hk, group, seed = 2, 2, 2, 0x1234_5678_9ABC
    hq = hk * group
    q, k, v = (_dev(x) for x in _uniform_identity_inputs(dtype, b, hk, group, nq, nk, d, layout))
    o = cupyflash.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, layout=layout, backend=BACKEND)
    out = _host(o).astype(np.float64)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    assert not np.isnan(out).any()
    rows, cols = np.arange(nq)[:, None], np.arange(nk)[None, :]
    visible = cols <= rows + nk - nq if causal else np.ones((nq, nk), bool)
    count = visible.sum(1, keepdims=True)
    for bi in range(b):
        for h in range(hq):
            keep = _philox.dropout_keep_mask(seed, 0, bi, h, nq, nk, p=p, heads=hq) & visible
            got = out[bi, h, :, :nk] != 0
            assert np.array_equal(got, keep), \
                f"batch {bi} head {h}: {np.count_nonzero(got != keep)} of {got.size} keep bits differ"
            kept_value = _philox.dropout_scale(p) / np.maximum(count, 1)
            expect = np.where(keep, kept_value, 0.0)
            assert rel_err(out[bi, h, :, :nk], expect) < TOLERANCE[dtype]
            assert np.all(out[bi, h, :, nk:] == 0)
    again = cupyflash.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, layout=layout, backend=BACKEND)
    assert np.array_equal(_host(o), _host(again)), "the same seed must give the same output"
    other = cupyflash.attention(q, k, v, causal=causal, dropout_p=p, seed=seed + 1, layout=layout, backend=BACKEND)
    assert not np.array_equal(_host(o), _host(other)), "another seed must give another mask"


def test_varlen_dropout_mask_is_philox_bit_for_bit():
    """Varlen: the mask of sequence s is that of batch entry s, rows and columns counted
    from the sequence's own start."""
    lens_q, lens_k = (50, 1, 3, 129, 7), (20, 64, 0, 37, 64)
    d, hk, group, p, seed = 64, 1, 3, 0.4, 31337
    hq = hk * group
    tq, tk = sum(lens_q), sum(lens_k)
    q = np.zeros((tq, hq, d), np.float16)
    k = np.ones((tk, hk, d), np.float16)
    v = np.concatenate([np.broadcast_to(np.eye(n, d, dtype=np.float16)[:, None, :], (n, hk, d))
                        for n in lens_k])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    o = cupyflash.varlen_attention(*(_dev(x) for x in (q, k, v, cu_q, cu_k)), max(lens_q), max(lens_k),
                                   dropout_p=p, seed=seed, backend=BACKEND)
    out = _host(o).astype(np.float64)
    assert not np.isnan(out).any()
    for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rows = out[cu_q[s]:cu_q[s + 1]]            # (nq, hq, d)
        assert np.all(rows[..., nk:] == 0)
        if nk == 0:
            continue
        for h in range(hq):
            keep = _philox.dropout_keep_mask(seed, 0, s, h, nq, nk, p=p, heads=hq)
            assert np.array_equal(rows[:, h, :nk] != 0, keep), f"sequence {s} head {h}"


# --------------------------------------------------------------------------- determinism


DETERMINISTIC_OPTION_CASES = {
    # Masks whose bands and block patterns decide which key blocks take turns on a dQ tile.
    "window": dict(window=(300, 200)),
    "causal+window": dict(causal=True, window=(700, -1)),
    "block_mask": "block_mask",
    "dropout+alibi+softcap": dict(causal=True, dropout_p=0.2, seed=11, softcap=20.0),
    "seqlens_k": dict(seqlens_k=np.array([1700, 923], np.int32)),
}


@pytest.mark.parametrize("case", list(DETERMINISTIC_OPTION_CASES))
def test_deterministic_options_repeat_bit_for_bit(rng, case):
    """deterministic=True gives the same gradient bits in every run, with the options, on
    sizes where many key blocks add into each dQ tile; and they match the reference."""
    nq, nk = 1500, 1700
    host = _qkv(rng, "bfloat16", 64, nq, nk, 2, "bhsd")
    opts = DETERMINISTIC_OPTION_CASES[case]
    if opts == "block_mask":
        opts = dict(block_mask=_block_mask(rng, (2, 4), nq, nk, 128, density=0.6))
    if case.startswith("dropout"):
        opts = dict(opts, alibi_slopes=rng.uniform(0.01, 0.1, 4))
    opts = dict(opts, deterministic=True)
    got, ref = _run_both(cupyflash.attention_forward, host, opts)
    *inputs, do = host
    again = _forward_backward(cupyflash.attention_forward, [_dev(x) for x in inputs], _dev(do),
                              {k: _dev(v) for k, v in opts.items()}, backend=BACKEND)
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(got[name].view(np.uint8), again[name].view(np.uint8)), f"{name} differs between runs"
    _check(got, ref, "bfloat16")


# --------------------------------------------------------------------------- edge rows


EMPTY_ROW_CASES = {
    # (nq, nk, causal, builder): each leaves some query rows without a visible key
    "seqlens_k-0": (40, 33, False, lambda r, b, h, nq, nk: dict(seqlens_k=np.array([0, 20], np.int32))),
    "block_mask-zero-row": (70, 50, False, lambda r, b, h, nq, nk: dict(
        block_mask=_block_mask(r, (b, h), nq, nk, 16, density=0.8), block_size=16)),
    "window-right-nq>nk": (90, 30, False, lambda r, b, h, nq, nk: dict(window=(-1, 5))),
    "causal+window-nq>nk": (90, 30, True, lambda r, b, h, nq, nk: dict(window=(8, -1), dropout_p=0.1, seed=3)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(EMPTY_ROW_CASES))
def test_rows_without_keys(rng, dtype, case):
    """Rows that see no key: o and dq exactly 0, LSE -inf, no NaN anywhere (both modes)."""
    nq, nk, causal, build = EMPTY_ROW_CASES[case]
    host = _qkv(rng, dtype, 64, nq, nk, 2, "bhsd")
    opts = build(rng, 2, 4, nq, nk)
    for deterministic in (False, True):
        got, ref = _run_both(cupyflash.attention_forward, host,
                             dict(opts, causal=causal, deterministic=deterministic))
        empty = np.isneginf(ref["lse"])
        assert empty.any() and not empty.all(), "the case must have rows with and without keys"
        assert np.array_equal(np.isneginf(got["lse"]), empty)
        assert np.all(got["o"][empty] == 0) and np.all(got["dq"][empty] == 0)
        _check(got, ref, dtype)


# --------------------------------------------------------------------------- equivalences


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unbounded_window_is_plain_attention(rng, dtype, layout):
    """window=(-1, -1) is no modifier at all: the same kernels, bit for bit (the backward
    in deterministic mode, whose sums have one order)."""
    host = _qkv(rng, dtype, 64, 129, 300, 2, layout)
    q, k, v, do = (_dev(x) for x in host)
    runs = []
    for window in (None, (-1, -1)):
        o, ctx = cupyflash.attention_forward(q, k, v, causal=True, window=window, layout=layout,
                                             deterministic=True, backend=BACKEND)
        runs.append([_host(x) for x in (o, ctx.lse, *cupyflash.attention_backward(do, ctx))])
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *runs):
        assert np.array_equal(a, b), f"{name} differs with window=(-1, -1)"


NEUTRAL_CASES = {
    "block_mask-all-ones": lambda b, h, nq, nk: dict(block_mask=np.ones((b, h, -(-nq // 128), -(-nk // 128)), bool)),
    "block_mask-all-ones-16": lambda b, h, nq, nk: dict(block_mask=np.ones((-(-nq // 16), -(-nk // 16)), bool),
                                                        block_size=16),
    "seqlens_k-full": lambda b, h, nq, nk: dict(seqlens_k=np.full(b, nk, np.int32)),
    "alibi-zero": lambda b, h, nq, nk: dict(alibi_slopes=np.zeros(h, np.float32)),
    "dropout-0-with-seed": lambda b, h, nq, nk: dict(dropout_p=0.0, seed=11),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("case", list(NEUTRAL_CASES))
def test_neutral_options_equal_dense(rng, dtype, case):
    """Options that hide nothing and add nothing (an all-ones block mask, seqlens_k = Nk,
    zero ALiBi slopes, dropout 0) give dense attention: within the tolerance of each other
    (the general kernels may sum in another order than the dense ones; the dense path
    itself is checked against the reference in test_gpu_forward/backward)."""
    nq, nk = 300, 257
    host = _qkv(rng, dtype, 128, nq, nk, 4, "bhsd")
    q, k, v, do = (_dev(x) for x in host)
    opts = {k_: _dev(v_) for k_, v_ in NEUTRAL_CASES[case](2, 8, nq, nk).items()}
    results = []
    for extra in ({}, opts):
        o, ctx = cupyflash.attention_forward(q, k, v, causal=True, backend=BACKEND, **extra)
        results.append({"o": _host(o), "lse": _host(ctx.lse),
                        **dict(zip(GRAD_NAMES, (_host(g) for g in cupyflash.attention_backward(do, ctx))))})
    dense, modded = results
    _check(modded, {k_: x.astype(np.float64) for k_, x in dense.items()}, dtype)


# --------------------------------------------------------------------------- API wiring


def test_entry_points_agree_with_modifiers(rng):
    """attention(return_lse=True) and attention_vjp(...)(do, return_dbias=True) give what
    attention_forward + attention_backward give, bit for bit, with every modifier on."""
    nq, nk, b, hq = 129, 200, 2, 4
    host = _qkv(rng, "bfloat16", 64, nq, nk, 2, "bshd")
    q, k, v, do = (_dev(x) for x in host)
    kw = dict(causal=True, window=(64, -1), dropout_p=0.1, seed=8, softcap=4.0,
              bias=_dev(_bias(rng, (b, 1, nq, nk), "bfloat16")), alibi_slopes=_dev(_slopes((hq,))),
              block_mask=_dev(_block_mask(rng, (b, hq), nq, nk, 32)), block_size=32,
              seqlens_k=_dev(np.array([nk, 150], np.int32)),
              layout="bshd", deterministic=True, backend=BACKEND)
    o, ctx = cupyflash.attention_forward(q, k, v, **kw)
    grads = cupyflash.attention_backward(do, ctx, return_dbias=True)
    o2, lse2 = cupyflash.attention(q, k, v, return_lse=True, **kw)
    o3, vjp = cupyflash.attention_vjp(q, k, v, **kw)
    grads3 = vjp(do, return_dbias=True)
    assert len(grads) == len(grads3) == 4
    for a, b_ in [(o, o2), (ctx.lse, lse2), (o, o3), *zip(grads, grads3)]:
        assert np.array_equal(_host(a), _host(b_), equal_nan=True)
    ref_host = [x.astype(np.float64) for x in host]
    ref_kw = dict(kw, backend="numpy", **{k_: _host(v_) for k_, v_ in kw.items() if k_ in
                                        ("bias", "alibi_slopes", "block_mask", "seqlens_k")})
    ref_kw["bias"] = ref_kw["bias"].astype(np.float64)
    _, ref_ctx = cupyflash.attention_forward(*ref_host[:3], **ref_kw)
    ref = {"o": _host(ref_ctx.o), "lse": _host(ref_ctx.lse),
           **dict(zip(GRAD_NAMES, cupyflash.attention_backward(ref_host[3], ref_ctx, return_dbias=True)))}
    got = {"o": _host(o), "lse": _host(ctx.lse), **dict(zip(GRAD_NAMES, (_host(g) for g in grads)))}
    _check(got, ref, "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_with_an_lse_gradient(rng, dtype, causal):
    """attention_backward(dlse=...) under dropout: the kernels carry dropout's scale in
    their row workspaces (kernels_cu/bwd.cuh), the LSE's gradient included, and the
    gradients still match the float64 reference."""
    nq, nk = 129, 300
    host = _qkv(rng, dtype, 64, nq, nk, 2, "bhsd")
    dlse = rng.standard_normal(host[0].shape[:3]).astype(np.float64 if dtype == "float64" else np.float32)
    kw = dict(causal=causal, dropout_p=0.3, seed=11)
    results = []
    for backend, inputs, g in ((BACKEND, [_dev(x) for x in host], _dev(dlse)),
                               ("numpy", [x.astype(np.float64) for x in host], dlse.astype(np.float64))):
        o, ctx = cupyflash.attention_forward(*inputs[:3], backend=backend, **kw)
        grads = cupyflash.attention_backward(inputs[3], ctx, dlse=g)
        results.append({"o": _host(o), "lse": _host(ctx.lse), **dict(zip(GRAD_NAMES, (_host(x) for x in grads)))})
    got, ref = results
    _check(got, ref, dtype)


@pytest.mark.parametrize("d", [64, 128])
def test_fp32_backward_of_a_zero_do(rng, d):
    """dO = 0 and no dlse: every gradient is exactly 0, not NaN. (On Hopper the halves' scale
    of an all-zero dO is 2^126: fp32's backward takes its dS scale and unscales from the
    exponents, held in range, kernels_cu/bwd_sm90.cu ds_scale.)"""
    q, k, v, do = (_dev(x) for x in _qkv(rng, "float32", d, 129, 200, 2, "bhsd"))
    do *= 0
    o, ctx = cupyflash.attention_forward(q, k, v, causal=True, backend=BACKEND)
    for grad in cupyflash.attention_backward(do, ctx):
        g = _host(grad)
        assert np.isfinite(g).all() and not g.any()


@pytest.mark.parametrize("deterministic", [False, True])
def test_fp32_backward_with_an_lse_gradient_alone(rng, monkeypatch, deterministic):
    """A dlse with dO = 0 (a loss of the LSE alone): dS = P (dlse - ...) is bounded by the
    dlse, not by dO and V, which bound the dS scale of fp32's Hopper backward
    (kernels_cu/bwd_sm90.cu ds_scale), so calls with a dlse run the next kernel in line
    (bwd_wide.cu), at fp32's tolerance against float64."""
    from cupyflash import _cuda, _kernels
    nq, nk = 200, 300
    host = _qkv(rng, "float32", 64, nq, nk, 2, "bhsd")
    host[3][:] = 0
    dlse = rng.standard_normal(host[0].shape[:3]).astype(np.float32) * np.float32(1e3)
    launched = []
    if not DRY_RUN:
        launch = _cuda._launch
        monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    results = []
    for backend, inputs, g in ((BACKEND, [_dev(x) for x in host], _dev(dlse)),
                               ("numpy", [x.astype(np.float64) for x in host], dlse.astype(np.float64))):
        o, ctx = cupyflash.attention_forward(*inputs[:3], backend=backend, deterministic=deterministic)
        grads = cupyflash.attention_backward(inputs[3], ctx, dlse=g)
        results.append({"o": _host(o), "lse": _host(ctx.lse), **dict(zip(GRAD_NAMES, (_host(x) for x in grads)))})
    got, ref = results
    _check(got, ref, "float32")
    assert not any(v.family is _kernels.BWD_SM90 for v in launched), [v.name_expression for v in launched]


@pytest.mark.parametrize("nk", [129, 136])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_deterministic_backward_with_modifiers_is_bitwise_reproducible(rng, dtype, nk):
    """deterministic=True: dq, dk, dv and dbias identical run to run with dropout, bias,
    block mask and GQA. (dbias is reproducible for a bias without broadcast axes, as
    here: each element then gets exactly one addition; over broadcast axes the kernels
    sum it with atomics, as documented.) On Hopper Nk = 136 runs bwd_sm90.cu's bias kernel
    (its rows 16-byte aligned, as the bias's tensor map needs), 129 the mma.sync kernels."""
    nq, b, hq = 300, 2, 8
    host = _qkv(rng, dtype, 128, nq, nk, 4, "bhsd")
    q, k, v, do = (_dev(x) for x in host)
    kw = dict(dropout_p=0.2, seed=4, bias=_dev(_bias(rng, (b, hq, nq, nk), dtype)),
              block_mask=_dev(_block_mask(rng, (b, hq), nq, nk, 16, density=0.6)), block_size=16,
              deterministic=True, backend=BACKEND)
    runs = []
    for _ in range(3):
        _, ctx = cupyflash.attention_forward(q, k, v, **kw)
        runs.append([_host(g) for g in cupyflash.attention_backward(do, ctx, return_dbias=True)])
    for name, first, *others in zip(GRAD_NAMES, *runs):
        for other in others:
            assert np.array_equal(first.view(np.uint8), other.view(np.uint8)), f"{name} differs between runs"


# --------------------------------------------------------------------------- Hopper path

# Every option family (and a few combinations) at the sizes where tiles are partial: one
# row, 17, 129, 1000 and 4097 (queries and keys differ in some), on fwd_sm90.cu.
HOPPER_SIZES = ((1, 17), (17, 17), (129, 1000), (1000, 129), (1000, 1000), (4097, 4097))
HOPPER_OPTIONS = (
    ("window", False, lambda r, b, h, nq, nk, t: dict(window=(300, 40))),
    ("causal+window", True, lambda r, b, h, nq, nk, t: dict(window=(256, 0))),
    ("seqlens_k", False, lambda r, b, h, nq, nk, t: dict(seqlens_k=_seqlens(r, b, nk))),
    ("block_mask", False, lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (b, h), nq, nk, 128),
                                                          block_size=128)),
    ("block_mask-64x32+causal", True,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (1, h), nq, nk, (64, 32)), block_size=(64, 32))),
    ("dropout", False, lambda r, b, h, nq, nk, t: dict(dropout_p=0.1, seed=77)),
    ("softcap", False, lambda r, b, h, nq, nk, t: dict(softcap=30.0)),
    ("alibi+causal", True, lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((h,)))),
    ("bias-2d", False, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (nq, nk), t))),
    ("everything", True, lambda r, b, h, nq, nk, t: dict(
        window=(500, 3), seqlens_k=_seqlens(r, b, nk), softcap=20.0, alibi_slopes=_slopes((h,)),
        bias=_bias(r, (1, h, 1, nk), t), dropout_p=0.25, seed=3)),
)


def _hopper_params():
    for i, (name, causal, build) in enumerate(HOPPER_OPTIONS):
        for j, (nq, nk) in enumerate(HOPPER_SIZES):
            dtype = ("bfloat16", "float16")[(i + j) % 2]
            d = (64, 128, 104)[(i + 2 * j) % 3]   # 104: the d = 128 kernel, TMA zero-filling columns
            layout = LAYOUTS[(i + j // 2) % 2]
            # A third of the cases with one CTA per work tile instead of persistent CTAs.
            persistent = (i + j) % 3 != 0
            yield pytest.param(dtype, d, nq, nk, layout, causal, build, persistent,
                               id=f"{name}-{dtype}-d{d}-{nq}x{nk}-{layout}{'' if persistent else '-per-tile'}")


@pytest.mark.parametrize("dtype,d,nq,nk,layout,causal,build,persistent", list(_hopper_params()))
def test_hopper_path_with_options(rng, monkeypatch, dtype, d, nq, nk, layout, causal, build, persistent):
    """The options as policies of the Hopper kernels against the float64 reference: the
    forward (fwd_sm90.cu, MODE_EXT and MODE_BIAS instantiations, with persistent CTAs or
    one CTA per work tile) and the backward (bwd_sm90.cu's MODE_EXT; with a bias, whose
    gradient these calls ask for, its MODE_BIAS kernel where TMA can read the bias's rows,
    else the mma.sync kernels: test_hopper_backward_with_a_bias pins which). The call
    must take those kernels."""
    if DRY_RUN:
        pytest.skip("pins a GPU kernel")
    import cupy as cp
    from cupyflash import _cuda, _kernels
    monkeypatch.setattr(_cuda, "PERSISTENT_FORWARD", persistent)
    device = cp.cuda.Device().id
    if _cuda._device_info(device)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    batch = 2 if nq * nk <= 10**6 else 1
    host = _qkv(rng, dtype, d, nq, nk, 2, layout, batch=batch, kv_heads=1)
    opts = build(rng, batch, 2, nq, nk, dtype)
    mods = dict(opts)
    mode = _kernels.MODE_EXT | (_kernels.MODE_BIAS if "bias" in mods else 0)
    D = _kernels.padded_head_dim(d, d)
    variant = _cuda._choose(_kernels.forward_variants(dtype, D, mode), device)
    assert variant.family is _kernels.FWD_SM90, variant.name_expression
    launched = []
    launch = _cuda._launch
    monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    opts.update(causal=causal, layout=layout)
    got, ref = _run_both(cupyflash.attention_forward, host, opts)
    _check(got, ref, dtype)
    hopper_backward = any(v.family is _kernels.BWD_SM90 for v in launched)
    assert hopper_backward or "bias" in mods, [v.name_expression for v in launched]


def _check_fp32_at_precision(host, opts, precision):
    """An fp32 case, forward and backward, against the float64 reference: at fp32's
    tolerance, or with precision="tf32" at the documented TF32 tolerance (outputs that
    are not finite in the same places)."""
    if precision == "highest":
        got, ref = _run_both(cupyflash.attention_forward, host, opts)
        _check(got, ref, "float32")
        return
    *inputs, do = host
    got = _forward_backward(cupyflash.attention_forward, [_dev(x) for x in inputs], _dev(do),
                            {**{k: _dev(v) for k, v in opts.items()}, "precision": "tf32"}, backend=BACKEND)
    ref = _forward_backward(cupyflash.attention_forward, [x.astype(np.float64) for x in inputs],
                            do.astype(np.float64), _ref_options(opts), backend="numpy")
    for name, r in ref.items():
        g = got[name].astype(np.float64)
        finite = np.isfinite(r)
        assert np.array_equal(finite, np.isfinite(g)), name
        assert rel_err(g[finite], r[finite]) < TOLERANCE["tf32"], name


def _fp32_hopper_params():
    options = (("dense", False, lambda *a: {}), ("causal", True, lambda *a: {}), *HOPPER_OPTIONS,
               ("bias-per-head-causal", True, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (b, h, nq, nk), t))))
    for i, (name, causal, build) in enumerate(options):
        for j, (nq, nk) in enumerate(HOPPER_SIZES[1:4] if i % 2 else HOPPER_SIZES[3:]):
            d = (64, 128, 40, 104)[(i + j) % 4]   # 40 and 104: TMA zero-fills the padding columns
            layout = LAYOUTS[(i + j) % 2]
            yield pytest.param(d, nq, nk, layout, causal, build, id=f"{name}-d{d}-{nq}x{nk}-{layout}")


# q, k and v far outside fp16's range (the halves' scales), q k^T of order 1 and the
# gradients (dq ~ |v| |k|, dk ~ |v| |q|) inside fp32's normal range.
FAR_FROM_FP16 = (3e-21, 3e20, 1e-9)
# The passes (split_f32.cu) of an fp32 call on Hopper: the forward's one, which scales each
# chunk of rows on its own, and the backward's two, a scale a tensor.
FORWARD_HALVES_PASSES = ("f32_halves<2, true>",)
BACKWARD_HALVES_PASSES = ("f32_halves_max", "f32_halves<2, false>")


@pytest.mark.parametrize("d,nq,nk,layout,causal,build,precision,magnitudes", [
    *(pytest.param(*p.values, precision, FAR_FROM_FP16 if i % 4 == 1 else (1, 1, 1),
                   id=f"{p.id}-{precision}" + ("-far-from-fp16" if i % 4 == 1 else ""))
      for i, p in enumerate(_fp32_hopper_params()) for precision in ("highest", "tf32")[:1 + (i % 3 == 0)]),
    # The dense tiles over many key tiles (stages reused round after round), both precisions.
    *(pytest.param(d, 1000, 1000, LAYOUTS[d // 128], causal, lambda *a: {}, precision, (1, 1, 1),
                   id=f"dense-tiles-{'causal-' if causal else ''}d{d}-1000x1000-{precision}")
      for d in (64, 128) for causal in (False, True) for precision in ("highest", "tf32"))])
def test_hopper_fp32_forward_on_fp16_halves(rng, monkeypatch, d, nq, nk, layout, causal, build, precision,
                                            magnitudes):
    """fp32 on Hopper's 16-bit warpgroup MMA (fwd_sm90.cu over the fp16 halves that
    split_f32.cu writes, kernels_cu/halves.cuh) against the float64 reference, dense and
    with every option (the bias read from global memory); GQA 2:1: at fp32's tolerance
    (three products), or with precision="tf32" (the high halves' one product, MODE_TF32)
    at the documented TF32 tolerance, gradients included (the backward is fp32-accurate
    from that forward's o and LSE). q, k and v far outside fp16's range (q k^T of order 1)
    check the halves' scales. The forward must take that kernel after its one pass."""
    if DRY_RUN:
        pytest.skip("pins a GPU kernel")
    import cupy as cp
    from cupyflash import _cuda, _kernels
    if _cuda._device_info(cp.cuda.Device().id)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    batch = 2 if nq * nk <= 10**6 else 1
    host = _qkv(rng, "float32", d, nq, nk, 2, layout, batch=batch)
    host[:3] = [x * np.float32(m) for x, m in zip(host, magnitudes)]
    opts = build(rng, batch, 4, nq, nk, "float32")
    launched = []
    launch = _cuda._launch
    monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    opts.update(causal=causal, layout=layout)
    _check_fp32_at_precision(host, opts, precision)
    forward = [v for v in launched if v.source.startswith("fwd")]
    tf32 = precision == "tf32"
    assert forward and all(v.family is _kernels.FWD_SM90 and "<float," in v.name_expression
                           and bool(v.mode & _kernels.MODE_TF32) == tf32 for v in forward), \
        [v.name_expression for v in launched]
    # The forward's pass, then the backward's where it runs bwd_sm90.cu (the dense path).
    passes = [v.name_expression for v in launched if v.family is _kernels.SPLIT_F32]
    hopper_backward = any(v.family is _kernels.BWD_SM90 for v in launched)
    assert passes == ([f"f32_halves<{1 if tf32 else 2}, true>"] * len(forward)
                      + list(BACKWARD_HALVES_PASSES) * hopper_backward), passes


# The fp32 backward's cases on Hopper: (d, nq, nk, causal, options); the dense path (MODE_BAND
# and its one term), then the option kernels (MODE_EXT: two terms, key lengths, a block mask
# of blocks smaller than a tile; MODE_BIAS: a bias, whole or broadcast over the batch, with
# other options).
FP32_HOPPER_BACKWARD_CASES = (
    (64, 300, 300, False, {}), (128, 257, 513, True, {}), (40, 129, 200, False, {}),
    (104, 200, 129, True, {}), (64, 1000, 1000, False, dict(window=(100, 20))), (128, 70, 333, False, {}),
    (64, 257, 300, True, dict(alibi_slopes=_slopes((4,)))), (128, 200, 129, False, dict(softcap=2.0, window=(64, 16))),
    (64, 129, 333, False, dict(dropout_p=0.2, seed=7)), (128, 300, 257, True, dict(dropout_p=0.1, seed=3)),
    # dropout's scale 1 / (1 - p) = 10 on the kept P and dS (their multipliers give up 16)
    (64, 200, 300, False, dict(dropout_p=0.9, seed=11)),
    (64, 257, 300, False, dict(alibi_slopes=_slopes((4,)), softcap=3.0)),
    (128, 300, 200, True, dict(softcap=2.0, dropout_p=0.3, seed=5, window=(90, 30))),
    (64, 300, 333, False, dict(seqlens_k=np.array([333, 150], np.int32), alibi_slopes=_slopes((2, 4)))),
    (128, 129, 257, True, dict(block_mask=_block_mask(np.random.default_rng(5), (), 129, 257, 16), block_size=16,
                               dropout_p=0.2, seed=9)),
    (64, 257, 300, False, dict(bias=_bias(np.random.default_rng(6), (2, 4, 257, 300), "float32"))),
    # (the bias's rows 16-byte aligned, as its tensor map needs: Nk % 4 == 0 for fp32)
    (128, 200, 132, True, dict(bias=_bias(np.random.default_rng(7), (4, 200, 132), "float32"),
                               alibi_slopes=_slopes((4,)), dropout_p=0.2, seed=4)),
    # softcap beside a bias: the deterministic calls take bwd_wide.cu (Sm90BwdKVTile::SOFTCAP_BIAS)
    (64, 129, 200, False, dict(bias=_bias(np.random.default_rng(8), (2, 1, 129, 200), "float32"), softcap=2.5)))


@pytest.mark.parametrize("d,nq,nk,causal,options,deterministic,magnitudes", [
    pytest.param(d, nq, nk, causal, options, det, mags,
                 id=f"d{d}-{nq}x{nk}{'-causal' if causal else ''}{''.join('-' + k for k in options if k != 'seed')}"
                    f"-{'det' if det else 'atomic'}{'-far-from-fp16' if mags != (1, 1, 1, 1) else ''}")
    for i, (d, nq, nk, causal, options) in enumerate(FP32_HOPPER_BACKWARD_CASES)
    for det in (False, True)
    for mags in ((1, 1, 1, 1), (3e-21, 3e20, 1e-9, 1e5))[:1 + (i % 2 == det)]])
def test_hopper_fp32_backward_on_fp16_halves(rng, monkeypatch, d, nq, nk, causal, options, deterministic, magnitudes):
    """The fp32 backward on Hopper's 16-bit warpgroup MMA (bwd_sm90.cu in the roles over the
    fp16 halves of q, k, v and dO that split_f32.cu writes, kernels_cu/halves.cuh) against
    the float64 reference at fp32's tolerance: dense, with a window (MODE_BAND) and with
    its one term (ALiBi, softcap, dropout), with the options' kernels (MODE_EXT: two terms,
    key lengths, small blocks of a block mask; MODE_BIAS: a bias, and its gradient),
    GQA 2:1, partial key blocks and query tiles, both modes; q, k, v and dO far outside
    fp16's range (q k^T of order 1) check the halves' scales and dS's. The backward must
    take that kernel after the four-tensor passes, but for softcap beside a bias in the
    deterministic mode, which takes bwd_wide.cu."""
    if DRY_RUN:
        pytest.skip("pins a GPU kernel")
    import cupy as cp
    from cupyflash import _cuda, _kernels
    if _cuda._device_info(cp.cuda.Device().id)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    host = _qkv(rng, "float32", d, nq, nk, 2, "bhsd")
    host = [x * np.float32(m) for x, m in zip(host, magnitudes)]
    opts = dict(causal=causal, deterministic=deterministic, **options)
    launched = []
    launch = _cuda._launch
    monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    got, ref = _run_both(cupyflash.attention_forward, host, opts)   # dbias too, with a bias
    _check(got, ref, "float32")
    backward = [v for v in launched if v.family is _kernels.BWD_SM90]
    passes = [v.name_expression for v in launched if v.family is _kernels.SPLIT_F32]
    if deterministic and "bias" in options and "softcap" in options:
        names = [v.name_expression for v in launched]
        assert not backward and any(v.family is _kernels.BWD_WIDE for v in launched), names
        assert passes == list(FORWARD_HALVES_PASSES), passes
        return
    assert len(backward) == 1 and backward[0].name_expression.startswith("flash_bwd_dkdv_sm90<float,"), \
        [v.name_expression for v in launched]
    assert bool(backward[0].grads & _kernels.GRAD_DQ_ORDERED) == deterministic
    assert bool(backward[0].mode & _kernels.MODE_BIAS) == ("bias" in options)
    assert passes == list(FORWARD_HALVES_PASSES + BACKWARD_HALVES_PASSES), passes


@pytest.mark.parametrize("precision", ["highest", "tf32"])
def test_hopper_fp32_halves_pass_non_finite_inputs(rng, precision):
    """An infinity in v and a NaN in k: split_f32.cu leaves them out of the halves' scales
    and passes them through the halves (a low half of 0), so, as in float64, the outputs
    that see them are not finite in the same places (v's column in every row of its head,
    every row of k's head), and the rest keep the precision's accuracy. (Not causal: a
    masked key's P of 0 times an infinity is NaN wherever a tile holds both, so the
    places would follow the tiling.)"""
    if DRY_RUN:
        pytest.skip("pins a GPU kernel")
    import cupy as cp
    q, k, v = (rng.standard_normal((1, 2, 300, 64)).astype(np.float32) for _ in range(3))
    v[0, 0, 200, 5] = np.inf
    k[0, 1, 150, 3] = np.nan
    o, ctx = cupyflash.attention_forward(*(cp.asarray(x) for x in (q, k, v)), precision=precision)
    ref, ref_ctx = cupyflash.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), backend="numpy")
    for got, want in ((cp.asnumpy(o), ref), (cp.asnumpy(ctx.lse), ref_ctx.lse)):
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite)
        assert not finite.all() and rel_err(got[finite], want[finite]) < TOLERANCE[
            "float32" if precision == "highest" else "tf32"]


def _scaled_by_chunk(rng, x, decades):
    """x (B, H, N, d) with each chunk of HALVES_ROWS rows (kernels_cu/halves.cuh
    HALVES_CHUNK_ROWS) times its own 10^u, u uniform in ``decades``, and one chunk of zeros
    where there are three or more."""
    chunk = _kernels.HALVES_ROWS
    chunks = -(-x.shape[2] // chunk)
    factors = 10.0 ** rng.uniform(*decades, size=(x.shape[0], x.shape[1], chunks))
    if chunks >= 3:
        factors[:, :, chunks // 2] = 0
    rows = np.repeat(factors, chunk, axis=2)[:, :, :x.shape[2], None]
    return (x * rows).astype(np.float32)


def _varlen_forward_at_precision(host, nq, nk, opts, precision):
    """``host`` (q, k, v, do as (2, H, N, d)) packed as two sequences, forward and (at full
    precision) backward at the precision's tolerance against float64."""
    packed = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(-1, *x.shape[1::2]) for x in host]
    cu_q, cu_k = (np.array([0, n, 2 * n], np.int32) for n in (nq, nk))

    def fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
        return cupyflash.varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, nq, nk, **kw)

    if precision == "highest":
        got, ref = _run_varlen(fwd, packed, cu_q, cu_k, opts)
        _check(got, ref, "float32")
        return
    q, k, v, _ = packed
    o, _ = fwd(*(_dev(x) for x in (q, k, v, cu_q, cu_k)), precision=precision, backend=BACKEND,
               **{k_: _dev(v_) for k_, v_ in opts.items()})
    ref, _ = fwd(*(x.astype(np.float64) for x in (q, k, v)), cu_q, cu_k, backend="numpy", **_ref_options(opts))
    assert rel_err(_host(o).astype(np.float64), ref) < TOLERANCE["tf32"]


@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize("precision,d,nq,nk,causal", [
    ("tf32", 64, 1000, 200, True), ("highest", 64, 700, 300, False), ("tf32", 128, 513, 257, True),
    ("tf32", 192, 300, 100, False)])
def test_hopper_fp32_q_split_takes_its_buffers_in_turn(rng, monkeypatch, precision, d, nq, nk, causal, ctas):
    """The dense fp32 forwards that split q themselves (fwd_sm90.cu QSplit) over many work
    tiles a CTA: the persistent grid held to 1 or 3 CTAs, so that each takes dozens of
    tiles through the two Q buffers, the slots of fp32 rows and their barriers, round after
    round, some tiles without keys (causal with nq > nk), against float64 at the
    precision's tolerance, gradients included."""
    if DRY_RUN:
        pytest.skip("pins a GPU kernel")
    import cupy as cp
    from cupyflash import _cuda
    if _cuda._device_info(cp.cuda.Device().id)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    monkeypatch.setattr(_cuda, "_sm_count", lambda device_id: ctas)
    monkeypatch.setattr(_cuda, "_FORWARD_PLANS", {})   # plans keep their grid
    launched = []
    launch = _cuda._launch
    monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append((variant, a[0])), launch(variant, *a)))
    _check_fp32_at_precision(_qkv(rng, "float32", d, nq, nk, 2, "bhsd"), dict(causal=causal), precision)
    forward = [(v, grid) for v, grid in launched if v.family is _kernels.FWD_SM90]
    assert forward and forward[0][0].splits_q and forward[0][1] == (ctas,), forward


# (d, nq, nk, causal, options, precision): d = 30 reads rows that are not 16-byte aligned
# (the pass's element-wise reads), d = 192 (precision="tf32" only on Hopper) rows wider than
# the pass stages; d = 64 with precision="tf32" takes three consumer warpgroups.
CHUNK_SCALE_CASES = [
    *((64, 700, 900, False, {}, p) for p in ("highest", "tf32")),
    *((128, 513, 1000, True, {}, p) for p in ("highest", "tf32")),
    (104, 260, 700, False, {}, "highest"), (30, 300, 333, False, {}, "tf32"), (192, 300, 400, False, {}, "tf32"),
    # the option kernels walk the key tiles downwards
    *((64, 600, 777, False, dict(softcap=3.0, window=(300, 50)), p) for p in ("highest", "tf32")),
    (128, 300, 640, True, dict(alibi_slopes=_slopes((4,)), dropout_p=0.1, seed=5), "highest")]


@pytest.mark.parametrize("d,nq,nk,causal,options,precision", [
    pytest.param(*case, id=f"d{case[0]}-{case[1]}x{case[2]}{'-causal' if case[3] else ''}"
                           f"{''.join('-' + k for k in case[4] if k != 'seed')}-{case[5]}")
    for case in CHUNK_SCALE_CASES])
def test_hopper_fp32_forward_scales_each_chunk(rng, monkeypatch, d, nq, nk, causal, options, precision):
    """The fp32 forward on Hopper scales each chunk of 128 rows of q, k and v on its own
    (split_f32.cu's one pass, kernels_cu/halves.cuh; q's 64-row warpgroup tiles in the
    dense kernels that split it themselves): with chunks whose magnitudes differ
    by decades (q and k by up to 10^2, v by up to 10^2, a chunk of zeros), S is unscaled
    per key tile and V per key tile, walked upwards (the dense kernels) and downwards (the
    option kernels), at the precision's tolerance against float64, gradients included.
    At fp32 also the forward alone with v's chunks up to 10^16 apart (the backward scales
    a tensor as a whole: with v's chunks 10^6 apart its dq read 1.1e-5, past fp32's
    tolerance, on an H200). Varlen, whose tiles do not start at a chunk, takes the two
    passes that give every chunk its tensor's scale."""
    if DRY_RUN:
        pytest.skip("pins a GPU kernel")
    import cupy as cp
    from cupyflash import _cuda
    if _cuda._device_info(cp.cuda.Device().id)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    q, k, v, do = _qkv(rng, "float32", d, nq, nk, 2, "bhsd")
    q, k = (_scaled_by_chunk(rng, x, (-2, 0)) for x in (q, k))
    opts = dict(causal=causal, **options)
    launched = []
    launch = _cuda._launch
    monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    _check_fp32_at_precision([q, k, _scaled_by_chunk(rng, v, (-1, 1)), do], opts, precision)
    forward = [v for v in launched if v.family is _kernels.FWD_SM90]
    assert forward, [v.name_expression for v in launched]
    # Dense calls whose tile has room for a second Q buffer split q in the kernel
    # (fwd_sm90.cu QSplit, each warpgroup's 64 rows a scale; d = 30 through a copy whose
    # rows TMA can read): their pass writes k and v alone.
    assert forward[0].splits_q == (not options and (precision == "tf32" or d <= 64)), forward[0].name_expression
    planes = 1 if precision == "tf32" else 2
    assert [v.name_expression for v in launched if v.family is _kernels.SPLIT_F32][0] == f"f32_halves<{planes}, true>"
    if precision == "highest":
        got, ref = _run_both(cupyflash.attention_forward, [q, k, _scaled_by_chunk(rng, v, (-8, 8)), do], opts,
                             backward=False)
        _check(got, ref, "float32")
    launched.clear()
    _varlen_forward_at_precision([q, k, _scaled_by_chunk(rng, v, (-1, 1)), do], nq, nk, opts, precision)
    passes = [v.name_expression for v in launched if v.family is _kernels.SPLIT_F32]
    assert passes[:2] == ["f32_halves_max", f"f32_halves<{planes}, false>"], [v.name_expression for v in launched]


# The bias on the Hopper backward (bwd_sm90.cu's MODE_BIAS kernels, whole (Nq, Nk) rows
# whose rows TMA can read, Nk % 8 == 0; no dbias asked for): sizes with partial query
# tiles, sub-tiles and key blocks, biases broadcast over batch and heads or not, and the
# options beside it (softcap adds the bias in its pass instead of S^T's accumulator).
# From d = 192 the key-block kernels' warps share each 16-key m-tile's dK and dV columns
# (HALVES: S^T and dP^T computed once, in parts of d, and traded between them): fp64 on
# DMMA (bwd_wide.cu, four warps at d = 192, eight at 256) and fp16/bf16 on mma.sync
# (bwd_sm80.cu, two; on Hopper the dense and band-only calls run bwd_sm90.cu's two
# warpgroups in two roles over the same keys instead), dense and with options; d = 160
# runs padded to 192, d = 200 to 256.
# (id, d, nq, nk, GQA group, causal, builder as OPTION_CASES')
SHARED_KEY_CASES = (
    ("dense", 192, 200, 333, 1, False, lambda r, b, h, nq, nk, t: {}),
    ("causal-gqa", 256, 129, 300, 4, True, lambda r, b, h, nq, nk, t: {}),
    ("softcap+alibi+window-d160", 160, 250, 250, 2, False,
     lambda r, b, h, nq, nk, t: dict(softcap=2.0, alibi_slopes=_slopes((h,)), window=(64, 16))),
    ("dropout+bias-d200", 200, 100, 150, 1, False,
     lambda r, b, h, nq, nk, t: dict(dropout_p=0.2, seed=7, bias=_bias(r, (b, h, nq, nk), t))),
    ("block_mask+causal", 192, 300, 300, 2, True,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (b, 1), nq, nk, 16), block_size=16)),
    # The band alone: on Hopper the 16-bit calls run bwd_sm90.cu's roles (MODE_BAND).
    ("window+seqlens_k", 256, 300, 333, 2, True,
     lambda r, b, h, nq, nk, t: dict(window=(100, 0), seqlens_k=_seqlens(r, b, nk))),
    ("window-d192", 192, 257, 200, 1, False, lambda r, b, h, nq, nk, t: dict(window=(70, 30))),
)


def _checked_key_block_launches(rng, monkeypatch, dtype, d, nq, nk, group, causal, build, deterministic,
                                layout="bhsd"):
    """Runs a case (two batch entries) against the float64 reference at the dtype's
    tolerance and returns the key-block kernels it launched (those writing dK), or None
    in a dry run."""
    from cupyflash import _cuda, _kernels
    launched = []
    if not DRY_RUN:
        launch = _cuda._launch
        monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    host = _qkv(rng, dtype, d, nq, nk, group, layout, batch=2)
    opts = build(rng, 2, 2 * group, nq, nk, dtype)
    opts.update(causal=causal, layout=layout, deterministic=deterministic)
    got, ref = _run_both(cupyflash.attention_forward, host, opts)
    _check(got, ref, dtype)
    return None if DRY_RUN else [v for v in launched if v.grads & _kernels.GRAD_DK]


def _on_hopper():
    import cupy as cp
    from cupyflash import _cuda
    return DRY_RUN or _cuda._device_info(cp.cuda.Device().id)[0] == "sm_90a"


def _shares(variant):
    """The warps that share each 16-key m-tile of a key-block kernel (its tile's HALVES;
    on Hopper from d = 192 the two warpgroups of the roles)."""
    from cupyflash import _kernels
    if variant.family is _kernels.BWD_WIDE:
        return variant.tile[4]
    if variant.family is _kernels.BWD_SM90:
        return 2 if variant.head_dim >= _kernels.BWD_SM90_ROLES_MIN_HEAD_DIM else 1
    return variant.tile[3] if variant.family is _kernels.BWD_SM80 and len(variant.tile) > 3 else 1


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("name,d,nq,nk,group,causal,build", SHARED_KEY_CASES, ids=[c[0] for c in SHARED_KEY_CASES])
def test_backward_with_shared_key_tiles_from_d192(rng, monkeypatch, name, d, nq, nk, group, causal, build,
                                                  deterministic, dtype):
    """The backward from d = 192 against the float64 reference (the dtype's tolerance),
    through key-block kernels whose warps share each key m-tile (fp64's deterministic dQ
    on the CUDA cores), with the bias gradient too."""
    key_block = _checked_key_block_launches(rng, monkeypatch, dtype, d, nq, nk, group, causal, build, deterministic)
    if key_block is not None:
        assert key_block and all(_shares(v) > 1 for v in key_block), [v.name_expression for v in key_block]


# Options on the Hopper backward's roles (d = 192 and 256; the bias at d = 192, its gradient
# asked for): Gemma's softcap with a sliding window at d = 256, dropout, ALiBi, block masks,
# GQA, a bias (with softcap: the sm80 kernels in the deterministic mode).
HOPPER_ROLES_OPTION_CASES = (
    ("softcap+window-d256", 256, 300, 333, 2, True,
     lambda r, b, h, nq, nk, t: dict(softcap=50.0, window=(100, 0))),
    ("dropout-d192", 192, 257, 200, 1, False, lambda r, b, h, nq, nk, t: dict(dropout_p=0.2, seed=3)),
    ("alibi+block_mask-d160", 160, 200, 300, 4, False,
     lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((h,)),
                                     block_mask=_block_mask(r, (b, 1), nq, nk, 16), block_size=16)),
    ("everything-d200", 200, 129, 65, 1, True,
     lambda r, b, h, nq, nk, t: dict(softcap=5.0, alibi_slopes=_slopes((h,)), dropout_p=0.1, seed=9,
                                     window=(40, 7), seqlens_k=_seqlens(r, b, nk))),
    ("bias+dropout-d192", 192, 300, 264, 2, True,
     lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (b, h, nq, nk), t), dropout_p=0.2, seed=5)),
    ("bias+softcap-d192", 192, 200, 136, 1, False,
     lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (nq, nk), t), softcap=30.0)),
)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("name,d,nq,nk,group,causal,build", HOPPER_ROLES_OPTION_CASES,
                         ids=[c[0] for c in HOPPER_ROLES_OPTION_CASES])
def test_hopper_roles_with_options(rng, monkeypatch, name, d, nq, nk, group, causal, build, deterministic, dtype):
    """The options from d = 192 on the Hopper backward's roles (the dV role trading S^T as
    computed, each role running the options' passes on it) against the float64 reference,
    dbias included."""
    from cupyflash import _kernels
    if not _on_hopper():
        pytest.skip("not a Hopper GPU")
    key_block = _checked_key_block_launches(rng, monkeypatch, dtype, d, nq, nk, group, causal, build, deterministic)
    if key_block is not None and deterministic and name.startswith("bias+softcap"):
        assert [v.family for v in key_block] == [_kernels.BWD_SM80], [v.name_expression for v in key_block]
    elif key_block is not None:
        assert [v.family for v in key_block] == [_kernels.BWD_SM90], [v.name_expression for v in key_block]
        assert key_block[0].head_dim >= _kernels.BWD_SM90_ROLES_MIN_HEAD_DIM


# Block masks whose blocks are whole tiles of the Hopper backward (128 x 128 at d = 64,
# 64 queries x 128 keys at d = 128, 64 x 64 from d = 192) run its dense path (MODE_BAND:
# persistent CTAs, the walker skipping the tiles the mask leaves off, no element masked
# by it), alone or beside a band; rows whose blocks are all off see no key (dq 0). GQA
# with a mask per query head, uneven lengths. In the deterministic mode the option
# kernels take them (Sm90BwdKVTile::BAND_BLOCKS).
# (id, d, nq, nk, GQA group, causal, builder as OPTION_CASES')
HOPPER_WHOLE_TILE_BLOCK_CASES = (
    ("128-per-head", 64, 1000, 1300, 2, False,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (b, h), nq, nk, 128, density=0.4))),
    ("128+causal+window", 128, 1500, 1500, 1, True,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (1, h), nq, nk, 128, density=0.6),
                                     window=(600, 0))),
    ("64x128-d104-gqa4", 104, 700, 900, 4, False,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (b, 1), nq, nk, (64, 128), density=0.5),
                                     block_size=(64, 128))),
    ("64-d192+causal", 192, 300, 333, 2, True,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (b, h), nq, nk, 64, density=0.5), block_size=64)),
    ("128x64-d256+seqlens_k", 256, 257, 300, 1, False,
     lambda r, b, h, nq, nk, t: dict(block_mask=_block_mask(r, (), nq, nk, (128, 64), density=0.7,
                                                            empty_row=False),
                                     block_size=(128, 64), seqlens_k=_seqlens(r, b, nk))),
)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("name,d,nq,nk,group,causal,build", HOPPER_WHOLE_TILE_BLOCK_CASES,
                         ids=[c[0] for c in HOPPER_WHOLE_TILE_BLOCK_CASES])
def test_hopper_backward_block_mask_of_whole_tiles(rng, monkeypatch, name, d, nq, nk, group, causal, build,
                                                   deterministic):
    """A block mask of whole tiles on the Hopper backward's dense path (MODE_BAND; the
    option kernels in the deterministic mode), against the float64 reference; the
    key-block kernel must be that one."""
    from cupyflash import _kernels
    if not _on_hopper():
        pytest.skip("not a Hopper GPU")
    dtype = "float16" if deterministic else "bfloat16"
    key_block = _checked_key_block_launches(rng, monkeypatch, dtype, d, nq, nk, group, causal, build, deterministic,
                                            layout="bshd")
    if key_block is not None:
        mode = _kernels.MODE_EXT if deterministic else _kernels.MODE_BAND
        assert [(v.family, v.mode) for v in key_block] == [(_kernels.BWD_SM90, mode)], \
            [v.name_expression for v in key_block]


# ALiBi, softcap or dropout as the call's one such option on the Hopper backward's dense
# path (MODE_BAND | MODE_ALIBI: the lean passes add ALiBi to each score; MODE_BAND |
# MODE_SOFTCAP: P and dS in one pass once both products are in, with the roles from d =
# 192 the dV role trading S^T; MODE_BAND | MODE_DROPOUT: the keep bits drawn by warp
# pairs, dropped scores out of dV and dP), alone or beside a band or a block mask of
# whole tiles (which the deterministic mode leaves to the option kernels): ALiBi slopes
# per head or per (batch, head), GQA, d = 104 padded to 128, the roles from d = 192.
# (id, d, nq, nk, GQA group, causal, builder as OPTION_CASES')
HOPPER_DENSE_PATH_TERM_CASES = (
    ("alibi-causal-d64", 64, 1000, 1000, 2, True, lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((h,)))),
    ("alibi-window-gqa4-d128", 128, 700, 900, 4, False,
     lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((b, h)), window=(300, 50))),
    ("alibi-blocks-d104", 104, 700, 900, 1, False,
     lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((h,)), block_mask=_block_mask(r, (b, h), nq, nk, 128))),
    ("alibi-causal-d192", 192, 300, 333, 2, True, lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((b, h)))),
    ("alibi-seqlens_k-d256", 256, 257, 300, 1, False,
     lambda r, b, h, nq, nk, t: dict(alibi_slopes=_slopes((h,)), seqlens_k=_seqlens(r, b, nk))),
    ("softcap-d64", 64, 1000, 1100, 2, False, lambda r, b, h, nq, nk, t: dict(softcap=3.0)),
    ("softcap-causal-window-gqa4-d128", 128, 700, 900, 4, True,
     lambda r, b, h, nq, nk, t: dict(softcap=5.0, window=(300, 0))),
    ("softcap-blocks-d104", 104, 700, 900, 1, False,
     lambda r, b, h, nq, nk, t: dict(softcap=2.0, block_mask=_block_mask(r, (b, h), nq, nk, 128))),
    ("softcap-causal-d192", 192, 300, 333, 2, True, lambda r, b, h, nq, nk, t: dict(softcap=4.0)),
    ("softcap-seqlens_k-d256", 256, 257, 300, 1, False,
     lambda r, b, h, nq, nk, t: dict(softcap=3.0, seqlens_k=_seqlens(r, b, nk))),
    ("dropout-d64", 64, 1000, 1100, 2, False, lambda r, b, h, nq, nk, t: dict(dropout_p=0.2, seed=5)),
    ("dropout-causal-window-gqa4-d128", 128, 700, 900, 4, True,
     lambda r, b, h, nq, nk, t: dict(dropout_p=0.1, seed=6, window=(300, 0))),
    ("dropout-blocks-d104", 104, 700, 900, 1, False,
     lambda r, b, h, nq, nk, t: dict(dropout_p=0.3, seed=7, block_mask=_block_mask(r, (b, h), nq, nk, 128))),
    ("dropout-causal-d192", 192, 300, 333, 2, True, lambda r, b, h, nq, nk, t: dict(dropout_p=0.15, seed=8)),
    ("dropout-seqlens_k-d256", 256, 257, 300, 1, False,
     lambda r, b, h, nq, nk, t: dict(dropout_p=0.2, seed=9, seqlens_k=_seqlens(r, b, nk))),
)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("name,d,nq,nk,group,causal,build", HOPPER_DENSE_PATH_TERM_CASES,
                         ids=[c[0] for c in HOPPER_DENSE_PATH_TERM_CASES])
def test_hopper_backward_score_term_on_the_dense_path(rng, monkeypatch, name, d, nq, nk, group, causal, build,
                                                      deterministic):
    """ALiBi, softcap or dropout on the Hopper backward's dense path (MODE_BAND |
    MODE_ALIBI, MODE_SOFTCAP or MODE_DROPOUT), against the float64 reference; the
    key-block kernel must be that one."""
    from cupyflash import _kernels
    if not _on_hopper():
        pytest.skip("not a Hopper GPU")
    dtype = "bfloat16" if deterministic else "float16"
    key_block = _checked_key_block_launches(rng, monkeypatch, dtype, d, nq, nk, group, causal, build, deterministic)
    if key_block is not None:
        term, ext = name.split("-")[0], deterministic and "-blocks" in name
        mode = _kernels.MODE_EXT if ext else _kernels.MODE_BAND | _kernels.DENSE_PATH_TERMS[term]
        assert [(v.family, v.mode) for v in key_block] == [(_kernels.BWD_SM90, mode)], \
            [v.name_expression for v in key_block]


HOPPER_BIAS_CASES = (
    ("2d", (1, 16), 64, False, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (nq, nk), t))),
    ("2d-causal", (129, 1000), 128, True, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (nq, nk), t))),
    ("per-head", (1000, 136), 104, False, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (1, h, nq, nk), t))),
    ("full-causal", (300, 512), 64, True, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (b, h, nq, nk), t))),
    ("softcap", (1000, 1000), 128, False,
     lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (b, 1, nq, nk), t), softcap=25.0)),
    ("softcap-d64", (257, 200), 64, True, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (nq, nk), t), softcap=25.0)),
    ("everything", (1000, 1000), 64, True, lambda r, b, h, nq, nk, t: dict(
        bias=_bias(r, (1, h, nq, nk), t), window=(400, 5), seqlens_k=_seqlens(r, b, nk),
        alibi_slopes=_slopes((h,)), dropout_p=0.2, seed=11)),
    ("long", (4097, 4096), 128, True, lambda r, b, h, nq, nk, t: dict(bias=_bias(r, (nq, nk), t))),
)


@pytest.mark.parametrize("dbias", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name,sizes,d,causal,build", HOPPER_BIAS_CASES, ids=[c[0] for c in HOPPER_BIAS_CASES])
def test_hopper_backward_with_a_bias(rng, monkeypatch, name, sizes, d, causal, build, deterministic, dbias):
    """dq, dk, dv (and dbias where asked for) of a call with a bias from bwd_sm90.cu's
    MODE_BIAS kernel against the float64 reference; softcap beside a bias in the
    deterministic mode, or beside dbias at d = 128, takes the sm80 kernels
    (_cuda._sm90_bias_box), checked against the reference too."""
    if DRY_RUN:
        pytest.skip("pins a GPU kernel")
    import cupy as cp
    from cupyflash import _cuda, _kernels
    if _cuda._device_info(cp.cuda.Device().id)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    launched = []
    launch = _cuda._launch
    monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    nq, nk = sizes
    dtype = ("bfloat16", "float16")[(len(name) + deterministic) % 2]
    batch = 2 if nq * nk <= 10**6 else 1
    host = _qkv(rng, dtype, d, nq, nk, 2, LAYOUTS[len(name) % 2], batch=batch, kv_heads=1)
    opts = build(rng, batch, 2, nq, nk, dtype)
    opts.update(causal=causal, layout=LAYOUTS[len(name) % 2], deterministic=deterministic)
    got, ref = _run_both(cupyflash.attention_forward, host, opts, dbias=dbias)
    _check(got, ref, dtype)
    hopper = [v for v in launched if v.family is _kernels.BWD_SM90]
    if "softcap" in opts and (deterministic or (dbias and d > 64)):
        assert not hopper, "softcap with a bias in the deterministic mode, or with dbias at d = 128: the sm80 kernels"
    else:
        assert hopper and all(v.mode & _kernels.MODE_BIAS for v in hopper), [v.name_expression for v in launched]


def test_hopper_bias_tiles_by_tma_where_the_rows_allow():
    """The Hopper forward loads bias tiles by TMA only for a bias with whole rows whose
    rows TMA can describe; other biases take the per-thread loads (both are checked
    against the reference in test_hopper_path_with_options)."""
    if DRY_RUN:
        pytest.skip("needs the GPU")
    import cupy as cp
    from cupyflash import _cuda, _kernels
    variant = next(v for v in _kernels.forward_variants("bfloat16", 128, _kernels.MODE_EXT | _kernels.MODE_BIAS)
                   if v.family is _kernels.FWD_SM90)
    full = cp.zeros((1, 1, 100, 1000), cp.float16).astype("bfloat16")
    assert _cuda._sm90_bias_spec(variant, full, 100, 1000) is not None
    odd = cp.zeros((1, 1, 100, 999), cp.float16).astype("bfloat16")
    assert _cuda._sm90_bias_spec(variant, odd, 100, 999) is None                  # rows not 16-byte aligned
    assert _cuda._sm90_bias_spec(variant, full[:, :, :1], 100, 1000) is None       # broadcast over queries
    dense = next(v for v in _kernels.forward_variants("bfloat16", 128) if v.family is _kernels.FWD_SM90)
    assert _cuda._sm90_bias_spec(dense, full, 100, 1000) is None                  # a kernel without the bias


def test_index_arrays_are_uploaded_once_per_contents():
    """Host cu_seqlens / seqlens_k go to the GPU through a cache of their contents: equal
    contents share one read-only device copy, other contents get their own."""
    if DRY_RUN:
        pytest.skip("needs the GPU")
    import cupy as cp
    from cupyflash import _arrays
    device = cp.cuda.Device().id
    a = _arrays.device_copy_of_index(np.array([0, 5, 9], np.int32), device)
    b = _arrays.device_copy_of_index(np.array([0, 5, 9], np.int32), device)
    c = _arrays.device_copy_of_index(np.array([0, 5, 10], np.int32), device)
    assert a is b and c is not a
    assert cp.asnumpy(c).tolist() == [0, 5, 10] and c.dtype == np.int32
