"""`cupyflash.distributed`: ring attention through LocalRing (NumPy backend on the CPU, CuPy
on one GPU), zigzag sharding, the multi-device split, the named errors, and NCCL ring
attention in 2 and 4 processes where that many GPUs exist.

Every ring result is unsharded and compared with the unsharded cupyflash call and with
the float64 oracle on the same rounded inputs (tests/TOLERANCES.md)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cupyflash as cf
from cupyflash.distributed import (LocalRing, multi_device_attention, multi_device_attention_vjp,
                                   ring_attention, ring_attention_backward, ring_attention_forward,
                                   ring_attention_vjp, zigzag_chunks, zigzag_shard, zigzag_unshard)
from cupyflash.distributed.multi_device import query_blocks
from oracle import naive_attention, naive_attention_grads, naive_visible
from test_mods_reference import keep_mask
from test_reference import assert_close

TOL = {np.float64: 1e-12, np.float32: 1e-5}  # tests/TOLERANCES.md
ROOT = Path(__file__).resolve().parent.parent


def _seq_axis(layout):
    return -2 if layout == "bhsd" else 1


def _bhsd(x, layout):
    x = np.asarray(x, np.float64)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _problem(rng, dtype, *, n, hq=4, hk=2, d=16, dv=None, batch=2, layout="bhsd"):
    """Whole-sequence q, k, v, do and dlse in ``layout``."""
    dv = d if dv is None else dv
    shape = (lambda h, e: (batch, h, n, e)) if layout == "bhsd" else (lambda h, e: (batch, n, h, e))
    q, k, v, do = (rng.standard_normal(shape(h, e)).astype(dtype)
                   for h, e in ((hq, d), (hk, d), (hk, dv), (hq, dv)))
    dlse = rng.standard_normal((batch, hq, n)).astype(dtype)
    return q, k, v, do, dlse


def _ring_run(world, q, k, v, do, dlse, *, layout="bhsd", contiguous=False, **options):
    """Ring attention forward and backward (with dlse) over ``world`` LocalRing ranks,
    each result unsharded: o, lse, dq, dk, dv."""
    axis = _seq_axis(layout)
    if contiguous:   # plain equal slices: what non-causal attention may take
        split = lambda x, ax: np.split(x, world, axis=ax)   # noqa: E731
        join = lambda parts, ax: np.concatenate(parts, axis=ax)   # noqa: E731
    else:
        split = lambda x, ax: [zigzag_shard(x, r, world, ax) for r in range(world)]   # noqa: E731
        join = zigzag_unshard

    def rank(comm, q, k, v, do, dlse):
        o, ctx = ring_attention_forward(q, k, v, comm, layout=layout, **options)
        return (o, ctx.lse, *ring_attention_backward(do, ctx, dlse=dlse))

    results = LocalRing(world).run(rank, *(split(x, axis) for x in (q, k, v, do)), split(dlse, -1))
    axes = (axis, -1, axis, axis, axis)
    return tuple(join([r[i] for r in results], ax) for i, ax in enumerate(axes))


def _oracle(q, k, v, do, dlse, *, causal, layout, scale=None, softcap=0.0):
    """Float64 o, lse, dq, dk, dv of sum(do * o) + sum(dlse * lse), in the bhsd layout."""
    q, k, v, do = (_bhsd(x, layout) for x in (q, k, v, do))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    o, lse = naive_attention(q, k, v, scale=scale, causal=causal, softcap=softcap)
    dq, dk, dv = naive_attention_grads(do, q, k, v, scale=scale, causal=causal, softcap=softcap)[:3]
    # d lse_i / d x_ij = P_ij: the dlse term enters as do = 0 with D shifted by -dlse, i.e.
    # dS = P dlse; the oracle's gradients of sum(h * o) with v replaced by ones give P's rows.
    g = q.shape[1] // k.shape[1]
    kk = np.repeat(k, g, axis=1)
    s = scale * q @ kk.swapaxes(-1, -2)
    if softcap:
        s = softcap * np.tanh(s / softcap)
        cap = 1 - np.tanh(scale * q @ kk.swapaxes(-1, -2) / softcap) ** 2
    else:
        cap = 1.0
    if causal:
        n_q, n_k = s.shape[-2:]
        s = np.where(np.tril(np.ones((n_q, n_k), bool), k=n_k - n_q), s, -np.inf)
    p = np.exp(s - lse[..., None])
    ds = p * np.asarray(dlse, np.float64)[..., None] * cap * scale
    fold = lambda x: x.reshape(x.shape[0], k.shape[1], g, *x.shape[2:]).sum(axis=2)   # noqa: E731
    return o, lse, dq + ds @ kk, dk + fold(ds.swapaxes(-1, -2) @ q), dv


# Ring attention on the CPU ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_ring_equals_unsharded_call_and_oracle(dtype, world, causal, layout, rng):
    """GQA (4 query heads on 2 kv heads), odd head dims (d = 13, dv = 7), 6 rows per
    rank: the ring's o, lse and gradients (with an LSE cotangent) against the unsharded
    NumPy-backend call and the float64 oracle."""
    q, k, v, do, dlse = _problem(rng, dtype, n=6 * world, d=13, dv=7, layout=layout)
    got = _ring_run(world, q, k, v, do, dlse, causal=causal, layout=layout)
    o, ctx = cf.attention_forward(q, k, v, causal=causal, layout=layout, backend="numpy")
    whole = (o, ctx.lse, *cf.attention_backward(do, ctx, dlse=dlse))
    ref = _oracle(q, k, v, do, dlse, causal=causal, layout=layout)
    for i, (out, same, r) in enumerate(zip(got, whole, ref)):
        assert out.shape == same.shape and out.dtype == same.dtype
        bhsd = i != 1   # the LSE is (B, H, N) in both layouts
        assert_close(_bhsd(out, layout) if bhsd else out, _bhsd(same, layout) if bhsd else same,
                     TOL[dtype])
        assert_close(_bhsd(out, layout) if bhsd else out, r, TOL[dtype])


@pytest.mark.parametrize("world", [2, 3])
def test_non_causal_ring_takes_contiguous_shards(world, rng):
    q, k, v, do, dlse = _problem(rng, np.float64, n=5 * world, hq=2, hk=1, d=8)
    got = _ring_run(world, q, k, v, do, dlse, causal=False, contiguous=True)
    ref = _oracle(q, k, v, do, dlse, causal=False, layout="bhsd")
    for out, r in zip(got, ref):
        assert_close(out, r, TOL[np.float64])


def test_ring_softcap_scale_and_one_head_2d(rng):
    """softcap and an explicit scale pass to every pair; 2-D (N, d) shards are one head."""
    q, k, v, do, dlse = _problem(rng, np.float64, n=16, hq=1, hk=1, d=8, batch=1)
    got = _ring_run(4, q[0, 0], k[0, 0], v[0, 0], do[0, 0], dlse[0, 0], causal=True, scale=0.7,
                    softcap=2.0)
    ref = _oracle(q, k, v, do, dlse, causal=True, layout="bhsd", scale=0.7, softcap=2.0)
    for out, r in zip(got, ref):
        assert_close(out, r.reshape(out.shape), TOL[np.float64])


def test_ring_vjp_and_return_lse_agree_with_forward(rng):
    q, k, v, do, _ = _problem(rng, np.float64, n=8, hq=2, hk=2, d=4, batch=1)

    def rank(comm, q, k, v, do):
        o1, lse = ring_attention(q, k, v, comm, causal=True, return_lse=True)
        o2, vjp = ring_attention_vjp(q, k, v, comm, causal=True)
        return o1, lse, o2, vjp(do)

    shards = [[zigzag_shard(x, r, 2, -2) for r in range(2)] for x in (q, k, v, do)]
    results = LocalRing(2).run(rank, *shards)
    whole = cf.attention(q, k, v, causal=True, backend="numpy", return_lse=True)
    o1 = zigzag_unshard([r[0] for r in results], -2)
    assert_close(o1, whole[0], TOL[np.float64])
    assert_close(zigzag_unshard([r[1] for r in results], -1), whole[1], TOL[np.float64])
    np.testing.assert_array_equal(o1, zigzag_unshard([r[2] for r in results], -2))
    dq = zigzag_unshard([r[3][0] for r in results], -2)
    ref = naive_attention_grads(do, q, k, v, scale=0.5, causal=True)[0]
    assert_close(dq, ref, TOL[np.float64])


def test_ring_leaves_inputs_unchanged(rng):
    q, k, v, do, dlse = _problem(rng, np.float32, n=12, hq=2, hk=1, d=8)
    shards = [[zigzag_shard(x, r, 3, -2) for r in range(3)] for x in (q, k, v, do)]
    before = [[s.copy() for s in x] for x in shards]
    LocalRing(3).run(lambda c, q, k, v, do: ring_attention_vjp(q, k, v, c, causal=True)[1](do), *shards)
    for xs, ys in zip(shards, before):
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(x, y)


# Ring attention with options in global coordinates (window, ALiBi, dropout) --------------------

# Rows per rank of the option tests: two zigzag chunks of 32 rows, the least that places
# every chunk on dropout's 32-row origins (`_mods.ORIGIN_ALIGN`).
_PLACED_ROWS = 64


def _ring_options(case, rng, hq=4, batch=2):
    """The options of one case (``slopes`` per head, or per batch entry and head)."""
    slopes = (rng.uniform(0.01, 0.3, (hq,)) if "per-head" in case
              else rng.uniform(0.01, 0.3, (batch, hq)))
    return {
        "window-causal": dict(causal=True, window=(40, 0)),
        "window-causal-two-sided": dict(causal=True, window=(70, 30)),
        "window-two-sided": dict(window=(30, 50)),
        "window-narrow": dict(window=(0, 3)),
        "alibi-per-head": dict(alibi_slopes=slopes),
        "alibi-causal": dict(causal=True, alibi_slopes=slopes),
        "dropout-causal": dict(causal=True, dropout_p=0.3, seed=2**40 + 3),
        "dropout-window": dict(window=(20, 10), dropout_p=0.25, seed=11),
        "all-causal": dict(causal=True, window=(50, 0), alibi_slopes=slopes, dropout_p=0.2, seed=7,
                           softcap=3.0),
    }[case]


def _unsharded(q, k, v, do, dlse, *, layout="bhsd", **options):
    o, ctx = cf.attention_forward(q, k, v, layout=layout, backend="numpy", **options)
    return (o, ctx.lse, *cf.attention_backward(do, ctx, dlse=dlse))


def _assert_results_close(got, whole, layout, tol):
    for i, (out, same) in enumerate(zip(got, whole)):
        assert out.shape == same.shape and out.dtype == same.dtype
        np.testing.assert_array_equal(np.isneginf(out), np.isneginf(same))
        if i == 1:   # the LSE: -inf where a row sees no key
            finite = np.isfinite(same)
            assert_close(out[finite], same[finite], tol)
        else:
            assert_close(_bhsd(out, layout), _bhsd(same, layout), tol)


@pytest.mark.parametrize("case", ["window-causal", "window-causal-two-sided", "window-two-sided",
                                  "window-narrow", "alibi-per-head", "alibi-causal",
                                  "dropout-causal", "dropout-window", "all-causal"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_ring_options_equal_unsharded_call(dtype, world, case, rng):
    """Window (one- and two-sided, causal and not), ALiBi and dropout: each pair is placed
    in the whole sequence, so the ring's o, lse and gradients (with an LSE cotangent) are
    the unsharded call's, with GQA (4 query heads on 2 kv heads); o and lse also against
    the float64 oracle."""
    options = _ring_options(case, rng)
    q, k, v, do, dlse = _problem(rng, dtype, n=_PLACED_ROWS * world)
    got = _ring_run(world, q, k, v, do, dlse, **options)
    _assert_results_close(got, _unsharded(q, k, v, do, dlse, **options), "bhsd", TOL[dtype])
    oracle = dict(options)
    if "dropout_p" in oracle:   # an explicit seed: the call's RNG offset is 0
        n = q.shape[2]
        oracle["keep"] = keep_mask(oracle.pop("seed"), 0, 2, 4, n, n, options["dropout_p"])
    o, lse = naive_attention(q, k, v, scale=1 / 4, **{"causal": False, **oracle})
    assert_close(got[0], o, TOL[dtype])
    finite = np.isfinite(lse)
    assert_close(got[1][finite], lse[finite], TOL[dtype])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("nq, nk", [(64, 128), (128, 64)])
def test_ring_options_with_nq_ne_nk(nq, nk, layout, rng):
    """Non-causal shards of q and k of different lengths: the window and ALiBi take the
    whole problem's diagonal R * (nk - nq), and dropout its rows and keys."""
    world = 2
    q, _, _, do, dlse = _problem(rng, np.float64, n=nq * world, layout=layout)
    _, k, v, _, _ = _problem(rng, np.float64, n=nk * world, layout=layout)
    options = dict(window=(60, 20), alibi_slopes=rng.uniform(0.01, 0.3, (4,)), dropout_p=0.2, seed=5)
    got = _ring_run(world, q, k, v, do, dlse, layout=layout, **options)
    _assert_results_close(got, _unsharded(q, k, v, do, dlse, layout=layout, **options), layout,
                          TOL[np.float64])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window=(45, 15))],
                         ids=["full", "causal", "window"])
