"""CPU tier: the NumPy backend and the mask rules against brute force and the oracle.

Random data comes from the conftest ``rng`` fixture, seeded from the test id, so every
case draws fresh data and a failure reproduces alone.
"""

from __future__ import annotations

import itertools
import math
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest

from cupyflash import _masks
from cupyflash._reference import attention_backward, attention_forward
from oracle import naive_attention, naive_attention_grads

TOL = {np.float64: 1e-12, np.float32: 1e-5}  # tests/TOLERANCES.md
DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])


@dataclass(frozen=True)
class Case:
    b: int
    hq: int
    hk: int
    nq: int
    nk: int
    d: int
    dv: int
    causal: bool
    block_q: int = 128
    block_k: int = 128
    bshd: bool = False  # build inputs as (B, N, H, d) and pass transposed strided views

    def __str__(self):
        return (f"b{self.b}h{self.hq}/{self.hk}-q{self.nq}k{self.nk}-d{self.d}v{self.dv}"
                f"-{'causal' if self.causal else 'full'}-blk{self.block_q}x{self.block_k}"
                f"{'-bshd' if self.bshd else ''}")


CASES = [
    Case(1, 1, 1, 1, 1, 8, 8, False),
    Case(2, 2, 1, 1, 1, 64, 64, True),
    Case(1, 2, 2, 1, 127, 64, 64, True, 16, 32),  # one decoding step sees the whole cache
    Case(1, 2, 1, 127, 1, 8, 8, True, 32, 16),  # all rows but the last see no key
    Case(1, 3, 3, 127, 127, 1, 1, False, 32, 48),
    Case(1, 2, 2, 257, 257, 64, 64, True),  # default blocks, not dividing N
    Case(2, 4, 2, 257, 127, 100, 100, True, 64, 48, bshd=True),
    Case(1, 8, 1, 127, 257, 128, 128, True, 48, 64, bshd=True),
    Case(1, 2, 1, 131, 97, 256, 256, False, 37, 29),
    Case(2, 4, 2, 64, 64, 8, 8, True, 16, 16),  # blocks dividing N exactly
    Case(1, 2, 2, 100, 130, 64, 32, True, 32, 64, bshd=True),  # dv != d
    Case(1, 8, 4, 200, 50, 16, 16, True, 64, 32),  # Nq > Nk with GQA: empty rows
    Case(1, 16, 2, 61, 67, 32, 32, False, 17, 23, bshd=True),  # GQA 8
    Case(1, 2, 1, 5, 7, 4, 4, True, 1, 1),  # one-row tiles
]
CASE_PARAMS = pytest.mark.parametrize("case", CASES, ids=str)


def make_inputs(rng, case: Case, dtype):
    """Fresh q, k, v (and a cotangent do) for a case, as strided views when ``bshd``."""
    def tensor(heads, n, dim):
        if case.bshd:
            x = rng.standard_normal((case.b, n, heads, dim)).astype(dtype)
            return x.transpose(0, 2, 1, 3)
        return rng.standard_normal((case.b, heads, n, dim)).astype(dtype)

    q = tensor(case.hq, case.nq, case.d)
    k = tensor(case.hk, case.nk, case.d)
    v = tensor(case.hk, case.nk, case.dv)
    do = tensor(case.hq, case.nq, case.dv)
    return q, k, v, do


def scale_of(case: Case) -> float:
    return 1.0 / math.sqrt(case.d)


def assert_close(out, ref, tol, *, magnitude_if_zero=0.0):
    """Relative error norm ||out - ref|| / ||ref|| below tol, with -inf in the same places.

    A reference that is exactly zero has no relative error; then the error is measured
    against `magnitude_if_zero`, the size of the terms whose cancellation gives zero.
    """
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    finite = np.isfinite(ref)
    assert np.isfinite(out[finite]).all()
    err = np.linalg.norm(out[finite] - ref[finite])
    norm = np.linalg.norm(ref[finite]) or magnitude_if_zero
    assert err <= tol * norm, (err, norm)


def forward(q, k, v, case: Case):
    return attention_forward(q, k, v, scale=scale_of(case), causal=case.causal,
                             block_q=case.block_q, block_k=case.block_k)


def backward(do, q, k, v, o, lse, case: Case):
    # Other block sizes than the forward's: the backward must not depend on them.
    return attention_backward(do, q, k, v, o, lse, scale=scale_of(case), causal=case.causal,
                              block_q=case.block_k, block_k=case.block_q)


