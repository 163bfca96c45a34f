"""CPU tier: the NumPy backend's modifiers (window, key padding, varlen, block-sparse,
bias, ALiBi, softcap, dropout) against the float64 oracle, and the mask rules that
carry them against brute force.

The backend receives `cupyflash._mods.Modifiers` in compact form, built here by hand;
the public API's resolution of user arguments into that form is tested in test_api /
test_mods_api.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from cupyflash import _masks, _mods, _philox
from cupyflash._reference import attention_backward, attention_forward
from oracle import naive_attention, naive_attention_grads, naive_visible
from test_reference import Case, assert_close, make_inputs

TOL = {np.float64: 1e-12, np.float32: 1e-5}  # tests/TOLERANCES.md
DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])

# ------------------------------------------------------------------------------ masks

WINDOWS = [(-1, -1), (0, 0), (2, -1), (-1, 1), (3, 2), (0, 5)]


def _check_rules(seen, nq, nk, rules):
    """Spans, tile ranges and the tile-mask test under ``rules`` against ``seen``, the
    (nq, nk) visibility element by element: ranges visit exactly the tiles with a visible
    element."""
    got = _masks.visible(np.arange(nq)[:, None], np.arange(nk)[None, :], nq, nk, **rules)
    np.testing.assert_array_equal(got, seen)
    for span, n in ((_masks.visible_key_span, nq), (_masks.visible_query_span, nk)):
        lo, hi = span(np.arange(n), nq, nk, **rules)
        assert (np.diff(lo) >= 0).all() and (np.diff(hi) >= 0).all()
    for bq, bk in [(1, 1), (3, 4), (4, 3), (16, 16)]:
        tiles_q, tiles_k = -(-nq // bq), -(-nk // bk)
        hit = np.array([[seen[t * bq:(t + 1) * bq, u * bk:(u + 1) * bk].any()
                         for u in range(tiles_k)] for t in range(tiles_q)])
        for t in range(tiles_q):
            first, stop = _masks.key_block_range(t * bq, (t + 1) * bq, nq, nk, bk, **rules)
            assert list(range(first, stop)) == list(np.flatnonzero(hit[t]))
            for u in range(tiles_k):
                whole = seen[t * bq:(t + 1) * bq, u * bk:(u + 1) * bk].all() and (u + 1) * bk <= nk
                assert _masks.tile_needs_mask(t * bq, (t + 1) * bq, u * bk, (u + 1) * bk,
                                              nq, nk, **rules) == (not whole)
        for u in range(tiles_k):
            first, stop = _masks.query_block_range(u * bk, (u + 1) * bk, nq, nk, bq, **rules)
            assert list(range(first, stop)) == list(np.flatnonzero(hit[:, u]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_mask_rules_brute_force(causal, window):
    """The rules of a whole problem, for every key stop."""
    for nq, nk in itertools.product([1, 2, 3, 5, 8, 13], repeat=2):
        for key_stop in sorted({0, 1, nk // 2, nk}):
            seen = naive_visible(nq, nk, causal=causal, window=window, key_stop=key_stop)
            _check_rules(seen, nq, nk, dict(causal=causal, window=window, key_stop=key_stop))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_mask_rules_of_a_part_of_a_problem(causal, window):
    """A block of rows [r0, r0 + nq) and keys [k0, k0 + nk) of a larger problem (a chunk
    pair of the streamed path) with the problem's diagonal in its own indices sees what
    the problem sees there."""
    for big_q, big_k in [(13, 13), (8, 21), (21, 8)]:
        whole = naive_visible(big_q, big_k, causal=causal, window=window)
        for r0, nq in [(0, 5), (3, 7), (8, 5)]:
            for k0, nk in [(0, 8), (5, 3), (4, 4)]:
                if r0 + nq > big_q or k0 + nk > big_k:
                    continue
                diagonal = big_k - big_q + r0 - k0
                _check_rules(whole[r0:r0 + nq, k0:k0 + nk], nq, nk,
                             dict(causal=causal, window=window, diagonal=diagonal))


def test_block_mask_tiles_skips_zero_blocks():
    mask = np.array([[[0, 1, 0, 1, 1]], [[0, 0, 0, 1, 0]]], np.uint8)  # (2 heads, 1, 5)
    assert _masks.block_mask_tiles(mask[:, 0], 0, 5) == [1, 3, 4]
    assert _masks.block_mask_tiles(mask[:, 0], 2, 4) == [3]
    assert _masks.block_mask_tiles(mask[:, 0], 2, 2) == []


# --------------------------------------------------------------------- forward/backward


def assert_grad_close(got, ref, tol):
    """Relative error below tol, or absolute error below tol where the reference vanishes
    by cancellation (a per-query bias gets zero gradient: the softmax ignores row shifts)."""
    ref = np.asarray(ref, np.float64)
    if np.linalg.norm(ref) < 1e-6:
        assert np.abs(np.asarray(got, np.float64)).max() <= tol
    else:
        assert_close(got, ref, tol)


def make(rng, b, hq, hk, nq, nk, d, dv, dtype, *, bshd=False):
    return make_inputs(rng, Case(b, hq, hk, nq, nk, d, dv, False, bshd=bshd), dtype)


def keep_mask(seed, offset, b, hq, nq, nk, p, *, batch_base=0):
    """The dropout keep mask (B, Hq, Nq, Nk) the Philox mapping defines."""
    return np.stack([np.stack([_philox.dropout_keep_mask(seed, offset, batch_base + i, h, nq, nk,
                                                         p=p, heads=hq) for h in range(hq)])
                     for i in range(b)])


@dataclasses.dataclass(frozen=True)
class ModCase:
    """One modifier combination; ``oracle`` and ``mods`` give both sides' arguments."""
    name: str
    b: int
    hq: int
    hk: int
    nq: int
    nk: int
    d: int
    causal: bool = False
    window: tuple | None = None
    seqlens_k: tuple | None = None
    block_size: tuple = (16, 16)
    block_mask: str | None = None      # "random" or None
    bias_shape: tuple | None = None    # compact (Bb, Hb, Nqb, Nkb)
    alibi: str | None = None           # "per_head" (1, Hq) or "per_batch" (B, Hq)
    softcap: float = 0.0
    dropout_p: float = 0.0
    bshd: bool = False

    def __str__(self):
        return self.name


