"""Block-sparse attention patterns for the ``block_mask`` option.

A block mask says which (query block, key block) tiles of the score matrix are computed;
the rest are skipped, so time and memory traffic fall in proportion to the density
(FlashAttention, section 3.3). These helpers build the usual fixed patterns as NumPy
bool arrays of shape ``(n_query_blocks, n_key_blocks)``, which broadcast over batch and
heads when passed as ``block_mask`` together with the matching ``block_size``:

>>> import cupyflash as cf
>>> bs = 128
>>> mask = cf.local_global_block_mask(-(-nq // bs), -(-nk // bs), local=2,
...                                   global_blocks=1, causal=True)      # doctest: +SKIP
>>> o = cf.attention(q, k, v, causal=True, block_mask=mask, block_size=bs)  # doctest: +SKIP

Block indices are aligned like the causal mask, bottom-right: query block ``r`` sits on
the diagonal at key block ``r + n_key_blocks - n_query_blocks``.
"""

from __future__ import annotations

import numpy as np

from ._validate import _check_int_in, check_flag

__all__ = ["local_global_block_mask", "butterfly_block_mask", "block_mask_density"]


def _diagonal_offsets(n_query_blocks: int, n_key_blocks: int) -> np.ndarray:
    """(n_query_blocks, n_key_blocks) key block minus the query block's diagonal block."""
    rows = np.arange(n_query_blocks)[:, None] + (n_key_blocks - n_query_blocks)
    return np.arange(n_key_blocks)[None, :] - rows


def local_global_block_mask(n_query_blocks, n_key_blocks, *, local, global_blocks=0,
                            stride=None, causal=False) -> np.ndarray:
    """Sliding-window blocks plus global and strided blocks (Longformer / BigBird /
    Sparse Transformer style).

    Parameters
    ----------
    n_query_blocks, n_key_blocks : int
        The mask's shape, ``ceil(Nq / bq)`` and ``ceil(Nk / bk)``; at least 1.
    local : int
        Key blocks within ``local`` blocks of each query block's diagonal block are on
        (``0``: the diagonal block only).
    global_blocks : int, default 0
        The first ``global_blocks`` key blocks are seen by every query block, and the
        first ``global_blocks`` query blocks see every key block (global tokens).
    stride : int, optional
        Also every ``stride``-th key block, ``stride - 1, 2 * stride - 1, ...`` (the
        "summary" columns of the Sparse Transformer's fixed pattern).
    causal : bool, default False
        Remove the blocks wholly above the diagonal; the elementwise causal mask of the
        attention call (pass ``causal=True`` there too) handles the diagonal blocks.

    Returns
    -------
    numpy.ndarray of bool, shape (n_query_blocks, n_key_blocks)
    """
    n_query_blocks = _check_int_in(n_query_blocks, "n_query_blocks", 1)
    n_key_blocks = _check_int_in(n_key_blocks, "n_key_blocks", 1)
    local = _check_int_in(local, "local", 0)
    global_blocks = _check_int_in(global_blocks, "global_blocks", 0)
    causal = check_flag(causal, "causal")
    offsets = _diagonal_offsets(n_query_blocks, n_key_blocks)
    mask = np.abs(offsets) <= local
    mask[:, :global_blocks] = True
    mask[:global_blocks, :] = True
    if stride is not None:
        stride = _check_int_in(stride, "stride", 1)
        mask[:, stride - 1::stride] = True
    if causal:
        mask &= offsets <= 0
    return mask


def butterfly_block_mask(n_blocks, *, causal=False) -> np.ndarray:
    """The flat butterfly pattern of the FlashAttention paper's block-sparse experiments.

    Block ``(r, c)`` is on when ``r`` and ``c`` differ in at most one bit: the union of
    the ``log2(n)`` butterfly factors' supports and the diagonal (Dao et al., "Pixelated
    Butterfly", 2022), so every block reaches every other in ``log2(n)`` hops while
    ``(1 + log2 n) / n`` of the blocks are computed.

    Parameters
    ----------
    n_blocks : int
        Query and key blocks (a square mask); any size >= 1, a power of two gives the
        exact butterfly.
    causal : bool, default False
        Remove the blocks above the diagonal.

    Returns
    -------
    numpy.ndarray of bool, shape (n_blocks, n_blocks)
    """
    n_blocks = _check_int_in(n_blocks, "n_blocks", 1)
    causal = check_flag(causal, "causal")
    index = np.arange(n_blocks)
    differ = index[:, None] ^ index[None, :]
    mask = (differ & (differ - 1)) == 0   # zero or a power of two: at most one bit differs
    if causal:
        mask &= index[None, :] <= index[:, None]
    return mask


def block_mask_density(mask) -> float:
    """Fraction of blocks a mask computes, in [0, 1] (NumPy or CuPy array of bool or int).

    The attention call's work is about this fraction of the dense call's (for a causal
    call, of the dense causal one when the mask has ``causal=True``).
    """
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise TypeError(f"mask must be an array, got {type(mask).__name__}")
    if mask.dtype.kind not in "biu":
        raise TypeError(f"mask must be a bool or integer array, got dtype {mask.dtype}")
    if mask.size == 0:
        raise ValueError("mask must have at least one block, got an empty array")
    return float((mask != 0).sum()) / mask.size
