"""Zigzag sharding of a sequence over R ranks, so that causal work is balanced.

The sequence is cut into 2R equal chunks; rank r holds chunks r and 2R-1-r, in that
order. Under a causal mask query chunk c sees c key chunks fully and one on the diagonal,
so rank r's two chunks together see 2R-1 full chunks and two diagonals whatever r is:
every rank does the same work at every step of the ring (`cupyflash.distributed.ring`).
"""

from __future__ import annotations

import numbers

from .. import _arrays

__all__ = ["zigzag_chunks", "zigzag_shard", "zigzag_unshard"]


def _check_world(rank, world):
    for name, value in (("world", world), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}")


def _axis(x, axis, name):
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an integer, got {axis!r} ({type(axis).__name__})")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for {name} of shape {x.shape}")
    return axis % x.ndim


def zigzag_chunks(rank, world):
    """The two chunk indices (of 2 * world) that ``rank`` holds: ``(rank, 2*world-1-rank)``."""
    _check_world(rank, world)
    return rank, 2 * world - 1 - rank


def _take(x, axis, lo, hi):
    index = [slice(None)] * x.ndim
    index[axis] = slice(lo, hi)
    return x[tuple(index)]


def zigzag_shard(x, rank, world, axis):
    """Rank ``rank``'s zigzag shard of ``x`` along ``axis``: chunks ``rank`` and
    ``2*world-1-rank`` of ``2*world`` equal chunks, concatenated (a new array).

    Parameters
    ----------
    x : array
        The whole sequence (NumPy or CuPy); ``x.shape[axis]`` must be divisible by
        ``2 * world``.
    rank, world : int
        ``0 <= rank < world``.
    axis : int
        The sequence axis: -2 for "bhsd" arrays ``(..., N, d)``, 1 for "bshd" ``(B, N, H, d)``,
        -1 for an LSE ``(..., H, N)``.

    Raises
    ------
    TypeError, ValueError
        A non-array ``x``, a bad rank, world or axis, or a length not divisible by
        ``2 * world`` (named, nothing is allocated).
    """
    _check_world(rank, world)
    if _arrays.kind_of(x) is None:
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    x = _arrays.adopt(x, "x")
    axis = _axis(x, axis, "x")
    n = x.shape[axis]
    if n % (2 * world):
        raise ValueError(
            f"x has {n} entries along axis {axis}, not divisible by 2 * world = {2 * world}: "
            "zigzag sharding cuts the sequence into 2 * world equal chunks (pad it, or choose "
            "a world size that divides it)")
    c = n // (2 * world)
    first, second = zigzag_chunks(rank, world)
    xp = _arrays.namespace(_arrays.kind_of(x))
    with _arrays.on_device(_arrays.device_of(x)):
        return xp.concatenate([_take(x, axis, first * c, (first + 1) * c),
                               _take(x, axis, second * c, (second + 1) * c)], axis=axis)


def zigzag_unshard(parts, axis):
    """The whole sequence from every rank's zigzag shard (``parts[r]`` from rank r), a new
    array; the inverse of `zigzag_shard`.

    Parameters
    ----------
    parts : sequence of arrays
        One shard per rank, all of one shape, dtype and kind (NumPy, or CuPy on one
        device), each of even length along ``axis``.
    axis : int
        The sequence axis, as for `zigzag_shard`.

    Raises
    ------
    TypeError, ValueError
        An empty sequence, parts of different shapes, dtypes or places, or of odd length
        along ``axis`` (named ``parts[i]``).
    """
    if isinstance(parts, (str, bytes)) or not hasattr(parts, "__len__") or _arrays.kind_of(parts) is not None:
        raise TypeError(f"parts must be a sequence of arrays (one per rank), got {type(parts).__name__}")
    if len(parts) == 0:
        raise ValueError("parts must hold one shard per rank, got an empty sequence")
    kind = _arrays.kind_of(parts[0])
    for i, p in enumerate(parts):
        if _arrays.kind_of(p) is None:
            raise TypeError(f"parts[{i}] must be an array, got {type(p).__name__}")
        if _arrays.kind_of(p) != kind:
            raise TypeError(f"parts[{i}] is not on the same side (host or GPU) as parts[0]")
    parts = [_arrays.adopt(p, f"parts[{i}]") for i, p in enumerate(parts)]
    first = parts[0]
    axis = _axis(first, axis, "parts[0]")
    for i, p in enumerate(parts):
        if p.shape != first.shape:
            raise ValueError(f"parts[{i}] has shape {p.shape} but parts[0] has {first.shape}; "
                             "zigzag shards are all of one shape")
        if p.dtype != first.dtype:
            raise TypeError(f"parts[{i}] has dtype {p.dtype} but parts[0] has {first.dtype}")
        if _arrays.device_of(p) != _arrays.device_of(first):
            raise ValueError(f"parts[{i}] is on GPU {_arrays.device_of(p)} but parts[0] is on "
                             f"GPU {_arrays.device_of(first)}")
    if first.shape[axis] % 2:
        raise ValueError(f"parts[0] has {first.shape[axis]} entries along axis {axis}, an odd "
                         "number: a zigzag shard is two equal chunks")
    world, c = len(parts), first.shape[axis] // 2
    chunks = [None] * (2 * world)
    for rank, p in enumerate(parts):
        a, b = zigzag_chunks(rank, world)
        chunks[a], chunks[b] = _take(p, axis, 0, c), _take(p, axis, c, 2 * c)
    xp = _arrays.namespace(kind)
    with _arrays.on_device(_arrays.device_of(first)):
        return xp.concatenate(chunks, axis=axis)
