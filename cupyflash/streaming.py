"""Exact attention on host arrays larger than the GPU's memory, streamed through a bounded
device memory (issue #17).

The queries are cut into chunks and so are the keys. Each (query chunk, key chunk) pair
that the masks leave visible is one ordinary call of the backend on device copies of the
two chunks. The forward pass runs query chunks outside and key chunks inside, both of one
size, and merges the pairs of a query chunk by their log-sum-exps, exactly
(`cupyflash.merge`). The backward pass runs key chunks outside: a key chunk stays on the
device with its dk and dv sums while the query chunks that see it stream past, each pair
running the backend's backward with the *global* o and LSE rows of its query chunk. It
then recomputes the global probabilities P = exp(S - lse) and the global row term
D = rowsum(dO * o), so that pair's dq, dk and dv are exactly its terms of the sums over
keys (dq) and over queries (dk, dv). Its key chunks are a whole number of query chunks,
longer than them (`backward_chunks` says why).

Causal attention is aligned bottom-right (query i sees key j iff j <= i + Nk - Nq), and
so is a window. A pair's call is told where it lies in the problem (`_mods.Modifiers`
``row0``, ``key0``, ``diagonal``): its band (causal, window) and ALiBi take the problem's
diagonal, and dropout draws the bits of the problem's rows and keys from the call's one
RNG offset, so every pair computes exactly its part of the whole call. Such a call runs
the kernels' general path. A call with no option beyond causal runs the dense kernels,
whose diagonal is the call's own bottom-right corner; for it the key chunk boundaries lie
on the query boundaries shifted by Nk - Nq, so that a pair is either wholly visible (a
plain call), wholly hidden, or holds the keys where its query chunk's reach ends: the call
then takes the pair's keys up to that end only, and is causal with exactly the global
alignment (its own Nk - Nq is the global one, whatever the clipping at key 0). With an
option the key chunks start on the 128-row multiples the query chunks start on (the
origins the kernels' dropout draws need, `_mods.ORIGIN_ALIGN`, and whole block-mask
blocks). Either way a pair that the band, the key padding or the block mask leaves
empty is never computed and its chunks never copied for it, and a pair's keys end where
its query chunk's reach does.

`plan` is pure Python (sizes, the order of the pairs, which copies they need, the bytes
they move and the device memory they take); `forward` and `backward` run a plan on a
`_Mover`: CuPy with copies through a few pinned host buffers on copy streams of their own,
overlapped with the compute stream, or NumPy as the "device" (no copies across a bus, no
streams), which is how the chunking, masking, merging and gradient accumulation are tested
without a GPU. The array module and the copy mechanics are the only differences between
the two.

Varlen calls are cut between their sequences instead (`cupyflash.streaming_varlen`), which
runs a sequence too long for the limit through this module as a call of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from . import _arrays, _cpu_threads, _masks, _mods, merge

__all__ = ["StreamingPlan", "ROW_ALIGN"]

# Chunk sizes are multiples of the kernels' 128-row tiles, so every call but the last of
# a row or key range runs whole tiles (and chunk origins are aligned as dropout needs).
ROW_ALIGN = 128
assert ROW_ALIGN % _mods.ORIGIN_ALIGN == 0

# With device_memory_limit=None a call streams when the in-memory call would take more
# than this share of the free device memory, less the reserve (other allocations, the
# kernels' module images, CuPy's pool rounding).
FREE_SHARE = 0.9
FREE_RESERVE = 256 << 20

# CuPy rounds allocations up to 512 bytes; a call makes a few dozen of them.
_ALLOCATION_SLACK = 64 << 10
# Row-sized (B * Hq * c) temporaries of the two-way LSE merge (`merge._weights`): the
# stacked pair, its max, exp, sum and the new LSE, counted generously.
_MERGE_ROW_TEMPORARIES = 12

# The backward's key chunk is this many query chunks long where the memory allows
# (`backward_chunks`).
KEY_CHUNK_QUERY_CHUNKS = 4


# Planning ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    """What a plan depends on: shapes, dtype, the compact option arrays' shapes."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    value_dim: int
    dtype: np.dtype
    causal: bool
    window: tuple = (-1, -1)
    # The pairs' calls have an option beyond causal: they run the kernels' general path,
    # told where they lie in the problem, and the key chunks are not shifted (module doc).
    placed: bool = False
    bias_shape: tuple | None = None      # the compact (Bb, Hb, Nqb, Nkb) bias
    mask_shape: tuple | None = None      # the compact (Bm, Hm, nbq, nbk) block mask
    alibi_shape: tuple | None = None     # the compact (Ba, Hq) ALiBi slopes
    block_size: tuple = (128, 128)
    seqlens: bool = False
    dlse: bool = False                   # backward with a gradient of the LSE
    dbias: bool = False                  # backward with the bias gradient

    @property
    def dbias_per_key_chunk(self):
        """The bias broadcasts over the query rows: a key chunk's pairs share one slice of
        its gradient, summed on the device over them (they run one after another) and
        sent back once per key chunk; otherwise each pair's slice goes back with it."""
        return self.bias_shape is not None and self.bias_shape[2] == 1

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def acc_size(self):
        return _arrays.accumulation_dtype(self.dtype).itemsize

    def bias_elements(self, nq, nk):
        """Elements of the bias slice of a (nq rows, nk keys) pair (broadcast axes stay 1),
        and of its gradient's."""
        if self.bias_shape is None:
            return 0
        bb, hb, bq, bk = self.bias_shape
        return bb * hb * (nq if bq > 1 else 1) * (nk if bk > 1 else 1)

    def bias_bytes(self, nq, nk):
        return self.bias_elements(nq, nk) * self.itemsize

    def mask_bytes(self):
        return 0 if self.mask_shape is None else math.prod(self.mask_shape)

    def static_bytes(self):
        """Bytes of the option arrays that go up once, whole: the block mask, the ALiBi
        slopes and seqlens_k."""
        alibi = 0 if self.alibi_shape is None else math.prod(self.alibi_shape) * self.acc_size
        return self.mask_bytes() + alibi + 4 * self.batch * self.seqlens

    def row_bytes(self, backward):
        """Bytes uploaded per query row (of all batch entries and heads): q, and for the
        backward dO, the LSE and the row term (`backward`)."""
        g = self
        per = g.head_dim * g.itemsize if not backward else (
            (g.head_dim + g.value_dim) * g.itemsize + 2 * g.acc_size)
        return g.batch * g.q_heads * per

    def key_bytes(self):
        """Bytes of k and v per key row."""
        return self.batch * self.kv_heads * (self.head_dim + self.value_dim) * self.itemsize


