"""Naive float64 attention: the oracle every backend is tested against.

It materialises the full score matrix and uses SciPy's softmax and logsumexp, sharing no
code with cupyflash: the visibility rules (causal, window, key padding, block-sparse) and
the score modifiers (softcap, bias, ALiBi) are written here afresh from the formulas of
the `cupyflash._mods` docstring, so a bug in the library's blockwise algorithm or mask
rules cannot hide in both. Dropout takes an explicit keep mask (tests build it with
`cupyflash._philox`, the one shared piece, itself tested against known answers). Varlen
is not here: a packed batch is checked against one oracle call per sequence. Only for
small shapes: memory is ``O(B * Hq * Nq * Nk)``.

Shapes follow `cupyflash._reference`: q ``(B, Hq, Nq, d)``, k ``(B, Hk, Nk, d)``,
v ``(B, Hk, Nk, dv)`` with ``Hq % Hk == 0`` (query head ``h`` reads kv head
``h // (Hq // Hk)``). Inputs of any float dtype are upcast; results are float64.

Options (all keyword, all off by default):
    window        (left, right), -1 unbounded;
    seqlens_k     (B,) keys per batch entry (keys at or past it hidden);
    block_mask    broadcastable to (B, Hq, ceil(Nq / bq), ceil(Nk / bk)), with
    block_size    (bq, bk);
    bias          broadcastable to (B, Hq, Nq, Nk);
    alibi_slopes  broadcastable to (B, Hq);
    softcap       > 0 caps the scaled scores;
    keep, dropout_p  keep mask (B, Hq, Nq, Nk) and the dropout probability.
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp, softmax

from cupyflash import _philox

__all__ = ["naive_attention", "naive_attention_grads", "naive_visible"]


def naive_visible(nq, nk, *, causal=False, window=None, key_stop=None):
    """(Nq, Nk) bool: which keys each query sees under causal, window and key padding."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    seen = np.ones((nq, nk), bool)
    if causal:
        # Bottom-right aligned causal mask (flash-attn >= 2.1): row i sees j <= i + nk - nq.
        seen &= np.tril(np.ones((nq, nk), bool), k=nk - nq)
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= j >= i + nk - nq - left
        if right >= 0:
            seen &= j <= i + nk - nq + right
    if key_stop is not None:
        seen &= j < key_stop
    return seen


