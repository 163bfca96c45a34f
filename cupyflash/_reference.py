"""NumPy backend: the blockwise FlashAttention-2 algorithm the GPU kernels run, on every core.

It serves machines without a GPU and is the reference the kernels are tested against,
so it follows the kernels step by step rather than the shortest NumPy formulation:
query blocks stream key tiles with an online softmax in the forward pass, and the
backward pass recomputes the probabilities tile by tile from the saved log-sum-exp.
No ``Nq x Nk`` matrix is ever formed.

The work is split as the kernels split it over CTAs, into tasks that a pool of threads
runs (`cupyflash._cpu_threads`; NumPy releases the GIL in its products and loops): in the
forward one task per (batch entry, kv head, query block), in the backward one per (batch
entry, kv head, set of key blocks), each set with its own dQ accumulator, summed in a
fixed order at the end so that results do not depend on which thread ran what. A task
works on tiles of shape ``(G, rows, cols)`` with ``G = Hq // Hk`` query heads per kv
head, so grouped-query attention broadcasts a K/V tile over the group instead of
repeating it. Tiles are sized for a core's L2 cache (`tile_sizes`), not a GPU's shared
memory. Extra memory is a few tiles per thread plus ``O(N d)`` per kv head.

Every option beyond ``causal`` arrives as one `cupyflash._mods.Modifiers` with the
semantics written there. Options that change the lengths of a batch entry give it its
own piece (`_pieces`): one per sequence for varlen, one per batch entry otherwise, each
with its key stop. For one piece and kv head, `_Rules` answers the tile loops' questions
(which tiles, which scores, which dropout mask) so that the loops stay the algorithm of
the papers.

Exponentials are base 2 with ``log2(e)`` folded into the scale, as in the kernels where
``exp2`` is one instruction: ``exp(x) == exp2(x * log2(e))`` exactly in real arithmetic,
so scores, running maxima and probabilities here are the natural-base ones times
``log2(e)``; only the returned LSE is converted back to the natural log. The scale
multiplies each query block once (``rows x d``) rather than each tile of scores.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import _cpu_threads, _mods
from ._masks import (block_mask_tiles, key_block_range, query_block_range, tile_needs_mask,
                     visible)
from ._philox import dropout_keep_mask, dropout_scale

__all__ = ["attention_forward", "attention_backward", "tile_sizes"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Tiles of scores, (bytes, key columns), of the forward and the backward pass, for calls
# without and with a causal or window band, and the bytes of scores a forward step may
# take at once. About a core's L2 on current x86 server cores (1-2 MiB) with the Q, K
# and V rows a task keeps beside it. Tiles are what the band skips or masks: small ones
# waste little along a diagonal. A forward step takes a run of consecutive key tiles as
# one wider tile, so that its products and elementwise passes are few and large. The
# backward's step is one tile, since it keeps two (S and dP). On a 2-core AMD EPYC (1 MiB
# L2 a core; bench/NOTES.md, session 9 and #19 at the end) these ran best: steps of
# 1 MiB over tiles of 256 or 128 columns in the forward (0.8-0.9x the time of 256 x 256
# tiles with a band), and 1 MiB tiles of 512 columns in the dense backward, 256 KiB of
# 256 columns with a band (larger steps there were 0-35% slower).
_TILES = {"forward": {False: (256 * 1024, 256), True: (128 * 1024, 128)},
          "backward": {False: (1024 * 1024, 512), True: (256 * 1024, 256)}}
_FORWARD_STEP_BYTES = 1024 * 1024
# The backward splits a (batch entry, kv head)'s key blocks into sets until there are
# this many tasks per thread: enough to even out uneven tasks, few extra dQ buffers.
_TASKS_PER_THREAD = 2


def tile_sizes(dtype, group: int, banded: bool = False, *, backward: bool = False
               ) -> tuple[int, int]:
    """(query rows, key columns) of a forward or backward tile for ``group`` query heads
    per kv head, for a call with a causal or window band or without (`_TILES`).

    Query blocks take as many rows as fit the tile's bytes of scores for the whole group,
    a multiple of 16 and at least 16.
    """
    budget, cols = _TILES["backward" if backward else "forward"][banded]
    rows = budget // (np.dtype(dtype).itemsize * cols * group)
    return max(16, rows // 16 * 16), cols


@dataclass(frozen=True)
class _Piece:
    """One batch entry (a sequence, for varlen) with its own lengths and key stop."""

    batch: int        # index into the (B, H, N, d) arrays
    rows: slice       # query rows of q, o, lse, do
    keys: slice       # key rows of k, v
    key_stop: int | None
    entry: int        # batch entry of the modifiers: Philox batch index, bias/alibi row


def _pieces(bsz: int, mods: _mods.Modifiers):
    """The pieces of a call: varlen sequences, else the batch entries."""
    if mods.varlen:
        cu_q, cu_k = (np.asarray(c, np.int64) for c in (mods.cu_seqlens_q, mods.cu_seqlens_k))
        for s in range(len(cu_q) - 1):
            if cu_q[s + 1] > cu_q[s]:  # a sequence without queries has nothing to compute
                yield _Piece(0, slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1]),
                             None, s)
        return
    stops = None if mods.seqlens_k is None else np.asarray(mods.seqlens_k, np.int64)
    for b in range(bsz):
        yield _Piece(b, slice(None), slice(None), None if stops is None else int(stops[b]), b)


class _Rules:
    """The modifiers of one piece and kv head, answering the tile loops' questions.

    Tiles are ``(G, rows, cols)`` as in the loops; the compact modifier arrays are sliced
    to the piece's batch entry and the kv head's query heads once, here, as
    ``(G or 1, ...)``.
    """

    def __init__(self, mods: _mods.Modifiers, piece: _Piece, kv_head: int, *, nq: int, nk: int,
                 hq: int, hk: int, scale: float, causal: bool, dtype: np.dtype):
        self.mods, self.piece, self.dtype = mods, piece, dtype
        self.nq, self.nk, self.hq = nq, nk, hq
        group = hq // hk
        self.heads = range(kv_head * group, (kv_head + 1) * group)
        # The band's diagonal in the piece's indices: its own corner, or a streamed chunk
        # pair's place in its problem (`_mods.Modifiers.call_diagonal`).
        self.diagonal = mods.call_diagonal(nq, nk)
        self.span_rules = dict(causal=causal, window=mods.window, key_stop=piece.key_stop,
                               diagonal=self.diagonal)
        self._plain_span = not mods.windowed and piece.key_stop is None
        self.scale_log2 = dtype.type(scale * _LOG2E)
        self.block_mask = self._select(mods.block_mask)
        self.bias = self._select(mods.bias)
        alibi = self._select(mods.alibi_slopes)
        self.alibi = None if alibi is None else np.asarray(alibi, dtype)[:, None, None]

    def _select(self, x):
        """A compact ``(B?, H?, ...)`` array's part for this piece and kv head, as
        ``(G or 1, ...)``: size-1 axes broadcast."""
        if x is None:
            return None
        x = x[self.piece.entry if x.shape[0] > 1 else 0]
        return x[self.heads.start:self.heads.stop] if x.shape[0] > 1 else x

    def tile_sizes(self, block_q: int | None, block_k: int | None, *, backward: bool
                   ) -> tuple[int, int, int]:
        """(query rows, key columns) of a tile and the bytes of scores a forward step
        may take in a run of key tiles (0: one tile)."""
        # A tile is one block of the block-sparse mask, so a tile is skipped or kept whole.
        if self.block_mask is not None:
            return (*self.mods.block_size, 0)
        banded = self.span_rules["causal"] or self.mods.windowed
        default = tile_sizes(self.dtype, len(self.heads), banded, backward=backward)
        # Sizes a caller chose are the steps' too (the tests walk small tiles so).
        step = 0 if backward or block_q or block_k else _FORWARD_STEP_BYTES
        return block_q or default[0], block_k or default[1], step

    def key_tiles(self, q_start: int, q_stop: int, block_k: int, q_tile: int):
        """Key tiles the query tile ``q_tile`` (rows ``[q_start, q_stop)``) visits."""
        first, stop = key_block_range(q_start, q_stop, self.nq, self.nk, block_k,
                                      **self.span_rules)
        if self.block_mask is None:
            return range(first, stop)
        return block_mask_tiles(self.block_mask[:, q_tile, :], first, stop)

    def query_tiles(self, k_start: int, k_stop: int, block_q: int, k_tile: int):
        """Query tiles that see the key tile ``k_tile`` (keys ``[k_start, k_stop)``)."""
        first, stop = query_block_range(k_start, k_stop, self.nq, self.nk, block_q,
                                        **self.span_rules)
        if self.block_mask is None:
            return range(first, stop)
        return block_mask_tiles(self.block_mask[:, :, k_tile], first, stop)

    def scores_log2(self, s, rows: tuple[int, int], cols: tuple[int, int],
                    tiles: tuple[int, int]):
        """Turn ``s``, the products ``(scale * log2(e) * q) . k`` of one tile, into its
        scores in log2 units in place, ``-inf`` where a key is not visible; returns the
        softcap's derivative ``1 - tanh^2`` (None without softcap) for the backward.

        ``tiles`` are the tile's (query, key) block indices in the block mask.
        """
        dtype, softcap = self.dtype, self.mods.softcap
        capped_grad = None
        if softcap > 0:
            t = np.tanh(s * dtype.type(1 / (softcap * _LOG2E)))
            np.multiply(t, dtype.type(softcap * _LOG2E), out=s)
            capped_grad = 1 - t * t
        additive = self._additive(rows, cols)
        if additive is not None:
            s += additive * dtype.type(_LOG2E)
        seen = None
        if self._needs_mask(rows, cols):
            seen = visible(np.arange(*rows)[:, None], np.arange(*cols)[None, :], self.nq,
                           self.nk, **self.span_rules)
        if self.block_mask is not None:
            on = self.block_mask[:, tiles[0], tiles[1]][:, None, None] != 0
            if not on.all():
                seen = on if seen is None else seen & on
        if seen is not None:
            np.copyto(s, -np.inf, where=~seen)
        return capped_grad

    def _needs_mask(self, rows, cols) -> bool:
        """`tile_needs_mask`, answered without its general arithmetic (a tenth of a
        millisecond, a third of a tile's work) for plain and causal spans."""
        if not self._plain_span:
            return tile_needs_mask(*rows, *cols, self.nq, self.nk, **self.span_rules)
        if not self.span_rules["causal"]:
            return False   # tiles end at nk: every key of one is visible to every row
        # Each row sees a prefix at least as long as the row above's: the tile is whole
        # when its first row sees its last key.
        return cols[1] - 1 > rows[0] + self.diagonal

    def _additive(self, rows, cols):
        """Bias plus ALiBi of one tile in natural units, or None without either."""
        total = None
        if self.bias is not None:
            b = self.bias
            b = b[:, slice(*rows) if b.shape[1] > 1 else slice(None),
                  slice(*cols) if b.shape[2] > 1 else slice(None)]
            total = np.asarray(b).astype(self.dtype, copy=False)
        if self.alibi is not None:
            distance = np.abs(np.arange(*rows)[:, None] + self.diagonal
                              - np.arange(*cols)[None, :]).astype(self.dtype)
            term = -self.alibi * distance
            total = term if total is None else total + term
        return total

    def dropout_scale(self, rows: tuple[int, int], cols: tuple[int, int]):
        """``keep * dropout_scale(p)`` (``keep / (1 - p)`` at the drawn p) of one tile,
        ``(G, r, c)``; None without dropout.

        Rows and columns are the problem's: they count from the start of the piece,
        which for varlen is the sequence's own start, as the Philox mapping requires, and
        a streamed chunk pair adds its place in the problem (``row0``, ``key0``).
        """
        p = self.mods.dropout_p
        if p == 0:
            return None
        row0, key0 = self.mods.row0, self.mods.key0
        rows_at, cols_at = np.arange(rows[0] + row0, rows[1] + row0), np.arange(cols[0] + key0, cols[1] + key0)
        keep = np.stack([dropout_keep_mask(self.mods.seed, self.mods.rng_offset, self.piece.entry, h,
                                           rows_at, cols_at, p=p, heads=self.hq)
                         for h in self.heads])
        return keep * self.dtype.type(dropout_scale(p))

    def add_dbias(self, dbias, ds, rows: tuple[int, int], cols: tuple[int, int]):
        """Add a tile's dS, ``(G, r, c)``, into the compact bias gradient, summed over
        the axes the bias broadcasts over."""
        e = self.piece.entry if dbias.shape[0] > 1 else 0
        target = dbias[e:e + 1,
                       slice(self.heads.start, self.heads.stop) if dbias.shape[1] > 1 else slice(None),
                       slice(*rows) if dbias.shape[2] > 1 else slice(None),
                       slice(*cols) if dbias.shape[3] > 1 else slice(None)]
        ds = ds[None]
        for axis, n in enumerate(target.shape):
            if n == 1 and ds.shape[axis] > 1:
                ds = ds.sum(axis=axis, keepdims=True)
        target += ds


def _runs(tiles, most: int):
    """Runs of consecutive indices in ``tiles`` (ascending), each at most ``most`` long,
    as ``(first, stop)``."""
    run = None
    for t in tiles:
        if run is not None and t == run[1] and run[1] - run[0] < most:
            run[1] += 1
            continue
        if run is not None:
            yield tuple(run)
        run = [t, t + 1]
    if run is not None:
        yield tuple(run)


def _run_length(step_bytes: int, tile_elements: int, dtype) -> int:
    """Tiles of ``tile_elements`` scores a step of ``step_bytes`` takes (at least 1)."""
    return max(1, step_bytes // (tile_elements * np.dtype(dtype).itemsize))


def _units(q, k, mods, *, scale, causal, block_q, block_k, backward):
    """(piece, kv head, rules, (block_q, block_k, step bytes)) of every batch entry and
    kv head of a call, for the forward or the backward pass."""
    hq, hk = q.shape[1], k.shape[1]
    for piece in _pieces(q.shape[0], mods):
        nq = len(range(q.shape[2])[piece.rows])
        nk = len(range(k.shape[2])[piece.keys])
        for g in range(hk):
            rules = _Rules(mods, piece, g, nq=nq, nk=nk, hq=hq, hk=hk, scale=scale,
                           causal=causal, dtype=q.dtype)
            yield piece, g, rules, rules.tile_sizes(block_q, block_k, backward=backward)


def _rows_of(x, piece: _Piece, rules: _Rules):
    """The ``(G, n, ...)`` part of a ``(B, Hq, N, ...)`` array that a piece and kv head own."""
    return x[piece.batch, rules.heads.start:rules.heads.stop, piece.rows]


def _keys_of(x, piece: _Piece, kv_head: int):
    """The ``(n, ...)`` part of a ``(B, Hk, N, ...)`` array that a piece and kv head own."""
    return x[piece.batch, kv_head, piece.keys]


class _Workspace:
    """A task's tile buffers, allocated once: a product into a fresh array of a tile's
    size (up to 1 MiB) can cost page faults on every call; on the 2-core EPYC such products
    ran at about half their rate inside the backward (bench/NOTES.md, #19)."""

    def __init__(self, dtype, sizes: dict[str, int]):
        self._flat = {name: np.empty(n, dtype) for name, n in sizes.items()}

    def __call__(self, name: str, *shape: int) -> np.ndarray:
        """A C-contiguous ``shape`` view of buffer ``name``."""
        return self._flat[name][:math.prod(shape)].reshape(shape)


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                      causal: bool, mods: _mods.Modifiers = _mods.NONE,
                      block_q: int | None = None, block_k: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
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
    block_q, block_k : int, optional
        Query block and key tile heights (default: `tile_sizes`); they need not divide
        the sequence lengths. With a block mask, its block size is used instead.

    Returns
    -------
    o : ndarray, shape (B, Hq, Nq, dv)
        C-contiguous, in the input dtype. Rows that see no key are 0.
    lse : ndarray, shape (B, Hq, Nq)
        Natural-log log-sum-exp of the scores per row (before dropout), in the input
        dtype; ``-inf`` for rows that see no key.

    Notes
    -----
    Runs on `cupyflash._cpu_threads.num_threads` threads (``$CUPYFLASH_NUM_THREADS``).
    """
    bsz, hq, nq, _ = q.shape
    o = np.zeros((bsz, hq, nq, v.shape[3]), q.dtype)   # zero: rows of no varlen piece stay so
    lse = np.full((bsz, hq, nq), -np.inf, q.dtype)
    tasks = []
    for piece, g, rules, (bq, bk, step) in _units(q, k, mods, scale=scale, causal=causal,
                                                  block_q=block_q, block_k=block_k,
                                                  backward=False):
        qp, op, lsep = (_rows_of(x, piece, rules) for x in (q, o, lse))
        kp, vp = (_keys_of(x, piece, g) for x in (k, v))
        for q_tile, q_start in enumerate(range(0, qp.shape[1], bq)):
            q_stop = min(q_start + bq, qp.shape[1])
            key_tiles = rules.key_tiles(q_start, q_stop, bk, q_tile)
            most = _run_length(step, len(rules.heads) * (q_stop - q_start) * bk, q.dtype)
            tasks.append((len(key_tiles), functools.partial(
                _forward_block, qp[:, q_start:q_stop], kp, vp, op[:, q_start:q_stop],
                lsep[:, q_start:q_stop], rules, (q_start, q_stop), q_tile, key_tiles, bk,
                most)))
    # Longest first: causal blocks differ in length, and the threads take tasks in order.
    tasks.sort(key=lambda t: -t[0])
    _cpu_threads.run([task for _, task in tasks])
    return o, lse


def _forward_block(q, k, v, o, lse, rules: _Rules, rows: tuple[int, int], q_tile: int,
                   key_tiles, block_k: int, most: int) -> None:
    """The FlashAttention-2 forward of query block ``q_tile``, ``q`` ``(G, r, d)``, of one
    kv head (``k``, ``v``: ``(nk, d)``), writing its ``o`` and ``lse`` views; a step
    takes up to ``most`` consecutive key tiles."""
    dtype = q.dtype
    qs = q * rules.scale_log2
    m = np.full(q.shape[:-1], -np.inf, dtype)  # running row max, log2 units
    l = np.zeros(q.shape[:-1], dtype)  # running row sum of exp2(s - m)
    acc = np.zeros(q.shape[:-1] + (v.shape[1],), dtype)  # unnormalised output
    g, r = q.shape[:2]
    work = _Workspace(dtype, dict(s=g * r * block_k * most, pv=acc.size))

    for first, stop in _runs(key_tiles, most):
        k_start, k_stop = first * block_k, min(stop * block_k, k.shape[0])
        cols = (k_start, k_stop)
        s = np.matmul(qs, k[k_start:k_stop].T, out=work("s", g, r, k_stop - k_start))
        rules.scores_log2(s, rows, cols, (q_tile, first))  # runs are one tile with a block mask
        m_new = np.maximum(m, s.max(axis=-1))
        # A row that has seen no key yet has m_new = -inf, and exp2(-inf - -inf) is
        # NaN; subtracting 0 instead leaves its p = 0 and its (empty) state at 0.
        m_safe = np.where(m_new == -np.inf, dtype.type(0), m_new)
        s -= m_safe[..., None]
        p = np.exp2(s, out=s)
        alpha = np.exp2(m - m_safe)  # rescales what was summed under the old max
        l *= alpha
        l += p.sum(axis=-1)  # the softmax sums every p: LSE before dropout
        dropped = rules.dropout_scale(rows, cols)
        if dropped is not None:
            p *= dropped
        acc *= alpha[..., None]
        acc += np.matmul(p, v[k_start:k_stop], out=work("pv", *acc.shape))
        m = m_new

    # FlashAttention-2 divides by l once here rather than in every tile. l is 0 only
    # for rows that saw no key (the max entry contributes exp2(0) = 1 otherwise).
    empty = l == 0
    l_safe = np.where(empty, dtype.type(1), l)
    o[...] = acc / l_safe[..., None]
    lse[...] = np.where(empty, -np.inf, m * dtype.type(_LN2) + np.log(l_safe))


def attention_backward(do: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, *, scale: float, causal: bool,
                       mods: _mods.Modifiers = _mods.NONE, dbias: np.ndarray | None = None,
                       block_q: int | None = None, block_k: int | None = None,
                       dlse: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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

    Notes
    -----
    The sums are taken in an order fixed by the problem and the thread count, never by
    the threads' timing, so a call repeated gives the same bits. With a bias that
    broadcasts over batch entries, kv heads or keys, tasks would add into the same part
    of ``dbias``; such calls run on one thread to keep that order.
    """
    bsz, hq = q.shape[:2]
    hk = k.shape[1]
    dtype = q.dtype
    dq = np.zeros(q.shape, dtype)
    dk = np.zeros(k.shape, dtype)
    dv = np.zeros(v.shape, dtype)
    # D_i = sum_j P_ij dP_ij, the softmax Jacobian's per-row term, equals dO_i . O_i (with
    # dropout too, as O is the dropped output): a cheap pre-pass instead of a reduction
    # over all key tiles.
    delta = np.einsum("bhnd,bhnd->bhn", do, o)
    if dlse is not None:
        # A loss that reads the LSE too: d lse_i / d s_ij = P_ij, so dS_ij = P_ij (dP_ij -
        # D_i + dlse_i), the same form with D_i - dlse_i.
        delta -= dlse
    # P = exp2(s - lse * log2(e)). Rows that saw no key have lse = -inf and s = -inf,
    # where -inf - -inf is NaN; +inf in their place gives exactly P = 0.
    lse_log2 = np.where(lse == -np.inf, np.inf, lse * dtype.type(_LOG2E))

    shared_dbias = dbias is not None and (dbias.shape[0] < bsz or dbias.shape[1] < hk
                                          or dbias.shape[3] == 1)
    threads = 1 if shared_dbias else _cpu_threads.num_threads()
    units = list(_units(q, k, mods, scale=scale, causal=causal, block_q=block_q,
                        block_k=block_k, backward=True))
    sets = 1 if threads == 1 else -(-_TASKS_PER_THREAD * threads // max(len(units), 1))
    tasks, dq_parts = [], []
    for piece, g, rules, (bq, bk, _) in units:
        rows_in = [_rows_of(x, piece, rules) for x in (q, do, lse_log2, delta, dq)]
        # q with the scale (and log2 e) folded in, once per unit: every key tile reads it.
        rows_in[0] = rows_in[0] * rules.scale_log2
        keys_in = [_keys_of(x, piece, g) for x in (k, v, dk, dv)]
        n_key_tiles = -(-keys_in[0].shape[0] // bk)
        unit_sets = min(sets, n_key_tiles) or 1
        # The first set adds into dq itself; the others into their own buffers, added to
        # it in set order once every task is done.
        targets = [rows_in[4]] + [np.zeros_like(rows_in[4]) for _ in range(unit_sets - 1)]
        dq_parts.append(targets)
        for i, target in enumerate(targets):
            # Interleaved, so that each set gets early and late (causal: short and long)
            # key blocks alike.
            key_tiles = range(i, n_key_tiles, unit_sets)
            cost = sum(len(rules.query_tiles(t * bk, min((t + 1) * bk, keys_in[0].shape[0]),
                                             bq, t)) for t in key_tiles)
            tasks.append((cost, functools.partial(
                _backward_keys, *rows_in[:4], target, *keys_in, rules, key_tiles, bq, bk,
                dbias)))
    tasks.sort(key=lambda t: -t[0])
    _cpu_threads.run([task for _, task in tasks], threads=threads)
    for first, *rest in dq_parts:
        for part in rest:
            first += part
    dq *= dtype.type(scale)
    return dq, dk, dv


def _sum_at_b(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``sum_g a[g]^T b[g]`` of ``(G, r, m)`` and ``(G, r, n)`` into ``out`` ``(m, n)``:
    merging ``(G, r)`` into one axis makes the sum over the query heads of a kv
    group part of a single product, which is how a kv head's dK and dV collect every query
    head that reads it."""
    return np.matmul(a.reshape(-1, a.shape[-1]).T, b.reshape(-1, b.shape[-1]), out=out)


def _backward_keys(q, do, lse_log2, delta, dq, k, v, dk, dv, rules: _Rules, key_tiles,
                   block_q: int, block_k: int, dbias) -> None:
    """The FlashAttention-2 backward of the key tiles ``key_tiles`` of one kv head.

    ``q`` (scaled by ``scale * log2(e)``), ``do``, ``lse_log2``, ``delta`` are the
    ``(G, nq, ...)`` rows of the kv head's query heads; ``dq`` ``(G, nq, d)`` receives
    this task's unscaled dQ terms; ``k``, ``v`` are ``(nk, ...)``, and ``dk``, ``dv`` are
    written for the task's key tiles.
    """
    (g, nq, d), (nk, dv_dim) = q.shape, v.shape
    dtype = q.dtype
    work = _Workspace(dtype, dict(s=g * block_q * block_k, dp=g * block_q * block_k,
                                  dq=g * block_q * d, dk=block_k * d, dv=block_k * dv_dim))
    for k_tile in key_tiles:
        k_start, k_stop = k_tile * block_k, min((k_tile + 1) * block_k, nk)
        c = k_stop - k_start
        k_blk, v_blk = k[k_start:k_stop], v[k_start:k_stop]
        dk_acc = np.zeros((c, d), dtype)
        dv_acc = np.zeros((c, dv_dim), dtype)

        for t in rules.query_tiles(k_start, k_stop, block_q, k_tile):
            q_start, q_stop = t * block_q, min((t + 1) * block_q, nq)
            r = q_stop - q_start
            rows, cols = (q_start, q_stop), (k_start, k_stop)
            qs = q[:, q_start:q_stop]
            do_blk = do[:, q_start:q_stop]
            s = np.matmul(qs, k_blk.T, out=work("s", g, r, c))
            capped_grad = rules.scores_log2(s, rows, cols, (t, k_tile))
            s -= lse_log2[:, q_start:q_stop, None]
            p = np.exp2(s, out=s)
            dp = np.matmul(do_blk, v_blk.T, out=work("dp", g, r, c))
            dropped = rules.dropout_scale(rows, cols)
            if dropped is None:
                dv_acc += _sum_at_b(p, do_blk, work("dv", c, dv_dim))
            else:   # in place: `dropped` is this tile's own, not needed after
                dp *= dropped
                dv_acc += _sum_at_b(np.multiply(dropped, p, out=dropped), do_blk, work("dv", c, dv_dim))
            dp -= delta[:, q_start:q_stop, None]
            ds = np.multiply(dp, p, out=dp)  # d loss / d score
            if dbias is not None:
                rules.add_dbias(dbias, ds, rows, cols)
            if capped_grad is not None:
                ds *= capped_grad
            dq[:, q_start:q_stop] += np.matmul(ds, k_blk, out=work("dq", g, r, d))
            dk_acc += _sum_at_b(ds, qs, work("dk", c, d))

        # qs carries scale * log2(e), so ln(2) leaves dK = scale * dS^T Q.
        dk[k_start:k_stop] = dk_acc * dtype.type(_LN2)
        dv[k_start:k_stop] = dv_acc