def device_buffers(g: _Geometry, q_rows: int, k_rows: int, backward: bool) -> dict:
    """Device bytes a streamed pass holds at once, by buffer, for query chunks of ``q_rows``
    and key chunks of ``k_rows`` rows. Two slots of each streamed input chunk (one computed
    on, one being filled) and of each output that goes back per pair or per query chunk
    (one being written, one being copied out)."""
    R = g.batch * g.q_heads * q_rows          # query rows of a chunk, all heads
    K = g.batch * g.kv_heads * k_rows         # key rows of a chunk, all kv heads
    d, dv, isz, asz = g.head_dim, g.value_dim, g.itemsize, g.acc_size
    out = {"k, v chunks (2 slots)": 2 * K * (d + dv) * isz}
    if g.bias_shape is not None:
        out["bias chunks (2 slots)"] = 2 * g.bias_bytes(q_rows, k_rows)
    if g.mask_shape is not None:
        bq, bk = g.block_size
        bm, hm = g.mask_shape[:2]
        out["block mask (whole, and a pair's slice)"] = (
            g.mask_bytes() + bm * hm * -(-q_rows // bq) * -(-k_rows // bk))
    if g.seqlens:
        out["seqlens_k (whole, and a chunk's)"] = 2 * 4 * g.batch
    if g.alibi_shape is not None:
        out["ALiBi slopes"] = math.prod(g.alibi_shape) * asz
    if not backward:
        out["q chunks (2 slots)"] = 2 * R * d * isz
        out["o, lse of a pair"] = R * (dv * isz + asz)
        out["o, lse accumulators"] = R * (dv + 1) * asz
        out["merge temporaries"] = R * (dv + _MERGE_ROW_TEMPORARIES) * asz
        out["o, lse out (2 slots)"] = 2 * R * (dv * isz + asz)
    else:
        out["q, dO, lse, row term chunks (2 slots)"] = 2 * R * ((d + dv) * isz + 2 * asz)
        out["zero o (the row term holds D)"] = R * dv * isz
        out["dq of a pair (2 slots)"] = 2 * R * d * isz
        out["dk, dv of a pair"] = K * (d + dv) * isz
        out["dk, dv sums"] = K * (d + dv) * asz
        out["dk, dv out"] = K * (d + dv) * isz
        if g.dbias:
            # A pair's (or a key chunk's: `dbias_per_key_chunk`) slice of the bias
            # gradient, in the accumulation dtype: one being added into, one going back.
            out["dbias slices (2 slots)"] = 2 * g.bias_elements(q_rows, k_rows) * asz
        # The backward kernels' workspaces (`_cuda.attention_backward`): the LSE in base 2
        # and the row term D over 128-row padded rows, the fp32 dQ accumulator with rows
        # padded to d + 8, and one turn counter per 64-row query tile.
        padded = g.batch * g.q_heads * -(-q_rows // ROW_ALIGN) * ROW_ALIGN
        out["kernel workspaces"] = (2 * padded * asz + R * (d + 8) * asz
                                    + 4 * g.batch * g.q_heads * -(-q_rows // 64))
    out["allocation rounding"] = _ALLOCATION_SLACK
    return out


def in_memory_bytes(g: _Geometry, backward: bool) -> int:
    """Device bytes of the in-memory call on host inputs: device copies of the inputs, the
    outputs and, for ``backward``, dO, the gradients and the kernels' workspaces."""
    d, dv, isz, asz = g.head_dim, g.value_dim, g.itemsize, g.acc_size
    rows, keys = g.batch * g.q_heads * g.q_len, g.batch * g.kv_heads * g.k_len
    total = (rows * (d + dv) * isz + keys * (d + dv) * isz + rows * asz
             + g.bias_bytes(g.q_len, g.k_len) + g.static_bytes())
    if backward:
        padded = g.batch * g.q_heads * -(-g.q_len // ROW_ALIGN) * ROW_ALIGN
        total += (rows * (dv + d) * isz + keys * (d + dv) * isz + rows * asz * g.dlse
                  + 2 * padded * asz + rows * (d + 8) * asz
                  + g.bias_elements(g.q_len, g.k_len) * asz * g.dbias)
    return total + _ALLOCATION_SLACK


def _bounds(n, c, shift=0):
    """Cut points of [0, n) at the positions congruent to ``shift`` modulo ``c``."""
    cuts = sorted({0, n, *range(shift % c, n, c)})
    return tuple((a, b) for a, b in zip(cuts, cuts[1:]) if a < b)


def _key_bounds(g, c):
    """Key chunks of at most ``c`` rows, a multiple of the query chunk's: for the dense
    kernels' causal calls the cuts lie on the query cuts shifted by Nk - Nq, where a
    query chunk's reach ends; placed calls (`_Geometry.placed`) cut where the query
    chunks do. One chunk when all keys fit in one."""
    if c >= g.k_len:
        return ((0, g.k_len),) if g.k_len else ()
    return _bounds(g.k_len, c, shift=(g.k_len - g.q_len) if g.causal and not g.placed else 0)


@dataclass(frozen=True)
class _Step:
    """One (query chunk, key chunk) pair of a plan, in execution order, and its copies."""

    index: int
    row: int            # query chunk
    key: int            # key chunk
    key_stop: int       # the pair's keys end here: the key chunk's end, or (causal, a
    #                     window's right side) where the query chunk's reach ends inside it
    causal: bool        # the pair's keys run past its first query's reach: the call is causal
    row_first: bool     # first pair of its query chunk
    row_last: bool      # last pair of its query chunk
    key_first: bool     # first pair of its key chunk
    key_last: bool      # last pair of its key chunk
    row_slot: int
    row_upload: bool
    key_slot: int
    key_upload: bool


def _slots(keys):
    """(slot, upload) per step for two device slots: a chunk still held by a slot is
    reused; otherwise the least recently used slot is refilled, which is never the one the
    current step computes on, so its copy overlaps that step."""
    held, used, out = [None, None], [-1, -1], []
    for t, key in enumerate(keys):
        if key in held:
            slot, upload = held.index(key), False
        else:
            slot, upload = min((0, 1), key=lambda s: used[s]), True
            held[slot] = key
        used[slot] = t
        out.append((slot, upload))
    return out


@dataclass(frozen=True)
class StreamingPlan:
    """How a streamed pass cuts a problem, what it holds on the device and what it moves.

    Made by `cupyflash.streaming_plan` (and internally by every streamed call).

    Attributes
    ----------
    backward : bool
        A plan of the backward pass (else the forward). The forward runs query chunks
        outside, key chunks inside; the backward the other way round.
    query_chunk, key_chunk : int
        Rows per query chunk and the most rows of a key chunk (multiples of 128 unless a
        chunk holds all the rows). Equal in the forward; in the backward the key chunk is
        a whole number of query chunks, up to `KEY_CHUNK_QUERY_CHUNKS`, or all the keys.
    query_bounds, key_bounds : tuple of (start, stop)
        The chunks' row ranges.
    pairs : int
        The (query chunk, key chunk) pairs computed; hidden pairs (causal, outside the
        window, key padding, an empty block-mask region) are skipped and never copied.
    device_memory_limit : int
        The bound the plan was made for, in bytes.
    device_bytes : int
        Device bytes the pass holds at once (at most ``device_memory_limit``);
        ``buffers`` says what they are.
    h2d_bytes, d2h_bytes : int
        Bytes the pass copies host to device and device to host.
    min_bytes : int
        The least any pass moves: every input the device needs read once, every output
        written once. The backward needs q, k, v, dO, the LSE and one row term per query
        row (o stays on the host: `backward`).
    in_memory_bytes : int
        Device bytes of the same call without streaming.
    """

    backward: bool
    query_chunk: int
    key_chunk: int
    query_bounds: tuple
    key_bounds: tuple
    device_memory_limit: int
    device_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    min_bytes: int
    in_memory_bytes: int
    buffers: dict = field(repr=False)
    steps: tuple = field(repr=False)
    _geometry: _Geometry = field(repr=False)

    @property
    def pairs(self):
        return len(self.steps)

    @property
    def traffic_ratio(self):
        """Bytes moved over the least possible (1.0: every byte crosses once)."""
        return (self.h2d_bytes + self.d2h_bytes) / max(self.min_bytes, 1)

    @property
    def query_rows(self):
        return max((b - a for a, b in self.query_bounds), default=0)

    @property
    def key_rows(self):
        return max((b - a for a, b in self.key_bounds), default=0)


def _visible_pairs(g, qb, kb, seqlens_k, block_mask, *, keys_outside):
    """(query chunk, key chunk, key stop, causal) of every pair with something visible, in
    execution order: query chunks outside, or with ``keys_outside`` key chunks outside,
    each key chunk's causal pairs after its others (`_causal_last`)."""
    off = g.k_len - g.q_len
    key_end = g.k_len if seqlens_k is None else int(np.max(seqlens_k, initial=0))
    order = ([(i, j) for j in range(len(kb)) for i in range(len(qb))] if keys_outside
             else [(i, j) for i in range(len(qb)) for j in range(len(kb))])
    pairs = []
    for i, j in order:
        (q0, q1), (k0, k1) = qb[i], kb[j]
        call = _masks.pair_call(q0, q1, k0, k1, g.q_len, g.k_len, causal=g.causal, window=g.window,
                                key_end=key_end)
        if call is None:
            continue
        stop, causal = call
        # The dense kernels' diagonal is the call's corner: by the shifted boundaries the
        # pair's keys then end where the chunk's reach ends.
        assert g.placed or not causal or stop == q1 + off
        if block_mask is not None:
            bq, bk = g.block_size
            if not block_mask[..., q0 // bq:-(-q1 // bq), k0 // bk:-(-stop // bk)].any():
                continue
        pairs.append((i, j, stop, causal))
    return _causal_last(pairs) if keys_outside else pairs


def _causal_last(pairs):
    """Key-chunk-ordered pairs with each key chunk's causal pairs (the shorter calls, their
    keys clipped) after its wholly visible ones: the switch to the next key chunk, when
    the host uploads its k and v, then comes between long calls (the last causal pair
    takes the whole key chunk, the next chunk starts with a whole pair where it has one),
    and the host work the short calls leave exposed does not pile up on it."""
    return sorted(pairs, key=lambda p: (p[1], p[3]))


def _steps(pairs):
    rows, keys = [p[0] for p in pairs], [p[1] for p in pairs]
    row_slots, key_slots = _slots(rows), _slots(keys)
    first_row = {i: rows.index(i) for i in set(rows)}
    last_row = {i: t for t, i in enumerate(rows)}
    first_key = {j: keys.index(j) for j in set(keys)}
    last_key = {j: t for t, j in enumerate(keys)}
    return tuple(
        _Step(t, i, j, stop, causal, first_row[i] == t, last_row[i] == t, first_key[j] == t,
              last_key[j] == t, *row_slots[t], *key_slots[t])
        for t, (i, j, stop, causal) in enumerate(pairs))


def _traffic(g, backward, qb, kb, steps):
    """(h2d, d2h, min) bytes of a plan's steps."""
    rows, keys = g.row_bytes(backward), g.key_bytes()
    isz, asz = g.itemsize, g.acc_size
    h2d = g.static_bytes()
    d2h = 0
    for s in steps:
        (q0, q1), (k0, k1) = qb[s.row], kb[s.key]
        h2d += rows * (q1 - q0) * s.row_upload + keys * (k1 - k0) * s.key_upload
        h2d += g.bias_bytes(q1 - q0, s.key_stop - k0)
        if backward:
            d2h += g.batch * g.q_heads * (q1 - q0) * g.head_dim * isz     # the pair's dq
            if s.key_last:
                d2h += keys * (k1 - k0)                                    # the chunk's dk, dv
            if g.dbias and (s.key_last if g.dbias_per_key_chunk else True):
                d2h += g.bias_elements(q1 - q0, (k1 if g.dbias_per_key_chunk else s.key_stop) - k0) * asz
        elif s.row_last:
            d2h += g.batch * g.q_heads * (q1 - q0) * (g.value_dim * isz + asz)
    inputs = rows * g.q_len + keys * g.k_len + g.bias_bytes(g.q_len, g.k_len) + g.static_bytes()
    outputs = g.batch * g.q_heads * g.q_len * (g.head_dim * isz if backward else g.value_dim * isz + asz)
    if backward:
        outputs += keys * g.k_len + g.bias_elements(g.q_len, g.k_len) * asz * g.dbias
    return h2d, d2h, inputs + outputs


def _largest(fits, most):
    """The largest m in [1, most] with fits(m), for fits true at 1 and monotone (bisection)."""
    lo, hi = 1, max(most, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _chunk_step(g):
    """What chunk sizes are multiples of: 128 rows, and whole blocks of a block mask (whose
    calls are placed, so that key chunks start on these multiples too)."""
    if g.mask_shape is None:
        return ROW_ALIGN
    assert g.placed
    bq, bk = g.block_size
    return math.lcm(ROW_ALIGN, bq, bk)


def backward_chunks(g: _Geometry, limit: int, step: int) -> tuple:
    """(query chunk, key chunk) rows of a backward plan within ``limit`` bytes, both
    multiples of ``step`` (which must fit as one chunk of each).

    The key chunk stays on the device while every query chunk that sees it streams past,
    so the query chunks cross the bus once per key chunk: the bytes moved fall as the key
    chunk grows, and the key chunk takes most of the memory. The query chunk still has to
    be long enough that each pair is one large call: the pair's dk and dv are summed on
    the device over the whole key chunk (a pass over key-chunk-sized arrays per pair), and
    each call has its launches and copies. So the query chunk is the largest for which a
    key chunk `KEY_CHUNK_QUERY_CHUNKS` times longer fits too, and the key chunk then the
    most whole query chunks that fit (whole, so that causal key chunks end where a query
    chunk's reach does). Where every key fits in one chunk, the query chunk takes the rest.
    """
    def fits(cq, ck):
        return sum(device_buffers(g, min(cq, g.q_len), min(ck, g.k_len), True).values()) <= limit

    q_steps = -(-g.q_len // step)
    ratio = KEY_CHUNK_QUERY_CHUNKS
    cq = step
    if fits(step, ratio * step):
        cq = step * _largest(lambda m: fits(m * step, ratio * m * step), q_steps)
    ck = cq * _largest(lambda m: fits(cq, m * cq), -(-g.k_len // cq))
    if ck >= g.k_len:
        cq = step * _largest(lambda m: fits(m * step, g.k_len), q_steps)
    return cq, ck


def plan(g: _Geometry, limit: int, *, backward: bool, seqlens_k=None, block_mask=None) -> StreamingPlan:
    """The plan with the largest chunks whose buffers fit in ``limit`` bytes (larger chunks
    re-read the other side's chunks fewer times).

    Forward: query and key chunks of one size, the largest that fits. A key chunk much
    shorter than the query chunk would leave each call a few key tiles per query block
    and the calls launch-bound, and causal pairs need equal sizes to stay wholly visible,
    hidden or ending where the query chunk's reach ends. Backward: `backward_chunks`.
    ``seqlens_k`` (host, (B,)) and ``block_mask`` (host, compact) only prune pairs.
    Raises ValueError naming ``device_memory_limit`` when one chunk of the smallest size
    does not fit.
    """
    step = _chunk_step(g)

    def need(cq, ck):
        return sum(device_buffers(g, min(cq, g.q_len), min(ck, g.k_len), backward).values())

    smallest = need(step, step)
    if smallest > limit:
        parts = device_buffers(g, min(step, g.q_len), min(step, g.k_len), backward)
        largest = max(parts, key=parts.get)
        raise ValueError(
            f"device_memory_limit={limit} bytes is too small for this problem: one chunk of "
            f"{step} rows already needs {smallest} bytes of device memory (the largest part: "
            f"{largest}, {parts[largest]} bytes); pass at least {smallest}")
    if backward:
        cq, ck = backward_chunks(g, limit, step)
    else:
        cq = ck = step * _largest(lambda m: need(m * step, m * step) <= limit,
                                  -(-max(g.q_len, g.k_len) // step))
    qb, kb = _bounds(g.q_len, cq), _key_bounds(g, ck)
    steps = _steps(_visible_pairs(g, qb, kb, seqlens_k, block_mask, keys_outside=backward))
    h2d, d2h, least = _traffic(g, backward, qb, kb, steps)
    buffers = device_buffers(g, min(cq, g.q_len), min(ck, g.k_len), backward)
    return StreamingPlan(
        backward=backward, query_chunk=min(cq, g.q_len), key_chunk=min(ck, g.k_len),
        query_bounds=qb, key_bounds=kb, device_memory_limit=int(limit),
        device_bytes=sum(buffers.values()), h2d_bytes=h2d, d2h_bytes=d2h, min_bytes=least,
        in_memory_bytes=in_memory_bytes(g, backward), buffers=buffers, steps=steps, _geometry=g)


def geometry(q_shape, k_shape, v_shape, dtype, mods, *, causal, dlse=False, dbias=False) -> _Geometry:
    """The `_Geometry` of (B, H, N, d) shapes and a call's compact modifiers; ``dbias``: a
    backward pass that returns the bias gradient."""
    (batch, hq, nq, d), (_, hk, nk, _), dv = q_shape, k_shape, v_shape[-1]
    return _Geometry(
        batch=batch, q_heads=hq, kv_heads=hk, q_len=nq, k_len=nk, head_dim=d, value_dim=dv,
        dtype=np.dtype(dtype), causal=bool(causal), window=tuple(mods.window), placed=mods.active,
        bias_shape=None if mods.bias is None else tuple(mods.bias.shape),
        mask_shape=None if mods.block_mask is None else tuple(mods.block_mask.shape),
        alibi_shape=None if mods.alibi_slopes is None else tuple(mods.alibi_slopes.shape),
        block_size=tuple(mods.block_size), seqlens=mods.seqlens_k is not None, dlse=bool(dlse),
        dbias=bool(dbias) and mods.bias is not None)


def plan_for(g, mods, limit, *, backward):
    """`plan` with the pairs that ``mods``' key padding and block mask hide pruned."""
    seqlens, mask = (None if x is None else _arrays.move(x, _arrays.HOST, None)
                     for x in (mods.seqlens_k, mods.block_mask))
    return plan(g, limit, backward=backward, seqlens_k=seqlens, block_mask=mask)


def free_device_budget(device):
    """Bytes a call may take on ``device``: a share of its free memory (CuPy's pool's
    free blocks included), less a reserve."""
    cp = _arrays.cupy_module()
    with cp.cuda.Device(device):
        free, _ = cp.cuda.runtime.memGetInfo()
        free += cp.get_default_memory_pool().free_bytes()
    return max(int(free * FREE_SHARE) - FREE_RESERVE, 0)


def choose(problem, mods, *, backend, kv_heads, causal, limit, backward):
    """The plan a forward call streams with, or None for the in-memory path; ``backward``:
    a backward pass may follow, which must fit too.

    A given ``limit`` streams host inputs on either backend (on the NumPy backend the host
    is the "device"); None streams host inputs on the GPU backend only when the in-memory
    call (with its backward pass where one may follow) would not fit in the free device
    memory (`free_device_budget`). A varlen call's plan is a `streaming_varlen.VarlenPlan`.
    Errors come before anything is allocated.
    """
    if problem.kind != _arrays.HOST:
        if limit is not None:
            raise ValueError(
                "device_memory_limit streams host (NumPy) arrays through the GPU, but q, k and "
                "v are GPU arrays already; pass NumPy arrays, or leave device_memory_limit=None")
        return None
    b, d = problem.batch, problem.head_dim
    g = geometry((b, problem.heads, problem.q_len, d), (b, kv_heads, problem.k_len, d),
                 (b, kv_heads, problem.k_len, problem.value_dim), problem.dtype, mods, causal=causal)
    if limit is None:
        if backend != "cuda":
            return None
        budget = free_device_budget(_arrays.current_device())
        if in_memory_bytes(g, backward) <= budget:
            return None
        limit = budget
    planner = plan_for
    if mods.varlen:
        from . import streaming_varlen   # built on this module: imported where it is needed
        planner = streaming_varlen.plan_for
    if backward:   # a context's backward pass needs more: refuse its limit now, not then
        # (with the bias gradient's slices where there is a bias: it may be asked for)
        planner(dataclasses.replace(g, dbias=mods.bias is not None), mods, limit, backward=True)
    return planner(g, mods, limit, backward=False)


# Moving chunks -------------------------------------------------------------------------------


# Host work on chunks is split into tasks of about this many bytes for the NumPy backend's
# threads (NumPy releases the GIL in these loops; one thread copies strided rows at a few
# GB/s, less than a bus moves).
_HOST_TASK_BYTES = 4 << 20
# Copies across the bus go through a few pinned host buffers of this size, in turn, so the
# pinned memory a pass takes is bounded whatever its chunks (pinned chunk-sized staging
# would take as much host memory as the device buffers, tens of GiB under a large limit).
_PIECE_BYTES = 64 << 20
_PIECES = 4


def _copy(dst, src):
    np.copyto(dst, src, casting="unsafe")


def _add(dst, src):
    np.add(dst, src, out=dst, casting="unsafe")


def _host_op(op, dst, *srcs):
    """``op(dst, *srcs)`` on same-shaped host arrays, split over the NumPy backend's threads
    into blocks along the second-to-last axis (rows) when large."""
    if dst.nbytes < 2 * _HOST_TASK_BYTES or dst.ndim < 2:
        op(dst, *srcs)
        return
    row_bytes = dst.nbytes // max(math.prod(dst.shape[:-1]), 1)
    per = max(1, _HOST_TASK_BYTES // max(row_bytes, 1))
    rows = dst.shape[-2]
    parts = [(*lead, slice(r, r + per)) for lead in np.ndindex(dst.shape[:-2]) for r in range(0, rows, per)]
    _cpu_threads.run([lambda ix=ix: op(dst[ix], *(x[ix] for x in srcs)) for ix in parts])


def _pieces(shape, itemsize):
    """Index tuples cutting a C-contiguous (B, H, rows[, d]) chunk into parts that are
    contiguous and at most `_PIECE_BYTES`: runs of whole heads of one batch entry, or row
    ranges of one head where a head is larger."""
    batch, heads, rows = shape[:3]
    row_bytes = math.prod(shape[3:]) * itemsize
    head_bytes = rows * row_bytes
    if head_bytes == 0:
        return []
    if head_bytes <= _PIECE_BYTES:
        per = _PIECE_BYTES // head_bytes
        return [(b, slice(h, min(h + per, heads))) for b in range(batch) for h in range(0, heads, per)]
    per = _PIECE_BYTES // row_bytes
    return [(b, h, slice(r, min(r + per, rows)))
            for b in range(batch) for h in range(heads) for r in range(0, rows, per)]


class _Slot:
    """One device buffer per field, and the events that order its copies and its use."""

    def __init__(self, mover, fields):
        self.device = {n: mover.xp.empty(count, dtype) for n, (count, dtype) in fields.items()}
        self.copied = mover.event()   # the last upload into this slot has finished
        self.used = mover.event()     # the compute stream's last work on this slot has finished
        self.pending = False          # a download of this slot is waiting for `reclaim`

    def view(self, name, shape):
        return _arrays.flat_view(self.device[name], shape)


class _HostMover:
    """The NumPy backend as the "device": uploads are copies into chunk buffers, downloads
    run their host work at once, nothing is asynchronous."""

    xp = np

    def event(self):
        return None

    def to_device(self, x):
        return x

    def upload(self, slot, items):
        for name, shape, src in items:
            _host_op(_copy, slot.view(name, shape), src)

    def ready(self, slot):
        pass

    def done_with(self, slot):
        pass

    def download(self, slot, items):
        for name, shape, write in items:
            write(Ellipsis, slot.view(name, shape))

    def reclaim(self, slot):
        pass

    def carry_out_ready(self):
        pass

    def flush(self):
        pass

    def step_event(self):
        return None

    def synchronize(self):
        pass


class _CudaMover:
    """CuPy: chunks copied piece by piece through a few pinned host buffers, uploads and
    downloads each on a stream of their own (the bus carries both directions at once),
    ordered against the compute stream (the current one, where the kernels run) by
    events, so the copies of the next pair overlap the kernels of this one.

    A download is issued after the kernels that write its slot and carried out (copied
    and its host work done) in the order the downloads were issued, once those kernels
    are done (`carry_out_ready`, after each step's work is queued) or at the latest when
    the slot is needed again (`reclaim`): the host does that work while the device
    computes the pairs queued after them."""

    def __init__(self):
        cp = _arrays.cupy_module()
        import cupyx
        self.xp, self._cp = cp, cp
        self.compute = cp.cuda.get_current_stream()
        self.uploads = cp.cuda.Stream(non_blocking=True)
        self.downloads = cp.cuda.Stream(non_blocking=True)
        # Pinned buffers from CuPy's pinned pool: allocated by the first pass only.
        self._upload_pieces = [cupyx.empty_pinned((_PIECE_BYTES,), np.uint8) for _ in range(_PIECES)]
        self._upload_done = [None] * _PIECES
        self._next_piece = 0
        self._download_pieces = [cupyx.empty_pinned((_PIECE_BYTES,), np.uint8) for _ in range(_PIECES)]
        self._pending = collections.deque()   # (slot, items) of issued downloads, in order

    def event(self):
        return self._cp.cuda.Event(disable_timing=True)

    def to_device(self, x):
        return self._cp.asarray(x)

    def _memcpy(self, dst, src, kind, stream):
        self._cp.cuda.runtime.memcpyAsync(_arrays.data_pointer(dst), _arrays.data_pointer(src),
                                          dst.nbytes, kind, stream.ptr)

    def upload(self, slot, items):
        self.uploads.wait_event(slot.used)   # the kernels are done with the slot's old chunk
        for name, shape, src in items:
            chunk = slot.view(name, shape)
            for index in _pieces(chunk.shape, chunk.itemsize):
                n = self._next_piece
                self._next_piece = (n + 1) % _PIECES
                if self._upload_done[n] is not None:
                    self._upload_done[n].synchronize()   # its last copy has left the buffer
                part = chunk[index]
                stage = _arrays.flat_view(self._upload_pieces[n].view(chunk.dtype), part.shape)
                _host_op(_copy, stage, src[index])
                self._memcpy(part, stage, self._cp.cuda.runtime.memcpyHostToDevice, self.uploads)
                self._upload_done[n] = self.event()
                self._upload_done[n].record(self.uploads)
        slot.copied.record(self.uploads)

    def ready(self, slot):
        self.compute.wait_event(slot.copied)

    def done_with(self, slot):
        slot.used.record(self.compute)

    def download(self, slot, items):
        """Copy ``items`` ((field, shape, write) triples) of ``slot`` out once the work
        queued so far on the compute stream is done; ``write(index, part)`` does the host
        work for the part ``index`` of the (B, H, rows[, d]) chunk."""
        slot.used.record(self.compute)
        slot.pending = True
        self._pending.append((slot, items))

    def _carry_out(self, slot, items):
        self.downloads.wait_event(slot.used)
        in_flight = collections.deque()

        def finish_oldest():
            write, index, stage, copied = in_flight.popleft()
            copied.synchronize()
            write(index, stage)

        n = 0
        for name, shape, write in items:
            chunk = slot.view(name, shape)
            for index in _pieces(chunk.shape, chunk.itemsize):
                if len(in_flight) == _PIECES:
                    finish_oldest()
                part = chunk[index]
                stage = _arrays.flat_view(self._download_pieces[n % _PIECES].view(chunk.dtype), part.shape)
                n += 1
                self._memcpy(stage, part, self._cp.cuda.runtime.memcpyDeviceToHost, self.downloads)
                copied = self.event()
                copied.record(self.downloads)
                in_flight.append((write, index, stage, copied))
        while in_flight:
            finish_oldest()
        slot.pending = False

    def reclaim(self, slot):
        """Carry out the downloads issued up to this slot's, before the slot is written again."""
        while slot.pending:
            self._carry_out(*self._pending.popleft())

    def carry_out_ready(self):
        """Carry out the downloads whose kernels are done, without waiting for any."""
        while self._pending and self._pending[0][0].used.done:
            self._carry_out(*self._pending.popleft())

    def flush(self):
        while self._pending:
            self._carry_out(*self._pending.popleft())

    def step_event(self):
        event = self.event()
        event.record(self.compute)
        return event

    def synchronize(self):
        self.uploads.synchronize()
        self.downloads.synchronize()
        self.compute.synchronize()


def mover(backend):
    """The NumPy "device", or CuPy on the current device (`_execute` makes the pass's current)."""
    return _HostMover() if backend == "numpy" else _CudaMover()


# Progress ------------------------------------------------------------------------------------


class _Progress:
    """Reports completed pairs to ``progress(done, total)`` (or a tqdm bar), in order, as
    the device finishes them (at most a couple of pairs late: the host polls)."""

    def __init__(self, progress, total, what):
        self._pending = collections.deque()
        self._total = total
        self._bar = None
        self._report = progress
        if progress == "tqdm":
            import tqdm
            self._bar = tqdm.tqdm(total=total, desc=f"attention {what} (streamed)", unit="pair")
            self._report = lambda done, _: self._bar.update(done - self._bar.n)

    def step(self, done, event):
        if self._report is None:
            return
        self._pending.append((done, event))
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].done):
            self._report(self._pending.popleft()[0], self._total)

    def close(self, completed):
        if completed and self._report is not None:
            while self._pending:
                self._report(self._pending.popleft()[0], self._total)
        if self._bar is not None:
            self._bar.close()


# Running a plan ------------------------------------------------------------------------------


class _Chunks:
    """Two slots of one kind of chunk."""

    def __init__(self, mover, fields):
        self.slots = [_Slot(mover, fields), _Slot(mover, fields)]


class _Pipeline:
    """The steps of a plan with their inputs' copies issued one step ahead.

    ``bundles`` are (chunks, slot of a step, whether the step uploads, the step's sources
    as (field, shape, host view) items)."""

    def __init__(self, mover, steps, bundles, progress):
        self.mover, self.steps, self.bundles, self.progress = mover, steps, bundles, progress

    def _prefetch(self, t):
        if t < len(self.steps):
            s = self.steps[t]
            for chunks, slot_of, uploads, sources in self.bundles:
                if uploads(s):
                    self.mover.upload(chunks.slots[slot_of(s)], sources(s))

    def run(self, compute):
        self._prefetch(0)
        for s in self.steps:
            slots = [chunks.slots[slot_of(s)] for chunks, slot_of, _, _ in self.bundles]
            for slot in slots:
                self.mover.ready(slot)
            compute(s, slots)
            for slot in slots:
                self.mover.done_with(slot)
            # Issued after this step's kernels: the host stages the next chunks while the
            # device computes, and their copies run beside the kernels.
            self._prefetch(s.index + 1)
            self.mover.carry_out_ready()
            self.progress.step(s.index + 1, self.mover.step_event())


class _StaticMods:
    """A pass's option arrays on the device once, and each pair's slice of them and place
    in the problem."""

    def __init__(self, mover, mods, g):
        self.g, self.xp = g, mover.xp
        self.mask = None if mods.block_mask is None else mover.to_device(mods.block_mask)
        self.seqlens = None if mods.seqlens_k is None else mover.to_device(mods.seqlens_k)
        # The slopes are per (batch entry, head), the same for every pair: on the device
        # whole. The seed and the RNG offset are the call's, unchanged: a pair's dropout
        # differs from another's by its place alone.
        alibi = None if mods.alibi_slopes is None else mover.to_device(mods.alibi_slopes)
        self.mods = dataclasses.replace(mods, alibi_slopes=alibi)

    def of_pair(self, q0, q1, k0, k1, bias=None):
        changes = {}
        if self.g.placed:
            changes.update(row0=q0, key0=k0, diagonal=self.g.k_len - self.g.q_len)
        if self.mask is not None:
            bq, bk = self.g.block_size
            changes["block_mask"] = self.xp.ascontiguousarray(
                self.mask[..., q0 // bq:-(-q1 // bq), k0 // bk:-(-k1 // bk)])
        if self.seqlens is not None:
            # Key padding per chunk: batch entry b sees the chunk's keys below seqlens_k[b].
            changes["seqlens_k"] = self.xp.clip(self.seqlens - k0, 0, k1 - k0).astype(np.int32)
        if bias is not None:
            changes["bias"] = bias
        return dataclasses.replace(self.mods, **changes) if changes else self.mods


def _bias_slice(bias, q0, q1, k0, k1):
    """The compact bias's part for a pair; broadcast (length-1) axes stay whole."""
    rows = slice(q0, q1) if bias.shape[2] > 1 else slice(None)
    keys = slice(k0, k1) if bias.shape[3] > 1 else slice(None)
    return bias[:, :, rows, keys]


class _BiasGradient:
    """The bias gradient of a streamed backward pass. Each pair's call adds its dS into a
    device slice (in the accumulation dtype), which goes back and is added on the host
    into ``host``, the compact gradient the caller zeroed: pairs whose slices overlap (the
    bias broadcasts over batch entries, heads, rows or keys) sum in the steps' order, the
    same in every run. Where the bias broadcasts over the query rows the pairs of a key
    chunk, which run one after another, share one device slice and it goes back once
    (`_Geometry.dbias_per_key_chunk`); otherwise each pair's slice goes back with it."""

    def __init__(self, mover, plan, host):
        g = plan._geometry
        self.mover, self.plan, self.host = mover, plan, host
        self.per_key_chunk = g.dbias_per_key_chunk
        count = g.bias_elements(plan.query_rows, plan.key_rows)
        self.chunks = _Chunks(mover, {"dbias": (count, host.dtype)})
        self.turns = 0
        self.slot = self.view = None

    def _host_part(self, s):
        """The host slice a step's device slice adds into (its key chunk's, per key chunk)."""
        (q0, q1), (k0, k1) = self.plan.query_bounds[s.row], self.plan.key_bounds[s.key]
        return _bias_slice(self.host, q0, q1, k0, k1 if self.per_key_chunk else s.key_stop)

    def pair(self, s):
        """The device view the step's call adds its dS into."""
        if not self.per_key_chunk or s.key_first:
            self.slot = self.chunks.slots[self.turns % 2]
            self.turns += 1
            self.mover.reclaim(self.slot)
            self.view = self.slot.view("dbias", self._host_part(s).shape)
            self.view[...] = 0
        if self.per_key_chunk and self.host.shape[3] > 1:   # the step's keys of the chunk
            return self.view[..., :s.key_stop - self.plan.key_bounds[s.key][0]]
        return self.view

    def send_back(self, s):
        """After the step's call: its slice goes back (per key chunk: after the last pair)."""
        if not self.per_key_chunk or s.key_last:
            part = self._host_part(s)
            self.mover.download(self.slot, [("dbias", part.shape, _writer(_add, part))])


def _bias_bundle(mover, mods, g, plan):
    if mods.bias is None:
        return None
    count = g.bias_bytes(plan.query_rows, plan.key_rows) // g.itemsize
    chunks = _Chunks(mover, {"bias": (count, g.dtype)})

    def sources(s):
        (q0, q1), k0 = plan.query_bounds[s.row], plan.key_bounds[s.key][0]
        part = _bias_slice(mods.bias, q0, q1, k0, s.key_stop)
        return [("bias", part.shape, part)]

    return (chunks, lambda s: s.index % 2, lambda s: True, sources)


def _key_bundle(mover, k, v, plan):
    B, Hk, _, d = k.shape
    dv = v.shape[-1]
    count = B * Hk * plan.key_rows
    chunks = _Chunks(mover, {"k": (count * d, k.dtype), "v": (count * dv, v.dtype)})

    def sources(s):
        k0, k1 = plan.key_bounds[s.key]
        return [("k", (B, Hk, k1 - k0, d), k[:, :, k0:k1]), ("v", (B, Hk, k1 - k0, dv), v[:, :, k0:k1])]

    return (chunks, lambda s: s.key_slot, lambda s: s.key_upload, sources)


def _row_bundle(mover, plan, named, prepare=None):
    """The query chunks' inputs: ``named`` is (field, (B, H, Nq, ...) host array) pairs;
    ``prepare(q0, q1)``, where given, runs before a chunk's rows are read."""
    rows = plan.query_rows
    fields = {n: (x.shape[0] * x.shape[1] * rows * math.prod(x.shape[3:]), x.dtype) for n, x in named}
    chunks = _Chunks(mover, fields)

    def sources(s):
        q0, q1 = plan.query_bounds[s.row]
        if prepare is not None:
            prepare(q0, q1)
        return [(n, (*x.shape[:2], q1 - q0, *x.shape[3:]), x[:, :, q0:q1]) for n, x in named]

    return (chunks, lambda s: s.row_slot, lambda s: s.row_upload, sources)


def _unseen_rows(plan):
    """Query chunks no step computes (every key hidden): their outputs are set on the host."""
    seen = {s.row for s in plan.steps}
    return [b for i, b in enumerate(plan.query_bounds) if i not in seen]


def _unseen_keys(plan):
    """Key chunks no step computes (hidden from every query): their gradients are zero."""
    seen = {s.key for s in plan.steps}
    return [b for j, b in enumerate(plan.key_bounds) if j not in seen]


def _pair_inputs(s, plan, slots, static, mods):
    """A step's key and value views (its keys only: a chunk's leading rows, up to the
    step's key stop) and its modifiers, from the step's slots (rows, keys[, bias])."""
    kv = slots[1]
    (q0, q1), (k0, k1) = plan.query_bounds[s.row], plan.key_bounds[s.key]
    g = plan._geometry
    chunk = (g.batch, g.kv_heads, k1 - k0)
    k = kv.view("k", (*chunk, g.head_dim))[:, :, :s.key_stop - k0]
    v = kv.view("v", (*chunk, g.value_dim))[:, :, :s.key_stop - k0]
    bias = None
    if mods.bias is not None:
        bias = slots[2].view("bias", _bias_slice(mods.bias, q0, q1, k0, s.key_stop).shape)
    return k, v, static.of_pair(q0, q1, k0, s.key_stop, bias)


def _execute(plan, backend, device, progress, what, body):
    with _arrays.on_device(device):
        moving = mover(backend)
        report = _Progress(progress, plan.pairs, what)
        completed = False
        try:
            body(moving, report)
            completed = True
        finally:
            # Also after an error: no copy may still be in flight when the buffers go back
            # to CuPy's pool.
            moving.synchronize()
            report.close(completed)


def forward(q, k, v, o, lse, *, plan, scale, causal, mods, backend, device, progress=None):
    """A streamed forward pass: writes ``o`` and ``lse`` ((B, H, N, d) host views) from
    host q, k, v, by the ``plan``'s pairs on ``backend`` ("cuda", or "numpy" for the
    test path), ``mods`` the call's compact host modifiers."""
    del causal   # each step carries its own: the plan made the pairs from it
    from .api import _backend_module

    run = _backend_module(backend)
    B, Hq, _, d = q.shape
    dv, g = v.shape[-1], plan._geometry
    acc = _arrays.accumulation_dtype(q.dtype)
    for q0, q1 in _unseen_rows(plan):
        o[:, :, q0:q1] = 0
        lse[:, :, q0:q1] = -np.inf

    def body(moving, report):
        xp, R = moving.xp, B * Hq * plan.query_rows
        bundles = [_row_bundle(moving, plan, [("q", q)]), _key_bundle(moving, k, v, plan)]
        bias = _bias_bundle(moving, mods, g, plan)
        bundles += [bias] if bias else []
        outs = _Chunks(moving, {"o": (R * dv, q.dtype), "lse": (R, acc)})
        o_pair, lse_pair = xp.empty(R * dv, q.dtype), xp.empty(R, acc)
        o_acc, lse_acc = xp.empty(R * dv, acc), xp.empty(R, acc)
        static = _StaticMods(moving, mods, g)

        def compute(s, slots):
            q0, q1 = plan.query_bounds[s.row]
            rows = (B, Hq, q1 - q0)
            k_pair, v_pair, pm = _pair_inputs(s, plan, slots, static, mods)
            op, lp = _arrays.flat_view(o_pair, (*rows, dv)), _arrays.flat_view(lse_pair, rows)
            run.attention_forward(slots[0].view("q", (*rows, d)), k_pair, v_pair, op, lp,
                                  scale=scale, causal=s.causal, mods=pm)
            oa, la = _arrays.flat_view(o_acc, (*rows, dv)), _arrays.flat_view(lse_acc, rows)
            if s.row_first:
                oa[...] = op
                la[...] = lp
            else:
                merge.merge_into(oa, la, op, lp, xp)
            if s.row_last:
                slot = outs.slots[s.row % 2]
                moving.reclaim(slot)
                slot.view("o", (*rows, dv))[...] = oa
                slot.view("lse", rows)[...] = la
                moving.download(slot, [("o", (*rows, dv), _writer(_copy, o[:, :, q0:q1])),
                                       ("lse", rows, _writer(_copy, lse[:, :, q0:q1]))])

        _Pipeline(moving, plan.steps, bundles, report).run(compute)
        moving.flush()

    if plan.steps:
        _execute(plan, backend, device, progress, "forward", body)


def _writer(op, dst, *others):
    """A download's host work: ``op(dst[index], *(x[index] for x in others), part)`` for
    each part ``index`` of the chunk (``dst`` and ``others`` are the chunk's host views)."""
    return lambda index, part: _host_op(op, dst[index], *(x[index] for x in others), part)


def _sum_into(dst, partial, part):
    np.add(partial, part, out=dst, casting="unsafe")


def _fill_row_terms(terms, o, do, dlse):
    """``terms`` := dlse - D, D = rowsum(dO * o), in the dtype of ``terms`` ((B, H, rows)
    host views, o and dO (B, H, rows, dv); ``dlse`` None is zero), over the threads."""
    per = max(1, _HOST_TASK_BYTES // (o.shape[-1] * terms.itemsize))

    def rows(index):
        products = o[index].astype(terms.dtype)
        np.multiply(products, do[index], out=products, casting="unsafe")
        np.negative(products.sum(axis=-1), out=terms[index])
        if dlse is not None:
            terms[index] += dlse[index]

    _cpu_threads.run([lambda ix=(b, h, slice(r, r + per)): rows(ix)
                      for b, h in np.ndindex(o.shape[:2]) for r in range(0, o.shape[2], per)])


def backward(do, q, k, v, o, lse, dq, dk, dv, *, plan, scale, deterministic, mods, backend,
             device, dlse=None, dbias=None, progress=None):
    """A streamed backward pass: writes ``dq``, ``dk``, ``dv`` ((B, H, N, d) host views)
    from host do, q, k, v and the forward's global o and lse (and ``dlse``), and adds the
    bias gradient into ``dbias`` (host, compact, the accumulation dtype, zeroed) where
    given (`_BiasGradient`; the plan's geometry must have ``dbias``).

    Loop order: key chunks outside, query chunks inside. A key chunk's k and v go up once,
    its dk and dv are summed on the device (in the accumulation dtype) over its pairs and
    come back once, in the inputs' dtype. Each pair uploads its query chunk's q, dO, LSE
    and row term and sends its dq back as the kernels write it (in the inputs' dtype: nothing
    is lost by copying it at that size), to be summed on the host in the accumulation
    dtype; a query chunk with one pair writes dq directly. The other order (query chunks
    outside, dq summed on the device) sends each pair's dk and dv back, as many bytes
    with as many kv heads as query heads, but it cannot make the resident chunk longer
    than the streamed one: a causal pair's rows would then need two calls (the kernels'
    causal mask is aligned to the end of the keys, so only the keys can be clipped), and
    its host sums would be over dk and dv, twice the host memory of dq's.

    The row term: the kernels' pre-pass computes each row's D = rowsum(dO * o) and takes
    ``dlse`` off it. Given o = 0 and dlse - D in place of dlse, it gets the same D - dlse,
    so o (as many bytes per row as dO) does not cross the bus with every pair: D is
    computed on the host, once per query chunk, before the chunk's first upload.
    """
    from .api import _backend_module

    run = _backend_module(backend)
    B, Hq, _, d = q.shape
    Hk, dvd, g = k.shape[1], v.shape[-1], plan._geometry
    acc = _arrays.accumulation_dtype(q.dtype)
    for q0, q1 in _unseen_rows(plan):
        dq[:, :, q0:q1] = 0
    for k0, k1 in _unseen_keys(plan):
        dk[:, :, k0:k1] = 0
        dv[:, :, k0:k1] = 0
    # dq rows that more than one pair adds to are summed here; np.empty maps a large array
    # lazily, so the rows no sum passes through (query chunks with one pair) take no memory.
    dq_sum = np.empty(dq.shape, acc) if any(not (s.row_first and s.row_last) for s in plan.steps) else None
    row_terms = np.empty(lse.shape, acc)
    filled = set()

    def fill_row_terms(q0, q1):
        if q0 not in filled:
            filled.add(q0)
            rows = (slice(None), slice(None), slice(q0, q1))
            _fill_row_terms(row_terms[rows], o[rows], do[rows], None if dlse is None else dlse[rows])

    def dq_writer(s, q0, q1):
        rows = dq[:, :, q0:q1]
        if s.row_first and s.row_last:
            return _writer(_copy, rows)
        partial = dq_sum[:, :, q0:q1]
        if s.row_first:
            return _writer(_copy, partial)
        if not s.row_last:
            return _writer(_add, partial)
        return _writer(_sum_into, rows, partial)

    def body(moving, report):
        xp, R, K = moving.xp, B * Hq * plan.query_rows, B * Hk * plan.key_rows
        named = [("q", q), ("do", do), ("lse", lse), ("row_term", row_terms)]
        bundles = [_row_bundle(moving, plan, named, fill_row_terms), _key_bundle(moving, k, v, plan)]
        bias = _bias_bundle(moving, mods, g, plan)
        bundles += [bias] if bias else []
        dq_outs = _Chunks(moving, {"dq": (R * d, q.dtype)})
        key_out = _Slot(moving, {"dk": (K * d, q.dtype), "dv": (K * dvd, q.dtype)})
        dk_pair, dv_pair = xp.empty(K * d, q.dtype), xp.empty(K * dvd, q.dtype)
        dk_sum, dv_sum = xp.empty(K * d, acc), xp.empty(K * dvd, acc)
        o_zero = xp.zeros(R * dvd, q.dtype)
        static = _StaticMods(moving, mods, g)
        bias_grad = None if dbias is None else _BiasGradient(moving, plan, dbias)

        def compute(s, slots):
            (q0, q1), (k0, k1) = plan.query_bounds[s.row], plan.key_bounds[s.key]
            rows, chunk, pair = (B, Hq, q1 - q0), (B, Hk, k1 - k0), (B, Hk, s.key_stop - k0)
            rs = slots[0]
            k_pair, v_pair, pm = _pair_inputs(s, plan, slots, static, mods)
            out = dq_outs.slots[s.index % 2]
            moving.reclaim(out)
            dqp = out.view("dq", (*rows, d))
            dkp, dvp = _arrays.flat_view(dk_pair, (*pair, d)), _arrays.flat_view(dv_pair, (*pair, dvd))
            run.attention_backward(
                rs.view("do", (*rows, dvd)), rs.view("q", (*rows, d)), k_pair, v_pair,
                _arrays.flat_view(o_zero, (*rows, dvd)), rs.view("lse", rows), dqp, dkp, dvp,
                scale=scale, causal=s.causal, deterministic=deterministic, mods=pm,
                dbias=None if bias_grad is None else bias_grad.pair(s), dlse=rs.view("row_term", rows))
            moving.download(out, [("dq", (*rows, d), dq_writer(s, q0, q1))])
            if bias_grad is not None:
                bias_grad.send_back(s)
            dks, dvs = _arrays.flat_view(dk_sum, (*chunk, d)), _arrays.flat_view(dv_sum, (*chunk, dvd))
            if s.key_first:   # keys past every pair's stop get no term
                dks[...] = 0
                dvs[...] = 0
            # In place on one view object: `dks[:, :, :n] += dkp` would end in a __setitem__
            # of the view onto itself, for which CuPy copies it first (10 GB at N = 4M).
            for sums, part in ((dks, dkp), (dvs, dvp)):
                seen = sums[:, :, :s.key_stop - k0]
                xp.add(seen, part, out=seen)
            if s.key_last:
                moving.reclaim(key_out)
                key_out.view("dk", (*chunk, d))[...] = dks
                key_out.view("dv", (*chunk, dvd))[...] = dvs
                moving.download(key_out, [("dk", (*chunk, d), _writer(_copy, dk[:, :, k0:k1])),
                                          ("dv", (*chunk, dvd), _writer(_copy, dv[:, :, k0:k1]))])

        _Pipeline(moving, plan.steps, bundles, report).run(compute)
        moving.flush()

    if plan.steps:
        _execute(plan, backend, device, progress, "backward", body)