def _scores(q, k, *, scale, causal, window=None, seqlens_k=None, block_mask=None,
            block_size=None, bias=None, alibi_slopes=None, softcap=0.0):
    """Scores x (B, Hq, Nq, Nk) in natural units, the visibility (same shape) and, with
    softcap, d x / d (scale q.k)."""
    q = np.asarray(q, np.float64)
    k = np.repeat(np.asarray(k, np.float64), q.shape[1] // k.shape[1], axis=1)
    bsz, hq, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    raw = scale * (q @ k.swapaxes(-1, -2))
    x, cap_grad = raw, None
    if softcap > 0:
        x = softcap * np.tanh(raw / softcap)
        cap_grad = 1 - np.tanh(raw / softcap) ** 2
    if bias is not None:
        x = x + np.asarray(bias, np.float64)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), (bsz, hq))
        distance = np.abs(np.arange(nq)[:, None] + nk - nq - np.arange(nk)[None, :])
        x = x - slopes[:, :, None, None] * distance
    seen = np.empty((bsz, hq, nq, nk), bool)
    for b in range(bsz):
        stop = None if seqlens_k is None else seqlens_k[b]
        seen[b] = naive_visible(nq, nk, causal=causal, window=window, key_stop=stop)
    if block_mask is not None:
        bq, bk = block_size
        full = np.broadcast_to(np.asarray(block_mask) != 0,
                               (bsz, hq, -(-nq // bq), -(-nk // bk)))
        seen &= np.repeat(np.repeat(full, bq, axis=2), bk, axis=3)[:, :, :nq, :nk]
    return x, seen, cap_grad


def _probabilities(q, k, **options):
    """Attention probabilities ``P`` (B, Hq, Nq, Nk), natural-log LSE (B, Hq, Nq) and the
    softcap derivative (None without softcap).

    A row that sees no key has ``P = 0`` and ``LSE = -inf`` by definition.
    """
    x, seen, cap_grad = _scores(q, k, **options)
    has_key = seen.any(axis=-1, keepdims=True)
    # SciPy answers NaN for a row of only -inf; such rows get zeros before the call and
    # their defined values after it.
    s = np.where(has_key, np.where(seen, x, -np.inf), 0.0)
    p = np.where(seen, softmax(s, axis=-1), 0.0)
    lse = np.where(has_key[..., 0], logsumexp(s, axis=-1), -np.inf)
    return p, lse, cap_grad


def _dropout_factor(keep, dropout_p):
    # Kept scores scale by one over the drawn keep probability (p at 8-bit resolution).
    return 1.0 if keep is None else np.asarray(keep, np.float64) * _philox.dropout_scale(dropout_p)


def _fold_group(x, hk):
    """Sum ``(B, Hq, ...)`` over the query heads of each kv group: ``(B, Hk, ...)``."""
    return x.reshape(x.shape[0], hk, x.shape[1] // hk, *x.shape[2:]).sum(axis=2)


def naive_attention(q, k, v, *, scale, causal, keep=None, dropout_p=0.0, **options):
    """Forward pass in float64, with any of the options of the module docstring.

    Returns
    -------
    o : ndarray, shape (B, Hq, Nq, dv)
        Zero for rows that see no key.
    lse : ndarray, shape (B, Hq, Nq)
        Before dropout; ``-inf`` for rows that see no key.
    """
    p, lse, _ = _probabilities(q, k, scale=scale, causal=causal, **options)
    v = np.repeat(np.asarray(v, np.float64), p.shape[1] // v.shape[1], axis=1)
    return (p * _dropout_factor(keep, dropout_p)) @ v, lse


def naive_attention_grads(do, q, k, v, *, scale, causal, keep=None, dropout_p=0.0,
                          **options):
    """Analytic gradients of ``sum(do * o)`` with respect to q, k, v (and the bias).

    Written from the softmax Jacobian, ``dS = P * (dP - rowsum(P * dP))``, rather than
    FlashAttention's ``rowsum(dO * O)`` form, so the two routes check each other.

    Returns
    -------
    dq, dk, dv : ndarray
        Shaped like q, k, v; a kv head's gradient sums over its query-head group.
    dbias : ndarray
        Only when a bias is given: shaped like it, summed over its broadcast axes.
    """
    hk = np.shape(k)[1]
    p, _, cap_grad = _probabilities(q, k, scale=scale, causal=causal, **options)
    g = p.shape[1] // hk
    q = np.asarray(q, np.float64)
    k = np.repeat(np.asarray(k, np.float64), g, axis=1)
    v = np.repeat(np.asarray(v, np.float64), g, axis=1)
    do = np.asarray(do, np.float64)
    z = _dropout_factor(keep, dropout_p)
    dp = z * (do @ v.swapaxes(-1, -2))
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    ds_raw = ds if cap_grad is None else ds * cap_grad
    dq = scale * (ds_raw @ k)
    dk = scale * (ds_raw.swapaxes(-1, -2) @ q)
    dv = (p * z).swapaxes(-1, -2) @ do
    grads = (dq, _fold_group(dk, hk), _fold_group(dv, hk))
    bias = options.get("bias")
    if bias is None:
        return grads
    shape = np.shape(bias)
    padded = (1,) * (ds.ndim - len(shape)) + shape
    summed = ds.sum(axis=tuple(a for a, n in enumerate(padded) if n == 1), keepdims=True)
    return (*grads, summed.reshape(shape))
