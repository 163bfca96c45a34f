"""Philox4x32-10 and the dropout stream (cupyflash/_philox.py, kernels_cu/philox.cuh).

CPU tier: the published known-answer vectors, the keep rate and the independence of
streams, the per-element decision against the grid's, argument checks, and the test kernel
building for sm_80 and sm_90a. GPU tier: that kernel against NumPy, bit for bit.
"""

import math

import numpy as np
import pytest

from cupyflash import _philox
from kernel_tests import ARCHS, assert_builds, gpu_kernel

# Known answers of Philox4x32-R, "counter[4] key[2] -> output[4]" in hex uint32 words, from
# Random123's tests/kat_vectors as D. E. Shaw Research cut and pasted them into
# DEShawResearch/Random123-Boost, libs/random/test/test_philox.cpp, test_kat_philox4x32
# (commit 916db91ae4c6fd8324ef054a518851321ab41f91). The same three 10-round lines appear
# in the kat_vectors of github.com/DEShawResearch/random123.
KAT_PHILOX4X32 = {
    10: """
        00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
        ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
        243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
        """,
    7: """
        00000000 00000000 00000000 00000000 00000000 00000000   5f6fb709 0d893f64 4f121f81 4f730a48
        ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   5207ddc2 45165e59 4d8ee751 8c52f662
        243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   4dfccaba 190a87f0 c47362ba b6b5242a
        """,
}


def _kat(rounds):
    rows = [[int(w, 16) for w in line.split()] for line in KAT_PHILOX4X32[rounds].strip().splitlines()]
    table = np.array(rows, dtype=np.uint32)
    return table[:, :4], table[:, 4:6], table[:, 6:]


@pytest.mark.parametrize("rounds", [10, 7])
def test_known_answers_one_by_one(rounds):
    for counter, key, expected in zip(*_kat(rounds)):
        out = _philox.philox4x32(counter, key, rounds=rounds)
        assert out.dtype == np.uint32
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("rounds", [10, 7])
def test_known_answers_vectorised(rounds):
    counters, keys, expected = _kat(rounds)
    np.testing.assert_array_equal(_philox.philox4x32(counters, keys, rounds=rounds), expected)


def test_default_is_ten_rounds_and_key_broadcasts(rng):
    counters = rng.integers(0, 2**32, size=(5, 7, 4), dtype=np.uint32)
    key = rng.integers(0, 2**32, size=2, dtype=np.uint32)
    out = _philox.philox4x32(counters, key)
    assert out.shape == (5, 7, 4)
    np.testing.assert_array_equal(out[2, 3], _philox.philox4x32(counters[2, 3], key, rounds=10))


@pytest.mark.parametrize("counter, key, match", [
    ([0, 0, 0], [0, 0], "counter"),
    ([0, 0, 0, 0], [0], "key"),
    ([0, 0, 0, 2**32], [0, 0], "counter"),
    ([0, 0, 0, 0], [-1, 0], "key"),
])
def test_philox_rejects_bad_words(counter, key, match):
    with pytest.raises(ValueError, match=match):
        _philox.philox4x32(counter, key)


def test_philox_rejects_float_words_and_bad_rounds():
    with pytest.raises(TypeError, match="counter"):
        _philox.philox4x32(np.zeros(4), [0, 0])
    with pytest.raises(ValueError, match="rounds"):
        _philox.philox4x32([0, 0, 0, 0], [0, 0], rounds=0)


# --------------------------------------------------------------------------- dropout


