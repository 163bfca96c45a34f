"""Varlen attention on host arrays larger than the GPU's memory (issue #17): packed
sequences streamed through a bounded device memory.

Sequences are independent problems, so a streamed varlen call is cut between them, never
inside one where it can be helped: consecutive sequences whose in-memory varlen call fits
the limit run as one such call (a *group*: its packed rows go up, its outputs come back),
and a sequence too long for the limit alone runs as a dense batch-1 streamed call over
its own rows (`cupyflash.streaming`), with the options as the varlen call applies them to
that sequence: its own bottom-right corner for causal and the window, its row of ALiBi
slopes, and its dropout streams (a varlen call's batch entry is the sequence, so the
sequence's streams start ``s * Hq`` past the call's RNG offset). Sequences without a
query row or without a key need no device at all where they do not fit a group: their
outputs are set on the host.

The plan is made once per pass (`plan_for`), in the sequences' order; its ``pairs``
counts the work `progress` reports: one per group, and each streamed sequence's pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import _arrays, streaming

__all__ = ["VarlenPart", "VarlenPlan"]

# Under varlen the backward kernels read up to a 128-row tile past the rows of the last
# sequence in their workspaces (`_cuda._plan_backward`): a group's call counts it.
_WORKSPACE_PAD_ROWS = 128


@dataclass(frozen=True)
class VarlenPart:
    """Sequences ``first`` to ``stop - 1`` of a streamed varlen pass, run one way.

    Attributes
    ----------
    kind : {"group", "streamed", "host"}
        "group": one in-memory varlen call over the sequences' packed rows; "streamed":
        one sequence too long for the limit, as a dense streamed call (``plan``); "host":
        sequences with no query rows or no keys, whose outputs are set on the host.
    device_bytes : int
        Device bytes the part holds at once.
    plan : StreamingPlan or None
        The streamed sequence's plan.
    """

    kind: str
    first: int
    stop: int
    device_bytes: int
    plan: object = None

    @property
    def pairs(self):
        if self.kind == "streamed":
            return self.plan.pairs
        return 1 if self.kind == "group" else 0


@dataclass(frozen=True)
class VarlenPlan:
    """How a streamed varlen pass cuts its sequences (module docstring).

    Attributes
    ----------
    backward, causal : bool
    parts : tuple of VarlenPart
        In the sequences' order, covering every sequence once.
    pairs : int
        Units of work `progress` counts: one per group, a streamed sequence's pairs.
    device_memory_limit, device_bytes, in_memory_bytes : int
        The bound, the most bytes any part holds at once (at most the bound) and the
        in-memory call's bytes.
    """

    backward: bool
    causal: bool
    parts: tuple
    device_memory_limit: int
    in_memory_bytes: int

    @property
    def device_bytes(self):
        return max((p.device_bytes for p in self.parts), default=0)

    @property
    def pairs(self):
        return sum(p.pairs for p in self.parts)


def _group_bytes(g, cu_q, cu_k, first, stop, backward):
    """Device bytes of one in-memory varlen call over sequences ``first`` to ``stop - 1``
    (`streaming.in_memory_bytes` of their packed rows, with the sequence boundaries and
    the varlen workspace padding)."""
    rows, keys = int(cu_q[stop] - cu_q[first]), int(cu_k[stop] - cu_k[first])
    part = dataclasses.replace(g, q_len=rows, k_len=keys)
    pad = backward * 2 * g.q_heads * _WORKSPACE_PAD_ROWS * g.acc_size
    return streaming.in_memory_bytes(part, backward) + 2 * 4 * (stop - first + 1) + pad


def _slopes_of(mods, first, stop):
    """The ALiBi slopes of sequences ``first`` to ``stop - 1`` (one row per sequence, or
    one row for all)."""
    slopes = mods.alibi_slopes
    return slopes[first:stop] if slopes is not None and slopes.shape[0] > 1 else slopes


def sequence_mods(mods, s, heads):
    """The modifiers of sequence ``s`` as a call of its own (batch 1, no cu_seqlens): every
    other field as the varlen call's, so that an option added later carries over."""
    return dataclasses.replace(mods, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                               rng_offset=(mods.rng_offset + s * heads) % 2**64,
                               alibi_slopes=_slopes_of(mods, s, s + 1))


def group_mods(mods, cu_q, cu_k, first, stop, heads):
    """The modifiers of sequences ``first`` to ``stop - 1`` as one varlen call of their own
    (host boundaries counted from the group's first row and key)."""
    lengths_q, lengths_k = np.diff(cu_q[first:stop + 1]), np.diff(cu_k[first:stop + 1])
    return dataclasses.replace(
        mods, cu_seqlens_q=(cu_q[first:stop + 1] - cu_q[first]).astype(np.int32),
        cu_seqlens_k=(cu_k[first:stop + 1] - cu_k[first]).astype(np.int32),
        max_seqlen_q=int(lengths_q.max()), max_seqlen_k=int(lengths_k.max()),
        rng_offset=(mods.rng_offset + first * heads) % 2**64, alibi_slopes=_slopes_of(mods, first, stop))


