"""NumPy backend: the blockwise FlashAttention-2 algorithm the GPU kernels run.

It serves machines without a GPU and is the reference the kernels are tested against,
so it follows the kernels step by step rather than the shortest NumPy formulation:
query blocks stream key tiles with an online softmax in the forward pass, and the
backward pass recomputes the probabilities tile by tile from the saved log-sum-exp.
No ``Nq x Nk`` matrix is ever formed; extra memory is ``O(B * H * block * (N + d))``.

Batch and heads are vectorised: a tile has shape ``(B, Hk, G, rows, cols)`` with
``G = Hq // Hk`` query heads per key/value head, so grouped-query attention broadcasts
K and V over the group instead of repeating them.

Every option beyond ``causal`` arrives as one `cupyflash._mods.Modifiers` with the
semantics written there. Options that change the lengths of a batch entry split the
call into pieces that share them (`_pieces`): one per sequence for varlen, one per batch
entry for key padding, else the whole batch at once. Within a piece, `_Rules` answers
the tile loops' questions (which tiles, which scores, which dropout mask) so that the
loops stay the algorithm of the papers.

Exponentials are base 2 with ``log2(e)`` folded into the scale, as in the kernels where
``exp2`` is one instruction: ``exp(x) == exp2(x * log2(e))`` exactly in real arithmetic,
so scores, running maxima and probabilities here are the natural-base ones times
``log2(e)``; only the returned LSE is converted back to the natural log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _mods
from ._masks import (block_mask_tiles, key_block_range, query_block_range, tile_needs_mask,
                     visible)
from ._philox import dropout_keep_mask, dropout_scale

__all__ = ["attention_forward", "attention_backward"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _group(x: np.ndarray, hk: int) -> np.ndarray:
    """View ``(B, Hq, ...)`` as ``(B, Hk, G, ...)``: query head ``h`` uses kv head ``h // G``.

    Splitting one axis in two never needs a copy, whatever the strides, so this stays a
    view of the caller's (possibly transposed) array or of our own output.
    """
    return x.reshape(x.shape[0], hk, x.shape[1] // hk, *x.shape[2:])


def _per_head(x: np.ndarray, hk: int) -> np.ndarray:
    """A compact ``(B?, H?, ...)`` modifier array with ``H?`` in {1, Hq}, viewed as
    ``(B?, Hk, G, ...)`` or ``(B?, 1, 1, ...)`` so that it broadcasts against a tile."""
    return x[:, :, None] if x.shape[1] == 1 else _group(x, hk)


def _entries(x, entries: range):
    """The rows of a compact modifier array that belong to batch entries ``entries``
    (all of a size-1 batch axis, which broadcasts)."""
    return x if x is None or x.shape[0] == 1 else x[entries.start:entries.stop]


def _matmul_at_b(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a^T b`` summed over the rows of a tile and over the query heads of a kv group.

    ``(B, Hk, G, r, m)`` and ``(B, Hk, G, r, n)`` give ``(B, Hk, m, n)``: merging
    ``(G, r)`` into one axis makes the group sum part of a single matrix product, which
    is how a kv head's dK and dV collect every query head that reads it.
    """
    bsz, hk, g, r = a.shape[:4]
    a2 = a.reshape(bsz, hk, g * r, a.shape[-1])
    b2 = b.reshape(bsz, hk, g * r, b.shape[-1])
    return a2.swapaxes(-1, -2) @ b2


@dataclass(frozen=True)
class _Piece:
    """Part of a call whose batch entries share their lengths and key stop."""

    batch: slice      # of the (B, H, N, d) arrays
    rows: slice       # query rows of q, o, lse, do
    keys: slice       # key rows of k, v
    key_stop: int | None
    entries: range    # batch entries of the modifiers: Philox batch index, bias/alibi row


