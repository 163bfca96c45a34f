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
    counter = (col >> 2, row, stream mod 2**32, stream >> 32)
    word    = philox4x32_10(counter, key)[col & 3]
    keep    = word >= threshold,   threshold = min(round(p * 2**32), 2**32 - 1)

so one Philox call serves 4 consecutive columns of a row, and a thread needs nothing but
its own indices. For a fixed seed the counter is injective in (stream, row, col >> 2) for
rows < 2**32 and columns < 2**34, and the stream counts (batch, head) pairs: a call that
draws the masks of B batch entries x H heads uses streams offset .. offset + B*H - 1, so
the next call under the same seed starts at offset + B*H (as torch advances its Philox
offset) and never repeats a counter. P(keep) = 1 - threshold / 2**32, within 2**-32 of
1 - p; the threshold is computed here, on the host, and handed to kernels as a uint32, so
no float rounding differs between the two sides.
"""

from __future__ import annotations

import operator

import numpy as np

from ._validate import _check_int, _check_int_in, _check_real

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


def dropout_threshold(p) -> int:
    """The uint32 a Philox word must reach for its score to be kept: round(p * 2**32),
    clamped to 2**32 - 1 so it fits a uint32 (mirror: the ``threshold`` argument of the
    device functions, which the host computes with this function).

    ``p * 2**32`` is exact in binary floating point, so the rounding is the only one.
    """
    p = _check_real(p, "p")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p!r}")
    return min(round(p * 2**32), 2**32 - 1)


def dropout_stream(offset, batch, head, *, heads) -> int:
    """The 64-bit stream of one (batch, head) in a call whose RNG offset is ``offset``:
    ``(offset + batch * heads + head) mod 2**64`` (mirror: ``dropout_stream``)."""
    offset = _check_int_in(offset, "offset", 0, 2**64, hi_text="2**64")
    heads = _check_int_in(heads, "heads", 1)
    batch = _check_int_in(batch, "batch", 0)
    head = _check_int_in(head, "head", 0, heads, hi_text=f"heads={heads}")
    return (offset + batch * heads + head) % 2**64


def _dropout_words(seed: int, stream: int, row, group) -> np.ndarray:
    """Philox4x32-10 words of (row, column group) in one stream, broadcast over ``row`` and
    ``group`` (mirror: ``dropout_words``)."""
    row, group = np.broadcast_arrays(np.asarray(row, np.uint64), np.asarray(group, np.uint64))
    counter = np.stack([group, row, np.full_like(row, stream & 0xFFFFFFFF),
                        np.full_like(row, stream >> 32)], axis=-1)
    return philox4x32(counter, np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint64))


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
    col = col.astype(np.int64)
    words = _dropout_words(seed, stream, row, col >> 2)
    word = np.take_along_axis(words, np.broadcast_to(col & 3, words.shape[:-1])[..., None], axis=-1)
    return word[..., 0] >= threshold


def dropout_keep_mask(seed, offset, batch, head, rows, cols, *, p, heads) -> np.ndarray:
    """The dropout keep mask of one (batch, head) over a grid of (row, col) scores.

    One Philox4x32-10 call per row and group of 4 consecutive columns; the module
    docstring gives the mapping, which ``kernels_cu/philox.cuh`` evaluates per element.

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
    groups, where = np.unique(c >> 2, return_inverse=True)
    words = _dropout_words(seed, stream, r[:, None], groups[None, :])   # (R, G, 4)
    return words[:, where.reshape(-1), c & 3] >= threshold