def _host_boundaries(mods):
    """The call's cu_seqlens_q and cu_seqlens_k as host arrays."""
    return tuple(np.asarray(_arrays.move(x, _arrays.HOST, None)) for x in (mods.cu_seqlens_q, mods.cu_seqlens_k))


def _has_work(cu_q, cu_k, first, stop):
    """Whether a sequence in the range has both query rows and keys."""
    return bool(((np.diff(cu_q[first:stop + 1]) > 0) & (np.diff(cu_k[first:stop + 1]) > 0)).any())


def plan_for(g, mods, limit, *, backward) -> VarlenPlan:
    """The parts of a varlen pass within ``limit`` bytes: groups as long as they fit, in
    the sequences' order; a sequence that does not fit alone streams (ValueError naming
    ``device_memory_limit`` when not even one chunk of it fits). ``g`` is the
    `streaming._Geometry` of the packed (1, H, total, d) problem; ``mods`` holds the host
    cu_seqlens."""
    cu_q, cu_k = _host_boundaries(mods)
    sequences = len(cu_q) - 1
    parts, first = [], 0
    while first < sequences:
        if _group_bytes(g, cu_q, cu_k, first, first + 1, backward) > limit:
            parts.append(_alone(g, mods, cu_q, cu_k, first, limit, backward))
            first += 1
            continue
        stop = first + 1
        while stop < sequences and _group_bytes(g, cu_q, cu_k, first, stop + 1, backward) <= limit:
            stop += 1
        if _has_work(cu_q, cu_k, first, stop):
            parts.append(VarlenPart("group", first, stop, _group_bytes(g, cu_q, cu_k, first, stop, backward)))
        else:
            parts.append(VarlenPart("host", first, stop, 0))
        first = stop
    return VarlenPlan(backward=backward, causal=g.causal, parts=tuple(parts), device_memory_limit=int(limit),
                      in_memory_bytes=_group_bytes(g, cu_q, cu_k, 0, sequences, backward))


def _alone(g, mods, cu_q, cu_k, s, limit, backward):
    """The part of sequence ``s``, too long for an in-memory call within ``limit``."""
    if not _has_work(cu_q, cu_k, s, s + 1):
        return VarlenPart("host", s, s + 1, 0)
    nq, nk = int(cu_q[s + 1] - cu_q[s]), int(cu_k[s + 1] - cu_k[s])
    seq = sequence_mods(mods, s, g.q_heads)
    one = streaming.geometry((1, g.q_heads, nq, g.head_dim), (1, g.kv_heads, nk, g.head_dim),
                             (1, g.kv_heads, nk, g.value_dim), g.dtype, seq, causal=g.causal, dlse=g.dlse)
    plan = streaming.plan_for(one, seq, limit, backward=backward)
    return VarlenPart("streamed", s, s + 1, plan.device_bytes, plan)


# Running a plan ------------------------------------------------------------------------------


class _Run:
    """What every part of a pass shares: the (1, H, total, ...) host views, the backend,
    where it computes and the progress of the whole pass."""

    def __init__(self, plan, mods, backend, device, progress, what, heads):
        from .api import _backend_module, _move_modifiers

        self.move_modifiers = _move_modifiers
        self.plan, self.mods, self.backend, self.device = plan, mods, backend, device
        self.run = _backend_module(backend)
        self.kind = _arrays.HOST if backend == "numpy" else _arrays.DEVICE
        self.cu_q, self.cu_k = _host_boundaries(mods)
        self.heads = heads
        self.report = streaming._Progress(progress, plan.pairs, what)
        self.done = 0

    def ranges(self, part):
        """The part's packed query rows and keys."""
        return (slice(int(self.cu_q[part.first]), int(self.cu_q[part.stop])),
                slice(int(self.cu_k[part.first]), int(self.cu_k[part.stop])))

    def up(self, x):
        """A host view of the packed arrays on the backend's side: (1, H, n, d) views go up
        as their packed (1, n, H, d) rows lie (no host copy of a contiguous packing) and
        are viewed (1, H, n, d) again; (1, H, n) LSE rows go up contiguous."""
        if self.kind == _arrays.HOST:
            return x
        if x.ndim == 3:
            return _arrays.move(np.ascontiguousarray(x), self.kind, self.device)
        packed = np.ascontiguousarray(x.swapaxes(1, 2))
        return _arrays.move(packed, self.kind, self.device).swapaxes(1, 2)

    def empty_like(self, x):
        """A new array on the backend's side for a (1, H, n, d) view of the packed arrays,
        packed (1, n, H, d) as the in-memory varlen call's outputs are."""
        b, h, n, d = x.shape
        return _arrays.empty((b, n, h, d), x.dtype, self.kind).swapaxes(1, 2)

    def down(self, dst, src):
        dst[...] = _arrays.move(src, _arrays.HOST, None)

    def group_mods(self, part):
        """The group's modifiers on the backend's side (`api._move_modifiers`)."""
        mods = group_mods(self.mods, self.cu_q, self.cu_k, part.first, part.stop, self.heads)
        return self.move_modifiers(mods, self.kind, self.device)

    def sequence_mods(self, part):
        return sequence_mods(self.mods, part.first, self.heads)

    def streamed_progress(self):
        """A streamed sequence's progress, as counts of the whole pass."""
        base = self.done
        return lambda n, _: self.report.step(base + n, None)

    def finished(self, part):
        self.done += part.pairs
        if part.kind == "group":
            self.report.step(self.done, None)

    def execute(self, body):
        # Unlike `streaming._execute` nothing is left in flight to synchronise: a group's
        # outputs come back by `down` (a synchronous copy), and a streamed sequence's pass
        # synchronises its own copies.
        completed = False
        try:
            with _arrays.on_device(self.device):
                for part in self.plan.parts:
                    body(part, *self.ranges(part))
                    self.finished(part)
            completed = True
        finally:
            self.report.close(completed)