def _pieces(bsz: int, mods: _mods.Modifiers):
    """The pieces of a call: varlen sequences, key-padded batch entries, or the batch."""
    if mods.varlen:
        cu_q, cu_k = (np.asarray(c, np.int64) for c in (mods.cu_seqlens_q, mods.cu_seqlens_k))
        for s in range(len(cu_q) - 1):
            if cu_q[s + 1] > cu_q[s]:  # a sequence without queries has nothing to compute
                yield _Piece(slice(0, 1), slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1]),
                             None, range(s, s + 1))
    elif mods.seqlens_k is not None:
        for b, stop in enumerate(np.asarray(mods.seqlens_k, np.int64)):
            yield _Piece(slice(b, b + 1), slice(None), slice(None), int(stop), range(b, b + 1))
    else:
        yield _Piece(slice(None), slice(None), slice(None), None, range(bsz))


class _Rules:
    """The modifiers of one piece, answering the tile loops' questions.

    Tiles are ``(B, Hk, G, rows, cols)`` as in the loops; the compact modifier arrays are
    sliced to the piece's batch entries and viewed per kv group once, here.
    """

    def __init__(self, mods: _mods.Modifiers, piece: _Piece, *, nq: int, nk: int, hq: int,
                 hk: int, scale: float, causal: bool, dtype: np.dtype):
        self.mods, self.piece, self.dtype = mods, piece, dtype
        self.nq, self.nk, self.hq, self.hk = nq, nk, hq, hk
        self.span_rules = dict(causal=causal, window=mods.window, key_stop=piece.key_stop)
        self.scale = scale
        self.scale_log2 = dtype.type(scale * _LOG2E)
        mask = _entries(mods.block_mask, piece.entries)
        self.block_mask = None if mask is None else _per_head(np.asarray(mask), hk)
        self.bias = _entries(mods.bias, piece.entries)
        alibi = _entries(mods.alibi_slopes, piece.entries)
        self.alibi = None if alibi is None else _per_head(
            np.asarray(alibi, dtype)[:, :, None, None], hk)

    def tile_sizes(self, block_q: int, block_k: int) -> tuple[int, int]:
        # A tile is one block of the block-sparse mask, so a tile is skipped or kept whole.
        return self.mods.block_size if self.block_mask is not None else (block_q, block_k)

    def key_tiles(self, q_start: int, q_stop: int, block_k: int, q_tile: int):
        """Key tiles the query tile ``q_tile`` (rows ``[q_start, q_stop)``) visits."""
        first, stop = key_block_range(q_start, q_stop, self.nq, self.nk, block_k,
                                      **self.span_rules)
        if self.block_mask is None:
            return range(first, stop)
        return block_mask_tiles(self.block_mask[..., q_tile, :], first, stop)

    def query_tiles(self, k_start: int, k_stop: int, block_q: int, k_tile: int):
        """Query tiles that see the key tile ``k_tile`` (keys ``[k_start, k_stop)``)."""
        first, stop = query_block_range(k_start, k_stop, self.nq, self.nk, block_q,
                                        **self.span_rules)
        if self.block_mask is None:
            return range(first, stop)
        return block_mask_tiles(self.block_mask[..., k_tile], first, stop)

    def scores_log2(self, q_blk, k_tile, rows: tuple[int, int], cols: tuple[int, int],
                    tiles: tuple[int, int]):
        """Scores of one tile in log2 units, ``-inf`` where a key is not visible, and the
        softcap's derivative ``1 - tanh^2`` (None without softcap) for the backward.

        ``tiles`` are the tile's (query, key) block indices in the block mask.
        """
        dtype, softcap = self.dtype, self.mods.softcap
        qk = q_blk @ k_tile.swapaxes(-1, -2)
        capped_grad = None
        if softcap > 0:
            t = np.tanh(qk * dtype.type(self.scale / softcap))
            s = t * dtype.type(softcap * _LOG2E)
            capped_grad = 1 - t * t
        else:
            s = qk * self.scale_log2
        additive = self._additive(rows, cols)
        if additive is not None:
            s = s + additive * dtype.type(_LOG2E)
        seen = None
        if tile_needs_mask(*rows, *cols, self.nq, self.nk, **self.span_rules):
            seen = visible(np.arange(*rows)[:, None], np.arange(*cols)[None, :], self.nq,
                           self.nk, **self.span_rules)
        if self.block_mask is not None:
            on = self.block_mask[..., tiles[0], tiles[1]][..., None, None] != 0
            if not on.all():
                seen = on if seen is None else seen & on
        if seen is not None:
            s = np.where(seen, s, -np.inf)
        return s, capped_grad

    def _additive(self, rows, cols):
        """Bias plus ALiBi of one tile in natural units, or None without either."""
        total = None
        if self.bias is not None:
            b = self.bias
            b = b[:, :, slice(*rows) if b.shape[2] > 1 else slice(None),
                  slice(*cols) if b.shape[3] > 1 else slice(None)]
            total = _per_head(np.asarray(b), self.hk).astype(self.dtype, copy=False)
        if self.alibi is not None:
            distance = np.abs(np.arange(*rows)[:, None] + (self.nk - self.nq)
                              - np.arange(*cols)[None, :]).astype(self.dtype)
            term = -self.alibi * distance
            total = term if total is None else total + term
        return total

    def dropout_scale(self, rows: tuple[int, int], cols: tuple[int, int]):
        """``keep * dropout_scale(p)`` (``keep / (1 - p)`` at the drawn p) of one tile, ``(B, Hk, G, r, c)``; None without dropout.

        Rows and columns count from the start of the piece, which for varlen is the
        sequence's own start, as the Philox mapping requires.
        """
        p = self.mods.dropout_p
        if p == 0:
            return None
        keep = np.stack([
            np.stack([dropout_keep_mask(self.mods.seed, self.mods.rng_offset, b, h,
                                        np.arange(*rows), np.arange(*cols), p=p, heads=self.hq)
                      for h in range(self.hq)])
            for b in self.piece.entries])
        return _group(keep * self.dtype.type(dropout_scale(p)), self.hk)

    def add_dbias(self, dbias, ds, rows: tuple[int, int], cols: tuple[int, int]):
        """Add a tile's dS, ``(B, Hk, G, r, c)``, into the compact bias gradient, summed
        over the axes the bias broadcasts over."""
        ds = ds.reshape(ds.shape[0], self.hq, *ds.shape[3:])
        target = _entries(dbias, self.piece.entries)
        for axis, n in enumerate(target.shape):
            if n == 1 and ds.shape[axis] > 1:
                ds = ds.sum(axis=axis, keepdims=True)
        target[:, :, slice(*rows) if target.shape[2] > 1 else slice(None),
               slice(*cols) if target.shape[3] > 1 else slice(None)] += ds


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                      causal: bool, mods: _mods.Modifiers = _mods.NONE, block_q: int = 128,
                      block_k: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention ``softmax(scale * q k^T) v`` with modifiers, computed blockwise.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, Nq, d)
    k : ndarray, shape (B, Hk, Nk, d)
    v : ndarray, shape (B, Hk, Nk, dv)
        All float32 or all float64 (callers upcast float16/bfloat16 to float32), with
        ``Hq % Hk == 0``: query head ``h`` reads kv head ``h // (Hq // Hk)``. Any strides
        (e.g. transposed from ``(B, N, H, d)``); they are only read. For varlen, ``B = 1``
        and N is the total of the packed sequences. Arguments are validated by the
        caller, not here.
    scale : float
        Multiplies the scores before the softmax.
    causal : bool
        Bottom-right aligned causal mask (see `cupyflash._masks`).
    mods : Modifiers
        Every other option, in the compact form of `cupyflash._mods` (NumPy arrays).
    block_q, block_k : int
        Query block and key tile heights; they need not divide the sequence lengths.
        With a block mask, its block size is used instead.

    Returns
    -------
    o : ndarray, shape (B, Hq, Nq, dv)
        C-contiguous, in the input dtype. Rows that see no key are 0.
    lse : ndarray, shape (B, Hq, Nq)
        Natural-log log-sum-exp of the scores per row (before dropout), in the input
        dtype; ``-inf`` for rows that see no key.
    """
    bsz, hq, nq, _ = q.shape
    dv = v.shape[3]
    o = np.zeros((bsz, hq, nq, dv), q.dtype)   # zero: rows of no varlen piece stay so
    lse = np.full((bsz, hq, nq), -np.inf, q.dtype)
    for piece in _pieces(bsz, mods):
        views = (x[piece.batch, :, piece.rows] for x in (q, o, lse))
        qp, op, lsep = views
        kp, vp = (x[piece.batch, :, piece.keys] for x in (k, v))
        rules = _Rules(mods, piece, nq=qp.shape[2], nk=kp.shape[2], hq=hq, hk=k.shape[1],
                       scale=scale, causal=causal, dtype=q.dtype)
        _forward_piece(qp, kp, vp, op, lsep, rules, *rules.tile_sizes(block_q, block_k))
    return o, lse


def _forward_piece(q, k, v, o, lse, rules: _Rules, block_q: int, block_k: int) -> None:
    """The FlashAttention-2 forward over one piece, writing ``o`` and ``lse`` views."""
    nq, nk, hk = q.shape[2], k.shape[2], k.shape[1]
    dtype = q.dtype
    qg = _group(q, hk)
    kt, vt = k[:, :, None], v[:, :, None]  # broadcast over the group: never repeated
    og, lseg = _group(o, hk), _group(lse, hk)

    for q_tile, q_start in enumerate(range(0, nq, block_q)):
        q_stop = min(q_start + block_q, nq)
        q_blk = qg[..., q_start:q_stop, :]
        m = np.full(q_blk.shape[:-1], -np.inf, dtype)  # running row max, log2 units
        l = np.zeros(q_blk.shape[:-1], dtype)  # running row sum of exp2(s - m)
        acc = np.zeros(q_blk.shape[:-1] + (v.shape[3],), dtype)  # unnormalised output

        for t in rules.key_tiles(q_start, q_stop, block_k, q_tile):
            k_start, k_stop = t * block_k, min((t + 1) * block_k, nk)
            rows, cols = (q_start, q_stop), (k_start, k_stop)
            s, _ = rules.scores_log2(q_blk, kt[..., k_start:k_stop, :], rows, cols, (q_tile, t))
            m_new = np.maximum(m, s.max(axis=-1))
            # A row that has seen no key yet has m_new = -inf, and exp2(-inf - -inf) is
            # NaN; subtracting 0 instead leaves its p = 0 and its (empty) state at 0.
            m_safe = np.where(m_new == -np.inf, dtype.type(0), m_new)
            p = np.exp2(s - m_safe[..., None])
            alpha = np.exp2(m - m_safe)  # rescales what was summed under the old max
            l = alpha * l + p.sum(axis=-1)  # the softmax sums every p: LSE before dropout
            dropped = rules.dropout_scale(rows, cols)
            if dropped is not None:
                p = p * dropped
            acc = alpha[..., None] * acc + p @ vt[..., k_start:k_stop, :]
            m = m_new

        # FlashAttention-2 divides by l once here rather than in every tile. l is 0 only
        # for rows that saw no key (the max entry contributes exp2(0) = 1 otherwise).
        empty = l == 0
        l_safe = np.where(empty, dtype.type(1), l)
        og[..., q_start:q_stop, :] = acc / l_safe[..., None]
        lseg[..., q_start:q_stop] = np.where(empty, -np.inf,
                                             m * dtype.type(_LN2) + np.log(l_safe))


def attention_backward(do: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, *, scale: float, causal: bool,
                       mods: _mods.Modifiers = _mods.NONE, dbias: np.ndarray | None = None,
                       block_q: int = 128, block_k: int = 128
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of `attention_forward` by recomputation, as in FlashAttention-2.

    Parameters
    ----------
    do : ndarray, shape (B, Hq, Nq, dv)
        Gradient of the loss with respect to the output.
    q, k, v : ndarray
        The forward inputs, with the shapes, dtypes and strides `attention_forward`
        accepts; only read.
    o, lse : ndarray
        The forward's output and log-sum-exp.
    scale, causal, mods, block_q, block_k
        As in `attention_forward` (the block sizes need not match the forward's).
    dbias : ndarray, optional
        The compact bias gradient ``(Bb, Hb, Nqb, Nkb)`` to add ``dS`` into (summed over
        the axes the bias broadcasts over); zero-initialised by the caller.

    Returns
    -------
    dq, dk, dv : ndarray
        C-contiguous, in the input dtype, shaped like `q`, `k`, `v`. The gradient of a kv
        head sums the contributions of every query head of its group; rows that see no
        key contribute nothing and get zero dq.
    """
    bsz, hq = q.shape[:2]
    dq = np.zeros(q.shape, q.dtype)
    dk = np.zeros(k.shape, k.dtype)
    dv = np.zeros(v.shape, v.dtype)
    for piece in _pieces(bsz, mods):
        row_views = [x[piece.batch, :, piece.rows] for x in (do, q, o, lse, dq)]
        key_views = [x[piece.batch, :, piece.keys] for x in (k, v, dk, dv)]
        rules = _Rules(mods, piece, nq=row_views[1].shape[2], nk=key_views[0].shape[2],
                       hq=hq, hk=k.shape[1], scale=scale, causal=causal, dtype=q.dtype)
        _backward_piece(*row_views, *key_views, rules, dbias,
                        *rules.tile_sizes(block_q, block_k))
    return dq, dk, dv