def test_mapping_is_the_documented_one(rng):
    """draw = byte ((row >> 3) & 1) * 8 + ((col >> 3) & 3) * 2 + (col & 1) of
    philox4x32_10(((col >> 5) * 4 + ((col >> 1) & 3), (row >> 4) * 8 + (row & 7), stream lo,
    stream hi), (seed lo, seed hi)), little-endian within its word, with stream = offset +
    batch * heads + head: the contract philox.cuh evaluates."""
    seed, offset, batch, head, heads, p = 0x0123456789ABCDEF, 2**63 + 5, 3, 2, 5, 0.25
    stream = offset + batch * heads + head
    rows = rng.integers(0, 2**32, size=50)
    cols = rng.integers(0, 2**34, size=50)
    threshold = 64
    for row, col in zip(rows.tolist(), cols.tolist()):
        words = _philox.philox4x32([(col >> 5) * 4 + ((col >> 1) & 3), (row >> 4) * 8 + (row & 7),
                                    stream % 2**32, stream >> 32], [seed % 2**32, seed >> 32])
        byte = ((row >> 3) & 1) * 8 + ((col >> 3) & 3) * 2 + (col & 1)
        expected = bool((int(words[byte >> 2]) >> (8 * (byte & 3))) & 0xFF >= threshold)
        assert _philox.dropout_keep(seed, offset, batch, head, row, col, p=p, heads=heads) == expected


def test_one_call_serves_a_fragment_threads_sixteen_scores():
    """The 16 draws of one Philox call are the scores (r + 8 h, c + 8 n + e) for h, e in
    {0, 1} and n in 0..3 (r a multiple of 16 plus g < 8, c a multiple of 32 plus 2 t): the
    scores a thread of an mma.sync C fragment holds in 4 n-tiles."""
    kw = dict(seed=3, offset=0, batch=0, head=0, p=0.5, heads=1)
    stream = 0
    for r, c in ((16 * 5 + 3, 32 * 7 + 2 * 2), (0, 0), (16 + 7, 32 + 6)):
        words = _philox.philox4x32([(c >> 5) * 4 + ((c >> 1) & 3), (r >> 4) * 8 + (r & 7), stream, 0], [3, 0])
        draws = words.astype("<u4").view(np.uint8)
        rows = np.array([r + 8 * h for h in (0, 1) for n in range(4) for e in (0, 1)])
        cols = np.array([c + 8 * n + e for h in (0, 1) for n in range(4) for e in (0, 1)])
        np.testing.assert_array_equal(_philox.dropout_keep(row=rows, col=cols, **kw), draws >= 128)


def test_threshold():
    assert _philox.dropout_threshold(0.0) == 0
    assert _philox.dropout_threshold(0.5) == 128
    assert _philox.dropout_threshold(0.1) == 26
    assert _philox.dropout_threshold(1 / 512 + 1e-9) == 1
    assert _philox.dropout_threshold(1 - 1 / 256) == 255
    for p in (0.0, 0.1, 1 / 3, 0.5, 0.9):
        keep = 1 - _philox.dropout_threshold(p) / 256
        assert abs(keep - (1 - p)) <= 1 / 512
        assert _philox.dropout_scale(p) == 1 / keep
    # A p that rounds to no dropout, or to dropping everything, is refused.
    for p in (1e-4, 1 - 1e-4):
        with pytest.raises(ValueError, match="8-bit resolution"):
            _philox.dropout_threshold(p)


def test_p_zero_keeps_everything():
    assert _philox.dropout_keep_mask(7, 0, 0, 0, 64, 130, p=0.0, heads=1).all()


@pytest.mark.parametrize("p", [0.01, 0.1, 0.3, 0.5, 0.9])
def test_keep_rate_is_binomial(p):
    mask = _philox.dropout_keep_mask(2024, 11, 1, 3, 1024, 1023, p=p, heads=4)
    p = _philox.dropout_threshold(p) / 256   # the drawn probability
    n = mask.size
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(int(mask.sum()) - n * (1 - p)) < 6 * sigma
    # Each of the 16 bytes of a Philox call (row bit 3, column bits 0 and 3-4) keeps at
    # the same rate.
    for h in range(2):
        for n_tile in range(4):
            for e in range(2):
                part = mask[[i for i in range(1024) if (i >> 3) & 1 == h]][:, [j for j in range(1023)
                                                                              if (j >> 3) & 3 == n_tile and j & 1 == e]]
                assert abs(int(part.sum()) - part.size * (1 - p)) < 6 * math.sqrt(part.size * p * (1 - p))


