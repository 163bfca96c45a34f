"""Philox4x32-10 in NumPy and the dropout stream built on it, bit-identical to the GPU's.

Philox4x32-R is the counter-based generator of Salmon, Moraes, Dror and Shaw, "Parallel
random numbers: as easy as 1, 2, 3" (SC'11), as Random123 implements it: a 128-bit counter
and a 64-bit key go through R rounds of two 32x32->64-bit products and XORs, and out come
four uint32 words. No state: any word of the stream is a pure function of (counter, key),
so a GPU thread evaluates exactly the elements it holds, the backward pass regenerates the
forward's mask, and this module draws the same bits. ``kernels_cu/philox.cuh`` is the
device side; every function here names its mirror there.

Dropout mapping (one choice, used by both sides)
------------------------------------------------
For attention score (row, col) of head ``head`` of batch entry ``batch``, in a call with
``heads`` query heads, RNG seed ``seed`` (64 bits) and RNG offset ``offset`` (64 bits):

    key     = (seed mod 2**32, seed >> 32)
    stream  = (offset + batch * heads + head) mod 2**64
    x       = (col >> 5) * 4 + ((col >> 1) & 3)
    y       = (row >> 4) * 8 + (row & 7)
    counter = (x, y, stream mod 2**32, stream >> 32)
    byte    = ((row >> 3) & 1) * 8 + ((col >> 3) & 3) * 2 + (col & 1)
    draw    = bits 8 (byte mod 4) .. 8 (byte mod 4) + 7 of philox4x32_10(counter, key)[byte >> 2]
    keep    = draw >= threshold,   threshold = round(p * 256), in 1 .. 255 for p > 0

so one Philox call gives the 16 bytes of rows {r, r + 8} x 8 columns of a 16 x 32 block,
exactly the scores one GPU thread holds in 4 n-tiles of an mma.sync C fragment (it draws
them with a single call), and a thread needs nothing but its own indices. The pair (x, y)
with the byte is a bijection of (row, col) for rows < 2**32 and columns < 2**34, and the
stream counts (batch, head) pairs: a call that draws the masks of B batch entries x H heads
uses streams offset .. offset + B*H - 1, so the next call under the same seed starts at
offset + B*H (as torch advances its Philox offset) and never repeats a counter. Rows and
columns are the whole problem's: a kernel that computes a part of it from the origin
(row0, col0), multiples of 16 and 32, adds `counter_base` (row0, col0) to the counters of
its own indices and draws the same bits.

The draw has 8-bit resolution, as FlashAttention's: a score is dropped with probability
``threshold / 256`` (``dropout_p`` rounded to the nearest multiple of 1/256) and a kept
one is scaled by ``dropout_scale(p) = 256 / (256 - threshold)``, so the output stays an
unbiased estimate. A p that rounds to 0 or 256 is refused by the validation. The
threshold and the scale are computed here, on the host, and handed to the kernels, so no
float rounding differs between the two sides.
"""

from __future__ import annotations

import operator

import numpy as np

from . import _validate
from ._validate import _check_int, _check_int_in

# Random123's philox4x32 multipliers and Weyl key increments (golden ratio, sqrt(3) - 1).
PHILOX_M4x32 = (0xD2511F53, 0xCD9E8D57)
PHILOX_W32 = (0x9E3779B9, 0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)

MAX_ROWS = 2**32
MAX_COLS = 2**34


def _uint32_words(value, name: str, width: int) -> np.ndarray:
    """``value`` as uint64 words (…, width), each checked to lie in [0, 2**32)."""
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {array.dtype}")
    if array.ndim == 0 or array.shape[-1] != width:
        raise ValueError(f"{name} must have shape (..., {width}), got {array.shape}")
    if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
        raise ValueError(f"{name} words must be in [0, 2**32)")
    return array.astype(np.uint64)