def _backward_piece(do, q, o, lse, dq, k, v, dk, dv, rules: _Rules, dbias, block_q: int,
                    block_k: int) -> None:
    """The FlashAttention-2 backward over one piece, writing the gradient views."""
    nq, nk, hk = q.shape[2], k.shape[2], k.shape[1]
    dtype = q.dtype
    # D_i = sum_j P_ij dP_ij, the softmax Jacobian's per-row term, equals dO_i . O_i (with
    # dropout too, as O is the dropped output): a cheap pre-pass instead of a reduction
    # over all key tiles.
    delta = _group(np.einsum("bhnd,bhnd->bhn", do, o), hk)
    # P = exp2(s - lse * log2(e)). Rows that saw no key have lse = -inf and s = -inf,
    # where -inf - -inf is NaN; +inf in their place gives exactly P = 0.
    lse_log2 = _group(np.where(lse == -np.inf, np.inf, lse * dtype.type(_LOG2E)), hk)
    qg, dog = _group(q, hk), _group(do, hk)
    # dq gathers from every key block, like the kernels' float32 atomics; scale is
    # applied once at the end, as the kernels do, instead of to every tile.
    dqg = _group(dq, hk)

    for k_tile, k_start in enumerate(range(0, nk, block_k)):
        k_stop = min(k_start + block_k, nk)
        k_blk = k[:, :, None, k_start:k_stop, :]
        v_blk = v[:, :, None, k_start:k_stop, :]
        dk_acc = np.zeros((*k_blk.shape[:2], k_stop - k_start, k.shape[3]), dtype)
        dv_acc = np.zeros((*v_blk.shape[:2], k_stop - k_start, v.shape[3]), dtype)

        for t in rules.query_tiles(k_start, k_stop, block_q, k_tile):
            q_start, q_stop = t * block_q, min((t + 1) * block_q, nq)
            rows, cols = (q_start, q_stop), (k_start, k_stop)
            q_blk = qg[..., q_start:q_stop, :]
            do_blk = dog[..., q_start:q_stop, :]
            s, capped_grad = rules.scores_log2(q_blk, k_blk, rows, cols, (t, k_tile))
            p = np.exp2(s - lse_log2[..., q_start:q_stop, None])
            dp = do_blk @ v_blk.swapaxes(-1, -2)
            dropped = rules.dropout_scale(rows, cols)
            if dropped is None:
                dv_acc += _matmul_at_b(p, do_blk)
            else:
                dv_acc += _matmul_at_b(p * dropped, do_blk)
                dp = dp * dropped
            ds = p * (dp - delta[..., q_start:q_stop, None])  # d loss / d score
            if dbias is not None:
                rules.add_dbias(dbias, ds, rows, cols)
            if capped_grad is not None:
                ds = ds * capped_grad
            dqg[..., q_start:q_stop, :] += ds @ k_blk
            dk_acc += _matmul_at_b(ds, q_blk)

        dk[:, :, k_start:k_stop] = dk_acc * dtype.type(rules.scale)
        dv[:, :, k_start:k_stop] = dv_acc
    dq *= dtype.type(rules.scale)
