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

The backward pass runs the ring again: for each visiting K/V shard a rank computes the
pair's gradients with the attention backward given the query rows' GLOBAL output and LSE
(P = exp(S - lse) are then the global probabilities, D = rowsum(dO o) the global row
term), so each pair's dq, dk, dv are exactly its share of the whole gradient. dq is
summed locally; the dk/dv accumulators (fp32) travel with their K/V shard and, after a
last hop, arrive complete at their owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import _arrays, _mods, _validate
from ..merge import merge_into
from ._place import place_of

__all__ = ["RingContext", "ring_attention", "ring_attention_backward", "ring_attention_forward",
           "ring_attention_vjp"]


# Checks ------------------------------------------------------------------------------------


def _reject_global_options(window, dropout_p, alibi_slopes, bias, block_mask):
    """Options the ring does not take yet, named: those that need global coordinates
    (window, ALiBi, dropout's RNG indices) and the per-pair arrays (bias, block mask)."""
    if window is not None and tuple(window) != (-1, -1):
        raise NotImplementedError("window is not supported by ring attention yet: a sliding "
                                  "window needs each chunk's global position")
    if dropout_p:
        raise NotImplementedError("dropout_p > 0 is not supported by ring attention yet: the "
                                  "dropout mask is indexed by global row and column")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported by ring attention yet: the "
                                  "ALiBi term needs each chunk's global position")
    for name, value in (("bias", bias), ("block_mask", block_mask)):
        if value is not None:
            raise NotImplementedError(f"{name} is not supported by ring attention: it would "
                                      "have to be sharded per (query, key) shard pair")


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


def _prepare(q, k, v, comm, *, causal, scale, softcap, layout, deterministic, window, dropout_p,
             alibi_slopes, bias, block_mask):
    """Every check of a ring call, before anything is allocated or sent."""
    _reject_global_options(window, dropout_p, alibi_slopes, bias, block_mask)
    options = _validate.check_options(
        causal=causal, scale=scale, window=None, dropout_p=0.0, seed=None, block_mask=None,
        bias=None, alibi_slopes=None, softcap=softcap, layout=layout, deterministic=deterministic,
        backend="auto")
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
    device = getattr(comm, "device", None)
    if device is not None:
        if problem.kind != _arrays.DEVICE:
            raise TypeError(f"q is a host (NumPy) array but comm ({comm!r}) exchanges GPU "
                            f"arrays; move the shards to GPU {device} (cupy.asarray)")
        if problem.device != device:
            raise ValueError(f"q is on GPU {problem.device} but comm's rank {comm.rank} runs on "
                             f"GPU {device}; each rank's arrays must be on its own GPU")
    mods = _mods.Modifiers(softcap=options.softcap) if options.softcap else _mods.NONE
    if problem.kind == _arrays.DEVICE:
        from .. import _cuda
        why_not = _cuda.unsupported_reason(problem.dtype, problem.head_dim, problem.value_dim,
                                           heads=problem.heads, device=problem.device, mods=mods)
        if why_not is not None:
            raise ValueError(f"q: the GPU kernels cannot run this case: {why_not}")
    scale = _validate.resolve_scale(options.scale, problem.head_dim, problem.dtype)
    return _Call(q, k, v, problem, scale, mods), options


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


def _pairs(step, owner, rank, n_q, n_k, causal):
    """The (query rows, key rows, causal) of the calls of one step (module docstring)."""
    if not causal:
        return [((0, n_q), (0, n_k), False)]
    half = n_q // 2
    if step == 0:
        return [((0, n_q), (0, n_k), True)]
    if owner < rank:
        return [((0, n_q), (0, half), False)]
    return [((half, n_q), (0, n_k), False)]


def _rows(x, lo, hi):
    return x[:, :, lo:hi]


def _forward(ring, q, k, v, o, lse, *, scale, causal, mods):
    """Write this rank's o (input dtype) and lse of ring attention; q, k, v, o in the
    caller's layout, k and v C-contiguous (they are sent as they are)."""
    xp, backend = ring.place.xp, ring.place.backend
    qb, ob = ring.view(q), ring.view(o)
    lse_acc = _arrays.lse_bhs_view(lse, ring.layout)   # accumulates in place (its dtype)
    B, Hq, n_q, _ = qb.shape
    n_k, dv = k.shape[-3 if ring.layout == "bshd" else -2], v.shape[-1]
    acc = lse.dtype
    o_acc = xp.empty((B, Hq, n_q, dv), acc)
    part_o, part_lse = xp.empty(B * Hq * n_q * dv, q.dtype), xp.empty(B * Hq * n_q, acc)
    for step, owner, (kc, vc) in ring.visiting(k, v):
        kb, vb = ring.view(kc), ring.view(vc)
        for (lo, hi), (klo, khi), diagonal in _pairs(step, owner, ring.rank, n_q, n_k, causal):
            po = _arrays.flat_view(part_o, (B, Hq, hi - lo, dv))
            pl = _arrays.flat_view(part_lse, (B, Hq, hi - lo))
            backend.attention_forward(_rows(qb, lo, hi), _rows(kb, klo, khi), _rows(vb, klo, khi),
                                      po, pl, scale=scale, causal=diagonal, mods=mods)
            if step == 0:   # every row: the first call initialises the accumulators
                o_acc[...] = po.astype(acc)
                lse_acc[...] = pl
                continue
            merge_into(_rows(o_acc, lo, hi), _rows(lse_acc, lo, hi), po, pl, xp)
    ob[...] = o_acc.astype(o.dtype)