def _agreement_within_bounds(a, b, p):
    """Two independent Bernoulli(1 - p) masks agree with probability (1-p)^2 + p^2."""
    q = (1 - p) ** 2 + p**2
    n = a.size
    agree = int((a == b).sum())
    return abs(agree - n * q) < 6 * math.sqrt(n * q * (1 - q))


BASE = dict(seed=99, offset=1000, batch=2, head=1, heads=8)


@pytest.mark.parametrize("change", [
    dict(seed=100), dict(seed=99 + 2**32), dict(offset=1000 + 8 * 3), dict(offset=1000 + 2**32),
    dict(head=2), dict(batch=3), dict(batch=0, head=0),
])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_streams_are_independent(change, p):
    def mask(seed, offset, batch, head, heads):
        return _philox.dropout_keep_mask(seed, offset, batch, head, 512, 512, p=p, heads=heads)

    a = mask(**BASE)
    b = mask(**{**BASE, **change})
    assert _agreement_within_bounds(a, b, p)


def test_rows_and_neighbouring_columns_are_independent():
    p = 0.5
    mask = _philox.dropout_keep_mask(5, 0, 0, 0, 1024, 1024, p=p, heads=1)
    assert _agreement_within_bounds(mask[:-1], mask[1:], p)             # row r vs r + 1
    for j in range(1, 4):                                                # words of one call
        assert _agreement_within_bounds(mask[:, 0::4], mask[:, j::4], p)
    assert _agreement_within_bounds(mask[:, :-4], mask[:, 4:], p)        # group g vs g + 1


def test_offset_counts_batch_head_streams():
    """A call of B x H heads uses streams offset .. offset + B*H - 1; the next starts after."""
    kw = dict(rows=33, cols=41, p=0.5, heads=4)
    np.testing.assert_array_equal(_philox.dropout_keep_mask(1, 10, 0, 1, **kw),
                                  _philox.dropout_keep_mask(1, 9, 0, 2, **kw))
    np.testing.assert_array_equal(_philox.dropout_keep_mask(1, 10 + 4, 0, 3, **kw),
                                  _philox.dropout_keep_mask(1, 10, 1, 3, **kw))
    assert _philox.dropout_stream(2**64 - 1, 0, 1, heads=2) == 0   # wraps mod 2**64


def test_single_element_equals_grid(rng):
    """What one GPU thread decides for its score equals the grid's decision."""
    kw = dict(seed=int(rng.integers(0, 2**63)) * 2 + 1, offset=2**40 + 17, batch=5, head=6,
              p=0.37, heads=7)
    grid = _philox.dropout_keep_mask(rows=67, cols=130, **kw)
    rows, cols = np.meshgrid(np.arange(67), np.arange(130), indexing="ij")
    np.testing.assert_array_equal(_philox.dropout_keep(row=rows, col=cols, **kw), grid)
    for row, col in zip(rng.integers(0, 67, 40).tolist(), rng.integers(0, 130, 40).tolist()):
        assert _philox.dropout_keep(row=row, col=col, **kw) == grid[row, col]


def test_tile_of_indices_equals_slice_of_grid(rng):
    kw = dict(seed=3, offset=0, batch=0, head=0, p=0.2, heads=1)
    grid = _philox.dropout_keep_mask(rows=96, cols=200, **kw)
    tile = _philox.dropout_keep_mask(rows=np.arange(32, 64), cols=np.arange(61, 190), **kw)
    np.testing.assert_array_equal(tile, grid[32:64, 61:190])
    # Scattered and repeated indices, and indices past 2**32.
    rows = rng.integers(0, 2**32, 20)
    cols = np.concatenate([rng.integers(0, 2**34, 30), [2**34 - 1, 2**34 - 4, 5, 5]])
    mask = _philox.dropout_keep_mask(rows=rows, cols=cols, **kw)
    np.testing.assert_array_equal(mask, _philox.dropout_keep(row=rows[:, None], col=cols[None, :], **kw))


