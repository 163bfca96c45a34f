"""Ring attention: exact attention over a sequence sharded across ranks (context parallelism).

Each rank holds a shard of q, k and v along the sequence. The K/V shards travel around the
ring (rank r sends to r+1 and receives from r-1), so after R steps every rank has seen
every shard; each step's partial result is merged into fp32 (fp64) accumulators by the
log-sum-exp arithmetic of `cupyflash.merge`. On a GPU the next shard's transfer runs on
a stream of its own while the current shard's kernels run.

Causal attention needs zigzag shards (`zigzag_shard`): with 2R equal chunks, rank r
holds chunks r and 2R-1-r. The kernels' causal mask is aligned bottom-right, so with
equal chunks every (query chunk, key chunk) pair is fully visible, fully hidden or the
diagonal, where a local causal call with Nq == Nk is exact; no other mask is needed:

- step 0 (the rank's own K/V): one causal call over the whole local shard (its first
  chunk sees its own keys up to the diagonal, its second chunk sees all of the first and
  its own up to the diagonal);
- K/V of a rank s < r: every local query sees the first chunk (s) and none of the second;
- K/V of a rank s > r: the second local chunk sees both chunks, the first sees nothing.

So every rank does the same work at every step. Non-causal attention takes any split of
the sequence into equal shards (contiguous or zigzag).

A window, ALiBi and dropout see global coordinates: the band and the ALiBi distance are
measured from the whole problem's diagonal, and dropout draws the bits of the whole
problem's row and key. Their pairs are placed calls, as the streamed path's
(`cupyflash.streaming`, `_mods.Modifiers` ``row0``, ``key0``, ``diagonal``): each zigzag
chunk is a contiguous run of the sequence, so each step runs one call per (query chunk,
key chunk) pair (a rank's two chunks merge into one run where they are adjacent), told the
chunks' first row and key in the whole sequence and its ``Nk - Nq``. A pair the band
leaves empty is skipped (the K/V exchange still runs on every rank), and a pair's keys end
where its query chunk's reach does. The origins are multiples of the chunk length, which
must then be a multiple of `_mods.ORIGIN_ALIGN` (the kernels' dropout blocks); these
options therefore take zigzag shards, causal or not. Dropout with a seed draws exactly
the unsharded call's mask: every pair uses the call's one RNG offset.

The backward pass runs the ring again: for each visiting K/V shard a rank computes the
pair's gradients with the attention backward given the query rows' GLOBAL output and LSE
(P = exp(S - lse) are then the global probabilities, D = rowsum(dO o) the global row
term), so each pair's dq, dk, dv are exactly its share of the whole gradient. dq is
summed locally; the dk/dv accumulators (fp32) travel with their K/V shard and, complete
after R steps, take a last hop to their owner in the gradients' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import _arrays, _mods, _validate
from ..merge import add_into, merge_into
from . import _pairs
from ._place import place_of
from .zigzag import zigzag_chunks

__all__ = ["RingContext", "ring_attention", "ring_attention_backward", "ring_attention_forward",
           "ring_attention_vjp"]


# Checks ------------------------------------------------------------------------------------


def _reject_per_pair_arrays(bias, block_mask):
    """The options the ring does not take, named: arrays as large as the scores (or their
    blocks), which would have to be sharded per (query shard, key shard) pair."""
    for name, value in (("bias", bias), ("block_mask", block_mask)):
        if value is not None:
            raise NotImplementedError(f"{name} is not supported by ring attention: it would "
                                      "have to be sharded per (query, key) shard pair")


def _placed_option_names(options):
    """The options given that need the chunks' places in the whole sequence."""
    window = options.window is not None and tuple(options.window) != (-1, -1)
    return [name for name, on in (("window", window), ("alibi_slopes", options.alibi_slopes is not None),
                                  ("dropout_p", options.dropout_p > 0)) if on]