def case_arrays(case: ModCase, rng, dtype):
    """(oracle options, Modifiers) for a case, with fresh random modifier arrays."""
    opts, fields = {}, {}
    if case.window is not None:
        opts["window"] = fields["window"] = case.window
    if case.seqlens_k is not None:
        opts["seqlens_k"] = case.seqlens_k
        fields["seqlens_k"] = np.array(case.seqlens_k, np.int32)
    if case.block_mask:
        shape = (case.b, case.hq, -(-case.nq // case.block_size[0]), -(-case.nk // case.block_size[1]))
        mask = (rng.random(shape) < 0.6).astype(np.uint8)
        opts.update(block_mask=mask, block_size=case.block_size)
        fields.update(block_mask=mask, block_size=case.block_size)
    if case.bias_shape is not None:
        bias = rng.standard_normal(case.bias_shape).astype(dtype)
        opts["bias"] = fields["bias"] = bias
    if case.alibi:
        rows = case.b if case.alibi == "per_batch" else 1
        slopes = rng.uniform(0.05, 0.5, (rows, case.hq))
        opts["alibi_slopes"] = slopes
        fields["alibi_slopes"] = slopes.astype(dtype)
    if case.softcap:
        opts["softcap"] = fields["softcap"] = case.softcap
    if case.dropout_p:
        seed, offset = int(rng.integers(2**63)), int(rng.integers(2**40))
        fields.update(dropout_p=case.dropout_p, seed=seed, rng_offset=offset)
        opts.update(dropout_p=case.dropout_p,
                    keep=keep_mask(seed, offset, case.b, case.hq, case.nq, case.nk, case.dropout_p))
    return opts, _mods.Modifiers(**fields)


MOD_CASES = [
    ModCase("window", 2, 4, 2, 37, 41, 16, window=(5, 3)),
    ModCase("window-left-only-nq>nk", 1, 2, 1, 53, 29, 8, window=(4, -1)),
    ModCase("causal+window", 1, 2, 2, 61, 67, 8, causal=True, window=(7, 2), bshd=True),
    ModCase("causal+window-n1", 1, 3, 1, 1, 1, 4, causal=True, window=(0, 0)),
    ModCase("seqlens_k", 3, 2, 1, 23, 31, 8, seqlens_k=(31, 0, 17)),
    ModCase("seqlens_k+causal+window", 2, 2, 2, 29, 29, 8, causal=True, window=(6, -1),
            seqlens_k=(11, 29)),
    ModCase("block_mask", 2, 2, 1, 71, 53, 16, block_mask="random", block_size=(16, 32)),
    ModCase("block_mask+causal", 1, 4, 2, 97, 97, 8, causal=True, block_mask="random",
            bshd=True),
    ModCase("bias-full", 2, 2, 1, 19, 23, 8, bias_shape=(2, 2, 19, 23)),
    ModCase("bias-broadcast+causal", 2, 4, 2, 31, 37, 8, causal=True, bias_shape=(1, 4, 1, 37)),
    ModCase("bias-per-query", 1, 2, 2, 17, 13, 8, bias_shape=(1, 1, 17, 1)),
    ModCase("alibi", 2, 4, 4, 43, 47, 8, alibi="per_batch"),
    ModCase("softcap", 1, 2, 1, 41, 37, 16, softcap=2.0),
    ModCase("softcap+alibi", 1, 4, 2, 29, 59, 16, causal=True, softcap=5.0, alibi="per_head"),
    ModCase("dropout", 2, 2, 2, 47, 43, 8, dropout_p=0.3),
    ModCase("dropout+gqa", 1, 6, 2, 37, 53, 8, causal=True, dropout_p=0.2, bshd=True),
    ModCase("everything", 2, 4, 2, 67, 71, 16, causal=True, window=(40, -1), seqlens_k=(71, 50),
            block_mask="random", bias_shape=(2, 1, 67, 71), alibi="per_head", softcap=3.0,
            dropout_p=0.25),
]
MOD_PARAMS = pytest.mark.parametrize("case", MOD_CASES, ids=str)


def run_case(case, rng, dtype):
    q, k, v, do = make(rng, case.b, case.hq, case.hk, case.nq, case.nk, case.d, case.d + 3,
                       dtype, bshd=case.bshd)
    opts, mods = case_arrays(case, rng, dtype)
    scale = 1 / math.sqrt(case.d)
    return q, k, v, do, opts, mods, scale


@MOD_PARAMS
@DTYPES
def test_forward_matches_oracle(case, dtype, rng):
    q, k, v, _, opts, mods, scale = run_case(case, rng, dtype)
    o, lse = attention_forward(q, k, v, scale=scale, causal=case.causal, mods=mods,
                               block_q=32, block_k=16)
    o_ref, lse_ref = naive_attention(q, k, v, scale=scale, causal=case.causal, **opts)
    assert o.dtype == dtype and lse.dtype == dtype
    assert_close(o, o_ref, TOL[dtype])
    assert_close(lse, lse_ref, TOL[dtype])


@MOD_PARAMS
@DTYPES
def test_backward_matches_oracle(case, dtype, rng):
    q, k, v, do, opts, mods, scale = run_case(case, rng, dtype)
    o, lse = attention_forward(q, k, v, scale=scale, causal=case.causal, mods=mods)
    dbias = None if mods.bias is None else np.zeros(mods.bias.shape, dtype)
    grads = attention_backward(do, q, k, v, o, lse, scale=scale, causal=case.causal,
                               mods=mods, dbias=dbias, block_q=16, block_k=32)
    refs = naive_attention_grads(do, q, k, v, scale=scale, causal=case.causal, **opts)
    if dbias is not None:
        grads = (*grads, dbias)
    assert len(grads) == len(refs)
    for got, ref in zip(grads, refs):
        assert got.shape == ref.shape
        assert_grad_close(got, ref, TOL[dtype])


FD_CASES = [c for c in MOD_CASES if c.name in (
    "causal+window", "bias-broadcast+causal", "softcap+alibi", "dropout+gqa", "everything")]


@pytest.mark.parametrize("case", FD_CASES, ids=str)
def test_backward_matches_finite_differences(case, rng):
    """dq, dk, dv and dbias against central differences of sum(do * o), in float64, on
    shrunken copies of the cases (every element differentiated)."""
    small = dataclasses.replace(case, b=1, nq=min(case.nq, 9), nk=min(case.nk, 11), d=4,
                                seqlens_k=None if case.seqlens_k is None else (7,),
                                block_size=(16, 16),
                                bias_shape=None if case.bias_shape is None else
                                tuple(1 if n == 1 else m for n, m in
                                      zip(case.bias_shape, (1, case.hq, 9, 11))))
    q, k, v, do, opts, mods, scale = run_case(small, rng, np.float64)
    arrays = {"q": q, "k": k, "v": v}
    if mods.bias is not None:
        arrays["bias"] = mods.bias

    def loss(**changed):
        m = dataclasses.replace(mods, bias=changed.get("bias", mods.bias))
        o, _ = attention_forward(*(changed.get(n, arrays[n]) for n in "qkv"), scale=scale,
                                 causal=small.causal, mods=m)
        return float((o * do).sum())

    o, lse = attention_forward(q, k, v, scale=scale, causal=small.causal, mods=mods)
    dbias = None if mods.bias is None else np.zeros(mods.bias.shape)
    grads = list(attention_backward(do, q, k, v, o, lse, scale=scale, causal=small.causal,
                                    mods=mods, dbias=dbias))
    if dbias is not None:
        grads.append(dbias)
    eps = 1e-6
    for (name, x), grad in zip(arrays.items(), grads):
        numeric = np.zeros(x.shape)
        for index in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[index] += eps
            minus[index] -= eps
            numeric[index] = (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)
        assert_grad_close(grad, numeric, 1e-6)


# ---------------------------------------------------------------------------- varlen


def pack(rng, lengths, heads, dim, dtype):
    """Packed (1, H, total, dim) array and its per-sequence (1, H, n, dim) pieces."""
    whole = rng.standard_normal((1, heads, sum(lengths), dim)).astype(dtype)
    starts = np.cumsum([0, *lengths])
    return whole, [whole[:, :, a:b] for a, b in zip(starts, starts[1:])], starts


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@DTYPES
def test_varlen_equals_per_sequence_oracle(causal, dtype, rng):
    """Packed sequences (with an empty one, one without keys, Nq != Nk) against one oracle
    call per sequence; ALiBi per sequence, window, softcap and dropout with batch index =
    sequence index and rows/columns counted from each sequence's start."""
    lq, lk = [5, 0, 17, 1, 23], [7, 3, 17, 0, 19]
    hq, hk, d = 4, 2, 8
    q, qs, cu_q = pack(rng, lq, hq, d, dtype)
    k, ks, cu_k = pack(rng, lk, hk, d, dtype)
    v, vs, _ = pack(rng, lk, hk, d + 1, dtype)
    do, dos, _ = pack(rng, lq, hq, d + 1, dtype)
    slopes = rng.uniform(0.05, 0.5, (len(lq), hq))
    seed, offset, p = 99, 12345, 0.2
    mods = _mods.Modifiers(cu_seqlens_q=cu_q.astype(np.int32), cu_seqlens_k=cu_k.astype(np.int32),
                           max_seqlen_q=max(lq), max_seqlen_k=max(lk), window=(6, 4),
                           alibi_slopes=slopes.astype(dtype), softcap=4.0, dropout_p=p,
                           seed=seed, rng_offset=offset)
    scale = 0.3
    o, lse = attention_forward(q, k, v, scale=scale, causal=causal, mods=mods, block_q=16, block_k=16)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, scale=scale, causal=causal, mods=mods)
    for s in range(len(lq)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lq[s] == 0:
            continue
        if lk[s] == 0:   # no key at all: output 0, LSE -inf, no gradient
            assert not o[:, :, rows].any() and not dq[:, :, rows].any()
            assert np.isneginf(lse[:, :, rows]).all()
            continue
        opts = dict(scale=scale, causal=causal, window=(6, 4), alibi_slopes=slopes[s], softcap=4.0,
                    dropout_p=p, keep=keep_mask(seed, offset, 1, hq, lq[s], lk[s], p, batch_base=s))
        o_ref, lse_ref = naive_attention(qs[s], ks[s], vs[s], **opts)
        assert_close(o[:, :, rows], o_ref, TOL[dtype])
        assert_close(lse[:, :, rows], lse_ref, TOL[dtype])
        refs = naive_attention_grads(dos[s], qs[s], ks[s], vs[s], **opts)
        for got, ref in zip((dq[:, :, rows], dk[:, :, keys], dv[:, :, keys]), refs):
            assert_grad_close(got, ref, TOL[dtype])
    for s in range(len(lk)):
        if lq[s] == 0:   # keys no query sees get zero gradients
            assert not dk[:, :, cu_k[s]:cu_k[s + 1]].any()


# --------------------------------------------------------------------------- placed calls


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(40, 30), (-1, -1), (60, 0)], ids=str)
def test_a_placed_call_is_its_part_of_the_problem(causal, window, rng):
    """A call on rows [r0, r1) and keys [k0, k1) of a larger problem, told where it lies
    (row0, key0, the problem's diagonal: a chunk pair of the streamed path), computes
    the problem restricted to those keys: the oracle on the whole problem with every
    other key hidden (a block mask of single elements), the same band, ALiBi distances
    and dropout bits; its gradients are that restricted problem's."""
    b, hq, hk, big_q, big_k, d = 2, 4, 2, 150, 230, 8
    r0, r1, k0, k1 = 64, 119, 96, 171
    p, seed, offset = 0.25, 2**33 + 9, 40
    q, k, v, _ = make(rng, b, hq, hk, big_q, big_k, d, d + 3, np.float64)
    do = rng.standard_normal((b, hq, big_q, d + 3))
    slopes = rng.uniform(0.05, 0.3, (b, hq))
    part = np.zeros((big_q, big_k), bool)
    part[r0:r1, k0:k1] = True
    do[:, :, ~part.any(axis=1)] = 0   # rows outside the part add nothing to dk, dv
    opts = dict(window=window, alibi_slopes=slopes, dropout_p=p,
                keep=keep_mask(seed, offset, b, hq, big_q, big_k, p), block_mask=part, block_size=(1, 1))
    scale = 1 / math.sqrt(d)
    o_ref, lse_ref = naive_attention(q, k, v, scale=scale, causal=causal, **opts)
    grads_ref = naive_attention_grads(do, q, k, v, scale=scale, causal=causal, **opts)
    mods = _mods.Modifiers(window=window, alibi_slopes=slopes, dropout_p=p, seed=seed, rng_offset=offset,
                           row0=r0, key0=k0, diagonal=big_k - big_q)
    qp, kp, vp, dop = q[:, :, r0:r1], k[:, :, k0:k1], v[:, :, k0:k1], do[:, :, r0:r1]
    o, lse = attention_forward(qp, kp, vp, scale=scale, causal=causal, mods=mods, block_q=16, block_k=32)
    assert_close(o, o_ref[:, :, r0:r1], TOL[np.float64])
    assert_close(lse, lse_ref[:, :, r0:r1], TOL[np.float64])
    grads = attention_backward(dop, qp, kp, vp, o, lse, scale=scale, causal=causal, mods=mods,
                               block_q=32, block_k=16)
    for got, ref in zip(grads, (grads_ref[0][:, :, r0:r1], grads_ref[1][:, :, k0:k1], grads_ref[2][:, :, k0:k1])):
        assert_grad_close(got, ref, TOL[np.float64])