def philox4x32(counter, key, rounds: int = 10) -> np.ndarray:
    """Philox4x32-``rounds`` of each counter under its key (mirror: ``philox4x32`` in philox.cuh).

    Parameters
    ----------
    counter : array_like of int, shape (..., 4)
        128-bit counters as four uint32 words, word 0 first (Random123's order).
    key : array_like of int, shape (..., 2)
        64-bit keys as two uint32 words; broadcast against ``counter``'s leading axes.
    rounds : int, default 10
        Rounds of the Philox bijection; 10 is the Crush-resistant default.

    Returns
    -------
    numpy.ndarray of uint32, shape (broadcast leading axes..., 4)
    """
    rounds = _check_int(rounds, "rounds")
    if not 1 <= rounds <= 16:
        raise ValueError(f"rounds must be in [1, 16], got {rounds}")
    ctr = _uint32_words(counter, "counter", 4)
    k = _uint32_words(key, "key", 2)
    shape = np.broadcast_shapes(ctr.shape[:-1], k.shape[:-1])
    # uint64 throughout: a 32x32-bit product fits, and wrapping is an explicit mask.
    c0, c1, c2, c3 = (np.broadcast_to(ctr[..., i], shape) for i in range(4))
    k0, k1 = (np.broadcast_to(k[..., i], shape) for i in range(2))
    m0, m1 = (np.uint64(m) for m in PHILOX_M4x32)
    w0, w1 = (np.uint64(w) for w in PHILOX_W32)
    for r in range(rounds):
        if r:   # Random123 bumps the key before every round but the first
            k0 = (k0 + w0) & _MASK32
            k1 = (k1 + w1) & _MASK32
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = (p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _MASK32
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


# --------------------------------------------------------------------------- dropout


def _check_seed(seed) -> int:
    return _check_int_in(seed, "seed", 0, 2**64, hi_text="2**64")


# The draw's resolution: one byte per score.
DRAW_LEVELS = _validate.DROPOUT_LEVELS
# The dropout stream's Philox rounds (mirror: PHILOX_ROUNDS in philox.cuh).
DROPOUT_ROUNDS = 10


def round_keys(seed) -> np.ndarray:
    """The key of each of the dropout stream's 10 rounds under ``seed``, as uint32 words
    (round r's at 2 r and 2 r + 1): the key (seed mod 2**32, seed >> 32) bumped r times by
    Random123's Weyl increments, as `philox4x32` bumps it. The host hands the table to the
    kernels (``ModsParams::rng_round_keys``; mirror: ``RoundKeys`` in philox.cuh), which
    then read each round's key from their parameters rather than add it up per call."""
    seed = _check_seed(seed)
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    w0, w1 = PHILOX_W32
    # Python ints: a few microseconds of a call's host time, where NumPy's would be ~10.
    return np.array([word for r in range(DROPOUT_ROUNDS)
                     for word in ((lo + r * w0) & 0xFFFFFFFF, (hi + r * w1) & 0xFFFFFFFF)], np.uint32)


def dropout_threshold(p) -> int:
    """The byte a score's draw must reach to be kept: ``round(p * 256)`` (mirror: the
    ``threshold`` of the device functions, which the host computes with this function).
    0 for p = 0 (no dropout); a p > 0 must round to 1 .. 255."""
    return round(_validate.check_dropout_p(p, "p") * DRAW_LEVELS)


def dropout_scale(p) -> float:
    """The factor of a kept score, ``1 / (1 - dropout_threshold(p) / 256)``: one over the
    probability that a score is kept, so dropout leaves the expected output unchanged."""
    return DRAW_LEVELS / (DRAW_LEVELS - dropout_threshold(p))


def dropout_stream(offset, batch, head, *, heads) -> int:
    """The 64-bit stream of one (batch, head) in a call whose RNG offset is ``offset``:
    ``(offset + batch * heads + head) mod 2**64`` (mirror: ``dropout_stream``)."""
    offset = _check_int_in(offset, "offset", 0, 2**64, hi_text="2**64")
    heads = _check_int_in(heads, "heads", 1)
    batch = _check_int_in(batch, "batch", 0)
    head = _check_int_in(head, "head", 0, heads, hi_text=f"heads={heads}")
    return (offset + batch * heads + head) % 2**64


def _dropout_words(seed: int, stream: int, x, y) -> np.ndarray:
    """Philox4x32-10 words of counters (x, y) of one stream, broadcast over ``x`` and
    ``y`` (mirror: ``dropout_words``)."""
    x, y = np.broadcast_arrays(np.asarray(x, np.uint64), np.asarray(y, np.uint64))
    counter = np.stack([x, y, np.full_like(x, stream & 0xFFFFFFFF), np.full_like(x, stream >> 32)], axis=-1)
    return philox4x32(counter, np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint64), rounds=DROPOUT_ROUNDS)


def _counter_x(col):
    return (col >> 5) * 4 + ((col >> 1) & 3)


def _counter_y(row):
    return (row >> 4) * 8 + (row & 7)


def counter_base(row0, col0) -> tuple[int, int]:
    """The counter words ``(x, y)`` of an origin ``(row0, col0)``, row0 a multiple of 16
    and col0 of 32 (mirror: ``dropout_counter_base``): score ``(row0 + r, col0 + c)`` has
    the counter of ``(r, c)`` plus these and the same byte. A kernel that runs one part of
    a larger problem (a chunk pair of `cupyflash.streaming`) indexes its scores from its
    own origin and adds these to its counters, and so draws the problem's bits. The NumPy
    backend indexes its scores in the problem's coordinates instead; this twin is what
    the tests hold the kernels' arithmetic to."""
    row0 = _check_int_in(row0, "row0", 0, MAX_ROWS, hi_text="2**32")
    col0 = _check_int_in(col0, "col0", 0, MAX_COLS, hi_text="2**34")
    if row0 % 16 or col0 % 32:
        raise ValueError(f"row0 must be a multiple of 16 and col0 of 32, got {row0} and {col0}")
    return int(_counter_x(col0)), int(_counter_y(row0))


