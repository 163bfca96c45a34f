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
    """An option of ``mods`` reads the problem's coordinates (not just the scores)."""
    return mods.windowed or mods.alibi_slopes is not None or mods.dropout_p > 0


def reach(q0, q1, total_q, total_k, *, causal, window):
    """``(first, stop)``: the problem's rows ``[q0, q1)`` together see keys in ``[first,
    stop)`` (none when ``first >= stop``): from the first row's first key to the last row's
    last, since the band's bounds grow with the row (`cupyflash._masks`)."""
    first = int(_masks.visible_key_span(q0, total_q, total_k, causal=causal, window=window)[0])
    stop = int(_masks.visible_key_span(q1 - 1, total_q, total_k, causal=causal, window=window)[1])
    return first, stop


def place(q0, q1, k0, k1, *, total_q, total_k, causal, mods):
    """The call of rows ``[q0, q1)`` and keys ``[k0, k1)`` of the problem (``q0``, ``k0``
    multiples of `_mods.ORIGIN_ALIGN`), as ``(key stop, causal, mods)``: its keys end at
    ``key stop`` (where the rows' reach ends, if inside), ``causal`` says whether it needs
    the causal mask at all, and ``mods`` places it. None where the band hides every key."""
    first, stop = reach(q0, q1, total_q, total_k, causal=causal, window=mods.window)
    if q1 <= q0 or k0 >= min(stop, k1) or k1 <= first:
        return None
    stop = min(k1, stop)
    diagonal = total_k - total_q
    placed = dataclasses.replace(mods, row0=q0, key0=k0, diagonal=diagonal)
    # A call whose keys all lie at or below its first row's diagonal needs no causal mask.
    return stop, causal and stop - 1 > q0 + diagonal, placed