def forward(q, k, v, o, lse, *, plan, scale, causal, mods, backend, device, progress=None):
    """A streamed varlen forward pass: writes ``o`` and ``lse`` ((1, H, total, d) host
    views of the packed arrays) from host q, k, v by the ``plan``'s parts; ``mods`` holds
    the call's host cu_seqlens."""
    run = _Run(plan, mods, backend, device, progress, "forward", q.shape[1])

    def body(part, rows, keys):
        if part.kind == "host":
            o[:, :, rows] = 0
            lse[:, :, rows] = -np.inf
        elif part.kind == "streamed":
            streaming.forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], o[:, :, rows], lse[:, :, rows],
                              plan=part.plan, scale=scale, causal=causal, mods=run.sequence_mods(part),
                              backend=backend, device=device, progress=run.streamed_progress())
        else:
            o_part = run.empty_like(o[:, :, rows])
            lse_part = _arrays.empty(lse[:, :, rows].shape, lse.dtype, run.kind)
            run.run.attention_forward(run.up(q[:, :, rows]), run.up(k[:, :, keys]), run.up(v[:, :, keys]),
                                      o_part, lse_part, scale=scale, causal=causal, mods=run.group_mods(part))
            run.down(o[:, :, rows], o_part)
            run.down(lse[:, :, rows], lse_part)

    run.execute(body)


def backward(do, q, k, v, o, lse, dq, dk, dv, *, plan, scale, deterministic, mods, backend,
             device, dlse=None, dbias=None, progress=None):
    """A streamed varlen backward pass: writes ``dq``, ``dk``, ``dv`` ((1, H, total, d) host
    views) from host do, q, k, v, the forward's o and lse (and ``dlse``, (1, H, total)).
    ``dbias`` is `streaming.backward`'s parameter; a varlen call has no bias, so it is None."""
    assert dbias is None, "a varlen call has no bias"
    run = _Run(plan, mods, backend, device, progress, "backward", q.shape[1])

    def body(part, rows, keys):
        dlse_part = None if dlse is None else dlse[:, :, rows]
        if part.kind == "host":
            dq[:, :, rows] = 0
            dk[:, :, keys] = 0
            dv[:, :, keys] = 0
        elif part.kind == "streamed":
            streaming.backward(
                do[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], o[:, :, rows], lse[:, :, rows],
                dq[:, :, rows], dk[:, :, keys], dv[:, :, keys], plan=part.plan, scale=scale,
                deterministic=deterministic, mods=run.sequence_mods(part), backend=backend, device=device,
                dlse=dlse_part, progress=run.streamed_progress())
        else:
            grads = [run.empty_like(x[:, :, r]) for x, r in ((dq, rows), (dk, keys), (dv, keys))]
            run.run.attention_backward(
                *(run.up(x[:, :, rows]) for x in (do, q)), run.up(k[:, :, keys]), run.up(v[:, :, keys]),
                *(run.up(x[:, :, rows]) for x in (o, lse)), *grads, scale=scale, causal=plan.causal,
                deterministic=deterministic, mods=run.group_mods(part), dbias=None,
                dlse=None if dlse_part is None else run.up(dlse_part))
            for dst, src in zip((dq[:, :, rows], dk[:, :, keys], dv[:, :, keys]), grads):
                run.down(dst, src)

    run.execute(body)
