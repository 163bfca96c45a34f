"""The public API's modifiers on the NumPy backend: user arguments (broadcast shapes, both
layouts, batch dims) resolved and run, against the float64 oracle; dbias; the dropout
RNG; varlen against per-sequence attention; inputs left unmodified."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _philox
from oracle import naive_attention, naive_attention_grads
from test_mods_reference import assert_grad_close, keep_mask
from test_reference import assert_close

TOL = {np.float64: 1e-12, np.float32: 1e-5}  # tests/TOLERANCES.md
DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])


def _inputs(rng, dtype, b=2, hq=4, hk=2, nq=23, nk=29, d=8, dv=5):
    q = rng.standard_normal((b, hq, nq, d)).astype(dtype)
    k = rng.standard_normal((b, hk, nk, d)).astype(dtype)
    v = rng.standard_normal((b, hk, nk, dv)).astype(dtype)
    do = rng.standard_normal((b, hq, nq, dv)).astype(dtype)
    return q, k, v, do


def _to_bshd(*xs):
    return tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in xs)


def _option_sets(rng, dtype, b, hq, nq, nk):
    """(name, API options, oracle options): user-facing shapes, including broadcasting."""
    mask = rng.random((hq, -(-nq // 16), -(-nk // 16))) < 0.6   # broadcast over batch
    return [
        ("window", dict(window=(4, 2)), dict(window=(4, 2))),
        ("causal+window", dict(causal=True, window=(5, -1)), dict(causal=True, window=(5, -1))),
        ("seqlens_k", dict(seqlens_k=np.array([29, 3])), dict(seqlens_k=[29, 3])),
        ("block_mask+causal", dict(block_mask=mask, block_size=16, causal=True),
         dict(block_mask=mask, block_size=(16, 16), causal=True)),
        ("bias(Hq,1,Nk)+causal", dict(bias=(bias := rng.standard_normal((hq, 1, nk)).astype(dtype)),
                                      causal=True), dict(bias=bias, causal=True)),
        ("alibi+softcap", dict(alibi_slopes=(s := rng.uniform(0.1, 0.5, hq).astype(dtype)), softcap=2.5),
         dict(alibi_slopes=s, softcap=2.5)),
    ]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@DTYPES
def test_options_through_the_api_match_the_oracle(layout, dtype, rng):
    q, k, v, do = _inputs(rng, dtype)
    for name, api_opts, ref_opts in _option_sets(rng, dtype, 2, 4, 23, 29):
        ref_opts = {"causal": False, **ref_opts}
        args = (q, k, v) if layout == "bhsd" else _to_bshd(q, k, v)
        o, ctx = cf.attention_forward(*args, layout=layout, backend="numpy", **api_opts)
        dgrad = do if layout == "bhsd" else _to_bshd(do)[0]
        grads = cf.attention_backward(dgrad, ctx, return_dbias="bias" in api_opts)
        if layout == "bshd":
            o = o.transpose(0, 2, 1, 3)
            grads = (*(g.transpose(0, 2, 1, 3) for g in grads[:3]), *grads[3:])
        o_ref, lse_ref = naive_attention(q, k, v, scale=8 ** -0.5, **ref_opts)
        assert_close(o, o_ref, TOL[dtype]), name
        assert_close(ctx.lse, lse_ref, TOL[dtype]), name
        for got, ref in zip(grads, naive_attention_grads(do, q, k, v, scale=8 ** -0.5, **ref_opts)):
            assert got.dtype == dtype
            assert_grad_close(got, ref, TOL[dtype])


@pytest.mark.parametrize("shape", [(1, 4, 1, 29), (2, 1, 23, 29), (4, 23, 1), (29,), (2, 4, 23, 29)],
                         ids=str)
def test_dbias_has_the_bias_shape_summed_over_broadcast_axes(shape, rng):
    q, k, v, do = _inputs(rng, np.float64)
    bias = rng.standard_normal(shape)
    o, vjp = cf.attention_vjp(q, k, v, bias=bias, backend="numpy")
    *grads, dbias = vjp(do, return_dbias=True)
    refs = naive_attention_grads(do, q, k, v, scale=8 ** -0.5, causal=False, bias=bias)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    assert_grad_close(dbias, refs[3], 1e-12)


def test_bias_with_batch_dims_that_do_not_merge(rng):
    """bhsd with two batch dims and a bias broadcast over one of them: compacted by a copy
    of the broadcast leading axes, its gradient summed back."""
    q = rng.standard_normal((2, 3, 2, 7, 8))
    k = rng.standard_normal((2, 3, 2, 9, 8))
    v = rng.standard_normal((2, 3, 2, 9, 8))
    bias = rng.standard_normal((2, 1, 2, 7, 9))
    o, ctx = cf.attention_forward(q, k, v, bias=bias, backend="numpy")
    *_, dbias = cf.attention_backward(np.ones_like(o), ctx, return_dbias=True)
    flat = lambda x: x.reshape(6, *x.shape[2:])
    o_ref, _ = naive_attention(flat(q), flat(k), flat(v), scale=8 ** -0.5, causal=False,
                               bias=flat(np.broadcast_to(bias, (2, 3, 2, 7, 9))))
    assert_close(o, o_ref.reshape(o.shape), 1e-12)
    *_, db_full = naive_attention_grads(flat(np.ones_like(o)), flat(q), flat(k), flat(v),
                                        scale=8 ** -0.5, causal=False,
                                        bias=flat(np.broadcast_to(bias, (2, 3, 2, 7, 9))))
    assert_close(dbias, db_full.reshape(2, 3, 2, 7, 9).sum(axis=1, keepdims=True), 1e-12)


def test_return_dbias_needs_a_bias(rng):
    q, k, v, do = _inputs(rng, np.float64)
    o, ctx = cf.attention_forward(q, k, v, backend="numpy")
    with pytest.raises(ValueError, match="^return_dbias=True needs a forward pass with a bias"):
        cf.attention_backward(do, ctx, return_dbias=True)
    with pytest.raises(TypeError, match="^return_dbias must be True or False"):
        cf.attention_backward(do, ctx, return_dbias=1)


# ------------------------------------------------------------------------------ dropout


def test_dropout_with_seed_repeats_and_matches_the_keep_mask(rng):
    q, k, v, do = _inputs(rng, np.float64, hq=6, hk=2)
    o1, ctx = cf.attention_forward(q, k, v, dropout_p=0.3, seed=42, causal=True, backend="numpy")
    o2 = cf.attention(q, k, v, dropout_p=0.3, seed=42, causal=True, backend="numpy")
    np.testing.assert_array_equal(o1, o2)
    assert (ctx.seed, ctx.rng_offset) == (42, 0)
    keep = keep_mask(42, 0, 2, 6, 23, 29, 0.3)
    opts = dict(scale=8 ** -0.5, causal=True, keep=keep, dropout_p=0.3)
    assert_close(o1, naive_attention(q, k, v, **opts)[0], 1e-12)
    for got, ref in zip(cf.attention_backward(do, ctx), naive_attention_grads(do, q, k, v, **opts)):
        assert_close(got, ref, 1e-12)


def test_dropout_without_seed_draws_fresh_streams(rng):
    q, k, v, _ = _inputs(rng, np.float64)
    _, ctx1 = cf.attention_forward(q, k, v, dropout_p=0.5, backend="numpy")
    o2, ctx2 = cf.attention_forward(q, k, v, dropout_p=0.5, backend="numpy")
    assert ctx1.seed == ctx2.seed and ctx2.rng_offset == (ctx1.rng_offset + 2 * 4) % 2**64
    assert not np.array_equal(cf.attention(q, k, v, dropout_p=0.5, backend="numpy"), o2)
    # The context's seed and offset reproduce the call.
    keep = keep_mask(ctx2.seed, ctx2.rng_offset, 2, 4, 23, 29, 0.5)
    assert_close(o2, naive_attention(q, k, v, scale=8 ** -0.5, causal=False, keep=keep,
                                     dropout_p=0.5)[0], 1e-12)


def test_manual_seed_reproduces_a_sequence_of_calls(rng):
    q, k, v, _ = _inputs(rng, np.float32)
    def run():
        cf.manual_seed(1234)
        return [cf.attention(q, k, v, dropout_p=0.2, backend="numpy") for _ in range(2)]
    first, second = run(), run()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(*first)
    with pytest.raises(ValueError, match=r"^seed must be in \[0, 2\*\*64\)"):
        cf.manual_seed(-1)


def test_no_dropout_leaves_the_rng_alone(rng):
    q, k, v, _ = _inputs(rng, np.float32)
    cf.manual_seed(7)
    cf.attention(q, k, v, backend="numpy")
    _, ctx = cf.attention_forward(q, k, v, dropout_p=0.1, backend="numpy")
    assert (ctx.seed, ctx.rng_offset) == (7, 0)


# ------------------------------------------------------------------------------- varlen


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@DTYPES
def test_varlen_equals_per_sequence_attention(causal, dtype, rng):
    lq, lk = [7, 1, 0, 19], [5, 11, 2, 19]
    hq, hk, d = 4, 2, 8
    q = rng.standard_normal((sum(lq), hq, d)).astype(dtype)
    k = rng.standard_normal((sum(lk), hk, d)).astype(dtype)
    v = rng.standard_normal((sum(lk), hk, d)).astype(dtype)
    cu_q, cu_k = np.cumsum([0, *lq]), np.cumsum([0, *lk]).astype(np.int32)
    copies = [x.copy() for x in (q, k, v, cu_q, cu_k)]
    o, ctx = cf.varlen_attention_forward(q, k, v, cu_q, cu_k, 19, 20, causal=causal, window=(6, 3),
                                         backend="numpy")
    do = rng.standard_normal(o.shape).astype(dtype)
    dq, dk, dv = cf.attention_backward(do, ctx)
    assert o.shape == (sum(lq), hq, d) and ctx.lse.shape == (hq, sum(lq))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    _, lse = cf.varlen_attention(q, k, v, cu_q, cu_k, 19, 20, causal=causal, window=(6, 3),
                                 return_lse=True, backend="numpy")
    np.testing.assert_array_equal(lse, ctx.lse)
    for s in range(len(lq)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lq[s] == 0:
            continue
        seq = [x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys], do[rows])]
        o_s, ctx_s = cf.attention_forward(*seq[:3], causal=causal, window=(6, 3), backend="numpy")
        assert_close(o[rows], o_s[0].transpose(1, 0, 2), TOL[dtype])
        assert_close(ctx.lse[:, rows], ctx_s.lse[0], TOL[dtype])
        for got, ref in zip((dq[rows], dk[keys], dv[keys]), cf.attention_backward(seq[3], ctx_s)):
            assert_close(got, ref[0].transpose(1, 0, 2), TOL[dtype])
    for before, after in zip(copies, (q, k, v, cu_q, cu_k)):
        np.testing.assert_array_equal(before, after)


def test_varlen_dropout_alibi_counts_per_sequence(rng):
    """Batch index = sequence, rows/cols from the sequence start: the oracle per sequence
    with the Philox mask of that (sequence, head)."""
    lq, lk, hq = [5, 9], [6, 9], 2
    q, k, v = (rng.standard_normal((sum(n), hq, 4)) for n in (lq, lk, lk))
    cu_q, cu_k = np.cumsum([0, *lq]), np.cumsum([0, *lk])
    slopes = rng.uniform(0.1, 0.5, (2, hq))
    o, vjp = cf.varlen_attention_vjp(q, k, v, cu_q, cu_k, 9, 9, dropout_p=0.25, seed=3,
                                     alibi_slopes=slopes, softcap=3.0, causal=True, backend="numpy")
    for s in range(2):
        keep = keep_mask(3, 0, 1, hq, lq[s], lk[s], 0.25, batch_base=s)
        ref, _ = naive_attention(q[cu_q[s]:cu_q[s + 1]][None].transpose(0, 2, 1, 3),
                                 k[cu_k[s]:cu_k[s + 1]][None].transpose(0, 2, 1, 3),
                                 v[cu_k[s]:cu_k[s + 1]][None].transpose(0, 2, 1, 3),
                                 scale=0.5, causal=True, keep=keep, dropout_p=0.25,
                                 alibi_slopes=slopes[s], softcap=3.0)
        assert_close(o[cu_q[s]:cu_q[s + 1]], ref[0].transpose(1, 0, 2), 1e-12)
    assert len(vjp(np.ones_like(o))) == 3


def test_option_arrays_are_not_modified(rng):
    q, k, v, do = _inputs(rng, np.float64)
    arrays = dict(bias=rng.standard_normal((4, 23, 29)), alibi_slopes=rng.uniform(0, 1, 4),
                  block_mask=(rng.random((2, -(-23 // 16), -(-29 // 16))) < 0.7)[:, None].astype(np.int64),
                  seqlens_k=np.array([5, 29]))
    copies = {n: a.copy() for n, a in arrays.items()}
    for a in (*arrays.values(), q, k, v):
        a.flags.writeable = False
    o, ctx = cf.attention_forward(q, k, v, block_size=16, dropout_p=0.1, **arrays, backend="numpy")
    cf.attention_backward(do, ctx, return_dbias=True)
    for n, a in arrays.items():
        np.testing.assert_array_equal(a, copies[n])
