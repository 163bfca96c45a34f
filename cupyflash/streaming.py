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

Causal attention is aligned bottom-right (query i sees key j iff j <= i + Nk - Nq). Key
chunk boundaries lie on the query boundaries shifted by Nk - Nq, so a pair is either
wholly visible (a plain call), wholly hidden (never computed), or holds the keys where
its query chunk's reach ends: the call then takes the pair's keys up to that end only,
and is causal with exactly the global alignment (its own Nk - Nq is the global one,
whatever the clipping at key 0).

`plan` is pure Python (sizes, the order of the pairs, which copies they need, the bytes
they move and the device memory they take); `forward` and `backward` run a plan on a
`_Mover`: CuPy with copies through a few pinned host buffers on copy streams of their own,
overlapped with the compute stream, or NumPy as the "device" (no copies across a bus, no
streams), which is how the chunking, masking, merging and gradient accumulation are tested
without a GPU. The array module and the copy mechanics are the only differences between
the two.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from . import _arrays, _cpu_threads, merge

__all__ = ["StreamingPlan", "UNSUPPORTED", "ROW_ALIGN"]

# Chunk sizes are multiples of the kernels' 128-row tiles, so every call but the last of
# a row or key range runs whole tiles.
ROW_ALIGN = 128

# Options whose meaning depends on global row/key coordinates that a call on a chunk cannot
# express yet (the kernels take no row or key offset): the streamed path refuses them.
UNSUPPORTED = {
    "window": lambda m: m.windowed,
    "alibi_slopes": lambda m: m.alibi_slopes is not None,
    "dropout_p": lambda m: m.dropout_p > 0,
}

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


def check_supported(mods):
    """NotImplementedError naming the first option the streamed path cannot run."""
    for name, active in UNSUPPORTED.items():
        if active(mods):
            raise NotImplementedError(
                f"{name} is not supported by the streamed path (device_memory_limit, or host "
                "arrays larger than the free device memory) yet: its terms depend on global row "
                "and key positions that a call on one chunk cannot express; run without "
                "device_memory_limit on arrays that fit, or drop the option")


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
    bias_shape: tuple | None = None      # the compact (Bb, Hb, Nqb, Nkb) bias
    mask_shape: tuple | None = None      # the compact (Bm, Hm, nbq, nbk) block mask
    block_size: tuple = (128, 128)
    seqlens: bool = False
    dlse: bool = False                   # backward with a gradient of the LSE

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def acc_size(self):
        return _arrays.accumulation_dtype(self.dtype).itemsize

    def bias_bytes(self, nq, nk):
        """Bytes of the bias slice of a (nq rows, nk keys) pair (broadcast axes stay 1)."""
        if self.bias_shape is None:
            return 0
        bb, hb, bq, bk = self.bias_shape
        return bb * hb * (nq if bq > 1 else 1) * (nk if bk > 1 else 1) * self.itemsize

    def mask_bytes(self):
        return 0 if self.mask_shape is None else math.prod(self.mask_shape)

    def row_bytes(self, backward):
        """Bytes uploaded per query row (of all batch entries and heads)."""
        g = self
        per = g.head_dim * g.itemsize if not backward else (
            (g.head_dim + 2 * g.value_dim) * g.itemsize + g.acc_size * (1 + g.dlse))
        return g.batch * g.q_heads * per

    def key_bytes(self):
        """Bytes of k and v per key row."""
        return self.batch * self.kv_heads * (self.head_dim + self.value_dim) * self.itemsize