def _check_placeable(problem, size, names):
    """Shards that the placed pairs can take (module docstring): zigzag shards, two chunks
    each, whose origins in the whole sequence are multiples of `_mods.ORIGIN_ALIGN`. The
    rule is the same on every rank, so all of them refuse the call, none waits for a peer."""
    options = " and ".join(names)
    for name, n in (("q", problem.q_len), ("k", problem.k_len)):
        if n % 2:
            raise ValueError(f"{name}'s shard has {n} rows, an odd number: with {options} ring "
                             "attention takes zigzag shards, two equal chunks per rank "
                             "(zigzag_shard; the sequence length must be divisible by 2 * comm.size)")
        # One rank: its two chunks are one run starting at row 0, and no origin is moved.
        if size > 1 and (n // 2) % _mods.ORIGIN_ALIGN:
            raise ValueError(
                f"{name}'s shard has {n} rows: with {options} each of its two zigzag chunks "
                f"({n // 2} rows) starts at a multiple of its length in the whole sequence, "
                f"and those starts must be multiples of {_mods.ORIGIN_ALIGN} (dropout's Philox "
                f"blocks on the GPU), so the shard length must be a multiple of "
                f"{2 * _mods.ORIGIN_ALIGN} (the sequence a multiple of "
                f"{2 * _mods.ORIGIN_ALIGN} * comm.size = {2 * _mods.ORIGIN_ALIGN * size}; pad it)")


def check_comm(comm):
    """``comm`` has integer ``rank`` and ``size`` with 0 <= rank < size and a ``sendrecv``."""
    for attr in ("rank", "size", "sendrecv"):
        if not hasattr(comm, attr):
            raise TypeError(f"comm must be a communicator (rank, size, sendrecv: see "
                            f"cupyflash.distributed.Communicator), got {type(comm).__name__} "
                            f"without {attr!r}")
    rank, size = comm.rank, comm.size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"comm.size must be a positive integer, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"comm.rank must be in [0, comm.size) = [0, {size}), got {rank!r}")
    return comm


@dataclass(frozen=True)
class _Call:
    q: object
    k: object
    v: object
    problem: _validate.Problem
    scale: float
    mods: _mods.Modifiers
    seed: int | None    # the dropout seed to report (drawn from the process RNG without one)


def _prepare(q, k, v, comm, *, causal, scale, softcap, layout, deterministic, window, dropout_p,
             seed, alibi_slopes, bias, block_mask):
    """Every check of a ring call, before anything is allocated or sent; the dropout
    streams, where the call has no seed, are claimed last (a refused call leaves the
    process RNG as it was)."""
    from ..api import _claim_dropout_streams, _move_modifiers, _resolve_modifiers

    _reject_per_pair_arrays(bias, block_mask)
    options = _validate.check_options(
        causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed, block_mask=None,
        bias=None, alibi_slopes=alibi_slopes, softcap=softcap, layout=layout,
        deterministic=deterministic, backend="auto")
    check_comm(comm)
    q, k, v, problem = _validate.check_inputs(q, k, v, layout=layout)
    if options.causal:
        if problem.k_len != problem.q_len:
            raise ValueError(f"k has {problem.k_len} keys but q has {problem.q_len} queries: causal "
                             "ring attention takes each rank's zigzag shard of one sequence, the "
                             "same rows of q, k and v")
        if problem.q_len % 2:
            raise ValueError(f"q has {problem.q_len} rows, an odd number: causal ring attention "
                             "takes zigzag shards, two equal chunks per rank (zigzag_shard; the "
                             "sequence length must be divisible by 2 * comm.size)")
    placed = _placed_option_names(options)
    if placed:
        _check_placeable(problem, comm.size, placed)
    device = getattr(comm, "device", None)
    if device is not None:
        if problem.kind != _arrays.DEVICE:
            raise TypeError(f"q is a host (NumPy) array but comm ({comm!r}) exchanges GPU "
                            f"arrays; move the shards to GPU {device} (cupy.asarray)")
        if problem.device != device:
            raise ValueError(f"q is on GPU {problem.device} but comm's rank {comm.rank} runs on "
                             f"GPU {device}; each rank's arrays must be on its own GPU")
    # alibi_slopes is checked against the shard's batch dims and heads, the whole call's.
    mods = _resolve_modifiers(options, problem)
    if problem.kind == _arrays.DEVICE:
        from .. import _cuda
        why_not = _cuda.unsupported_reason(problem.dtype, problem.head_dim, problem.value_dim,
                                           heads=problem.heads, device=problem.device, mods=mods)
        if why_not is not None:
            raise ValueError(f"q: the GPU kernels cannot run this case: {why_not}")
    scale = _validate.resolve_scale(options.scale, problem.head_dim, problem.dtype)
    # Without a seed each rank claims its streams from its own process's RNG, as
    # `attention` does (the same `manual_seed` on every rank draws the unsharded call's).
    mods, seed = _claim_dropout_streams(mods, options, problem)
    mods = _move_modifiers(mods, problem.kind, problem.device)
    return _Call(q, k, v, problem, scale, mods, seed), options


# The ring ----------------------------------------------------------------------------------


class _Ring:
    """One rank's view of the ring: its communicator, where it computes, and the streams.

    Compute runs on the stream current at the call; exchanges run on a stream of their
    own, each after the compute queued before it (so buffers are not overwritten while
    read), and the compute waits for an exchange's event before it reads what arrived.
    """

    def __init__(self, comm, place, layout):
        self.comm, self.place, self.layout = comm, place, layout
        self.size, self.rank = comm.size, comm.rank
        self.compute = place.current_stream()
        self.stream = place.new_stream() if self.size > 1 else None

    def view(self, x):
        return _arrays.bhsd_view(x, self.layout)

    def exchange(self, send, recv):
        """Send ``send`` to the next rank and receive ``recv`` from the previous one, after
        the compute queued so far; returns the event of their arrival."""
        place = self.place
        place.wait(self.stream, place.record(self.compute))
        self.comm.sendrecv(send, (self.rank + 1) % self.size, recv, (self.rank - 1) % self.size,
                           self.stream)
        return place.record(self.stream)

    def arrived(self, event):
        self.place.wait(self.compute, event)

    def visiting(self, k, v):
        """Yield ``(step, owner, k, v)`` for the K/V shard of each rank in turn, starting
        with this rank's own; the next shard is in flight while a step computes (two
        receive buffers, each reused once the step that read it is done)."""
        xp = self.place.xp
        buffers = [(xp.empty_like(k), xp.empty_like(v)) for _ in range(min(2, self.size - 1))]
        current = (k, v)
        for step in range(self.size):
            if step + 1 < self.size:
                following = buffers[step % 2]
                event = self.exchange(current, following)
            yield step, (self.rank - step) % self.size, current
            if step + 1 < self.size:
                self.arrived(event)
                current = following


@dataclass(frozen=True)
class _PairCall:
    """One backend call of a ring step: this rank's query rows and the visiting shard's
    key rows it takes (local indices), whether it needs the causal mask, its modifiers."""

    rows: tuple
    keys: tuple
    causal: bool
    mods: _mods.Modifiers


def _runs(rank, size, n):
    """The contiguous runs of rank ``rank``'s zigzag shard of ``n`` rows, as
    ``(local start, local stop, start in the whole sequence)``: its two chunks, or one run
    where they are adjacent (the last rank, whose chunks are the sequence's middle two,
    and a ring of one)."""
    c = n // 2
    first, second = zigzag_chunks(rank, size)
    if second == first + 1:
        return [(0, n, first * c)]
    return [(0, c, first * c), (c, n, second * c)]


@dataclass(frozen=True)
class _Shards:
    """Where this rank's shards lie in the whole problem, and the calls of each ring step."""

    rank: int
    size: int
    n_q: int            # this rank's query rows (every rank's shard has as many)
    n_k: int
    causal: bool
    mods: _mods.Modifiers

    def calls(self, step, owner):
        """The `_PairCall` list of the step that visits ``owner``'s K/V shard."""
        if _pairs.needs_placing(self.mods):
            return self._placed_calls(owner)
        n_q, n_k = self.n_q, self.n_k
        if not self.causal:
            return [_PairCall((0, n_q), (0, n_k), False, self.mods)]
        half = n_q // 2
        if step == 0:
            return [_PairCall((0, n_q), (0, n_k), True, self.mods)]
        if owner < self.rank:
            return [_PairCall((0, n_q), (0, half), False, self.mods)]
        return [_PairCall((half, n_q), (0, n_k), False, self.mods)]

    def _placed_calls(self, owner):
        totals = dict(total_q=self.size * self.n_q, total_k=self.size * self.n_k)
        calls = []
        for lo, hi, q0 in _runs(self.rank, self.size, self.n_q):
            for klo, khi, k0 in _runs(owner, self.size, self.n_k):
                placed = _pairs.place(q0, q0 + hi - lo, k0, k0 + khi - klo, causal=self.causal,
                                      mods=self.mods, **totals)
                if placed is not None:   # else the band hides the pair
                    stop, causal, mods = placed
                    calls.append(_PairCall((lo, hi), (klo, klo + stop - k0), causal, mods))
        return calls


def _rows(x, lo, hi):
    return x[:, :, lo:hi]


def _forward(ring, shards, q, k, v, o, lse, *, scale):
    """Write this rank's o (input dtype) and lse of ring attention; q, k, v, o in the
    caller's layout, k and v C-contiguous (they are sent as they are)."""
    xp, backend = ring.place.xp, ring.place.backend
    qb, ob = ring.view(q), ring.view(o)
    lse_acc = _arrays.lse_bhs_view(lse, ring.layout)   # accumulates in place (its dtype)
    B, Hq, n_q, _ = qb.shape
    dv = v.shape[-1]
    acc = lse.dtype
    # Rows no call reaches (a window can hide every key from them) keep o = 0 and
    # lse = -inf, as `attention` gives them; every call merges into these.
    o_acc = xp.zeros((B, Hq, n_q, dv), acc)
    lse_acc[...] = -xp.inf
    part_o, part_lse = xp.empty(B * Hq * n_q * dv, q.dtype), xp.empty(B * Hq * n_q, acc)
    for step, owner, (kc, vc) in ring.visiting(k, v):
        kb, vb = ring.view(kc), ring.view(vc)
        for call in shards.calls(step, owner):
            (lo, hi), (klo, khi) = call.rows, call.keys
            po = _arrays.flat_view(part_o, (B, Hq, hi - lo, dv))
            pl = _arrays.flat_view(part_lse, (B, Hq, hi - lo))
            backend.attention_forward(_rows(qb, lo, hi), _rows(kb, klo, khi), _rows(vb, klo, khi),
                                      po, pl, scale=scale, causal=call.causal, mods=call.mods)
            merge_into(_rows(o_acc, lo, hi), _rows(lse_acc, lo, hi), po, pl, xp)
    ob[...] = o_acc   # cast as it is copied


def _backward(ring, shards, do, q, k, v, o, lse, dq, dk, dv, *, dlse, scale, deterministic):
    """Write this rank's dq, dk, dv (caller's layout); ``lse`` and ``dlse`` (None or the
    accumulation dtype) are (B, Hq, Nq) views."""
    xp, backend = ring.place.xp, ring.place.backend
    qb, ob, dob = ring.view(q), ring.view(o), ring.view(do)
    kb0, vb0 = ring.view(k), ring.view(v)
    B, Hq, n_q, d = qb.shape
    _, Hk, n_k, dv_dim = vb0.shape
    acc = lse.dtype
    dq_acc = xp.zeros((B, Hq, n_q, d), acc)
    # The accumulators of the visiting shard's dk, dv (fp32 on the wire), and the
    # buffers the next one arrives in.
    travel = [(xp.zeros((B, Hk, n_k, d), acc), xp.zeros((B, Hk, n_k, dv_dim), acc))]
    if ring.size > 1:
        travel.append((xp.empty((B, Hk, n_k, d), acc), xp.empty((B, Hk, n_k, dv_dim), acc)))
    gq = xp.empty(B * Hq * n_q * d, q.dtype)
    gk, gv = xp.empty(B * Hk * n_k * d, q.dtype), xp.empty(B * Hk * n_k * dv_dim, q.dtype)
    landed = None
    for step, owner, (kc, vc) in ring.visiting(k, v):
        kb, vb = ring.view(kc), ring.view(vc)
        dk_acc, dv_acc = travel[step % 2]
        for call in shards.calls(step, owner):
            (lo, hi), (klo, khi) = call.rows, call.keys
            pq = _arrays.flat_view(gq, (B, Hq, hi - lo, d))
            pk = _arrays.flat_view(gk, (B, Hk, khi - klo, d))
            pv = _arrays.flat_view(gv, (B, Hk, khi - klo, dv_dim))
            backend.attention_backward(
                _rows(dob, lo, hi), _rows(qb, lo, hi), _rows(kb, klo, khi), _rows(vb, klo, khi),
                _rows(ob, lo, hi), _rows(lse, lo, hi), pq, pk, pv, scale=scale, causal=call.causal,
                deterministic=deterministic, mods=call.mods, dbias=None,
                dlse=None if dlse is None else _rows(dlse, lo, hi))
            add_into(_rows(dq_acc, lo, hi), pq)
            if landed is not None:   # the accumulators of this shard, from the previous rank
                ring.arrived(landed)
                landed = None
            add_into(_rows(dk_acc, klo, khi), pk)
            add_into(_rows(dv_acc, klo, khi), pv)
        if step + 1 < ring.size:   # the sums travel on with their shard
            landed = ring.exchange(travel[step % 2], travel[(step + 1) % 2])
    if landed is not None:   # the last step had no call to wait for them
        ring.arrived(landed)
    dk_own, dv_own = _sums_home(ring, travel[(ring.size - 1) % 2], dk.dtype)
    ring.view(dq)[...] = dq_acc
    ring.view(dk)[...] = dk_own
    ring.view(dv)[...] = dv_own


def _sums_home(ring, sums, dtype):
    """The complete dk, dv sums of the shard this rank held last, sent one hop on to their
    owner, and this rank's own from its predecessor. Complete, they travel in the
    gradients' dtype: the last hop follows the last kernels with nothing to hide it, and
    16-bit sums take half the bytes of the accumulators."""
    if ring.size == 1:
        return sums
    send = [s.astype(dtype, copy=False) for s in sums]
    home = [ring.place.xp.empty_like(s) for s in send]
    ring.arrived(ring.exchange(send, home))
    return home


# Public functions ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RingContext:
    """What `ring_attention_backward` needs from one `ring_attention_forward` call on one
    rank: this rank's shards, its output and LSE, the communicator and the options. Made
    by `ring_attention_forward`; keep q, k, v and o unchanged until the backward pass, and
    run the backward pass on every rank (it communicates)."""

    q: object = field(repr=False)
    k: object = field(repr=False)
    v: object = field(repr=False)
    o: object = field(repr=False)
    lse: object = field(repr=False)
    comm: object
    scale: float
    causal: bool
    layout: str
    softcap: float
    deterministic: bool
    window: tuple | None
    dropout_p: float
    seed: int | None        # the dropout seed (drawn from the process RNG where none was given)
    rng_offset: int         # the first Philox stream of this rank's dropout
    alibi_slopes: object = field(repr=False)
    _shards: _Shards = field(repr=False)
    _problem: _validate.Problem = field(repr=False)


_DOC_PARAMETERS = """\
q, k, v : array
    This rank's shards along the sequence, in ``layout``: "bhsd" ``(..., H, n, d)`` or
    "bshd" ``(B, n, H, d)``; NumPy arrays (computed by the NumPy backend) or CuPy arrays
    (computed on their GPU, which must be the communicator's). Every rank passes shards of
    one shape and dtype. k and v may have fewer heads than q (GQA). For ``causal``,
    ``window``, ``alibi_slopes`` and ``dropout_p`` the shards must be zigzag shards
    (`zigzag_shard`; causal: q, k, v the same rows); otherwise any split into equal
    shards works. With ``window``, ``alibi_slopes`` or ``dropout_p`` on more than one
    rank, a shard's length must be a multiple of 64 (each zigzag chunk starts at a
    multiple of 32 in the whole sequence, as the kernels' dropout blocks need).
comm : Communicator
    `NcclCommunicator` (one process per GPU, e.g. from `from_env`) or a rank of a
    `LocalRing`. Every rank of it must make the same call.
causal : bool, default False
    Causal attention over the whole sequence (bottom-right aligned, as `attention`).
scale : float, optional
    Default ``1 / sqrt(d)``.
softcap : float, default 0.0
    As for `cupyflash.attention` (it acts on each score, so it shards freely).
layout : {"bhsd", "bshd"}, default "bhsd"
deterministic : bool, default False
    Passed to each pair's backward; the ring's own sums run in a fixed order.
window : (int, int), optional
    Sliding window over the whole sequence, as for `cupyflash.attention` (aligned
    bottom-right with the whole problem's ``Nk - Nq``). Pairs of shards the band leaves
    empty are skipped; every rank still passes the K/V shards on.
dropout_p : float, default 0.0
    Dropout on the attention probabilities, as for `cupyflash.attention`; the mask is
    indexed by the whole sequence's rows and keys.
seed : int, optional
    Dropout seed in [0, 2**64): the same seed on every rank draws exactly the mask of the
    unsharded call with that seed. None: each rank claims fresh streams from its own
    process's RNG, as `cupyflash.attention` does (`cupyflash.manual_seed` with one value
    on every rank, before the same calls, gives the unsharded call's mask again).
alibi_slopes : array, optional
    ALiBi slopes broadcastable to ``(*batch, Hq)`` (host or GPU), as for
    `cupyflash.attention`: distances are the whole sequence's.
bias, block_mask
    Not supported: anything but None raises NotImplementedError (they would have to be
    sharded per pair of shards)."""


def _with_doc(func):
    func.__doc__ = func.__doc__.replace("    @parameters@\n", "".join(
        "    " + line + "\n" if line else "\n" for line in _DOC_PARAMETERS.splitlines()))
    return func


def _empty_outputs(call, layout):
    p = call.problem
    o = _arrays.empty((*call.q.shape[:-1], p.value_dim), p.dtype, p.kind)
    lse = _arrays.empty(_arrays.lse_shape(call.q.shape, layout), _arrays.accumulation_dtype(p.dtype),
                        p.kind)
    return o, lse


@_with_doc
def ring_attention_forward(q, k, v, comm, *, causal=False, scale=None, softcap=0.0, layout="bhsd",
                           deterministic=False, window=None, dropout_p=0.0, seed=None,
                           alibi_slopes=None, bias=None, block_mask=None):
    """Ring attention's forward pass on this rank, keeping what the backward pass needs.

    Parameters
    ----------
    @parameters@

    Returns
    -------
    o : array
        This rank's rows of the output, shaped like q with v's last dim, in q's dtype.
    ctx : RingContext
        For `ring_attention_backward`; ``ctx.lse`` is this rank's rows of the LSE.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, named, before anything is allocated or sent (q, k, v and the
        options as for `cupyflash.attention`; odd or unequal causal shards; shards whose
        chunks cannot be placed for window, ALiBi or dropout; a bad comm; arrays not on
        the communicator's GPU).
    NotImplementedError
        ``bias`` or ``block_mask``.
    """
    call, options = _prepare(q, k, v, comm, causal=causal, scale=scale, softcap=softcap,
                             layout=layout, deterministic=deterministic, window=window,
                             dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes, bias=bias,
                             block_mask=block_mask)
    problem = call.problem
    shards = _Shards(rank=comm.rank, size=comm.size, n_q=problem.q_len, n_k=problem.k_len,
                     causal=options.causal, mods=call.mods)
    place = place_of(call.q)
    with place.activate():
        o, lse = _empty_outputs(call, layout)
        if call.problem.batch:   # every rank has the same (empty) batch: nothing to send
            xp = place.xp
            ring = _Ring(comm, place, layout)
            _forward(ring, shards, call.q, xp.ascontiguousarray(call.k),
                     xp.ascontiguousarray(call.v), o, lse, scale=call.scale)
    ctx = RingContext(q=call.q, k=call.k, v=call.v, o=o, lse=lse, comm=comm, scale=call.scale,
                      causal=options.causal, layout=layout, softcap=options.softcap,
                      deterministic=options.deterministic, window=options.window,
                      dropout_p=options.dropout_p, seed=call.seed, rng_offset=call.mods.rng_offset,
                      alibi_slopes=options.alibi_slopes, _shards=shards,
                      _problem=problem)
    return o, ctx


@_with_doc
def ring_attention(q, k, v, comm, *, causal=False, scale=None, softcap=0.0, layout="bhsd",
                   deterministic=False, return_lse=False, window=None, dropout_p=0.0, seed=None,
                   alibi_slopes=None, bias=None, block_mask=None):
    """Exact attention over a sequence sharded across the ranks of ``comm`` (ring attention).

    Rank r gets the rows of ``attention(Q, K, V)`` for its own queries, where Q, K, V are
    the whole sequence; the K/V shards pass around the ring, overlapped with the kernels.

    Parameters
    ----------
    @parameters@
    return_lse : bool, default False
        Also return this rank's rows of the log-sum-exp (float32; float64 for float64).

    Returns
    -------
    o : array
        This rank's rows of the output (``zigzag_unshard`` of every rank's gives the whole).
    lse : array
        With ``return_lse=True``.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As `ring_attention_forward`.

    Examples
    --------
    >>> comm = from_env()                                        # doctest: +SKIP
    >>> q, k, v = (zigzag_shard(x, comm.rank, comm.size, axis=-2) for x in (Q, K, V))
    >>> o = ring_attention(q, k, v, comm, causal=True)          # doctest: +SKIP
    """
    return_lse = _validate.check_flag(return_lse, "return_lse")
    o, ctx = ring_attention_forward(q, k, v, comm, causal=causal, scale=scale, softcap=softcap,
                                    layout=layout, deterministic=deterministic, window=window,
                                    dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
                                    bias=bias, block_mask=block_mask)
    return (o, ctx.lse) if return_lse else o


def ring_attention_backward(do, ctx, *, dlse=None):
    """Gradients of ring attention on this rank, from its `ring_attention_forward` context.

    Every rank must call it (the K/V shards and their gradients travel the ring again).

    Parameters
    ----------
    do : array
        Gradient of the loss with respect to this rank's o: its shape and dtype, on its side.
    ctx : RingContext
    dlse : array, optional
        Gradient with respect to this rank's LSE (``ctx.lse``'s shape, a real float dtype).

    Returns
    -------
    dq, dk, dv : array
        The gradients with respect to this rank's q, k, v shards (complete: dk and dv sum
        the contributions of every rank's queries), shaped and typed like them.
    """
    if not isinstance(ctx, RingContext):
        raise TypeError(f"ctx must be a RingContext from ring_attention_forward, got {type(ctx).__name__}")
    problem = ctx._problem
    do = _validate.check_do(do, o=ctx.o, kind=problem.kind, device=problem.device)
    if dlse is not None:
        dlse = _validate.check_dlse(dlse, lse=ctx.lse, kind=problem.kind, device=problem.device)
    place = place_of(ctx.q)
    with place.activate():
        grads = tuple(_arrays.empty(x.shape, x.dtype, problem.kind) for x in (ctx.q, ctx.k, ctx.v))
        if problem.batch:
            xp = place.xp
            if dlse is not None:
                dlse = _arrays.lse_bhs_view(dlse.astype(ctx.lse.dtype), ctx.layout)
            ring = _Ring(ctx.comm, place, ctx.layout)
            _backward(ring, ctx._shards, do, ctx.q, xp.ascontiguousarray(ctx.k),
                      xp.ascontiguousarray(ctx.v), ctx.o, _arrays.lse_bhs_view(ctx.lse, ctx.layout),
                      *grads, dlse=dlse, scale=ctx.scale, deterministic=ctx.deterministic)
    return grads


@_with_doc
def ring_attention_vjp(q, k, v, comm, *, causal=False, scale=None, softcap=0.0, layout="bhsd",
                       deterministic=False, window=None, dropout_p=0.0, seed=None,
                       alibi_slopes=None, bias=None, block_mask=None):
    """Ring attention's output on this rank and its vector-Jacobian product.

    Parameters
    ----------
    @parameters@

    Returns
    -------
    o : array
    vjp : callable
        ``vjp(do, *, dlse=None) -> (dq, dk, dv)``, as `ring_attention_backward`; every
        rank must call it.
    """
    o, ctx = ring_attention_forward(q, k, v, comm, causal=causal, scale=scale, softcap=softcap,
                                    layout=layout, deterministic=deterministic, window=window,
                                    dropout_p=dropout_p, seed=seed, alibi_slopes=alibi_slopes,
                                    bias=bias, block_mask=block_mask)

    def vjp(do, *, dlse=None):
        return ring_attention_backward(do, ctx, dlse=dlse)

    return o, vjp