# ---------------------------------------------------------------------------- masks


def brute_visible(nq, nk, causal):
    """The rule as stated, element by element."""
    return np.array([[not causal or j <= i + (nk - nq) for j in range(nk)]
                     for i in range(nq)], dtype=bool).reshape(nq, nk)


MASK_SIZES = [1, 2, 3, 5, 8, 13]
MASK_BLOCKS = [1, 3, 4, 16]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", list(itertools.product(MASK_SIZES, MASK_SIZES)))
def test_masks_brute_force(nq, nk, causal):
    seen = brute_visible(nq, nk, causal)
    rows, cols = np.arange(nq)[:, None], np.arange(nk + 20)[None, :]
    got = _masks.visible(rows, cols, nq, nk, causal=causal)
    np.testing.assert_array_equal(got[:, :nk], seen)
    assert not got[:, nk:].any()  # the padded tail of the last key tile

    lo, hi = _masks.visible_key_span(np.arange(nq), nq, nk, causal=causal)
    for i in range(nq):
        np.testing.assert_array_equal(np.arange(nk)[seen[i]], np.arange(lo[i], hi[i]))
    lo, hi = _masks.visible_query_span(np.arange(nk), nq, nk, causal=causal)
    for j in range(nk):
        np.testing.assert_array_equal(np.arange(nq)[seen[:, j]], np.arange(lo[j], hi[j]))

    for bq, bk in itertools.product(MASK_BLOCKS, MASK_BLOCKS):
        q_tiles, k_tiles = -(-nq // bq), -(-nk // bk)
        # Tiles as the kernels see them, running past the sequence ends.
        padded = np.zeros((q_tiles * bq, k_tiles * bk), bool)
        padded[:nq, :nk] = seen
        tile_any = padded.reshape(q_tiles, bq, k_tiles, bk).any(axis=(1, 3))
        for t in range(q_tiles):
            first, stop = _masks.key_block_range(t * bq, (t + 1) * bq, nq, nk, bk,
                                                 causal=causal)
            assert set(range(first, stop)) == set(np.flatnonzero(tile_any[t]))
            for u in range(k_tiles):
                rows_in = slice(t * bq, min((t + 1) * bq, nq))
                wholly = padded[rows_in, u * bk:(u + 1) * bk].all()
                assert _masks.tile_needs_mask(t * bq, (t + 1) * bq, u * bk, (u + 1) * bk,
                                              nq, nk, causal=causal) == (not wholly)
        for u in range(k_tiles):
            first, stop = _masks.query_block_range(u * bk, (u + 1) * bk, nq, nk, bq,
                                                   causal=causal)
            assert set(range(first, stop)) == set(np.flatnonzero(tile_any[:, u]))


def test_causal_is_bottom_right_aligned():
    # flash-attn >= 2.1: with Nq < Nk the last query sees every key; with Nq > Nk the
    # first Nq - Nk queries see none.
    assert _masks.visible(0, np.arange(5), 1, 5, causal=True).all()
    seen = _masks.visible(np.arange(5)[:, None], np.arange(2)[None, :], 5, 2, causal=True)
    np.testing.assert_array_equal(seen.any(axis=1), [False, False, False, True, True])


# ------------------------------------------------------------------ forward, backward


@DTYPES
@CASE_PARAMS
def test_forward_matches_oracle(case, dtype, rng):
    q, k, v, _ = make_inputs(rng, case, dtype)
    o, lse = forward(q, k, v, case)
    ref_o, ref_lse = naive_attention(q, k, v, scale=scale_of(case), causal=case.causal)
    assert o.dtype == dtype and lse.dtype == dtype
    assert o.flags.c_contiguous and lse.shape == (case.b, case.hq, case.nq)
    assert_close(o, ref_o, TOL[dtype])
    assert_close(lse, ref_lse, TOL[dtype])


@DTYPES
@CASE_PARAMS
def test_backward_matches_oracle(case, dtype, rng):
    q, k, v, do = make_inputs(rng, case, dtype)
    o, lse = forward(q, k, v, case)
    grads = backward(do, q, k, v, o, lse, case)
    refs = naive_attention_grads(do, q, k, v, scale=scale_of(case), causal=case.causal)
    # With one visible key per row the softmax is constant and dq, dk are exactly zero:
    # the computed values are the rounding left of dP - D, terms of size |dO| |V|.
    cancelled = scale_of(case) * np.linalg.norm(do) * np.linalg.norm(v)
    magnitudes = (cancelled * np.linalg.norm(k), cancelled * np.linalg.norm(q), 0.0)
    for name, x, g, ref, mag in zip("qkv", (q, k, v), grads, refs, magnitudes):
        assert g.dtype == dtype and g.shape == x.shape and g.flags.c_contiguous, name
        assert_close(g, ref, TOL[dtype], magnitude_if_zero=mag)


FD_CASES = [
    Case(1, 4, 2, 5, 3, 3, 2, True, 2, 2),  # GQA, causal, Nq > Nk: two empty rows
    Case(1, 2, 2, 3, 6, 2, 3, True, 2, 4),  # causal with Nq < Nk
    Case(2, 2, 1, 4, 5, 3, 3, False, 3, 2),  # MQA, full
]


@pytest.mark.parametrize("case", FD_CASES, ids=str)
def test_backward_matches_finite_differences(case, rng):
    q, k, v, w = make_inputs(rng, case, np.float64)
    q, k, v = q.copy(), k.copy(), v.copy()  # perturbed in place below

    def loss():
        return float(np.sum(forward(q, k, v, case)[0] * w))

    o, lse = forward(q, k, v, case)
    grads = backward(w, q, k, v, o, lse, case)
    h = 1e-6
    for x, g in zip((q, k, v), grads):
        fd = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            x0 = x[idx]
            x[idx] = x0 + h
            up = loss()
            x[idx] = x0 - h
            fd[idx] = (up - loss()) / (2 * h)
            x[idx] = x0
        assert_close(g, fd, 1e-7)


@DTYPES
def test_rows_without_keys(dtype, rng):
    case = Case(2, 4, 2, 7, 3, 8, 5, True, 4, 2)  # rows 0..3 see no key
    q, k, v, do = make_inputs(rng, case, dtype)
    # Any NaN or division by zero on the way is an error, not just a wrong final value.
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        o, lse = forward(q, k, v, case)
        dq, dk, dv = backward(do, q, k, v, o, lse, case)
    empty = slice(0, case.nq - case.nk)
    assert (o[:, :, empty] == 0).all()
    assert np.isneginf(lse[:, :, empty]).all() and np.isfinite(lse[:, :, empty.stop:]).all()
    assert (dq[:, :, empty] == 0).all()
    for g in (dq, dk, dv):
        assert np.isfinite(g).all()
    # Those rows must not leak into the kv gradients either: only the others count.
    sub = Case(case.b, case.hq, case.hk, case.nk, case.nk, case.d, case.dv, True, 4, 2)
    seen = slice(empty.stop, None)
    o_s, lse_s = forward(q[:, :, seen], k, v, sub)
    _, dk_s, dv_s = backward(do[:, :, seen], q[:, :, seen], k, v, o_s, lse_s, sub)
    np.testing.assert_allclose(dk, dk_s, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(dv, dv_s, rtol=TOL[dtype], atol=TOL[dtype])


def test_inputs_not_modified(rng):
    case = Case(1, 4, 2, 37, 29, 16, 8, True, 8, 8, bshd=True)
    arrays = make_inputs(rng, case, np.float32)
    copies = [x.copy() for x in arrays]
    for x in arrays:
        x.setflags(write=False)  # a write attempt raises instead of passing silently
    q, k, v, do = arrays
    o, lse = forward(q, k, v, case)
    o_copy, lse_copy = o.copy(), lse.copy()
    o.setflags(write=False)
    lse.setflags(write=False)
    backward(do, q, k, v, o, lse, case)
    for x, c in zip(arrays + (o, lse), copies + [o_copy, lse_copy]):
        np.testing.assert_array_equal(x, c)


@pytest.mark.parametrize("causal", [False, True])
def test_memory_stays_linear(causal, rng):
    # An Nq x Nk float32 matrix would take 256 MiB here; the blockwise passes need a few
    # tiles of 256 KiB per thread (sized for a core's cache, so independent of N) and
    # O(N d) vectors. NumPy reports its buffers to tracemalloc.
    n, d = 8192, 16
    q, k, v, do = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(4))
    quadratic = n * n * 4
    tracemalloc.start()
    try:
        o, lse = attention_forward(q, k, v, scale=0.25, causal=causal)
        _, forward_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        attention_backward(do, q, k, v, o, lse, scale=0.25, causal=causal)
        _, backward_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert forward_peak < quadratic / 16
    assert backward_peak < quadratic / 8