def test_placed_modifiers_hold_the_contract():
    """row0 and key0 need the problem's diagonal and the kernels' alignment, and a varlen
    call is never placed."""
    assert _mods.Modifiers(row0=64, key0=96, diagonal=5).call_diagonal(10, 20) == 5 + 64 - 96
    assert _mods.Modifiers().call_diagonal(10, 20) == 10
    with pytest.raises(ValueError, match="diagonal"):
        _mods.Modifiers(row0=64)
    with pytest.raises(ValueError, match="multiples of 32"):
        _mods.Modifiers(row0=16, diagonal=0)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match="varlen"):
        _mods.Modifiers(cu_seqlens_q=cu, cu_seqlens_k=cu, diagonal=0)


# --------------------------------------------------------------------------- dropout


def test_dropout_keep_rate_and_rescaling(rng):
    """With q = 0 the probabilities are uniform and V = 1 makes each row's output the kept
    share of its row over the drawn keep probability: exactly the Philox keep mask's,
    whose rate is that probability within 5 sigma, so the output is unbiased."""
    b, h, n, p_asked = 1, 2, 256, 0.3
    p = _philox.dropout_threshold(p_asked) / 256   # 0.30078..., the drawn probability
    q = np.zeros((b, h, n, 4))
    k = rng.standard_normal((b, h, n, 4))
    v = np.ones((b, h, n, 1))
    o, _ = attention_forward(q, k, v, scale=1.0, causal=False,
                             mods=_mods.Modifiers(dropout_p=p_asked, seed=5, rng_offset=0))
    keep = keep_mask(5, 0, b, h, n, n, p_asked)
    np.testing.assert_allclose(o[..., 0], keep.sum(-1) / (n * (1 - p)), rtol=1e-13)
    sigma = math.sqrt(p * (1 - p) / keep.size)
    assert abs(keep.mean() - (1 - p)) < 5 * sigma
    assert abs(o.mean() - 1) < 5 * sigma / (1 - p)


def test_dropout_streams_differ_per_head_and_offset(rng):
    q, k, v, _ = make(rng, 1, 2, 2, 16, 16, 4, 4, np.float64)
    base = _mods.Modifiers(dropout_p=0.5, seed=1, rng_offset=0)
    o1, lse1 = attention_forward(q, k, v, scale=1.0, causal=False, mods=base)
    o2, lse2 = attention_forward(q, k, v, scale=1.0, causal=False,
                                 mods=dataclasses.replace(base, rng_offset=2))
    np.testing.assert_array_equal(lse1, lse2)   # the LSE is before dropout
    assert not np.allclose(o1, o2)
