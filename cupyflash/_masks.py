"""Which keys a query sees, and which tiles the blockwise loops visit.

Every visibility rule of cupyflash lives in this module; ``kernels_cu/mask.cuh`` mirrors
it in integer arithmetic, so the NumPy backend and the kernels skip and mask exactly the
same tiles.

A rule is written once, as the half-open span of key columns ``[lo, hi)`` that a query
row sees (`visible_key_span`), together with its inverse, the span of query rows that see
a key column (`visible_query_span`). Both bounds are non-decreasing along the rows (and
along the columns for the inverse). That monotonicity is what lets the block functions
read a whole tile off its corner rows or columns in O(1), as a kernel must; every rule
added later (a sliding window ``(left, right)``, per-sequence key padding) has to keep it
and arrives as a keyword argument of the span functions, which the block functions pass
through. Block-sparse masks, which are not spans, will filter the tiles these ranges give.

Coordinates: ``nq`` query rows and ``nk`` key columns. With ``causal``, the mask is
aligned to the bottom-right corner as in flash-attn >= 2.1: row ``i`` sees column ``j``
iff ``j <= i + (nk - nq)``. So the last query always sees every key, as in decoding
with a key/value cache, and when ``nq > nk`` the first ``nq - nk`` rows see no key.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "visible_key_span",
    "visible_query_span",
    "visible",
    "key_block_range",
    "query_block_range",
    "tile_needs_mask",
]


def visible_key_span(rows, nq: int, nk: int, *, causal: bool):
    """Half-open span of key columns that query rows see.

    Parameters
    ----------
    rows : int or array_like of int
        Query row indices.
    nq, nk : int
        Number of query rows and key columns.
    causal : bool
        Bottom-right aligned causal mask.

    Returns
    -------
    lo, hi : ndarray of int
        Row ``i`` sees exactly the columns ``lo[i] <= j < hi[i]`` (none when
        ``lo >= hi``); both are non-decreasing in the row and lie in ``[0, nk]``.
    """
    rows = np.asarray(rows)
    lo = np.zeros_like(rows)
    hi = np.full_like(rows, nk)
    if causal:
        hi = np.clip(rows + (nk - nq) + 1, 0, nk)
    return lo, hi


def visible_query_span(cols, nq: int, nk: int, *, causal: bool):
    """Half-open span of query rows that see key columns: the inverse of `visible_key_span`.

    The backward pass walks key blocks and asks which query blocks see them; a closed
    form keeps that O(1) per block in the kernels.

    Parameters
    ----------
    cols : int or array_like of int
        Key column indices, each in ``[0, nk)``.
    nq, nk : int
        Number of query rows and key columns.
    causal : bool
        Bottom-right aligned causal mask.

    Returns
    -------
    lo, hi : ndarray of int
        Column ``j`` is seen by exactly the rows ``lo[j] <= i < hi[j]``; both are
        non-decreasing in the column and lie in ``[0, nq]``.
    """
    cols = np.asarray(cols)
    lo = np.zeros_like(cols)
    hi = np.full_like(cols, nq)
    if causal:
        lo = np.clip(cols - (nk - nq), 0, nq)
    return lo, hi


def visible(rows, cols, nq: int, nk: int, *, causal: bool) -> np.ndarray:
    """Elementwise visibility of key columns to query rows.

    Parameters
    ----------
    rows, cols : array_like of int
        Query row and key column indices, broadcast against each other (for a tile,
        ``rows[:, None]`` and ``cols[None, :]``). Columns ``>= nk`` (the padded tail of
        the last key tile) are never visible.
    nq, nk : int
        Number of query rows and key columns.
    causal : bool
        Bottom-right aligned causal mask.

    Returns
    -------
    ndarray of bool
        The broadcast shape of `rows` and `cols`; True where the row sees the column.
    """
    lo, hi = visible_key_span(rows, nq, nk, causal=causal)
    cols = np.asarray(cols)
    return (cols >= lo) & (cols < hi)


def _last_row(start: int, stop: int, n: int) -> int:
    # A tile may run past the end of the sequence (the kernels use fixed tile shapes);
    # those rows do not exist, so they neither widen a range nor call for a mask.
    return min(stop, n) - 1


def _tile_range(span, start, stop, n, block, nq, nk, causal):
    """Tiles of height `block` covering the union of `span` over indices [start, stop).

    Spans are monotone, so the union over the block runs from the first index's lo to the
    last index's hi; the rules keep consecutive spans overlapping or touching, so no gap.
    """
    lo, _ = span(start, nq, nk, causal=causal)
    _, hi = span(_last_row(start, stop, n), nq, nk, causal=causal)
    first = int(lo) // block
    return first, max(first, -(-int(hi) // block))


def key_block_range(q_start: int, q_stop: int, nq: int, nk: int, block_k: int, *,
                    causal: bool) -> tuple[int, int]:
    """Key tiles that the query rows ``[q_start, q_stop)`` must visit.

    Parameters
    ----------
    q_start, q_stop : int
        The query block; rows at or past `nq` are ignored.
    nq, nk : int
        Number of query rows and key columns.
    block_k : int
        Key tile height; tile ``t`` holds columns ``[t * block_k, (t + 1) * block_k)``.
    causal : bool
        Bottom-right aligned causal mask.

    Returns
    -------
    first, stop : int
        The tiles ``first <= t < stop`` are exactly those in which some row of the block
        sees some key; wholly invisible tiles are skipped. ``first == stop`` when no row
        of the block sees any key.
    """
    return _tile_range(visible_key_span, q_start, q_stop, nq, block_k, nq, nk, causal)


def query_block_range(k_start: int, k_stop: int, nq: int, nk: int, block_q: int, *,
                      causal: bool) -> tuple[int, int]:
    """Query tiles that see some key of ``[k_start, k_stop)``: the backward's inner loop.

    Parameters
    ----------
    k_start, k_stop : int
        The key block; columns at or past `nk` are ignored.
    nq, nk : int
        Number of query rows and key columns.
    block_q : int
        Query tile height; tile ``t`` holds rows ``[t * block_q, (t + 1) * block_q)``.
    causal : bool
        Bottom-right aligned causal mask.

    Returns
    -------
    first, stop : int
        The query tiles ``first <= t < stop`` are exactly those in which some row sees
        some key of the block; ``first == stop`` when no row sees any of them.
    """
    return _tile_range(visible_query_span, k_start, k_stop, nk, block_q, nq, nk, causal)


def tile_needs_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, nq: int, nk: int,
                    *, causal: bool) -> bool:
    """Whether a tile needs the elementwise mask, i.e. is not wholly visible.

    Only tiles that cross the causal diagonal, or run past the last key, need it; the
    bulk of the tiles take the unmasked fast path.

    Parameters
    ----------
    q_start, q_stop : int
        Query rows of the tile; rows at or past `nq` do not exist and are ignored.
    k_start, k_stop : int
        Key columns of the tile; columns at or past `nk` are invisible, so a tile that
        runs past the last key needs the mask.
    nq, nk : int
        Number of query rows and key columns.
    causal : bool
        Bottom-right aligned causal mask.

    Returns
    -------
    bool
        False exactly when every existing row of the tile sees every column of it.
    """
    # Wholly visible iff the tightest row on each side still covers the tile: the last
    # row has the largest lo, the first row the smallest hi.
    _, hi_first = visible_key_span(q_start, nq, nk, causal=causal)
    lo_last, _ = visible_key_span(_last_row(q_start, q_stop, nq), nq, nk, causal=causal)
    return bool(k_start < lo_last or k_stop > hi_first)