def _draw_bytes(words: np.ndarray) -> np.ndarray:
    """The 16 draws of each call, (..., 4) uint32 words -> (..., 16) bytes, byte b from
    bits 8 (b mod 4) up of word b >> 2 (the little-endian order of the words' bytes)."""
    return np.ascontiguousarray(words.astype("<u4")).view(np.uint8)


def _byte_index(row, col):
    return ((row >> 3) & 1) * 8 + ((col >> 3) & 3) * 2 + (col & 1)


def _indices(value, name: str, limit: int) -> np.ndarray:
    """An extent n (meaning 0 .. n-1) or a 1-D array of indices, as int64 in [0, limit)."""
    if np.ndim(value) == 0:
        n = _check_int(value, name)
        if not 0 <= n <= limit:
            raise ValueError(f"{name} must be in [0, {limit}], got {n}")
        return np.arange(n, dtype=np.int64)
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a count or a 1-D integer array of indices, got shape "
                         f"{array.shape} dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= limit):
        raise ValueError(f"{name} indices must be in [0, {limit})")
    return array.astype(np.int64)


def dropout_keep(seed, offset, batch, head, row, col, *, p, heads) -> np.ndarray:
    """Whether score (row, col) survives dropout, one Philox call per element: the decision
    a GPU thread makes for one score it holds (mirror: ``dropout_keep``).

    ``row`` and ``col`` are integers or integer arrays (broadcast together); the other
    arguments are as in :func:`dropout_keep_mask`.
    """
    seed = _check_seed(seed)
    threshold = dropout_threshold(p)
    stream = dropout_stream(offset, batch, head, heads=heads)
    row = np.asarray(row)
    col = np.asarray(col)
    for name, a, limit in (("row", row, MAX_ROWS), ("col", col, MAX_COLS)):
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} must be integer, got dtype {a.dtype}")
        if a.size and (a.min() < 0 or a.max() >= limit):
            raise ValueError(f"{name} must be in [0, {limit})")
    row, col = np.broadcast_arrays(row.astype(np.int64), col.astype(np.int64))
    draws = _draw_bytes(_dropout_words(seed, stream, _counter_x(col), _counter_y(row)))
    draw = np.take_along_axis(draws, _byte_index(row, col)[..., None], axis=-1)[..., 0]
    return draw >= threshold


def dropout_keep_mask(seed, offset, batch, head, rows, cols, *, p, heads) -> np.ndarray:
    """The dropout keep mask of one (batch, head) over a grid of (row, col) scores.

    One Philox4x32-10 call per 16 scores (the module docstring gives the mapping, which
    ``kernels_cu/philox.cuh`` evaluates per element and per mma fragment).

    Parameters
    ----------
    seed : int
        RNG seed in [0, 2**64); it is the Philox key.
    offset : int
        RNG offset in [0, 2**64): the first stream of this call. A call over B batch
        entries x H heads uses streams offset .. offset + B*H - 1.
    batch, head : int
        Which batch entry and query head; 0 <= head < heads.
    rows, cols : int or 1-D integer array
        An extent n (rows or columns 0 .. n-1) or the indices themselves, such as the rows
        and columns of one tile. Rows < 2**32, columns < 2**34.
    p : float
        Dropout probability in [0, 1).
    heads : int
        Query heads per batch entry in this call.

    Returns
    -------
    numpy.ndarray of bool, shape (len(rows), len(cols))
        True where the score is kept (and scaled by 1 / (1 - p) by the caller).
    """
    seed = _check_seed(seed)
    threshold = dropout_threshold(p)
    stream = dropout_stream(offset, batch, head, heads=heads)
    r = _indices(rows, "rows", MAX_ROWS)
    c = _indices(cols, "cols", MAX_COLS)
    # One call per distinct (y, x): rows share y in pairs, columns share x in fours.
    ys, y_at = np.unique(_counter_y(r), return_inverse=True)
    xs, x_at = np.unique(_counter_x(c), return_inverse=True)
    draws = _draw_bytes(_dropout_words(seed, stream, xs[None, :], ys[:, None]))   # (Y, X, 16)
    return draws[y_at.reshape(-1)[:, None], x_at.reshape(-1)[None, :], _byte_index(r[:, None], c[None, :])] >= threshold