def test_ring_dropout_keeps_the_unsharded_mask(world, options):
    """The keep mask itself, read out of the output (as tests/test_streaming.py does): with
    q = 0 every visible key is equally likely and v_j = e_j, so o[i, j] is nonzero exactly
    where key j is visible to row i and kept. The ring's mask is bit for bit the one the
    Philox mapping defines for the whole problem, and the unsharded call's."""
    b, hq, hk, p, seed = 2, 4, 2, 0.3, 12345
    n = _PLACED_ROWS * world
    q = np.zeros((b, hq, n, 16))
    k = np.ones((b, hk, n, 16))
    v = np.broadcast_to(np.eye(n), (b, hk, n, n)).copy()
    zeros = np.zeros((b, hq, n, n)), np.zeros((b, hq, n))
    o = _ring_run(world, q, k, v, *zeros, dropout_p=p, seed=seed, **options)[0]
    whole = cf.attention(q, k, v, dropout_p=p, seed=seed, backend="numpy", **options)
    keep = keep_mask(seed, 0, b, hq, n, n, p) & naive_visible(n, n, causal=options.get("causal", False),
                                                              window=options.get("window"))
    np.testing.assert_array_equal(o != 0, keep)
    np.testing.assert_array_equal(whole != 0, keep)
    assert_close(o, whole, TOL[np.float64])


