"""The process-wide dropout RNG state: one Philox seed and the next unused stream.

A dropout call without an explicit seed claims a fresh range of Philox streams (one per
batch entry and query head, see `cupyflash._philox`) under the process seed, so that
successive calls draw different masks and never reuse a counter, as torch advances its
Philox offset. The seed comes from ``os.urandom`` on first use, or from `manual_seed`.
A lock keeps claims from concurrent threads disjoint.
"""

from __future__ import annotations

import os
import threading

from ._validate import _check_int_in

__all__ = ["manual_seed", "claim_streams"]

_lock = threading.Lock()
_seed: int | None = None
_next_offset = 0


def manual_seed(seed) -> None:
    """Seed cupyflash's dropout RNG, for reproducible calls that pass no ``seed``.

    Parameters
    ----------
    seed : int
        In [0, 2**64). The stream offset restarts at 0, so the same sequence of dropout
        calls after the same ``manual_seed`` draws the same masks.
    """
    global _seed, _next_offset
    seed = _check_int_in(seed, "seed", 0, 2**64, hi_text="2**64")
    with _lock:
        _seed, _next_offset = seed, 0


def claim_streams(count: int) -> tuple[int, int]:
    """(seed, offset) for a call drawing ``count`` streams; advances the state past them."""
    global _seed, _next_offset
    with _lock:
        if _seed is None:
            _seed = int.from_bytes(os.urandom(8), "little")
        offset = _next_offset
        _next_offset = (offset + count) % 2**64
        return _seed, offset
