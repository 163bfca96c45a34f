"""Which keys a query sees, and which tiles the blockwise loops visit.

Every visibility rule of cupyflash lives in this module; ``kernels_cu/mask.cuh`` mirrors
it in integer arithmetic, so the NumPy backend and the kernels skip and mask exactly the
same tiles.

A rule is written once, as the half-open span of key columns ``[lo, hi)`` that a query
row sees (`visible_key_span`), together with its inverse, the span of query rows that see
a key column (`visible_query_span`). Both bounds are non-decreasing along the rows (and
along the columns for the inverse). That monotonicity is what lets the block functions
read a whole tile off its corner rows or columns in O(1), as a kernel must; every rule
keeps it and arrives as a keyword argument of the span functions (``causal``, a sliding
``window=(left, right)``, a key stop for key padding), which the block functions pass
through. Block-sparse masks, which are not spans, filter the tiles these ranges give
(`block_mask_tiles`).

Coordinates: ``nq`` query rows and ``nk`` key columns. With ``causal``, the mask is
aligned to the bottom-right corner as in flash-attn >= 2.1: row ``i`` sees column ``j``
iff ``j <= i + (nk - nq)``. So the last query always sees every key, as in decoding
with a key/value cache, and when ``nq > nk`` the first ``nq - nk`` rows see no key.

The window is aligned the same way: row ``i`` sees ``i + off - left <= j <= i + off +
right`` with ``off = nk - nq``, a side of -1 being unbounded; with ``causal`` both hold,
so causal wins over ``right >= 0``. ``key_stop`` (at most ``nk``) hides the columns
``j >= key_stop`` without moving that alignment, which always uses ``nk``: it is the
per-sequence key length of a padded batch (``seqlens_k``). ``diagonal`` replaces ``off``
where the rows and columns are a part of a larger problem (a chunk pair of the streamed
path: ``diagonal`` is the problem's ``Nk - Nq`` moved to the part's own indices,
`cupyflash._mods.Modifiers.call_diagonal`). These are the rules of `cupyflash._mods`.
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
    "block_mask_tiles",
]

_RULES_DOC = """\
    causal : bool
        Bottom-right aligned causal mask.
    window : (int, int), default (-1, -1)
        ``(left, right)`` extents of the sliding window around the diagonal (below);
        -1 leaves that side unbounded.
    key_stop : int, optional
        Columns ``>= key_stop`` are hidden (key padding); at most `nk`, default `nk`.
    diagonal : int, optional
        The diagonal key of row ``i`` is ``i + diagonal``; default ``nk - nq``."""


def _with_rules_doc(func):
    func.__doc__ = func.__doc__.replace("    @rules@\n", _RULES_DOC + "\n")
    return func


@_with_rules_doc
def visible_key_span(rows, nq: int, nk: int, *, causal: bool, window=(-1, -1),
                     key_stop=None, diagonal=None):
    """Half-open span of key columns that query rows see.

    Parameters
    ----------
    rows : int or array_like of int
        Query row indices.
    nq, nk : int
        Number of query rows and key columns.
    @rules@

    Returns
    -------
    lo, hi : ndarray of int
        Row ``i`` sees exactly the columns ``lo[i] <= j < hi[i]`` (none when
        ``lo >= hi``); both are non-decreasing in the row and lie in ``[0, key_stop]``.
    """
    rows = np.asarray(rows)
    stop = nk if key_stop is None else key_stop
    on_diagonal = rows + (nk - nq if diagonal is None else diagonal)
    left, right = window
    lo = np.zeros_like(rows)
    hi = np.full_like(rows, stop)
    if left >= 0:
        lo = on_diagonal - left
    if causal:
        hi = np.minimum(hi, on_diagonal + 1)
    if right >= 0:
        hi = np.minimum(hi, on_diagonal + right + 1)
    return np.clip(lo, 0, stop), np.clip(hi, 0, stop)


@_with_rules_doc
def visible_query_span(cols, nq: int, nk: int, *, causal: bool, window=(-1, -1),
                       key_stop=None, diagonal=None):
    """Half-open span of query rows that see key columns: the inverse of `visible_key_span`.

    The backward pass walks key blocks and asks which query blocks see them; a closed
    form keeps that O(1) per block in the kernels.

    Parameters
    ----------
    cols : int or array_like of int
        Key column indices, each in ``[0, nk)``.
    nq, nk : int
        Number of query rows and key columns.
    @rules@

    Returns
    -------
    lo, hi : ndarray of int
        Column ``j`` is seen by exactly the rows ``lo[j] <= i < hi[j]``; both are
        non-decreasing in the column and lie in ``[0, nq]``.
    """
    cols = np.asarray(cols)
    stop = nk if key_stop is None else key_stop
    # Row i sees column j iff j - off lies in [i - right, i + left] (causal: right = 0).
    row_of_col = cols - (nk - nq if diagonal is None else diagonal)
    left, right = window
    lo = np.zeros_like(cols)
    hi = np.full_like(cols, nq)
    if causal:
        lo = np.maximum(lo, row_of_col)
    if right >= 0:
        lo = np.maximum(lo, row_of_col - right)
    if left >= 0:
        hi = row_of_col + left + 1
    # A hidden column is seen by no row; (nq, nq) rather than (0, 0) keeps both bounds
    # non-decreasing, as the hidden columns are the last ones.
    hidden = cols >= stop
    return (np.where(hidden, nq, np.clip(lo, 0, nq)),
            np.where(hidden, nq, np.clip(hi, 0, nq)))


@_with_rules_doc
def visible(rows, cols, nq: int, nk: int, *, causal: bool, window=(-1, -1),
            key_stop=None, diagonal=None) -> np.ndarray:
    """Elementwise visibility of key columns to query rows.

    Parameters
    ----------
    rows, cols : array_like of int
        Query row and key column indices, broadcast against each other (for a tile,
        ``rows[:, None]`` and ``cols[None, :]``). Columns ``>= nk`` (the padded tail of
        the last key tile) are never visible.
    nq, nk : int
        Number of query rows and key columns.
    @rules@

    Returns
    -------
    ndarray of bool
        The broadcast shape of `rows` and `cols`; True where the row sees the column.
    """
    lo, hi = visible_key_span(rows, nq, nk, causal=causal, window=window, key_stop=key_stop,
                              diagonal=diagonal)
    cols = np.asarray(cols)
    return (cols >= lo) & (cols < hi)


def _last_row(start: int, stop: int, n: int) -> int:
    # A tile may run past the end of the sequence (the kernels use fixed tile shapes);
    # those rows do not exist, so they neither widen a range nor call for a mask.
    return min(stop, n) - 1


def _tile_range(span, start, stop, n, block, nq, nk, rules):
    """Tiles of height `block` covering the union of `span` over indices [start, stop).

    Spans are monotone, so the union over the block runs from the first index's lo to the
    last index's hi. The rules leave no gap inside it: consecutive non-empty spans
    overlap or touch, and empty ones only come first (hi = 0) or, for rows, last (lo at
    the key stop); a block whose spans are all empty gets ``hi <= lo`` and visits nothing.
    """
    lo, _ = span(start, nq, nk, **rules)
    _, hi = span(_last_row(start, stop, n), nq, nk, **rules)
    first = int(lo) // block
    return first, (first if hi <= lo else -(-int(hi) // block))


@_with_rules_doc
def key_block_range(q_start: int, q_stop: int, nq: int, nk: int, block_k: int, *,
                    causal: bool, window=(-1, -1), key_stop=None, diagonal=None) -> tuple[int, int]:
    """Key tiles that the query rows ``[q_start, q_stop)`` must visit.

    Parameters
    ----------
    q_start, q_stop : int
        The query block; rows at or past `nq` are ignored.
    nq, nk : int
        Number of query rows and key columns.
    block_k : int
        Key tile height; tile ``t`` holds columns ``[t * block_k, (t + 1) * block_k)``.
    @rules@

    Returns
    -------
    first, stop : int
        The tiles ``first <= t < stop`` are exactly those in which some row of the block
        sees some key; wholly invisible tiles are skipped. ``first == stop`` when no row
        of the block sees any key.
    """
    rules = dict(causal=causal, window=window, key_stop=key_stop, diagonal=diagonal)
    return _tile_range(visible_key_span, q_start, q_stop, nq, block_k, nq, nk, rules)


def pair_call(q0: int, q1: int, k0: int, k1: int, nq: int, nk: int, *, causal: bool, window=(-1, -1),
              key_end=None):
    """Rows ``[q0, q1)`` and keys ``[k0, k1)`` of a problem of ``nq`` x ``nk`` as a call of
    their own (a streamed chunk pair, a ring step's chunks, a device's query block):
    ``(key stop, causal)``, its keys ending where the rows' reach ends if inside and
    ``causal`` whether it needs the causal mask at all; None where the band hides every
    key (or every key the rows see is at or past ``key_end``, the longest sequence's keys)."""
    first, stop = key_block_range(q0, q1, nq, nk, 1, causal=causal, window=window)
    end = stop if key_end is None else min(stop, key_end)
    if q1 <= q0 or k0 >= end or k1 <= first:
        return None
    stop = min(k1, stop)
    # Not wholly visible to its first row: the call is causal.
    return stop, causal and stop - 1 > q0 + nk - nq


@_with_rules_doc
def query_block_range(k_start: int, k_stop: int, nq: int, nk: int, block_q: int, *,
                      causal: bool, window=(-1, -1), key_stop=None, diagonal=None) -> tuple[int, int]:
    """Query tiles that see some key of ``[k_start, k_stop)``: the backward's inner loop.

    Parameters
    ----------
    k_start, k_stop : int
        The key block; columns at or past `nk` are ignored.
    nq, nk : int
        Number of query rows and key columns.
    block_q : int
        Query tile height; tile ``t`` holds rows ``[t * block_q, (t + 1) * block_q)``.
    @rules@

    Returns
    -------
    first, stop : int
        The query tiles ``first <= t < stop`` are exactly those in which some row sees
        some key of the block; ``first == stop`` when no row sees any of them.
    """
    rules = dict(causal=causal, window=window, key_stop=key_stop, diagonal=diagonal)
    # Hidden keys end the block early: a span of them (seen by no row) after keys seen by
    # no row either would otherwise look like a non-empty union.
    k_stop = min(k_stop, nk if key_stop is None else key_stop)
    if k_stop <= k_start:
        return 0, 0
    return _tile_range(visible_query_span, k_start, k_stop, nk, block_q, nq, nk, rules)


@_with_rules_doc
def tile_needs_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, nq: int, nk: int,
                    *, causal: bool, window=(-1, -1), key_stop=None, diagonal=None) -> bool:
    """Whether a tile needs the elementwise mask, i.e. is not wholly visible.

    Only tiles that cross an edge of the causal/window band, or run past the last
    visible key, need it; the bulk of the tiles take the unmasked fast path.

    Parameters
    ----------
    q_start, q_stop : int
        Query rows of the tile; rows at or past `nq` do not exist and are ignored.
    k_start, k_stop : int
        Key columns of the tile; columns at or past `nk` are invisible, so a tile that
        runs past the last key needs the mask.
    nq, nk : int
        Number of query rows and key columns.
    @rules@

    Returns
    -------
    bool
        False exactly when every existing row of the tile sees every column of it.
    """
    # Wholly visible iff the tightest row on each side still covers the tile: the last
    # row has the largest lo, the first row the smallest hi.
    rules = dict(causal=causal, window=window, key_stop=key_stop, diagonal=diagonal)
    _, hi_first = visible_key_span(q_start, nq, nk, **rules)
    lo_last, _ = visible_key_span(_last_row(q_start, q_stop, nq), nq, nk, **rules)
    return bool(k_start < lo_last or k_stop > hi_first)


def block_mask_tiles(block_mask, first: int, stop: int) -> list[int]:
    """The tiles of ``[first, stop)`` that a block-sparse mask leaves on.

    Parameters
    ----------
    block_mask : ndarray, shape (..., n_tiles)
        The block mask's entries along the walked axis for one block of the other axis
        (e.g. ``mask[:, :, query_tile, :]`` when walking key tiles), with any leading
        (batch, head) axes: a tile stays when any of them has it on, and the elementwise
        step hides it for the others.
    first, stop : int
        The tile range from `key_block_range` or `query_block_range`.

    Returns
    -------
    list of int
        The tiles in order; zero blocks are skipped, which is where block sparsity saves
        time.
    """
    if stop <= first:
        return []
    on = np.asarray(block_mask)[..., first:stop].reshape(-1, stop - first).any(axis=0)
    return [first + int(t) for t in np.flatnonzero(on)]