@pytest.mark.parametrize("change, error, match", [
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(offset=-1), ValueError, "offset"),
    (dict(offset=2**64), ValueError, "offset"),
    (dict(p=-0.1), ValueError, "p must"),
    (dict(p=1.0), ValueError, "p must"),
    (dict(p=float("nan")), ValueError, "p must"),
    (dict(p=True), TypeError, "p must"),
    (dict(head=4), ValueError, "head"),
    (dict(batch=-1), ValueError, "batch"),
    (dict(heads=0), ValueError, "heads"),
    (dict(rows=-1), ValueError, "rows"),
    (dict(rows=2**32 + 1), ValueError, "rows"),
    (dict(cols=np.array([0, 2**34])), ValueError, "cols"),
    (dict(cols=np.zeros((2, 2), int)), ValueError, "cols"),
])
def test_dropout_arguments_are_checked(change, error, match):
    kw = dict(seed=0, offset=0, batch=0, head=0, rows=4, cols=4, p=0.5, heads=4)
    with pytest.raises(error, match=match):
        _philox.dropout_keep_mask(**{**kw, **change})


@pytest.mark.parametrize("row0, col0", [(0, 0), (16, 32), (128, 384), (2**20 + 48, 2**30 + 96),
                                        (2**32 - 64, 2**34 - 128)])
def test_counter_base_moves_a_tile_to_its_origin(row0, col0):
    """The identity the kernels' chunk pairs draw by (philox.cuh dropout_counter_base): the
    bits of the problem's scores (row0 + r, col0 + c) are those of (r, c) drawn with the
    origin's counters added, bytes unchanged."""
    seed, offset, batch, head, heads, p = 2**63 + 5, 77, 1, 2, 3, 0.4
    rows, cols = np.arange(48), np.arange(96)
    x0, y0 = _philox.counter_base(row0, col0)
    stream = _philox.dropout_stream(offset, batch, head, heads=heads)
    words = _philox._dropout_words(seed, stream, _philox._counter_x(cols)[None, :] + x0,
                                   _philox._counter_y(rows)[:, None] + y0)
    draws = _philox._draw_bytes(words)
    byte = _philox._byte_index(rows[:, None], cols[None, :])
    local = np.take_along_axis(draws, byte[..., None], axis=-1)[..., 0] >= _philox.dropout_threshold(p)
    problem = _philox.dropout_keep_mask(seed, offset, batch, head, rows + row0, cols + col0, p=p, heads=heads)
    np.testing.assert_array_equal(local, problem)


@pytest.mark.parametrize("row0, col0", [(8, 0), (0, 16), (-16, 0), (2**32, 0)])
def test_counter_base_refuses_unaligned_origins(row0, col0):
    with pytest.raises(ValueError, match="row0|col0"):
        _philox.counter_base(row0, col0)


def test_single_element_arguments_are_checked():
    kw = dict(seed=0, offset=0, batch=0, head=0, p=0.5, heads=1)
    with pytest.raises(ValueError, match="row"):
        _philox.dropout_keep(row=2**32, col=0, **kw)
    with pytest.raises(ValueError, match="col"):
        _philox.dropout_keep(row=0, col=-1, **kw)


# --------------------------------------------------------------------------- kernels

KERNELS = ("philox4x32_kernel<10>", "philox4x32_kernel<7>", "dropout_keep_kernel",
           *(f"dropout_m_tile_kernel<8, {table}>" for table in ("false", "true")),
           *(f"dropout_key_rows_kernel<8, {paired}, {table}>" for paired in ("false", "true")
             for table in ("false", "true")))

@pytest.mark.parametrize("arch", ARCHS)
def test_test_kernels_build(arch):
    assert_builds("philox_test.cu", KERNELS, arch)


def _gpu_kernel(expr):
    return gpu_kernel("philox_test.cu", expr)