def test_ring_dropout_without_a_seed_draws_each_ranks_own_streams(rng):
    """Without a seed each rank claims its streams from the process RNG, as `attention`
    does (simulated ranks share one process: they get different offsets); its forward and
    backward use the same ones, so the ring is the oracle with each rank's rows masked by
    its own streams. A refused call claims nothing."""
    world, b, hq, p = 2, 2, 4, 0.25
    n = _PLACED_ROWS * world
    q, k, v, do, _ = _problem(rng, np.float64, n=n, hq=hq, batch=b)
    cf.manual_seed(99)
    with pytest.raises(ValueError, match="q's shard has 32 rows"):
        ring_attention(q[:, :, :32], k[:, :, :32], v[:, :, :32], _RecordingComm(), dropout_p=p)

    def rank(comm, q, k, v, do):
        o, ctx = ring_attention_forward(q, k, v, comm, causal=True, dropout_p=p)
        return o, ctx.seed, ctx.rng_offset, ring_attention_backward(do, ctx)

    results = LocalRing(world).run(rank, *([zigzag_shard(x, r, world, -2) for r in range(world)]
                                           for x in (q, k, v, do)))
    offsets = sorted(r[2] for r in results)
    assert {r[1] for r in results} == {99} and offsets == [0, b * hq]
    # Row i of the whole sequence is rank r's: its mask is that of rank r's streams.
    owner = zigzag_unshard([np.full(n // world, r) for r in range(world)], 0)
    keep = np.zeros((b, hq, n, n), bool)
    for r, (_, seed, offset, _) in enumerate(results):
        keep[:, :, owner == r] = keep_mask(seed, offset, b, hq, n, n, p)[:, :, owner == r]
    o_ref, _ = naive_attention(q, k, v, scale=1 / 4, causal=True, keep=keep, dropout_p=p)
    grads_ref = naive_attention_grads(do, q, k, v, scale=1 / 4, causal=True, keep=keep, dropout_p=p)
    assert_close(zigzag_unshard([r[0] for r in results], -2), o_ref, TOL[np.float64])
    for i in range(3):
        assert_close(zigzag_unshard([r[3][i] for r in results], -2), grads_ref[i], TOL[np.float64])


def test_ring_skips_pairs_the_window_hides(rng):
    """A window narrower than a chunk: exactly the (query run, key run) pairs with a
    visible score are computed, and their keys end where the run's reach does; some steps
    compute nothing at all, and the ring (which still passes every K/V shard on) is the
    unsharded call."""
    from cupyflash import _mods
    from cupyflash.distributed.ring import _runs, _Shards
    world, n, window = 4, _PLACED_ROWS, (8, 0)
    total = n * world
    visible = naive_visible(total, total, causal=True, window=window)
    calls_per_step = []
    for r in range(world):
        shards = _Shards(rank=r, size=world, n_q=n, n_k=n, causal=True, mods=_mods.Modifiers(window=window))
        for step in range(world):
            owner = (r - step) % world
            calls = shards.calls(step, owner)
            calls_per_step.append(len(calls))
            expected = []
            for lo, hi, q0 in _runs(r, world, n):
                for klo, khi, k0 in _runs(owner, world, n):
                    seen = visible[q0:q0 + hi - lo, k0:k0 + khi - klo]
                    if seen.any():
                        last = int(np.nonzero(seen.any(axis=0))[0].max())
                        expected.append(((lo, hi), (klo, klo + last + 1), (q0, k0)))
            assert [(c.rows, c.keys, (c.mods.row0, c.mods.key0)) for c in calls] == expected
            assert all(c.mods.diagonal == 0 for c in calls)
    assert 0 in calls_per_step
    q, k, v, do, dlse = _problem(rng, np.float64, n=total)
    options = dict(causal=True, window=window)
    got = _ring_run(world, q, k, v, do, dlse, **options)
    _assert_results_close(got, _unsharded(q, k, v, do, dlse, **options), "bhsd", TOL[np.float64])


def test_one_rank_takes_options_on_any_even_shard(rng):
    """A ring of one holds the whole sequence as one run from row 0: no origin to align."""
    q, k, v, do, dlse = _problem(rng, np.float64, n=10)
    options = dict(causal=True, window=(3, 0), alibi_slopes=np.full(4, 0.1), dropout_p=0.2, seed=3)
    got = _ring_run(1, q, k, v, do, dlse, **options)
    _assert_results_close(got, _unsharded(q, k, v, do, dlse, **options), "bhsd", TOL[np.float64])


# Zigzag sharding ----------------------------------------------------------------------------


def test_zigzag_chunk_assignment():
    x = np.arange(8)
    assert [list(zigzag_shard(x, r, 2, 0)) for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [zigzag_chunks(r, 3) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("axis", [0, 1, -2, -1])
def test_zigzag_round_trip(world, axis, rng):
    shape = [2 * world * 3, 2 * world * 2, 2 * world, 6 * world]
    x = rng.standard_normal(shape)
    parts = [zigzag_shard(x, r, world, axis) for r in range(world)]
    assert all(p.shape[axis] == x.shape[axis] // world for p in parts)
    np.testing.assert_array_equal(zigzag_unshard(parts, axis), x)
    # Every element lands in exactly one shard.
    assert sorted(np.concatenate([p.ravel() for p in parts])) == sorted(x.ravel())


# Errors ---------------------------------------------------------------------------------------


class _RecordingComm:
    """A communicator that records exchanges (none may happen before the checks)."""

    def __init__(self, rank=0, size=2, device=None):
        self.rank, self.size, self.device = rank, size, device
        self.calls = 0

    def sendrecv(self, send, dst, recv, src, stream):
        self.calls += 1
        raise AssertionError("no exchange may happen for a call that fails its checks")


@pytest.mark.parametrize("call, error, match", [
    (lambda: zigzag_shard(np.zeros((2, 10, 4)), 0, 3, 1), ValueError, r"x has 10 entries .* 2 \* world = 6"),
    (lambda: zigzag_shard(np.zeros((12, 4)), 3, 3, 0), ValueError, r"rank must be in \[0, world\)"),
    (lambda: zigzag_shard(np.zeros((12, 4)), 0, 0, 0), ValueError, "world must be >= 1"),
    (lambda: zigzag_shard(np.zeros((12, 4)), 0, 2, 2), ValueError, "axis 2 is out of range"),
    (lambda: zigzag_shard([1, 2], 0, 1, 0), TypeError, "x must be an array"),
    (lambda: zigzag_unshard([np.zeros((4, 2)), np.zeros((6, 2))], 0), ValueError, r"parts\[1\] has shape"),
    (lambda: zigzag_unshard([np.zeros((3, 2))] * 2, 0), ValueError, "odd"),
    (lambda: zigzag_unshard([], 0), ValueError, "empty"),
    (lambda: zigzag_unshard([np.zeros((4, 2)), np.zeros((4, 2), np.float32)], 0), TypeError, r"parts\[1\] has dtype"),
])
def test_zigzag_errors_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _qkv(n=8, nk=None, d=4, dtype=np.float32):
    rng = np.random.default_rng(0)
    nk = n if nk is None else nk
    return (rng.standard_normal((1, 2, n, d)).astype(dtype), rng.standard_normal((1, 2, nk, d)).astype(dtype),
            rng.standard_normal((1, 2, nk, d)).astype(dtype))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bias=np.zeros((8, 8), np.float32)), NotImplementedError, "bias"),
    (dict(block_mask=np.ones((1, 1), bool)), NotImplementedError, "block_mask"),
    (dict(layout="sbhd"), ValueError, "layout"),
    (dict(scale=-1.0), ValueError, "scale"),
])
def test_ring_option_errors_are_named(kwargs, error, match):
    comm = _RecordingComm()
    with pytest.raises(error, match=match):
        ring_attention(*_qkv(), comm, **kwargs)
    assert comm.calls == 0


def test_ring_input_errors_come_before_any_exchange():
    comm = _RecordingComm()
    with pytest.raises(ValueError, match="q has 7 rows, an odd number"):
        ring_attention(*_qkv(n=7), comm, causal=True)
    with pytest.raises(ValueError, match="k has 6 keys but q has 8 queries"):
        ring_attention(*_qkv(n=8, nk=6), comm, causal=True)
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k has dtype float64"):
        ring_attention(q, k.astype(np.float64), v, comm)
    with pytest.raises(ValueError, match=r"comm.rank must be in \[0, comm.size\) = \[0, 2\), got 2"):
        ring_attention(q, k, v, _RecordingComm(rank=2, size=2))
    with pytest.raises(ValueError, match="comm.size must be a positive integer"):
        ring_attention(q, k, v, _RecordingComm(rank=0, size=0))
    with pytest.raises(TypeError, match="comm must be a communicator"):
        ring_attention(q, k, v, object())
    # A communicator bound to a GPU takes GPU arrays only.
    with pytest.raises(TypeError, match="q is a host .NumPy. array but comm"):
        ring_attention(q, k, v, _RecordingComm(device=0))
    assert comm.calls == 0


@pytest.mark.parametrize("shapes, kwargs, match", [
    # Chunks of 16 rows would start at row 16, 48, ...: no multiple of 32.
    ((32, 32), dict(window=(4, 0), causal=True), r"q's shard has 32 rows: with window .* multiple of 64 "
                                                 r"\(the sequence a multiple of 64 \* comm.size = 128"),
    ((64, 96), dict(alibi_slopes=np.ones(2)), r"k's shard has 96 rows: with alibi_slopes .* multiple of 64"),
    ((64, 64 + 32), dict(dropout_p=0.1, seed=1), r"k's shard has 96 rows: with dropout_p"),
    ((30, 64), dict(window=(1, 1), dropout_p=0.1), r"q's shard has 30 rows: with window and dropout_p"),
    ((33, 64), dict(alibi_slopes=np.ones(2)), r"q's shard has 33 rows, an odd number: with alibi_slopes "
                                              r"ring attention takes zigzag shards"),
    ((64, 64), dict(alibi_slopes=np.ones(3)), "alibi_slopes"),
    ((64, 64), dict(dropout_p=1.5), "dropout_p"),
    ((64, 64), dict(dropout_p=0.1, seed=-1), "seed"),
    ((64, 64), dict(window=(-2, 0)), "window"),
])
def test_ring_placed_option_errors_come_before_any_exchange(shapes, kwargs, match):
    """Shards whose zigzag chunks cannot start on dropout's 32-row origins (or are not
    two chunks), and bad option values, are named on every rank alike before anything is
    sent, with no dropout streams claimed."""
    from cupyflash import _rng
    comm = _RecordingComm()
    q, _, _ = _qkv(n=shapes[0])
    _, k, v = _qkv(n=shapes[1])
    cf.manual_seed(5)
    with pytest.raises(ValueError, match=match):
        ring_attention(q, k, v, comm, **kwargs)
    assert comm.calls == 0
    assert _rng.claim_streams(1) == (5, 0)


def test_backward_errors_are_named():
    q, k, v = _qkv()
    (o, ctx), = LocalRing(1).run(lambda c, q, k, v: ring_attention_forward(q, k, v, c), [q], [k], [v])
    with pytest.raises(ValueError, match="do must have the shape of o"):
        ring_attention_backward(np.zeros((1, 2, 7, 4), np.float32), ctx)
    with pytest.raises(ValueError, match="dlse must have the shape of lse"):
        ring_attention_backward(np.zeros_like(o), ctx, dlse=np.zeros((1, 2, 3), np.float32))
    with pytest.raises(TypeError, match="ctx must be a RingContext"):
        ring_attention_backward(np.zeros_like(o), object())


def test_unequal_shards_across_ranks_are_named():
    """Non-causal shards of different lengths: the rank that receives names both shapes
    and every rank stops (none waits forever)."""
    q, k, v = _qkv(n=10)
    qs, ks, vs = ([x[:, :, :6], x[:, :, 6:]] for x in (q, k, v))
    with pytest.raises(ValueError, match="every rank must pass arrays of one shape"):
        LocalRing(2, timeout=30).run(lambda c, q, k, v: ring_attention(q, k, v, c), qs, ks, vs)


def test_a_failing_rank_releases_the_others():
    """Rank 1's shard is odd: its ValueError is what run() raises, while rank 0, already
    in the ring, is released instead of waiting for rank 1's message."""
    q, k, v = _qkv(n=8)
    qs = [q, q[:, :, :7]]
    with pytest.raises(ValueError, match="odd number"):
        LocalRing(2, timeout=30).run(lambda c, q, k, v: ring_attention(q, k, v, c, causal=True),
                                     qs, [k, k[:, :, :7]], [v, v[:, :, :7]])


def test_local_ring_run_needs_one_argument_per_rank():
    ring = LocalRing(3)
    with pytest.raises(ValueError, match=r"per-rank argument 1 must hold one entry per rank \(LocalRing size 3\), got 2"):
        ring.run(lambda c, a, b: None, [1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="size must be >= 1"):
        LocalRing(0)
    with pytest.raises(ValueError, match=r"devices must list one GPU id per rank \(2\)"):
        LocalRing(2, devices=[0])


def test_local_ring_bound_to_gpus_refuses_host_arrays():
    """A rank bound to a GPU names host arrays before any exchange (checked without a GPU:
    the rank's communicator alone, outside run())."""
    comm = LocalRing(2, devices=[0, 1])[1]
    assert comm.device == 1
    with pytest.raises(TypeError, match="q is a host .NumPy. array but comm"):
        ring_attention(*_qkv(), comm)


def test_from_env_names_missing_variables(monkeypatch):
    from cupyflash.distributed import from_env
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        from_env()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK must be in \[0, WORLD_SIZE\) = \[0, 2\), got 2"):
        from_env()


def test_from_env_stops_its_group_at_exit(monkeypatch):
    """from_env hands the process group it joins to _stop_at_exit (the test below shows
    what that does), with the GPU and NCCL replaced by stand-ins."""
    cupyx_distributed = pytest.importorskip("cupyx.distributed")
    from types import SimpleNamespace
    from cupyflash import _gpu_status
    from cupyflash.distributed import comm
    backend, stopped = object(), []
    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(
        runtime=SimpleNamespace(getDeviceCount=lambda: 2),
        Device=lambda device: SimpleNamespace(use=lambda: None)))
    monkeypatch.setattr(_gpu_status, "why_not_usable", lambda: None)
    monkeypatch.setattr(comm._arrays, "cupy_module", lambda: fake_cupy)
    monkeypatch.setattr(cupyx_distributed, "init_process_group", lambda *args, **kwargs: backend)
    monkeypatch.setattr(comm, "NcclCommunicator", lambda group, device: (group, device))
    monkeypatch.setattr(comm, "_stop_at_exit", stopped.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert comm.from_env() == (backend, 1)
    assert stopped == [backend]


def test_a_rank_that_keeps_its_process_group_exits(tmp_path):
    """from_env's group is stopped at exit: rank 0's rendezvous server (a child process of
    cupyx.distributed) kept a script whose communicator lived to the end from exiting."""
    pytest.importorskip("cupyx.distributed")
    from cupyflash.distributed.launch import _free_port as free_port
    script = tmp_path / "keeps_group.py"
    script.write_text(
        "from cupyx.distributed import _store\n"
        "from cupyflash.distributed.comm import _stop_at_exit\n"
        "store = _store.TCPStore(1)\n"
        f"store.run('127.0.0.1', {free_port()})\n"
        "class Backend:\n"
        "    stop = staticmethod(store.stop)\n"
        "backend = Backend()   # a module global, as a script's communicator is\n"
        "_stop_at_exit(backend)\n")
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(), timeout=60,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_launcher_sets_the_ring_environment(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        out = os.path.join(sys.argv[1], "rank" + os.environ["RANK"])
        open(out, "w").write(" ".join(os.environ[n] for n in names))
    """))
    run = subprocess.run([sys.executable, "-m", "cupyflash.distributed.launch", "--nproc", "3",
                          str(script), str(tmp_path)], cwd=ROOT, env=_env(), timeout=60)
    assert run.returncode == 0
    seen = [(tmp_path / f"rank{r}").read_text().split() for r in range(3)]
    assert [s[:3] for s in seen] == [[str(r), str(r), "3"] for r in range(3)]
    assert len({s[4] for s in seen}) == 1   # one rendezvous port


def test_launcher_returns_a_failing_rank_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n")
    run = subprocess.run([sys.executable, "-m", "cupyflash.distributed.launch", "--nproc", "2",
                          str(script)], cwd=ROOT, env=_env(), timeout=30)
    assert run.returncode == 3


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


# The multi-device split -----------------------------------------------------------------------


@pytest.mark.parametrize("n_q, n_k", [(37, 37), (20, 45), (45, 20), (5, 5)])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_query_blocks_compose_the_whole_call(n_q, n_k, parts, causal, rng):
    """Every query row in exactly one call, each call on its visible key prefix, and
    together (NumPy backend) the float64 oracle's output."""
    plan = query_blocks(n_q, n_k, parts, causal)
    assert len(plan) == parts
    rows = sorted(r for calls in plan for (lo, hi), _ in calls for r in range(lo, hi))
    assert rows == list(range(n_q))
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (n_q, n_k, n_k))
    o = np.zeros((1, 2, n_q, 8))
    for calls in plan:
        for (lo, hi), (start, stop) in calls:
            assert start == 0   # the prefix, for the dense kernels' corner-aligned diagonal
            if stop:
                o[:, :, lo:hi] = cf.attention(q[:, :, lo:hi], k[:, :, :stop], v[:, :, :stop],
                                              causal=causal, backend="numpy")
    ref, _ = naive_attention(q, k, v, scale=8 ** -0.5, causal=causal)
    assert_close(o, ref, TOL[np.float64])


def test_query_blocks_balance_causal_work():
    plan = query_blocks(4096, 4096, 4, True)
    work = [sum((hi - lo) * stop for (lo, hi), (_, stop) in calls) for calls in plan]
    assert max(work) / min(work) < 1.01


@pytest.mark.parametrize("view", [
    lambda x: x[..., 10:20, :], lambda x: x[:1, :1, 10:20], lambda x: x[:, ::2, 3:7], lambda x: x,
    lambda x: x.transpose(0, 2, 1, 3)[:, 10:20], lambda x: x[1:, :, 5:6], lambda x: x[..., :8],
    lambda x: x[..., ::-1, :], lambda x: x[:, :, 10:20].transpose(1, 0, 2, 3)])
def test_rows_of_bytes_describe_a_2d_copy(view, rng):
    """multi_device's strided peer copy: where `_rows_of_bytes` gives (width, height, pitch),
    those runs of the source's memory are the view's bytes in order; where it gives None
    the view is not such runs (it is staged contiguous first)."""
    from cupyflash.distributed.multi_device import _rows_of_bytes
    base = rng.standard_normal((2, 4, 32, 16)).astype(np.float16)
    x = view(base)
    runs = _rows_of_bytes(x)
    offset = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    raw = base.reshape(-1).view(np.uint8)
    if runs is None:
        assert not x.flags.c_contiguous   # a contiguous view is always one run
        return
    width, height, pitch = runs
    got = b"".join(raw[offset + i * pitch: offset + i * pitch + width].tobytes() for i in range(height))
    assert got == np.ascontiguousarray(x).tobytes()


def test_move_inputs_give_each_call_its_rows_and_keys(monkeypatch, rng):
    """multi_device's input moves (pure Python, with a mover that records its copies): each
    call gets its query rows and its keys, and a device's keys move once a span."""
    import contextlib
    from types import SimpleNamespace
    from cupyflash.distributed import multi_device
    monkeypatch.setattr(multi_device._arrays, "on_device", lambda device: contextlib.nullcontext())

    class Recorder:
        def __init__(self):
            self.copies = []

        def to_device(self, x, device):
            self.copies.append((device, x.shape[-2]))
            return x.copy()

    q, k, v = (rng.standard_normal((1, 2, 64, 4)) for _ in range(3))
    calls = [SimpleNamespace(device=d, rows=r, keys=ks) for d, r, ks in
             [(0, (0, 8), (0, 8)), (0, (56, 64), (0, 64)), (1, (8, 16), (0, 16)), (1, (48, 56), (0, 56)),
              (2, (16, 24), (40, 48))]]
    mover = Recorder()
    moved = list(multi_device._move_inputs(mover, calls, q, k, v, "bhsd"))
    for call, (qg, kg, vg) in zip(calls, moved):
        np.testing.assert_array_equal(qg, q[..., slice(*call.rows), :])
        np.testing.assert_array_equal(kg, k[..., slice(*call.keys), :])
        np.testing.assert_array_equal(vg, v[..., slice(*call.keys), :])
    key_copies = sorted(c for c in mover.copies if c[1] != 8)
    assert key_copies == [(0, 64), (0, 64), (1, 56), (1, 56)]   # k and v once a device
    assert sum(c[1] == 8 for c in mover.copies) == 5 + 2          # the rows, and device 2's keys


@pytest.mark.parametrize("kind", ["numpy", "cupy"])
def test_queued_moves_gpu_inputs_before_any_launch(kind):
    """multi_device's order: from a GPU every copy is queued before the first kernel (a copy
    waits for an event on its source's stream, behind any kernel queued there first); from
    the host, whose copies return once done, each call's copies just before its kernels."""
    from cupyflash.distributed.multi_device import _queued
    events = []

    def moves():
        for call in range(3):
            events.append(("copy", call))
            yield call

    for call in _queued(kind, moves()):
        events.append(("launch", call))
    if kind == "cupy":
        assert events == [("copy", c) for c in range(3)] + [("launch", c) for c in range(3)]
    else:
        assert events == [(what, c) for c in range(3) for what in ("copy", "launch")]


def test_peer_access_is_enabled_once_a_pair(monkeypatch):
    """Before a strided copy between GPUs, the reading GPU gets direct access to the other's
    memory: once a pair, where the hardware allows, an 'already enabled' answer accepted."""
    import contextlib
    from types import SimpleNamespace
    runtime_error = pytest.importorskip("cupy_backends.cuda.api.runtime").CUDARuntimeError
    from cupyflash.distributed import multi_device
    calls, current = [], []

    def enable(peer):
        calls.append((current[-1], peer))
        if (current[-1], peer) == (2, 0):
            raise runtime_error(multi_device._PEER_ACCESS_ALREADY_ENABLED)

    @contextlib.contextmanager
    def device(d):
        current.append(d)
        yield
        current.pop()

    fake = SimpleNamespace(cuda=SimpleNamespace(Device=device, runtime=SimpleNamespace(
        deviceCanAccessPeer=lambda d, p: int(p != 3), deviceEnablePeerAccess=enable,
        CUDARuntimeError=runtime_error)))
    monkeypatch.setattr(multi_device._arrays, "cupy_module", lambda: fake)
    monkeypatch.setattr(multi_device, "_peer_pairs", set())
    for device_id, peer in [(1, 0), (1, 0), (2, 0), (0, 3), (0, 1)]:
        multi_device._allow_peer_access(device_id, peer)
    assert calls == [(1, 0), (2, 0), (0, 1)]


def test_key_spans_share_one_copy_per_device():
    """A device's calls whose keys overlap or touch read one copied span; apart, two."""
    from types import SimpleNamespace
    from cupyflash.distributed.multi_device import _key_spans
    calls = [SimpleNamespace(device=d, keys=k) for d, k in
             [(0, (0, 10)), (0, (0, 80)), (1, (30, 40)), (1, (0, 20)), (1, (20, 25))]]
    assert _key_spans(calls) == {0: [(0, 80)], 1: [(0, 25), (30, 40)]}


@pytest.mark.parametrize("case", ["window-causal", "window-two-sided", "alibi", "dropout-causal",
                                  "all-gqa"])
@pytest.mark.parametrize("n_q, n_k", [(300, 300), (200, 333), (333, 200)])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_multi_device_placed_blocks_compose_the_whole_call(parts, n_q, n_k, case, rng):
    """The multi-device plan with window, ALiBi and dropout (pure Python: no GPU needed)
    run block by block on the NumPy backend as the GPUs run it (each block's call placed in
    the problem, its keys those its rows see): o, lse and the gradients (with dlse) are the
    unsharded call's, and the row cuts lie on dropout's 32-row origins."""
    from cupyflash import _mods, _validate
    from cupyflash.api import _NUMPY_BACKEND, _resolve_modifiers
    from cupyflash.distributed.multi_device import _plan
    hk = 2 if case == "all-gqa" else 4
    options = {"window-causal": dict(causal=True, window=(70, 0)),
               "window-two-sided": dict(window=(50, 90)),
               "alibi": dict(alibi_slopes=rng.uniform(0.01, 0.3, (2, 4))),
               "dropout-causal": dict(causal=True, dropout_p=0.3, seed=2**33 + 1),
               "all-gqa": dict(causal=True, window=(100, 0), alibi_slopes=rng.uniform(0.01, 0.3, 4),
                               dropout_p=0.2, seed=8, softcap=2.0)}[case]
    q, do = (rng.standard_normal((2, 4, n_q, 16)) for _ in range(2))
    k, v = (rng.standard_normal((2, hk, n_k, 16)) for _ in range(2))
    dlse = rng.standard_normal((2, 4, n_q))
    checked = _validate.check_options(**{**dict(causal=False, scale=None, window=None, dropout_p=0.0,
                                                seed=None, block_mask=None, bias=None, alibi_slopes=None,
                                                softcap=0.0, layout="bhsd", deterministic=False,
                                                backend="numpy"), **options})
    problem = _validate.check_inputs(q, k, v, layout="bhsd")[3]
    mods = _resolve_modifiers(checked, problem)
    calls = _plan(problem, list(range(parts)), checked.causal, mods)
    assert sorted(r for c in calls for r in range(*c.rows)) == list(range(n_q))
    assert all(c.rows[0] % _mods.ORIGIN_ALIGN == 0 and c.keys[0] % _mods.ORIGIN_ALIGN == 0 for c in calls)
    o, lse = np.zeros((2, 4, n_q, 16)), np.full((2, 4, n_q), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for c in calls:
        if not c.sees_keys:
            continue
        rows, keys = slice(*c.rows), slice(*c.keys)
        args = (q[:, :, rows], k[:, :, keys], v[:, :, keys])
        _NUMPY_BACKEND.attention_forward(*args, o[:, :, rows], lse[:, :, rows], scale=0.25,
                                         causal=c.causal, mods=c.mods)
        grads = tuple(np.empty_like(x) for x in args)
        _NUMPY_BACKEND.attention_backward(do[:, :, rows], *args, o[:, :, rows], lse[:, :, rows], *grads,
                                          scale=0.25, causal=c.causal, deterministic=False, mods=c.mods,
                                          dbias=None, dlse=dlse[:, :, rows])
        dq[:, :, rows] = grads[0]
        dk[:, :, keys] += grads[1]
        dv[:, :, keys] += grads[2]
    whole = _unsharded(q, k, v, do, dlse, **options)
    _assert_results_close((o, lse, dq, dk, dv), whole, "bhsd", TOL[np.float64])


@pytest.mark.parametrize("devices, error, match", [
    ([], ValueError, "at least one GPU"),
    ([0, 0], ValueError, "must not repeat"),
    ("0", TypeError, "sequence of GPU ids"),
    ([0.0], TypeError, r"devices\[0\] must be an integer"),
])
def test_multi_device_errors_are_named(devices, error, match):
    with pytest.raises(error, match=match):
        multi_device_attention(*_qkv(), devices=devices)


@pytest.mark.parametrize("kwargs, match", [(dict(dropout_p=1.5), "dropout_p"), (dict(window=(0, -3)), "window"),
                                           (dict(dropout_p=0.1, seed=2**64), "seed"),
                                           (dict(alibi_slopes=[1.0, 2.0]), "alibi_slopes")])
def test_multi_device_option_errors_are_named(kwargs, match):
    """Option values are checked before the devices (so without a GPU too)."""
    with pytest.raises((TypeError, ValueError), match=match):
        multi_device_attention(*_qkv(), devices=[0], **kwargs)


def test_multi_device_without_a_gpu_says_so():
    from cupyflash._gpu_status import why_not_usable
    if why_not_usable() is None:
        pytest.skip("this machine has a usable GPU")
    with pytest.raises(RuntimeError, match="multi_device_attention runs on CUDA GPUs"):
        multi_device_attention(*_qkv(), devices=[0])


# GPU tests ------------------------------------------------------------------------------------

GPU_DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _gpu_count():
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


def _gpu_problem(rng, dtype, *, n, layout="bhsd", hq=4, hk=2, d=64):
    """Whole-sequence inputs as float32 host arrays rounded to ``dtype`` (the oracle sees
    the rounded values)."""
    from gpu_cases import np_dtype
    q, k, v, do, dlse = _problem(rng, np.float32, n=n, hq=hq, hk=hk, d=d, layout=layout)
    rounded = tuple(x.astype(np_dtype(dtype)).astype(np.float64) for x in (q, k, v, do))
    return (*rounded, dlse.astype(np.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_local_ring_on_one_gpu(world, causal, dtype, rng):
    """R ranks simulated on GPU 0 (CuPy arrays, the CUDA kernels, the side stream for
    the exchanges) against the unsharded GPU call and the float64 oracle. Gradients get
    3x the limit: each pair's dq, dk, dv come out of the kernel rounded to the dtype
    before the fp32 sums, roundings the unsharded call does not have (as test_merge's)."""
    import cupy as cp
    from gpu_cases import TOLERANCE, rel_err
    layout = "bshd" if world == 4 else "bhsd"
    q, k, v, do, dlse = _gpu_problem(rng, dtype, n=96 * world, layout=layout)
    g = lambda x: cp.asarray(x).astype(dtype)   # noqa: E731
    got = _ring_run_gpu(world, *(g(x) for x in (q, k, v, do)), cp.asarray(dlse, np.float64 if dtype == "float64" else np.float32),
                        causal=causal, layout=layout)
    o, ctx = cf.attention_forward(*(g(x) for x in (q, k, v)), causal=causal, layout=layout, backend="cuda")
    whole = (o, ctx.lse, *cf.attention_backward(g(do), ctx, dlse=cp.asarray(dlse, ctx.lse.dtype)))
    ref = _oracle(q, k, v, do, dlse, causal=causal, layout=layout)
    for i, (out, same, r) in enumerate(zip(got, whole, ref)):
        assert out.dtype == same.dtype and out.shape == same.shape
        out = cp.asnumpy(out).astype(np.float64)
        out = out if i == 1 else _bhsd(out, layout)
        limit = TOLERANCE[dtype] * (1 if i < 2 else 3)
        same = cp.asnumpy(same).astype(np.float64)
        assert np.isfinite(out).all()
        assert rel_err(out, r) < limit, (i, rel_err(out, r))
        assert rel_err(out, same if i == 1 else _bhsd(same, layout)) < limit


def _ring_run_gpu(world, q, k, v, do, dlse, *, layout, devices=None, **options):
    """`_ring_run` for CuPy arrays (zigzag shards); rank r's shards on ``devices[r]``
    (default all on the arrays' GPU)."""
    import cupy as cp
    axis = _seq_axis(layout)
    ring = LocalRing(world, devices=devices)   # each rank on its own stream (see LocalRing)
    devices = devices or [q.device.id] * world

    def on(r, x):
        with cp.cuda.Device(devices[r]):
            return cp.asarray(cp.asnumpy(x))

    shards = [[on(r, zigzag_shard(x, r, world, ax)) for r in range(world)]
              for x, ax in ((q, axis), (k, axis), (v, axis), (do, axis), (dlse, -1))]

    def rank(comm, q, k, v, do, dlse):
        with cp.cuda.Device(q.device.id):
            o, ctx = ring_attention_forward(q, k, v, comm, layout=layout, **options)
            grads = ring_attention_backward(do, ctx, dlse=dlse)
            return [cp.asnumpy(x) for x in (o, ctx.lse, *grads)]

    results = ring.run(rank, *shards)
    with cp.cuda.Device(q.device.id):
        return tuple(cp.asarray(zigzag_unshard([r[i] for r in results], ax))
                     for i, ax in enumerate((axis, -1, axis, axis, axis)))


# The GPU cases' ALiBi slopes: powers of two, exact in the float32 the kernels take them in.
_GPU_SLOPES = np.array([2.0**-1, 2.0**-3, 2.0**-5, 2.0**-7], np.float32)


def _gpu_options(case):
    return {"window-causal": dict(causal=True, window=(100, 0)),
            "window-two-sided": dict(window=(70, 150)),
            "alibi": dict(alibi_slopes=_GPU_SLOPES),
            "alibi-causal": dict(causal=True, alibi_slopes=_GPU_SLOPES),
            "dropout-causal": dict(causal=True, dropout_p=0.2, seed=2**40 + 17),
            "all-causal": dict(causal=True, window=(150, 0), alibi_slopes=_GPU_SLOPES, dropout_p=0.15,
                               seed=99)}[case]


def _float64_reference(q, k, v, do, dlse, *, layout, **options):
    """o, lse, dq, dk, dv of the unsharded call in float64 on the NumPy backend (the same
    rounded inputs; dropout with the same seed draws the same mask), in ``layout``."""
    o, ctx = cf.attention_forward(q, k, v, layout=layout, backend="numpy", **options)
    return (o, ctx.lse, *cf.attention_backward(do, ctx, dlse=dlse))


def _check_gpu_results(got, whole, ref, *, layout, dtype, grad_factor=3):
    """Each of o, lse, dq, dk, dv (GPU) within the dtype's limit of the float64 reference
    (gradients ``grad_factor`` times: rounded to the dtype per pair before their sums),
    and of ``whole`` (the unsharded GPU call) where given; -inf LSEs in the same places."""
    import cupy as cp
    from gpu_cases import TOLERANCE, rel_err
    host = lambda x: np.asarray(cp.asnumpy(x) if not isinstance(x, np.ndarray) else x, np.float64)   # noqa: E731
    for i, (out, same, r) in enumerate(zip(got, whole or [None] * 5, ref)):
        limit = TOLERANCE[dtype] * (1 if i < 2 else grad_factor)
        out, r = host(out), host(r)
        if i == 1:
            finite = np.isfinite(r)
            assert (np.isneginf(out) == ~finite).all()
            out, r = out[finite], r[finite]
            same = None if same is None else host(same)[finite]
        else:
            out, r = _bhsd(out, layout), _bhsd(r, layout)
            same = None if same is None else _bhsd(host(same), layout)
        assert np.isfinite(out).all()
        assert rel_err(out, r) < limit, (i, rel_err(out, r))
        if same is not None:
            assert rel_err(out, same) < limit, (i, rel_err(out, same))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", ["window-causal", "window-two-sided", "alibi", "alibi-causal",
                                  "dropout-causal", "all-causal"])
@pytest.mark.parametrize("world", [2, 3])
def test_local_ring_options_on_one_gpu(world, case, dtype, rng):
    """Window, ALiBi and dropout over R ranks simulated on GPU 0: each pair of zigzag
    chunks (64 rows each, so origins on 64-row multiples that are not the kernels' 128-row
    tiles) is a placed call of the general kernels; against the unsharded GPU call and
    the float64 NumPy backend on the same rounded inputs (dropout: the same seed, so the
    same mask), forward, LSE and gradients with an LSE cotangent (3x, as above)."""
    import cupy as cp
    options = _gpu_options(case)
    layout = "bshd" if world == 3 else "bhsd"
    q, k, v, do, dlse = _gpu_problem(rng, dtype, n=128 * world, layout=layout)
    acc = np.float64 if dtype == "float64" else np.float32
    g = lambda x: cp.asarray(x).astype(dtype)   # noqa: E731
    got = _ring_run_gpu(world, *(g(x) for x in (q, k, v, do)), cp.asarray(dlse, acc), layout=layout,
                        **options)
    o, ctx = cf.attention_forward(*(g(x) for x in (q, k, v)), layout=layout, backend="cuda", **options)
    whole = (o, ctx.lse, *cf.attention_backward(g(do), ctx, dlse=cp.asarray(dlse, acc)))
    ref = _float64_reference(q, k, v, do, dlse, layout=layout, **options)
    _check_gpu_results(got, whole, ref, layout=layout, dtype=dtype)


@pytest.mark.gpu
def test_local_ring_over_two_gpus(rng):
    """Ranks on GPUs 0 and 1 (copies between devices in the exchanges)."""
    import cupy as cp
    from gpu_cases import TOLERANCE, rel_err
    if _gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpu_count()}")
    q, k, v, do, dlse = _gpu_problem(rng, "bfloat16", n=256)
    g = lambda x: cp.asarray(x).astype("bfloat16")   # noqa: E731
    got = _ring_run_gpu(2, *(g(x) for x in (q, k, v, do)), cp.asarray(dlse, np.float32), causal=True,
                        layout="bhsd", devices=[0, 1])
    for i, (out, r) in enumerate(zip(got, _oracle(q, k, v, do, dlse, causal=True, layout="bhsd"))):
        assert rel_err(cp.asnumpy(out).astype(np.float64), r) < TOLERANCE["bfloat16"] * (1 if i < 2 else 3)


def _check_multi_device(q, k, v, do, dlse, *, devices, causal, layout, dtype, to):
    from gpu_cases import TOLERANCE, rel_err
    import cupy as cp
    acc = np.float64 if dtype == "float64" else np.float32
    o, vjp = multi_device_attention_vjp(*(to(x) for x in (q, k, v)), devices=devices, causal=causal,
                                        layout=layout)
    grads = vjp(to(do), dlse=to(dlse).astype(acc))
    host = lambda x: np.asarray(cp.asnumpy(x) if not isinstance(x, np.ndarray) else x, np.float64)   # noqa: E731
    ref = _oracle(q, k, v, do, dlse, causal=causal, layout=layout)
    for i, (out, r) in enumerate(zip((o, vjp.lse, *grads), ref)):
        assert type(out) is type(to(q))
        out = host(out) if i == 1 else _bhsd(host(out), layout)
        assert rel_err(out, r) < TOLERANCE[dtype] * (1 if i < 3 else 3), (i, rel_err(out, r))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("host_inputs", [False, True])
def test_multi_device_on_gpu_0(host_inputs, causal, dtype, rng):
    """devices=[0]: the whole call split into (causal: two zigzag) query blocks on GPU 0,
    NumPy or CuPy inputs, Nq != Nk and GQA; dk, dv (3x: summed from parts rounded to the
    dtype) against the oracle."""
    import cupy as cp
    from gpu_cases import np_dtype
    layout = "bshd" if host_inputs else "bhsd"
    q, k, v, do, dlse = _gpu_problem(rng, dtype, n=200, layout=layout)
    q, do, dlse = (_seq_slice(x, 0, 150, layout if x.ndim == 4 else None) for x in (q, do, dlse))
    to = ((lambda x: x.astype(np_dtype(dtype)) if x.ndim == 4 else x) if host_inputs
          else (lambda x: cp.asarray(x).astype(dtype) if x.ndim == 4 else cp.asarray(x)))
    _check_multi_device(q, k, v, do, dlse, devices=[0], causal=causal, layout=layout, dtype=dtype, to=to)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", ["window-causal", "window-two-sided", "alibi", "dropout-causal", "all-causal"])
@pytest.mark.parametrize("host_inputs", [False, True])
def test_multi_device_options_on_gpu_0(host_inputs, case, dtype, rng):
    """devices=[0] with window, ALiBi and dropout: the causal call's two blocks (rows cut on
    32-row multiples) placed in the problem, Nq != Nk and GQA, NumPy or CuPy inputs,
    against the float64 NumPy backend's unsharded call with the same seed."""
    import cupy as cp
    from gpu_cases import np_dtype
    options = _gpu_options(case)
    layout = "bshd" if host_inputs else "bhsd"
    q, k, v, do, dlse = _gpu_problem(rng, dtype, n=400, layout=layout)
    q, do, dlse = (_seq_slice(x, 0, 300, layout if x.ndim == 4 else None) for x in (q, do, dlse))
    to = ((lambda x: x.astype(np_dtype(dtype)) if x.ndim == 4 else x) if host_inputs
          else (lambda x: cp.asarray(x).astype(dtype) if x.ndim == 4 else cp.asarray(x)))
    acc = np.float64 if dtype == "float64" else np.float32
    o, vjp = multi_device_attention_vjp(*(to(x) for x in (q, k, v)), devices=[0], layout=layout, **options)
    grads = vjp(to(do), dlse=to(dlse).astype(acc))
    assert all(type(x) is type(to(q)) for x in (o, vjp.lse, *grads))
    ref = _float64_reference(q, k, v, do, dlse, layout=layout, **options)
    _check_gpu_results((o, vjp.lse, *grads), None, ref, layout=layout, dtype=dtype)


def _seq_slice(x, lo, hi, layout):
    if layout is None:
        return x[..., lo:hi]
    return x[:, lo:hi] if layout == "bshd" else x[:, :, lo:hi]


@pytest.mark.gpu
@pytest.mark.parametrize("count", [2, 4])
def test_multi_device_over_several_gpus(count, rng):
    import cupy as cp
    if _gpu_count() < count:
        pytest.skip(f"needs {count} GPUs, this machine has {_gpu_count()}")
    q, k, v, do, dlse = _gpu_problem(rng, "bfloat16", n=512)
    # Inputs on the last GPU: every other device's results come back by peer copies.
    with cp.cuda.Device(count - 1):
        to = lambda x: cp.asarray(x).astype("bfloat16") if x.ndim == 4 else cp.asarray(x)   # noqa: E731
        _check_multi_device(q, k, v, do, dlse, devices=list(range(count)), causal=True, layout="bhsd",
                            dtype="bfloat16", to=to)
        # Window, ALiBi (slopes on the last GPU: each device gets its own copy) and dropout.
        options = dict(_gpu_options("all-causal"), alibi_slopes=cp.asarray(_GPU_SLOPES))
        o, vjp = multi_device_attention_vjp(*(to(x) for x in (q, k, v)), devices=list(range(count)), **options)
        grads = vjp(to(do), dlse=to(dlse).astype(np.float32))
    ref = _float64_reference(q, k, v, do, dlse, layout="bhsd", **dict(options, alibi_slopes=_GPU_SLOPES))
    _check_gpu_results((o, vjp.lse, *grads), None, ref, layout="bhsd", dtype="bfloat16")


_NCCL_WORKER = """
import sys
import numpy as np
import cupy as cp
import cupyflash as cf
from cupyflash.distributed import from_env, ring_attention_vjp, zigzag_shard

comm = from_env()
rng = np.random.default_rng(0)                    # the same whole problem on every rank
Q, K, V, dO = (rng.standard_normal(s).astype(np.float32)
               for s in ((2, 8, 1024, 128), (2, 2, 1024, 128), (2, 2, 1024, 128), (2, 8, 1024, 128)))
failed = []
for causal in (False, True):
    # Window, ALiBi and dropout with one seed on every rank: the unsharded call's mask.
    for name, options in (("plain", {}), ("window-alibi-dropout", dict(
            window=(300, 0 if causal else 200), alibi_slopes=np.array([2.0**-i for i in range(1, 9)], np.float32),
            dropout_p=0.15, seed=1234))):
        for case in sys.argv[1:]:                  # dtype:limit, each dtype in turn
            dtype, limit = case.split(":")
            g = lambda x: cp.asarray(x).astype(dtype)
            shard = lambda x: zigzag_shard(g(x), comm.rank, comm.size, -2)
            o, vjp = ring_attention_vjp(shard(Q), shard(K), shard(V), comm, causal=causal, **options)
            grads = vjp(shard(dO))
            whole, ctx = cf.attention_forward(g(Q), g(K), g(V), causal=causal, **options)
            ref = (whole, *cf.attention_backward(g(dO), ctx))
            worst = 0.0
            for i, (mine, r) in enumerate(zip((o, *grads), ref)):
                r = zigzag_shard(r, comm.rank, comm.size, -2).astype(cp.float64)
                err = float(cp.linalg.norm(mine.astype(cp.float64) - r) / cp.linalg.norm(r))
                worst = max(worst, err / (1 if i == 0 else 3))
            print(f"rank {comm.rank} causal={causal} {name} {dtype}: worst error {worst:.3g} (limit {limit})",
                  flush=True)
            if not worst < float(limit):
                failed.append((causal, name, dtype))
sys.exit(1 if failed else 0)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_ring_in_processes(world, tmp_path):
    """`world` processes (python -m cupyflash.distributed.launch), NCCL through CuPy: each
    rank's output and gradients against its rows of the unsharded call on its GPU, causal
    and not, plain and with a window, ALiBi and seeded dropout, in every dtype (one launch,
    for the processes' start; gradients 3x the dtype's tolerance, as above)."""
    from cupy.cuda import nccl
    from gpu_cases import TOLERANCE
    if _gpu_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {_gpu_count()}")
    if not nccl.available:
        pytest.skip("NCCL is not available to CuPy (pip install nvidia-nccl-cu12)")
    script = tmp_path / "worker.py"
    script.write_text(_NCCL_WORKER)
    run = subprocess.run([sys.executable, "-m", "cupyflash.distributed.launch", "--nproc", str(world),
                          str(script), *(f"{dtype}:{TOLERANCE[dtype]}" for dtype in GPU_DTYPES)],
                         cwd=ROOT, env=_env(), timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("worst error") == world * 4 * len(GPU_DTYPES)


def test_example_runs_simulated_ranks_without_a_launcher():
    """examples/ring_attention.py outside the launcher: says how to start it, then runs 3
    simulated ranks (NumPy backend here, one GPU where there is one) and checks rows."""
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "ring_attention.py"), "--simulate", "3",
                          "--seqlen", "128", "--heads", "2"], cwd=ROOT, env=env, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "python -m cupyflash.distributed.launch --nproc N" in run.stdout
    assert "OK" in run.stdout