def device_buffers(g: _Geometry, q_rows: int, k_rows: int, backward: bool) -> dict:
    """Device bytes a streamed pass holds at once, by buffer, for query chunks of ``q_rows``
    and key chunks of ``k_rows`` rows. Two slots of each input chunk (one computed on, one
    being filled) and of each output chunk (one being written, one being copied out)."""
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
    if not backward:
        out["q chunks (2 slots)"] = 2 * R * d * isz
        out["o, lse of a pair"] = R * (dv * isz + asz)
        out["o, lse accumulators"] = R * (dv + 1) * asz
        out["merge temporaries"] = R * (dv + _MERGE_ROW_TEMPORARIES) * asz
        out["o, lse out (2 slots)"] = 2 * R * (dv * isz + asz)
    else:
        out["q, o, dO, lse chunks (2 slots)"] = 2 * R * ((d + 2 * dv) * isz + asz * (1 + g.dlse))
        out["dq of a pair"] = R * d * isz
        out["dq accumulator"] = R * d * asz
        out["dq out (2 slots)"] = 2 * R * d * isz
        out["dk, dv of a pair"] = K * (d + dv) * isz
        out["dk, dv out (2 slots)"] = 2 * K * (d + dv) * asz
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
             + g.bias_bytes(g.q_len, g.k_len) + g.mask_bytes() + 4 * g.batch * g.seqlens)
    if backward:
        padded = g.batch * g.q_heads * -(-g.q_len // ROW_ALIGN) * ROW_ALIGN
        total += (rows * (dv + d) * isz + keys * (d + dv) * isz + rows * asz * g.dlse
                  + 2 * padded * asz + rows * (d + 8) * asz)
    return total + _ALLOCATION_SLACK


def _bounds(n, c, shift=0):
    """Cut points of [0, n) at the positions congruent to ``shift`` modulo ``c``."""
    cuts = sorted({0, n, *range(shift % c, n, c)})
    return tuple((a, b) for a, b in zip(cuts, cuts[1:]) if a < b)


@dataclass(frozen=True)
class _Step:
    """One (query chunk, key chunk) pair of a plan, in execution order, and its copies."""

    index: int
    row: int            # query chunk
    key: int            # key chunk
    causal: bool        # the diagonal pair: the local call is causal
    first: bool         # first pair of its query chunk
    last: bool          # last pair of its query chunk
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
        A plan of the backward pass (else the forward).
    query_chunk, key_chunk : int
        Rows per query chunk and the most rows of a key chunk (multiples of 128 unless a
        chunk holds all the rows; equal for causal attention).
    query_bounds, key_bounds : tuple of (start, stop)
        The chunks' row ranges.
    pairs : int
        The (query chunk, key chunk) pairs computed; hidden pairs (causal, key padding, an
        empty block-mask region) are skipped and never copied.
    device_memory_limit : int
        The bound the plan was made for, in bytes.
    device_bytes : int
        Device bytes the pass holds at once (at most ``device_memory_limit``);
        ``buffers`` says what they are.
    h2d_bytes, d2h_bytes : int
        Bytes the pass copies host to device and device to host.
    min_bytes : int
        The least any pass moves: every input read once, every output written once.
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


def _visible_pairs(g, qb, kb, seqlens_k, block_mask):
    """(query chunk, key chunk, causal) of every pair with something visible, in order."""
    off = g.k_len - g.q_len
    key_stop = g.k_len if seqlens_k is None else int(np.max(seqlens_k, initial=0))
    pairs = []
    for i, (q0, q1) in enumerate(qb):
        for j, (k0, k1) in enumerate(kb):
            if k0 >= key_stop:
                continue
            diagonal = False
            if g.causal:
                if k0 >= q1 + off:          # past the last query's reach
                    continue
                # Not wholly visible: the last key is past the first query's reach. By the
                # shifted boundaries that is the pair ending where the chunk's reach ends.
                diagonal = k1 - 1 > q0 + off
                assert not diagonal or k1 == q1 + off
            if block_mask is not None:
                bq, bk = g.block_size
                if not block_mask[..., q0 // bq:-(-q1 // bq), k0 // bk:-(-k1 // bk)].any():
                    continue
            pairs.append((i, j, diagonal))
    return pairs


def _steps(pairs):
    if not pairs:
        return ()
    rows = _slots([i for i, _, _ in pairs])
    keys = _slots([j for _, j, _ in pairs])
    steps = []
    for t, (i, j, diagonal) in enumerate(pairs):
        first = t == 0 or pairs[t - 1][0] != i
        last = t == len(pairs) - 1 or pairs[t + 1][0] != i
        steps.append(_Step(t, i, j, diagonal, first, last, *rows[t], *keys[t]))
    return tuple(steps)


def _traffic(g, backward, qb, kb, steps):
    """(h2d, d2h, min) bytes of a plan's steps."""
    rows, keys = g.row_bytes(backward), g.key_bytes()
    asz, isz = g.acc_size, g.itemsize
    h2d = g.mask_bytes() + 4 * g.batch * g.seqlens
    d2h = 0
    for s in steps:
        (q0, q1), (k0, k1) = qb[s.row], kb[s.key]
        h2d += rows * (q1 - q0) * s.row_upload + keys * (k1 - k0) * s.key_upload
        h2d += g.bias_bytes(q1 - q0, k1 - k0)
        if backward:
            d2h += g.batch * g.kv_heads * (k1 - k0) * (g.head_dim + g.value_dim) * asz
        if s.last:
            per_row = g.head_dim * isz if backward else g.value_dim * isz + asz
            d2h += g.batch * g.q_heads * (q1 - q0) * per_row
    inputs = (rows * g.q_len + keys * g.k_len + g.bias_bytes(g.q_len, g.k_len)
              + g.mask_bytes() + 4 * g.batch * g.seqlens)
    outputs = g.batch * g.q_heads * g.q_len * (g.head_dim * isz if backward else g.value_dim * isz + asz)
    if backward:
        outputs += keys * g.k_len
    return h2d, d2h, inputs + outputs


def plan(g: _Geometry, limit: int, *, backward: bool, seqlens_k=None, block_mask=None) -> StreamingPlan:
    """The plan with the largest chunks whose buffers fit in ``limit`` bytes (larger chunks
    re-read the keys fewer times: every query chunk reads its visible key chunks once).

    Query and key chunks have one size: a key chunk much shorter than the query chunk
    would leave each call a few key tiles per query block and the calls launch-bound,
    and causal pairs need equal sizes to stay wholly visible, hidden or diagonal.
    ``seqlens_k`` (host, (B,)) and ``block_mask`` (host, compact) only prune pairs.
    Raises ValueError naming ``device_memory_limit`` when one chunk of the smallest size
    does not fit, and NotImplementedError for a causal block mask whose key blocks the
    shifted key chunks would cut.
    """
    step = ROW_ALIGN
    if g.mask_shape is not None:
        bq, bk = g.block_size
        step = math.lcm(ROW_ALIGN, bq, bk)
        if g.causal and (g.k_len - g.q_len) % bk:
            raise NotImplementedError(
                f"block_mask with causal=True and Nk - Nq = {g.k_len - g.q_len} (not a multiple of "
                f"the key block size {bk}) is not supported by the streamed path yet: its key "
                "chunks start at the query chunks' boundaries shifted by Nk - Nq, which would cut "
                "key blocks")

    def need(c):
        return sum(device_buffers(g, min(c, g.q_len), min(c, g.k_len), backward).values())

    smallest = need(step)
    if smallest > limit:
        parts = device_buffers(g, min(step, g.q_len), min(step, g.k_len), backward)
        largest = max(parts, key=parts.get)
        raise ValueError(
            f"device_memory_limit={limit} bytes is too small for this problem: one chunk of "
            f"{step} rows already needs {smallest} bytes of device memory (the largest part: "
            f"{largest}, {parts[largest]} bytes); pass at least {smallest}")
    # need() grows with c: the largest c that fits, by bisection over multiples of step.
    lo, hi = 1, -(-max(g.q_len, g.k_len) // step)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid * step) <= limit:
            lo = mid
        else:
            hi = mid - 1
    c = lo * step
    qb = _bounds(g.q_len, c)
    kb = _bounds(g.k_len, c, shift=(g.k_len - g.q_len) if g.causal else 0)
    steps = _steps(_visible_pairs(g, qb, kb, seqlens_k, block_mask))
    h2d, d2h, least = _traffic(g, backward, qb, kb, steps)
    buffers = device_buffers(g, min(c, g.q_len), min(c, g.k_len), backward)
    return StreamingPlan(
        backward=backward, query_chunk=min(c, g.q_len), key_chunk=min(c, g.k_len),
        query_bounds=qb, key_bounds=kb, device_memory_limit=int(limit),
        device_bytes=sum(buffers.values()), h2d_bytes=h2d, d2h_bytes=d2h, min_bytes=least,
        in_memory_bytes=in_memory_bytes(g, backward), buffers=buffers, steps=steps, _geometry=g)


def geometry(q_shape, k_shape, v_shape, dtype, mods, *, causal, dlse=False) -> _Geometry:
    """The `_Geometry` of (B, H, N, d) shapes and a call's compact modifiers."""
    (batch, hq, nq, d), (_, hk, nk, _), dv = q_shape, k_shape, v_shape[-1]
    return _Geometry(
        batch=batch, q_heads=hq, kv_heads=hk, q_len=nq, k_len=nk, head_dim=d, value_dim=dv,
        dtype=np.dtype(dtype), causal=bool(causal),
        bias_shape=None if mods.bias is None else tuple(mods.bias.shape),
        mask_shape=None if mods.block_mask is None else tuple(mods.block_mask.shape),
        block_size=tuple(mods.block_size), seqlens=mods.seqlens_k is not None, dlse=bool(dlse))


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
    memory (`free_device_budget`), and then only for options the streamed path supports
    (others run in memory, as before). Errors come before anything is allocated.
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
        try:
            check_supported(mods)
        except NotImplementedError:
            return None
        limit = budget
    else:
        check_supported(mods)
    if backward:   # a context's backward pass needs more: refuse its limit now, not then
        plan_for(dataclasses.replace(g, dlse=True), mods, limit, backward=True)
    return plan_for(g, mods, limit, backward=False)


# Moving chunks -------------------------------------------------------------------------------


def _host_op(dst, src, add=False):
    """``dst[...] = src`` (or ``+=``) for (B, H, N[, d]) host arrays, split over the batch
    and head axes on the NumPy backend's threads when large (NumPy releases the GIL in
    these loops; one thread copies strided rows at a few GB/s)."""
    def op(a, b):
        if add:
            np.add(a, b, out=a, casting="unsafe")
        else:
            np.copyto(a, b, casting="unsafe")

    if dst.nbytes < (8 << 20) or dst.ndim < 3:
        op(dst, src)
        return
    tasks = [lambda b=b, h=h: op(dst[b, h], src[b, h]) for b, h in np.ndindex(dst.shape[:2])]
    _cpu_threads.run(tasks)


class _Slot:
    """One device buffer per field, with pinned host staging where copies cross the bus."""

    def __init__(self, mover, fields):
        self.device = {n: mover.xp.empty(count, dtype) for n, (count, dtype) in fields.items()}
        self.staging = {n: mover.staging(count, dtype) for n, (count, dtype) in fields.items()}
        self.copied = mover.event()   # the last copy into or out of this slot has finished
        self.used = mover.event()     # the compute stream's last work on this slot has finished
        self.pending = None           # a download's host work, run once `copied`

    def view(self, name, shape):
        return _arrays.flat_view(self.device[name], shape)


class _HostMover:
    """The NumPy backend as the "device": uploads are copies into chunk buffers, nothing
    is asynchronous."""

    xp = np

    def staging(self, count, dtype):
        return None

    def event(self):
        return None

    def to_device(self, x):
        return x

    def upload(self, slot, items):
        for name, shape, src in items:
            _host_op(slot.view(name, shape), src)

    def ready(self, slot):
        pass

    def done_with(self, slot):
        pass

    def download(self, slot, items, finish):
        finish(*(slot.view(name, shape) for name, shape in items))

    def reclaim(self, slot):
        pass

    def step_event(self):
        return None

    def synchronize(self):
        pass


class _CudaMover:
    """CuPy: chunks staged through pinned host buffers and copied on a copy stream of
    their own, ordered against the compute stream (the current one, where the kernels
    run) by events, so the copies of the next pair overlap the kernels of this one."""

    def __init__(self):
        cp = _arrays.cupy_module()
        self.xp, self._cp = cp, cp
        self.compute = cp.cuda.get_current_stream()
        self.copy = cp.cuda.Stream(non_blocking=True)

    def staging(self, count, dtype):
        import cupyx
        return cupyx.empty_pinned((count,), dtype)

    def event(self):
        return self._cp.cuda.Event(disable_timing=True)

    def to_device(self, x):
        return self._cp.asarray(x)

    def _memcpy(self, dst, src, kind):
        self._cp.cuda.runtime.memcpyAsync(_arrays.data_pointer(dst), _arrays.data_pointer(src),
                                          dst.nbytes, kind, self.copy.ptr)

    def upload(self, slot, items):
        slot.copied.synchronize()            # the staging's previous upload has left it
        staged = []
        for name, shape, src in items:
            stage = _arrays.flat_view(slot.staging[name], shape)
            _host_op(stage, src)
            staged.append((slot.view(name, shape), stage))
        self.copy.wait_event(slot.used)      # the kernels are done with the slot's old chunk
        for dst, stage in staged:
            self._memcpy(dst, stage, self._cp.cuda.runtime.memcpyHostToDevice)
        slot.copied.record(self.copy)

    def ready(self, slot):
        self.compute.wait_event(slot.copied)

    def done_with(self, slot):
        slot.used.record(self.compute)

    def download(self, slot, items, finish):
        slot.used.record(self.compute)
        self.copy.wait_event(slot.used)
        views = []
        for name, shape in items:
            stage = _arrays.flat_view(slot.staging[name], shape)
            self._memcpy(stage, slot.view(name, shape), self._cp.cuda.runtime.memcpyDeviceToHost)
            views.append(stage)
        slot.copied.record(self.copy)
        slot.pending = (finish, views)

    def reclaim(self, slot):
        """Finish the slot's download (its host work) before the slot is written again."""
        if slot.pending is not None:
            finish, views = slot.pending
            slot.copied.synchronize()
            slot.pending = None
            finish(*views)

    def step_event(self):
        event = self.event()
        event.record(self.compute)
        return event

    def synchronize(self):
        self.copy.synchronize()
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
            self.progress.step(s.index + 1, self.mover.step_event())


class _StaticMods:
    """A pass's option arrays on the device once, and each pair's slice of them."""

    def __init__(self, mover, mods, g):
        self.mods, self.g, self.xp = mods, g, mover.xp
        self.mask = None if mods.block_mask is None else mover.to_device(mods.block_mask)
        self.seqlens = None if mods.seqlens_k is None else mover.to_device(mods.seqlens_k)

    def of_pair(self, q0, q1, k0, k1, bias=None):
        changes = {}
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


def _bias_bundle(mover, mods, g, plan):
    if mods.bias is None:
        return None
    count = g.bias_bytes(plan.query_rows, plan.key_rows) // g.itemsize
    chunks = _Chunks(mover, {"bias": (count, g.dtype)})

    def sources(s):
        (q0, q1), (k0, k1) = plan.query_bounds[s.row], plan.key_bounds[s.key]
        part = _bias_slice(mods.bias, q0, q1, k0, k1)
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


def _row_bundle(mover, plan, named):
    """The query chunks' inputs: ``named`` is (field, (B, H, Nq, ...) host array) pairs."""
    rows = plan.query_rows
    fields = {n: (x.shape[0] * x.shape[1] * rows * math.prod(x.shape[3:]), x.dtype) for n, x in named}
    chunks = _Chunks(mover, fields)

    def sources(s):
        q0, q1 = plan.query_bounds[s.row]
        return [(n, (*x.shape[:2], q1 - q0, *x.shape[3:]), x[:, :, q0:q1]) for n, x in named]

    return (chunks, lambda s: s.row_slot, lambda s: s.row_upload, sources)


def _unseen_rows(plan):
    """Query chunks no step computes (every key hidden): their outputs are set on the host."""
    seen = {s.row for s in plan.steps}
    return [b for i, b in enumerate(plan.query_bounds) if i not in seen]


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
            (q0, q1), (k0, k1) = plan.query_bounds[s.row], plan.key_bounds[s.key]
            rows, keys = (B, Hq, q1 - q0), (B, v.shape[1], k1 - k0)
            qs, kv = slots[0], slots[1]
            pm = static.of_pair(q0, q1, k0, k1, slots[2].view("bias", _bias_slice(
                mods.bias, q0, q1, k0, k1).shape) if bias else None)
            op, lp = _arrays.flat_view(o_pair, (*rows, dv)), _arrays.flat_view(lse_pair, rows)
            run.attention_forward(qs.view("q", (*rows, d)), kv.view("k", (*keys, d)),
                                  kv.view("v", (*keys, dv)), op, lp, scale=scale, causal=s.causal,
                                  mods=pm)
            oa, la = _arrays.flat_view(o_acc, (*rows, dv)), _arrays.flat_view(lse_acc, rows)
            if s.first:
                oa[...] = op
                la[...] = lp
            else:
                merge.merge_into(oa, la, op, lp, xp)
            if s.last:
                slot = outs.slots[s.row % 2]
                moving.reclaim(slot)
                slot.view("o", (*rows, dv))[...] = oa
                slot.view("lse", rows)[...] = la

                def finish(o_part, lse_part, q0=q0, q1=q1):
                    _host_op(o[:, :, q0:q1], o_part)
                    _host_op(lse[:, :, q0:q1], lse_part)

                moving.download(slot, [("o", (*rows, dv)), ("lse", rows)], finish)

        _Pipeline(moving, plan.steps, bundles, report).run(compute)
        for slot in outs.slots:
            moving.reclaim(slot)

    if plan.steps:
        _execute(plan, backend, device, progress, "forward", body)


def backward(do, q, k, v, o, lse, dq, dk, dv, *, plan, scale, deterministic, mods, backend,
             device, dlse=None, progress=None):
    """A streamed backward pass: writes ``dq``, ``dk``, ``dv`` ((B, H, N, d) host views)
    from host do, q, k, v and the forward's global o and lse (and ``dlse``).

    Loop order: query chunks outside, key chunks inside, as in the forward. Each query
    chunk's q, o, dO and LSE rows go up once and its dq is summed on the device; each pair
    sends its dk, dv terms back to be summed on the host. The other order (key chunks
    outside, dk/dv summed on the device) would move q, o, dO, LSE up and dq back per pair
    instead of k, v up and dk, dv back: the same bytes with as many kv heads as query
    heads, more with grouped-query attention (Hk < Hq), and the LSE rows besides.
    """
    from .api import _backend_module

    run = _backend_module(backend)
    B, Hq, _, d = q.shape
    Hk, dvd, g = k.shape[1], v.shape[-1], plan._geometry
    acc = _arrays.accumulation_dtype(q.dtype)
    for q0, q1 in _unseen_rows(plan):
        dq[:, :, q0:q1] = 0
    dk_acc = np.zeros(dk.shape, acc)   # summed over query chunks on the host
    dv_acc = np.zeros(dv.shape, acc)

    def body(moving, report):
        xp, R, K = moving.xp, B * Hq * plan.query_rows, B * Hk * plan.key_rows
        named = [("q", q), ("o", o), ("do", do), ("lse", lse)] + ([("dlse", dlse)] if dlse is not None else [])
        bundles = [_row_bundle(moving, plan, named), _key_bundle(moving, k, v, plan)]
        bias = _bias_bundle(moving, mods, g, plan)
        bundles += [bias] if bias else []
        row_outs = _Chunks(moving, {"dq": (R * d, q.dtype)})
        key_outs = _Chunks(moving, {"dk": (K * d, acc), "dv": (K * dvd, acc)})
        dq_pair, dq_acc = xp.empty(R * d, q.dtype), xp.empty(R * d, acc)
        dk_pair, dv_pair = xp.empty(K * d, q.dtype), xp.empty(K * dvd, q.dtype)
        static = _StaticMods(moving, mods, g)

        def compute(s, slots):
            (q0, q1), (k0, k1) = plan.query_bounds[s.row], plan.key_bounds[s.key]
            rows, keys = (B, Hq, q1 - q0), (B, Hk, k1 - k0)
            rs, kv = slots[0], slots[1]
            pm = static.of_pair(q0, q1, k0, k1, slots[2].view("bias", _bias_slice(
                mods.bias, q0, q1, k0, k1).shape) if bias else None)
            dqp = _arrays.flat_view(dq_pair, (*rows, d))
            dkp, dvp = _arrays.flat_view(dk_pair, (*keys, d)), _arrays.flat_view(dv_pair, (*keys, dvd))
            run.attention_backward(
                rs.view("do", (*rows, dvd)), rs.view("q", (*rows, d)), kv.view("k", (*keys, d)),
                kv.view("v", (*keys, dvd)), rs.view("o", (*rows, dvd)), rs.view("lse", rows),
                dqp, dkp, dvp, scale=scale, causal=s.causal, deterministic=deterministic, mods=pm,
                dbias=None, dlse=rs.view("dlse", rows) if dlse is not None else None)
            qa = _arrays.flat_view(dq_acc, (*rows, d))
            if s.first:
                qa[...] = dqp
            else:
                qa += dqp
            slot = key_outs.slots[s.index % 2]
            moving.reclaim(slot)
            slot.view("dk", (*keys, d))[...] = dkp
            slot.view("dv", (*keys, dvd))[...] = dvp

            def add(dk_part, dv_part, k0=k0, k1=k1):
                _host_op(dk_acc[:, :, k0:k1], dk_part, add=True)
                _host_op(dv_acc[:, :, k0:k1], dv_part, add=True)

            moving.download(slot, [("dk", (*keys, d)), ("dv", (*keys, dvd))], add)
            if s.last:
                slot = row_outs.slots[s.row % 2]
                moving.reclaim(slot)
                slot.view("dq", (*rows, d))[...] = qa

                def finish(dq_part, q0=q0, q1=q1):
                    _host_op(dq[:, :, q0:q1], dq_part)

                moving.download(slot, [("dq", (*rows, d))], finish)

        _Pipeline(moving, plan.steps, bundles, report).run(compute)
        for slot in (*key_outs.slots, *row_outs.slots):
            moving.reclaim(slot)

    if plan.steps:
        _execute(plan, backend, device, progress, "backward", body)
    _host_op(dk, dk_acc)
    _host_op(dv, dv_acc)