@pytest.mark.gpu
@pytest.mark.parametrize("rounds", [10, 7])
def test_gpu_philox_matches_numpy(rounds, rng):
    import cupy

    counters, keys, _ = _kat(rounds)
    n = 100_003
    counters = np.concatenate([counters, rng.integers(0, 2**32, (n, 4), dtype=np.uint32)])
    keys = np.concatenate([keys, rng.integers(0, 2**32, (n, 2), dtype=np.uint32)])
    out = cupy.full(counters.shape, 0xDEADBEEF, dtype=cupy.uint32)   # poisoned
    kernel = _gpu_kernel(f"philox4x32_kernel<{rounds}>")
    total = len(counters)
    kernel(((total + 255) // 256,), (256,),
           (cupy.asarray(counters), cupy.asarray(keys), out, np.int32(total)))
    np.testing.assert_array_equal(cupy.asnumpy(out), _philox.philox4x32(counters, keys, rounds=rounds))


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1 - 1 / 256])
@pytest.mark.parametrize("row0, key0", [(0, 0), (4096 + 128, 2**20 + 96)])
def test_gpu_dropout_keep_matches_numpy(p, row0, key0, rng):
    """Per-score draws of the scores (row0 + row, key0 + col): a chunk pair's, from its own
    indices and its origin's counters."""
    import cupy

    seed, offset, batch, head, heads = 2**64 - 3, 2**64 - 2, 3, 5, 6   # the stream wraps
    rows = np.concatenate([np.repeat(np.arange(64), 97), rng.integers(0, 2**32 - row0, 5000)])
    cols = np.concatenate([np.tile(np.arange(97), 64), rng.integers(0, 2**34 - key0, 5000)])
    keep = cupy.full(rows.shape, 7, dtype=cupy.uint8)   # poisoned
    kernel = _gpu_kernel("dropout_keep_kernel")
    kernel(((len(rows) + 255) // 256,), (256,),
           (np.uint64(seed), np.uint64(offset), np.uint32(batch), np.uint32(head), np.uint32(heads),
            cupy.asarray(rows, dtype=cupy.uint32), cupy.asarray(cols, dtype=cupy.uint64),
            np.uint32(row0), np.uint32(key0), np.uint32(_philox.dropout_threshold(p)), keep,
            np.int32(len(rows))))
    expected = _philox.dropout_keep(seed, offset, batch, head, rows + row0, cols + key0, p=p, heads=heads)
    np.testing.assert_array_equal(cupy.asnumpy(keep), expected.astype(np.uint8))
    grid = _philox.dropout_keep_mask(seed, offset, batch, head, np.arange(row0, row0 + 64),
                                     np.arange(key0, key0 + 97), p=p, heads=heads)
    np.testing.assert_array_equal(cupy.asnumpy(keep[:64 * 97]).reshape(64, 97), grid.astype(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1 - 1 / 256])
@pytest.mark.parametrize("r0,c0", [(0, 0), (16, 64), (4096 + 48, 2**20 + 32)])
@pytest.mark.parametrize("row_origin, key_origin", [(0, 0), (384, 2**20 + 160)])
@pytest.mark.parametrize("table", [False, True])
def test_gpu_m_tile_bits_match_numpy(p, r0, c0, row_origin, key_origin, table):
    """The forward's keep bits (fwd_sm90.cu: one Philox call a thread for 4 n-tiles, the
    byte compares a word at a time) against the per-score draw of the NumPy twin, over a
    warp's 16 rows x 64 keys, counted from an origin (a chunk pair's) or from 0; the key
    as the seed or as the host's table of its rounds' keys."""
    import cupy

    seed, stream = 2**63 + 54321, 91
    keep = cupy.full((16, 64), 7, dtype=cupy.uint8)   # poisoned
    _gpu_kernel(f"dropout_m_tile_kernel<8, {str(table).lower()}>")((1,), (32,), (
        np.uint64(seed), cupy.asarray(_philox.round_keys(seed)), np.uint64(stream), np.int32(r0), np.int32(c0), np.uint32(row_origin),
        np.uint32(key_origin), np.uint32(_philox.dropout_threshold(p)), keep))
    rows, keys = np.meshgrid(np.arange(row_origin + r0, row_origin + r0 + 16),
                             np.arange(key_origin + c0, key_origin + c0 + 64), indexing="ij")
    expected = _philox.dropout_keep(seed, stream, 0, 0, rows.ravel(), keys.ravel(), p=p, heads=1)
    np.testing.assert_array_equal(cupy.asnumpy(keep), expected.reshape(16, 64).astype(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("key0,q0", [(0, 0), (16, 64), (48, 4096 + 16), (2**20 + 32, 2**21 + 48)])
@pytest.mark.parametrize("row_origin, key_origin", [(0, 0), (384, 2**20 + 160)])
@pytest.mark.parametrize("table", [False, True])
def test_gpu_key_rows_bits_match_numpy(paired, p, key0, q0, row_origin, key_origin, table):
    """The backward's keep bits (two lanes sharing each Philox call; paired, two warps too,
    bwd_sm90.cu) against the per-score draw of the NumPy twin, over a warp's 16 keys (a
    pair's 32, from key0 rounded down to 32) x 64 queries, counted from an origin (a chunk
    pair's) or from 0; the key as the seed or as the host's table of its rounds' keys."""
    import cupy

    seed, stream = 2**63 + 12345, 77
    warps = 2 if paired else 1
    key0 = key0 // 32 * 32 if paired else key0
    keep = cupy.full((16 * warps, 64), 7, dtype=cupy.uint8)   # poisoned
    kernel = _gpu_kernel(f"dropout_key_rows_kernel<8, {str(paired).lower()}, {str(table).lower()}>")
    kernel((1,), (32 * warps,), (np.uint64(seed), cupy.asarray(_philox.round_keys(seed)), np.uint64(stream),
                                 np.int32(key0), np.int32(q0),
                                 np.uint32(row_origin), np.uint32(key_origin),
                                 np.uint32(_philox.dropout_threshold(p)), keep))
    keys, queries = np.meshgrid(np.arange(key_origin + key0, key_origin + key0 + 16 * warps),
                                np.arange(row_origin + q0, row_origin + q0 + 64), indexing="ij")
    expected = _philox.dropout_keep(seed, stream, 0, 0, queries.ravel(), keys.ravel(), p=p, heads=1)
    np.testing.assert_array_equal(cupy.asnumpy(keep), expected.reshape(16 * warps, 64).astype(np.uint8))


@pytest.mark.parametrize("seed", [0, 1, 0x0123456789ABCDEF, 2**64 - 1])
def test_round_keys_are_the_key_schedule(seed):
    """The table the kernels read each round's key from (philox.cuh RoundKeys) is the key
    philox4x32 bumps round by round: Philox with the table's round-0 key and one round
    per entry retraced gives the 10-round words."""
    keys = _philox.round_keys(seed)
    assert keys.dtype == np.uint32 and keys.shape == (2 * _philox.DROPOUT_ROUNDS,)
    assert (int(keys[0]), int(keys[1])) == (seed % 2**32, seed >> 32)
    w0, w1 = _philox.PHILOX_W32
    for r in range(1, _philox.DROPOUT_ROUNDS):
        assert int(keys[2 * r]) == (int(keys[2 * r - 2]) + w0) % 2**32
        assert int(keys[2 * r + 1]) == (int(keys[2 * r - 1]) + w1) % 2**32
    # The schedule is the one philox4x32 applies: one round under key r per round.
    counter = np.array([[1, 2, 3, 4]], np.uint32)
    words = counter.astype(np.uint64)
    m0, m1 = _philox.PHILOX_M4x32
    for r in range(_philox.DROPOUT_ROUNDS):
        c0, c1, c2, c3 = (int(x) for x in words[0])
        p0, p1 = m0 * c0, m1 * c2
        words = np.array([[(p1 >> 32) ^ c1 ^ int(keys[2 * r]), p1 % 2**32,
                           (p0 >> 32) ^ c3 ^ int(keys[2 * r + 1]), p0 % 2**32]], np.uint64)
    np.testing.assert_array_equal(words.astype(np.uint32),
                                  _philox.philox4x32(counter, [[seed % 2**32, seed >> 32]]))
