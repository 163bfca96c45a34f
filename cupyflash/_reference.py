"""NumPy backend: the blockwise FlashAttention-2 algorithm the GPU kernels run.

It serves machines without a GPU and is the reference the kernels are tested against,
so it follows the kernels step by step rather than the shortest NumPy formulation:
query blocks stream key tiles with an online softmax in the forward pass, and the
backward pass recomputes the probabilities tile by tile from the saved log-sum-exp.
No ``Nq x Nk`` matrix is ever formed; extra memory is ``O(B * H * block * (N + d))``.

Batch and heads are vectorised: a tile has shape ``(B, Hk, G, rows, cols)`` with
``G = Hq // Hk`` query heads per key/value head, so grouped-query attention broadcasts
K and V over the group instead of repeating them.

Exponentials are base 2 with ``log2(e)`` folded into the scale, as in the kernels where
``exp2`` is one instruction: ``exp(x) == exp2(x * log2(e))`` exactly in real arithmetic,
so scores, running maxima and probabilities here are the natural-base ones times
``log2(e)``; only the returned LSE is converted back to the natural log.
"""

from __future__ import annotations

import math

import numpy as np

from ._masks import key_block_range, query_block_range, tile_needs_mask, visible

__all__ = ["attention_forward", "attention_backward"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _group(x: np.ndarray, hk: int) -> np.ndarray:
    """View ``(B, Hq, ...)`` as ``(B, Hk, G, ...)``: query head ``h`` uses kv head ``h // G``.

    Splitting one axis in two never needs a copy, whatever the strides, so this stays a
    view of the caller's (possibly transposed) array or of our own output.
    """
    return x.reshape(x.shape[0], hk, x.shape[1] // hk, *x.shape[2:])


def _scores_log2(q_blk, k_tile, scale_log2, rows: tuple[int, int], cols: tuple[int, int],
                 nq: int, nk: int, causal: bool) -> np.ndarray:
    """Scaled scores of one tile in log2 units, ``-inf`` where a key is not visible.

    ``q_blk`` is ``(B, Hk, G, bq, d)``, ``k_tile`` is ``(B, Hk, 1, bk, d)``; returns
    ``(B, Hk, G, bq, bk)``.
    """
    s = (q_blk @ k_tile.swapaxes(-1, -2)) * scale_log2
    if tile_needs_mask(*rows, *cols, nq, nk, causal=causal):
        seen = visible(np.arange(*rows)[:, None], np.arange(*cols)[None, :], nq, nk,
                       causal=causal)
        s = np.where(seen, s, -np.inf)
    return s


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


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                      causal: bool, block_q: int = 128, block_k: int = 128
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention ``softmax(scale * q k^T) v``, computed blockwise.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, Nq, d)
    k : ndarray, shape (B, Hk, Nk, d)
    v : ndarray, shape (B, Hk, Nk, dv)
        All float32 or all float64 (callers upcast float16/bfloat16 to float32), with
        ``Hq % Hk == 0``: query head ``h`` reads kv head ``h // (Hq // Hk)``. Any strides
        (e.g. transposed from ``(B, N, H, d)``); they are only read. Arguments are
        validated by the caller, not here.
    scale : float
        Multiplies the scores before the softmax.
    causal : bool
        Bottom-right aligned causal mask (see `cupyflash._masks`).
    block_q, block_k : int
        Query block and key tile heights; they need not divide the sequence lengths.

    Returns
    -------
    o : ndarray, shape (B, Hq, Nq, dv)
        C-contiguous, in the input dtype. Rows that see no key are 0.
    lse : ndarray, shape (B, Hq, Nq)
        Natural-log log-sum-exp of the scaled scores per row, ``m + log(l)``, in the input
        dtype; ``-inf`` for rows that see no key.
    """
    bsz, hq, nq, _ = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    dtype = q.dtype
    # A NumPy float64 scale would silently promote float32 tiles to float64.
    scale_log2 = dtype.type(scale * _LOG2E)

    qg = _group(q, hk)
    kt, vt = k[:, :, None], v[:, :, None]  # broadcast over the group: never repeated
    o = np.empty((bsz, hq, nq, dv), dtype)
    lse = np.empty((bsz, hq, nq), dtype)
    og, lseg = _group(o, hk), _group(lse, hk)

    for q_start in range(0, nq, block_q):
        q_stop = min(q_start + block_q, nq)
        q_blk = qg[..., q_start:q_stop, :]
        m = np.full(q_blk.shape[:-1], -np.inf, dtype)  # running row max, log2 units
        l = np.zeros(q_blk.shape[:-1], dtype)  # running row sum of exp2(s - m)
        acc = np.zeros(q_blk.shape[:-1] + (dv,), dtype)  # unnormalised output

        first, stop = key_block_range(q_start, q_stop, nq, nk, block_k, causal=causal)
        for t in range(first, stop):
            k_start, k_stop = t * block_k, min((t + 1) * block_k, nk)
            s = _scores_log2(q_blk, kt[..., k_start:k_stop, :], scale_log2,
                             (q_start, q_stop), (k_start, k_stop), nq, nk, causal)
            m_new = np.maximum(m, s.max(axis=-1))
            # A row that has seen no key yet has m_new = -inf, and exp2(-inf - -inf) is
            # NaN; subtracting 0 instead leaves its p = 0 and its (empty) state at 0.
            m_safe = np.where(m_new == -np.inf, dtype.type(0), m_new)
            p = np.exp2(s - m_safe[..., None])
            alpha = np.exp2(m - m_safe)  # rescales what was summed under the old max
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ vt[..., k_start:k_stop, :]
            m = m_new

        # FlashAttention-2 divides by l once here rather than in every tile. l is 0 only
        # for rows that saw no key (the max entry contributes exp2(0) = 1 otherwise).
        empty = l == 0
        l_safe = np.where(empty, dtype.type(1), l)
        og[..., q_start:q_stop, :] = acc / l_safe[..., None]
        lseg[..., q_start:q_stop] = np.where(empty, -np.inf,
                                             m * dtype.type(_LN2) + np.log(l_safe))
    return o, lse


def attention_backward(do: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                       o: np.ndarray, lse: np.ndarray, *, scale: float, causal: bool,
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
    scale, causal, block_q, block_k
        As in `attention_forward` (the block sizes need not match the forward's).

    Returns
    -------
    dq, dk, dv : ndarray
        C-contiguous, in the input dtype, shaped like `q`, `k`, `v`. The gradient of a kv
        head sums the contributions of every query head of its group; rows that see no
        key contribute nothing and get zero dq.
    """
    bsz, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    dtype = q.dtype
    scale_log2 = dtype.type(scale * _LOG2E)

    # D_i = sum_j P_ij dP_ij, the softmax Jacobian's per-row term, equals dO_i . O_i: a
    # cheap pre-pass instead of a reduction over all key tiles.
    delta = _group(np.einsum("bhnd,bhnd->bhn", do, o), hk)
    # P = exp2(s - lse * log2(e)). Rows that saw no key have lse = -inf and s = -inf,
    # where -inf - -inf is NaN; +inf in their place gives exactly P = 0.
    lse_log2 = _group(np.where(lse == -np.inf, np.inf, lse * dtype.type(_LOG2E)), hk)
    qg, dog = _group(q, hk), _group(do, hk)
    # dq gathers from every key block, like the kernels' float32 atomics; scale is
    # applied once at the end, as the kernels do, instead of to every tile.
    dq = np.zeros((bsz, hq, nq, d), dtype)
    dqg = _group(dq, hk)
    dk = np.empty((bsz, hk, nk, d), dtype)
    dv_out = np.empty((bsz, hk, nk, dv), dtype)

    for k_start in range(0, nk, block_k):
        k_stop = min(k_start + block_k, nk)
        k_tile = k[:, :, None, k_start:k_stop, :]
        v_tile = v[:, :, None, k_start:k_stop, :]
        dk_acc = np.zeros((bsz, hk, k_stop - k_start, d), dtype)
        dv_acc = np.zeros((bsz, hk, k_stop - k_start, dv), dtype)

        first, stop = query_block_range(k_start, k_stop, nq, nk, block_q, causal=causal)
        for t in range(first, stop):
            q_start, q_stop = t * block_q, min((t + 1) * block_q, nq)
            q_blk = qg[..., q_start:q_stop, :]
            do_blk = dog[..., q_start:q_stop, :]
            s = _scores_log2(q_blk, k_tile, scale_log2, (q_start, q_stop),
                             (k_start, k_stop), nq, nk, causal)
            p = np.exp2(s - lse_log2[..., q_start:q_stop, None])
            dv_acc += _matmul_at_b(p, do_blk)
            dp = do_blk @ v_tile.swapaxes(-1, -2)
            ds = p * (dp - delta[..., q_start:q_stop, None])
            dqg[..., q_start:q_stop, :] += ds @ k_tile
            dk_acc += _matmul_at_b(ds, q_blk)

        dk[:, :, k_start:k_stop] = dk_acc * dtype.type(scale)
        dv_out[:, :, k_start:k_stop] = dv_acc
    dq *= dtype.type(scale)
    return dq, dk, dv_out