def _backward(ring, do, q, k, v, o, lse, dq, dk, dv, *, dlse, scale, causal, mods, deterministic):
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
        for (lo, hi), (klo, khi), diagonal in _pairs(step, owner, ring.rank, n_q, n_k, causal):
            pq = _arrays.flat_view(gq, (B, Hq, hi - lo, d))
            pk = _arrays.flat_view(gk, (B, Hk, khi - klo, d))
            pv = _arrays.flat_view(gv, (B, Hk, khi - klo, dv_dim))
            backend.attention_backward(
                _rows(dob, lo, hi), _rows(qb, lo, hi), _rows(kb, klo, khi), _rows(vb, klo, khi),
                _rows(ob, lo, hi), _rows(lse, lo, hi), pq, pk, pv, scale=scale, causal=diagonal,
                deterministic=deterministic, mods=mods, dbias=None,
                dlse=None if dlse is None else _rows(dlse, lo, hi))
            _rows(dq_acc, lo, hi)[...] += pq.astype(acc)
            if landed is not None:   # the accumulators of this shard, from the previous rank
                ring.arrived(landed)
                landed = None
            _rows(dk_acc, klo, khi)[...] += pk.astype(acc)
            _rows(dv_acc, klo, khi)[...] += pv.astype(acc)
        if ring.size > 1:   # after the last step this sends each shard's sums home
            landed = ring.exchange(travel[step % 2], travel[(step + 1) % 2])
    if landed is not None:
        ring.arrived(landed)
    dk_own, dv_own = travel[ring.size % len(travel)]   # after R hops: this rank's own shard
    ring.view(dq)[...] = dq_acc.astype(dq.dtype)
    ring.view(dk)[...] = dk_own.astype(dk.dtype)
    ring.view(dv)[...] = dv_own.astype(dv.dtype)


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
    _mods: _mods.Modifiers = field(repr=False)
    _problem: _validate.Problem = field(repr=False)


_DOC_PARAMETERS = """\
q, k, v : array
    This rank's shards along the sequence, in ``layout``: "bhsd" ``(..., H, n, d)`` or
    "bshd" ``(B, n, H, d)``; NumPy arrays (computed by the NumPy backend) or CuPy arrays
    (computed on their GPU, which must be the communicator's). Every rank passes shards of
    one shape and dtype. k and v may have fewer heads than q (GQA). For ``causal`` the
    shards must be zigzag shards (`zigzag_shard`) and q, k, v the same rows; otherwise
    any split into equal shards works.
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
window, dropout_p, alibi_slopes, bias, block_mask
    Not supported yet: anything but their defaults raises NotImplementedError."""


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
                           deterministic=False, window=None, dropout_p=0.0, alibi_slopes=None,
                           bias=None, block_mask=None):
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
        Bad arguments, named, before anything is allocated or sent (q, k, v as for
        `cupyflash.attention`; odd or unequal causal shards; a bad comm; arrays not on the
        communicator's GPU).
    NotImplementedError
        An option of those listed above.
    """
    call, options = _prepare(q, k, v, comm, causal=causal, scale=scale, softcap=softcap,
                             layout=layout, deterministic=deterministic, window=window,
                             dropout_p=dropout_p, alibi_slopes=alibi_slopes, bias=bias,
                             block_mask=block_mask)
    place = place_of(call.q)
    with place.activate():
        o, lse = _empty_outputs(call, layout)
        if call.problem.batch:   # every rank has the same (empty) batch: nothing to send
            xp = place.xp
            ring = _Ring(comm, place, layout)
            _forward(ring, call.q, xp.ascontiguousarray(call.k), xp.ascontiguousarray(call.v), o,
                     lse, scale=call.scale, causal=options.causal, mods=call.mods)
    ctx = RingContext(q=call.q, k=call.k, v=call.v, o=o, lse=lse, comm=comm, scale=call.scale,
                      causal=options.causal, layout=layout, softcap=options.softcap,
                      deterministic=options.deterministic, _mods=call.mods, _problem=call.problem)
    return o, ctx


@_with_doc
def ring_attention(q, k, v, comm, *, causal=False, scale=None, softcap=0.0, layout="bhsd",
                   deterministic=False, return_lse=False, window=None, dropout_p=0.0,
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
                                    dropout_p=dropout_p, alibi_slopes=alibi_slopes, bias=bias,
                                    block_mask=block_mask)
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
            _backward(ring, do, ctx.q, xp.ascontiguousarray(ctx.k), xp.ascontiguousarray(ctx.v),
                      ctx.o, _arrays.lse_bhs_view(ctx.lse, ctx.layout), *grads, dlse=dlse,
                      scale=ctx.scale, causal=ctx.causal, mods=ctx._mods,
                      deterministic=ctx.deterministic)
    return grads


@_with_doc
def ring_attention_vjp(q, k, v, comm, *, causal=False, scale=None, softcap=0.0, layout="bhsd",
                       deterministic=False, window=None, dropout_p=0.0, alibi_slopes=None,
                       bias=None, block_mask=None):
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
                                    dropout_p=dropout_p, alibi_slopes=alibi_slopes, bias=bias,
                                    block_mask=block_mask)

    def vjp(do, *, dlse=None):
        return ring_attention_backward(do, ctx, dlse=dlse)

    return o, vjp
