"""One rectangle of a larger attention problem as a call of its own, placed in the problem.

Ring attention's (query chunk, key chunk) pairs and the multi-device split's query blocks
are such rectangles. With a window, ALiBi or dropout the call must see the whole
problem's coordinates: it is told its first row and key in the problem and the problem's
``Nk - Nq`` (`_mods.Modifiers` ``row0``, ``key0``, ``diagonal``, as the streamed path's
pairs are, `cupyflash.streaming`), so its band, its ALiBi distances and its dropout bits
are the problem's. Such a call runs the kernels' general path, so callers place calls only
where an option needs it (`needs_placing`).
"""

from __future__ import annotations

import dataclasses

from .. import _masks, _mods


def needs_placing(mods: _mods.Modifiers) -> bool:
    """An option of ``mods`` reads the problem's coordinates (not just the scores). The
    streamed path places every call with an option (`streaming.geometry`); the ring and
    the device split only these, so that softcap alone asks no alignment of the shards."""
    return mods.windowed or mods.alibi_slopes is not None or mods.dropout_p > 0


def place(q0, q1, k0, k1, *, total_q, total_k, causal, mods):
    """The call of rows ``[q0, q1)`` and keys ``[k0, k1)`` of the problem (``q0``, ``k0``
    multiples of `_mods.ORIGIN_ALIGN`), as ``(key stop, causal, mods)`` (`_masks.pair_call`)
    with ``mods`` placing it; None where the band hides every key."""
    call = _masks.pair_call(q0, q1, k0, k1, total_q, total_k, causal=causal, window=mods.window)
    if call is None:
        return None
    placed = dataclasses.replace(mods, row0=q0, key0=k0, diagonal=total_k - total_q)
    return (*call, placed)
