"""Naive float64 attention: the oracle every backend is tested against.

It materialises the full score matrix and uses SciPy's softmax and logsumexp, sharing no
code with cupyflash (the causal mask is written here afresh with `np.tril`), so a bug in
the library's blockwise algorithm or mask rules cannot hide in both. Only for small
shapes: memory is ``O(B * Hq * Nq * Nk)``.

Shapes follow `cupyflash._reference`: q ``(B, Hq, Nq, d)``, k ``(B, Hk, Nk, d)``,
v ``(B, Hk, Nk, dv)`` with ``Hq % Hk == 0`` (query head ``h`` reads kv head
``h // (Hq // Hk)``). Inputs of any float dtype are upcast; results are float64.
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp, softmax

__all__ = ["naive_attention", "naive_attention_grads"]


def _probabilities(q, k, *, scale, causal):
    """Attention probabilities ``P`` (B, Hq, Nq, Nk) and natural-log LSE (B, Hq, Nq).

    A row that sees no key has ``P = 0`` and ``LSE = -inf`` by definition.
    """
    q = np.asarray(q, np.float64)
    k = np.repeat(np.asarray(k, np.float64), q.shape[1] // k.shape[1], axis=1)
    nq, nk = q.shape[2], k.shape[2]
    s = scale * (q @ k.swapaxes(-1, -2))
    # Bottom-right aligned causal mask (flash-attn >= 2.1): row i sees j <= i + nk - nq.
    seen = np.tril(np.ones((nq, nk), bool), k=nk - nq) if causal else np.ones((nq, nk), bool)
    has_key = seen.any(axis=-1)[:, None]
    # SciPy answers NaN for a row of only -inf; such rows get zeros before the call and
    # their defined values after it.
    s = np.where(has_key, np.where(seen, s, -np.inf), 0.0)
    p = np.where(seen, softmax(s, axis=-1), 0.0)
    lse = np.where(has_key[:, 0], logsumexp(s, axis=-1), -np.inf)
    return p, lse


def _fold_group(x, hk):
    """Sum ``(B, Hq, ...)`` over the query heads of each kv group: ``(B, Hk, ...)``."""
    return x.reshape(x.shape[0], hk, x.shape[1] // hk, *x.shape[2:]).sum(axis=2)


def naive_attention(q, k, v, *, scale, causal):
    """Forward pass: ``o = softmax(scale * q k^T) v`` and the row LSE, in float64.

    Returns
    -------
    o : ndarray, shape (B, Hq, Nq, dv)
        Zero for rows that see no key.
    lse : ndarray, shape (B, Hq, Nq)
        ``-inf`` for rows that see no key.
    """
    p, lse = _probabilities(q, k, scale=scale, causal=causal)
    v = np.repeat(np.asarray(v, np.float64), p.shape[1] // v.shape[1], axis=1)
    return p @ v, lse


def naive_attention_grads(do, q, k, v, *, scale, causal):
    """Analytic gradients of ``sum(do * o)`` with respect to q, k and v, in float64.

    Written from the softmax Jacobian, ``dS = P * (dP - rowsum(P * dP))``, rather than
    FlashAttention's ``rowsum(dO * O)`` form, so the two routes check each other.

    Returns
    -------
    dq, dk, dv : ndarray
        Shaped like q, k, v; a kv head's gradient sums over its query-head group.
    """
    hk = np.shape(k)[1]
    p, _ = _probabilities(q, k, scale=scale, causal=causal)
    g = p.shape[1] // hk
    q = np.asarray(q, np.float64)
    k = np.repeat(np.asarray(k, np.float64), g, axis=1)
    v = np.repeat(np.asarray(v, np.float64), g, axis=1)
    do = np.asarray(do, np.float64)
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * (ds @ k)
    dk = scale * (ds.swapaxes(-1, -2) @ q)
    dv = p.swapaxes(-1, -2) @ do
    return dq, _fold_group(dk, hk), _fold_group(dv, hk)
