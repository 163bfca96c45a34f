"""Attention over the GPUs of one host from one process: query blocks split over devices.

Each device gets blocks of query rows and the keys they can see, and runs the attention
kernels on them; nothing needs merging, because a query block's output depends on the
keys alone. With ``causal`` the mask is bottom-right aligned, so query rows ``[a, b)``
see exactly the key prefix ``[0, b + Nk - Nq)``, and a causal call on that prefix is
exact; the rows are dealt out in zigzag order (2P blocks, device g takes blocks g and
2P-1-g) so the devices get equal work. The backward pass sums each device's dK/dV over
the prefixes in float32 (float64), where the caller's arrays are.

A window, ALiBi or dropout reads the whole problem's coordinates: a block's call is then
placed in the problem (`_pairs`: its first row and key, the problem's Nk - Nq), its
rows are cut on multiples of `_mods.ORIGIN_ALIGN` (the kernels' dropout blocks) and its
keys run from the first its rows see (rounded down to that multiple: a window's left side
keeps the copy short) to the last. Dropout without a seed claims the call's Philox
streams once, after every check, as `cupyflash.attention` does; every block draws its
rows' bits from them, so the mask is the in-memory call's.

The devices run concurrently: every copy and launch is queued without waiting, on each
device's current stream, and the caller's device waits for the others through events.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .. import _arrays, _masks, _mods, _validate
from ..merge import add_into
from . import _pairs

__all__ = ["multi_device_attention", "multi_device_attention_vjp", "query_blocks"]


def query_blocks(n_q, n_k, parts, causal, window=(-1, -1), *, placed=False):
    """The calls of each of ``parts`` devices: a list per device of ``((row_lo, row_hi),
    (key_lo, key_hi))``, the query rows of a call and the keys it reads (none where
    ``key_lo == key_hi``: the rows see no key). Rows are split as evenly as integers allow
    (``placed``: as evenly as multiples of `_mods.ORIGIN_ALIGN` allow); causal calls are
    dealt in zigzag order. Without ``placed`` the keys are the prefix a causal call on
    them needs (its diagonal is its own corner); with it, the keys the rows see."""
    blocks = 2 * parts if causal else parts
    align = _mods.ORIGIN_ALIGN if placed else 1
    cuts = [align * (n_q * i // (blocks * align)) for i in range(blocks)] + [n_q]
    calls = [[] for _ in range(parts)]
    for i in range(blocks):
        lo, hi = cuts[i], cuts[i + 1]
        if lo >= hi:
            continue
        if placed:
            first, stop = _masks.key_block_range(lo, hi, n_q, n_k, 1, causal=causal, window=window)
            keys = (first - first % align, stop) if first < stop else (0, 0)
        else:
            keys = (0, max(0, min(n_k, hi + n_k - n_q)) if causal else n_k)
        owner = i if i < parts else 2 * parts - 1 - i
        calls[owner].append(((lo, hi), keys))
    return calls


def _check_devices(devices):
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"devices must be a sequence of GPU ids, got {type(devices).__name__}")
    devices = list(devices)
    if not devices:
        raise ValueError("devices must list at least one GPU id, got an empty sequence")
    for i, d in enumerate(devices):
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"devices[{i}] must be an integer GPU id, got {d!r} ({type(d).__name__})")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices must not repeat a GPU, got {devices}")
    from ..api import _gpu_backend
    cuda, why_not = _gpu_backend()
    if cuda is None:
        raise RuntimeError(f"multi_device_attention runs on CUDA GPUs, but {why_not}")
    count = _arrays.cupy_module().cuda.runtime.getDeviceCount()
    bad = [d for d in devices if not 0 <= d < count]
    if bad:
        raise ValueError(f"devices {bad} do not exist: this machine has {count} GPU(s) (ids 0..{count - 1})")
    return devices


def _seq(x, lo, hi, layout, lse=False):
    """Rows ``[lo, hi)`` of a q/k/v/o-shaped array (or of an LSE) in ``layout``."""
    if lse:
        return x[..., lo:hi]
    return x[:, lo:hi] if layout == "bshd" else x[..., lo:hi, :]


def _rows_of_bytes(x):
    """``(width, height, pitch)`` where the array ``x`` is ``height`` runs of ``width``
    contiguous bytes, ``pitch`` bytes apart (one 2D copy moves it), else None. A slice of
    the sequence axis of a C-contiguous (B, H, N, d) or (B, N, H, d) array is such."""
    width, axes = x.itemsize, []
    for n, stride in reversed(list(zip(x.shape, x.strides))):
        if n == 1:
            continue
        if not axes and stride == width:
            width *= n                       # still inside the contiguous tail
        else:
            axes.append((n, stride))
    if not axes:
        return width, 1, width
    (height, pitch), rest = axes[0], axes[1:]
    for n, stride in rest:                   # the outer axes must step as one
        if stride != pitch * height:
            return None
        height *= n
    return (width, height, pitch) if pitch >= width else None


# cudaErrorPeerAccessAlreadyEnabled: CuPy's own copies between the two devices came first.
_PEER_ACCESS_ALREADY_ENABLED = 704
_peer_pairs = set()


def _allow_peer_access(device, peer):
    """Let ``device`` read ``peer``'s memory directly where the hardware can, once a pair.
    CuPy does this before its own copies between devices, not before the 2D copies of
    `_Mover`: without it a copy between devices may not take the direct path."""
    if (device, peer) in _peer_pairs:
        return
    cp = _arrays.cupy_module()
    if cp.cuda.runtime.deviceCanAccessPeer(device, peer):
        with cp.cuda.Device(device):
            try:
                cp.cuda.runtime.deviceEnablePeerAccess(peer)
            except cp.cuda.runtime.CUDARuntimeError as e:
                if e.status != _PEER_ACCESS_ALREADY_ENABLED:
                    raise
    _peer_pairs.add((device, peer))


@functools.lru_cache(maxsize=None)
def _max_pitch(device):
    """The largest pitch of a 2D copy on ``device`` (asked once a device, not once a copy)."""
    cp = _arrays.cupy_module()
    return cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMaxPitch, device)


class _Mover:
    """Copies between the host and the devices, queued on the current streams, with the
    sources kept alive until `finish` (a device-to-device copy reads its source on the
    destination's stream, after an event of the source's).

    A device's inputs must be queued before any kernel on the device they come from: the
    event a copy waits for is recorded on the source's stream when the copy is queued, so
    a copy queued behind a device's own kernels would wait for them (`_queued`: the passes
    move every input from a GPU first, then launch). A slice of the caller's array moves by
    one strided copy straight from its memory; another layout is made contiguous on its
    device first."""

    def __init__(self):
        self.cp = _arrays.cupy_module()
        self._keep = []
        self._events = []

    def to_device(self, x, device):
        cp = self.cp
        if _arrays.kind_of(x) == _arrays.HOST:
            with cp.cuda.Device(device):
                return cp.asarray(x)
        if x.device.id == device:
            return x
        return self._peer(x, device)

    def _peer(self, x, device):
        cp = self.cp
        runs = _rows_of_bytes(x)
        # A 2D copy where x is strided runs within the pitch limit (2 GiB: a (B, N, H, d)
        # slice at N = 1M passes it); one plain copy where x is contiguous; else staged.
        strided = runs if runs and runs[1] > 1 and runs[2] <= _max_pitch(device) else None
        with cp.cuda.Device(x.device.id):
            src = x if strided or x.flags.c_contiguous else cp.ascontiguousarray(x)
            ready = cp.cuda.Event(disable_timing=True)
            ready.record()
        with cp.cuda.Device(device):
            dst = cp.empty(src.shape, src.dtype)
            stream = cp.cuda.get_current_stream()
            stream.wait_event(ready)
            if strided:
                _allow_peer_access(device, x.device.id)
                width, height, pitch = strided
                cp.cuda.runtime.memcpy2DAsync(dst.data.ptr, width, src.data.ptr, pitch, width, height,
                                              cp.cuda.runtime.memcpyDefault, stream.ptr)
            else:
                dst.data.copy_from_device_async(src.data, src.nbytes, stream)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
        self._keep.append(src)
        self._events.append((x.device.id, done))
        return dst

    def back(self, y, kind, device):
        """A device result where the caller's arrays are (host, or GPU ``device``)."""
        if kind == _arrays.HOST:
            with self.cp.cuda.Device(y.device.id):
                return self.cp.asnumpy(y)
        return y if y.device.id == device else self._peer(y, device)

    def finish(self, device):
        """Make ``device``'s current stream (None: the host) wait for every copy, and every
        source device's stream wait for the copies that read its memory."""
        cp = self.cp
        for source, done in self._events:
            with cp.cuda.Device(source):
                cp.cuda.get_current_stream().wait_event(done)
            if device is not None:
                with cp.cuda.Device(device):
                    cp.cuda.get_current_stream().wait_event(done)
        self._keep.clear()
        self._events.clear()


@dataclass
class _Call:
    """One device's call: its rows and keys of the problem, whether it needs the causal
    mask, its modifiers (placed where an option needs it; on its device once it ran), and
    what its backward pass needs: q, k, v, o, lse on its device, in the caller's layout."""

    device: int
    rows: tuple
    keys: tuple
    causal: bool
    mods: _mods.Modifiers
    saved: tuple | None = None

    @property
    def sees_keys(self):
        return self.keys[0] < self.keys[1]


def _plan(problem, devices, causal, mods):
    placed = _pairs.needs_placing(mods)
    blocks = query_blocks(problem.q_len, problem.k_len, len(devices), causal, mods.window, placed=placed)
    calls = []
    for device, device_blocks in zip(devices, blocks):
        for rows, keys in device_blocks:
            call = _Call(device, rows, keys, causal, mods)
            if placed and call.sees_keys:
                stop, call.causal, call.mods = _pairs.place(
                    *rows, *keys, total_q=problem.q_len, total_k=problem.k_len, causal=causal, mods=mods)
                assert stop == keys[1]   # query_blocks ends the keys where the rows' reach does
            calls.append(call)
    return calls


def _key_spans(calls):
    """Per device, the key ranges to copy: one call's keys lie in one of them, and calls
    whose keys overlap or touch share one (a device's causal prefixes nest)."""
    spans = {}
    for call in sorted(calls, key=lambda c: c.keys):
        merged = spans.setdefault(call.device, [])
        lo, hi = call.keys
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return spans


def _move_inputs(mover, calls, q, k, v, layout):
    """``(q, k, v)`` of each call on its device, in call order: its query rows, and its
    keys as a view of the copy of its device's key span (`_key_spans`, copied where the
    device's first call needs it), so that each key moves once a device."""
    spans = _key_spans(calls)
    copies = {}
    for call in calls:
        lo, hi = call.keys
        (a, b), = [(a, b) for a, b in spans[call.device] if a <= lo and hi <= b]
        with _arrays.on_device(call.device):
            if (call.device, a) not in copies:
                copies[call.device, a] = tuple(mover.to_device(_seq(x, a, b, layout), call.device) for x in (k, v))
            qg = mover.to_device(_seq(q, *call.rows, layout), call.device)
        kg, vg = (_seq(x, lo - a, hi - a, layout) for x in copies[call.device, a])
        yield qg, kg, vg


def _queued(kind, moves):
    """``moves`` (an iterator of copies, one item a call) ready to be zipped with the calls'
    launches: from the GPUs, every copy queued before any kernel (`_Mover`); from the host,
    where a copy returns once done, each call's just before its kernels, so that the devices
    start one by one while the host copies on."""
    return moves if kind == _arrays.HOST else list(moves)


@dataclass
class _Pass:
    """What the backward pass needs of a forward pass."""

    q: object
    k: object
    v: object
    o: object
    lse: object
    calls: list
    problem: _validate.Problem
    layout: str
    scale: float
    deterministic: bool


def _run_forward(q, k, v, devices, options, layout, want_ctx):
    from .. import _cuda
    from ..api import _claim_dropout_streams, _move_modifiers, _resolve_modifiers

    q, k, v, problem = _validate.check_inputs(q, k, v, layout=layout)
    scale = _validate.resolve_scale(options.scale, problem.head_dim, problem.dtype)
    mods = _resolve_modifiers(options, problem)
    for device in devices:
        why_not = _cuda.unsupported_reason(problem.dtype, problem.head_dim, problem.value_dim,
                                           heads=problem.heads, device=device, mods=mods)
        if why_not is not None:
            raise ValueError(f"devices: GPU {device} cannot run this case: {why_not}")
    # After every check, so that a refused call leaves the process RNG as it was.
    mods, _ = _claim_dropout_streams(mods, options, problem)
    # The ALiBi slopes (a few numbers) go to each device from the host: a CuPy array stays
    # on its own GPU when moved to "the device".
    mods = _move_modifiers(mods, _arrays.HOST, None)
    calls = _plan(problem, devices, options.causal, mods) if problem.batch else []
    kind, home = problem.kind, problem.device
    acc = _arrays.accumulation_dtype(problem.dtype)
    o = _arrays.empty((*q.shape[:-1], problem.value_dim), problem.dtype, kind)
    lse = _arrays.empty(_arrays.lse_shape(q.shape, layout), acc, kind)
    mover = _Mover()
    with _arrays.on_device(home):
        xp = _arrays.namespace(kind)
        running = [call for call in calls if call.sees_keys]
        parts = []
        for call, (qg, kg, vg) in zip(running, _queued(kind, _move_inputs(mover, running, q, k, v, layout))):
            with _arrays.on_device(call.device):
                og = _arrays.empty((*qg.shape[:-1], problem.value_dim), problem.dtype, _arrays.DEVICE)
                lg = _arrays.empty(_arrays.lse_shape(qg.shape, layout), acc, _arrays.DEVICE)
                call.mods = _move_modifiers(call.mods, _arrays.DEVICE, call.device)
                _cuda.attention_forward(*(_arrays.bhsd_view(x, layout) for x in (qg, kg, vg, og)),
                                        _arrays.lse_bhs_view(lg, layout), scale=scale,
                                        causal=call.causal, mods=call.mods)
                if want_ctx:
                    call.saved = (qg, kg, vg, og, lg)
                parts.append((call, og, lg))
        for call in calls:
            if not call.sees_keys:   # rows that see no key: output 0, LSE -inf
                _seq(o, *call.rows, layout)[...] = 0
                _seq(lse, *call.rows, layout, lse=True)[...] = -xp.inf
        for call, og, lg in parts:
            _seq(o, *call.rows, layout)[...] = mover.back(og, kind, home)
            _seq(lse, *call.rows, layout, lse=True)[...] = mover.back(lg, kind, home)
        mover.finish(home)
    state = _Pass(q, k, v, o, lse, calls, problem, layout, scale, options.deterministic) if want_ctx else None
    return o, lse, state


def _run_backward(do, dlse, state):
    from .. import _cuda

    problem, layout = state.problem, state.layout
    kind, home = problem.kind, problem.device
    do = _validate.check_do(do, o=state.o, kind=kind, device=home)
    if dlse is not None:
        dlse = _validate.check_dlse(dlse, lse=state.lse, kind=kind, device=home)
    acc = _arrays.accumulation_dtype(problem.dtype)
    view = lambda x: _arrays.bhsd_view(x, layout)   # noqa: E731
    mover = _Mover()
    with _arrays.on_device(home):
        xp = _arrays.namespace(kind)
        running = [call for call in state.calls if call.saved is not None]

        def moves():
            for call in running:
                lo, hi = call.rows
                # The cast where dlse is (the caller's device), so that the copy follows it.
                dl = None if dlse is None else _seq(dlse, lo, hi, layout, lse=True).astype(acc)
                with _arrays.on_device(call.device):
                    dog = mover.to_device(_seq(do, lo, hi, layout), call.device)
                    dlg = None if dl is None else mover.to_device(dl, call.device)
                yield dog, dlg

        results = []
        for call, (dog, dlg) in zip(running, _queued(kind, moves())):
            with _arrays.on_device(call.device):
                grads = tuple(_arrays.empty(x.shape, x.dtype, _arrays.DEVICE) for x in call.saved[:3])
                qg, kg, vg, og, lg = call.saved
                _cuda.attention_backward(
                    view(dog), view(qg), view(kg), view(vg), view(og), _arrays.lse_bhs_view(lg, layout),
                    *(view(g) for g in grads), scale=state.scale, causal=call.causal,
                    deterministic=state.deterministic, mods=call.mods, dbias=None,
                    dlse=None if dlg is None else _arrays.lse_bhs_view(dlg, layout))
                results.append((call, grads))
        # Zeroed after every copy and launch is queued: on the caller's stream, before
        # them, the fills would hold back each copy from it (_Mover).
        dq = xp.zeros(state.q.shape, state.q.dtype)
        dk_acc, dv_acc = xp.zeros(state.k.shape, acc), xp.zeros(state.v.shape, acc)
        for call, (dqg, dkg, dvg) in results:
            _seq(dq, *call.rows, layout)[...] = mover.back(dqg, kind, home)
            add_into(_seq(dk_acc, *call.keys, layout), mover.back(dkg, kind, home))
            add_into(_seq(dv_acc, *call.keys, layout), mover.back(dvg, kind, home))
        mover.finish(home)
        return dq, dk_acc.astype(state.k.dtype), dv_acc.astype(state.v.dtype)


def _options(causal, scale, softcap, layout, deterministic, window, dropout_p, seed, alibi_slopes):
    return _validate.check_options(
        causal=causal, scale=scale, window=window, dropout_p=dropout_p, seed=seed, block_mask=None,
        bias=None, alibi_slopes=alibi_slopes, softcap=softcap, layout=layout,
        deterministic=deterministic, backend="cuda")


def multi_device_attention(q, k, v, *, devices, causal=False, scale=None, softcap=0.0,
                           layout="bhsd", deterministic=False, return_lse=False, window=None,
                           dropout_p=0.0, seed=None, alibi_slopes=None):
    """Exact attention split over several GPUs of this host, from one process.

    The query rows are split into blocks over ``devices`` (zigzag order when causal, so
    the work is even); each device receives its query blocks and the keys they can see,
    and runs the attention kernels on them. The devices run concurrently.

    Parameters
    ----------
    q, k, v : array
        The whole problem, as for `cupyflash.attention` (GQA, Nq != Nk, both layouts):
        NumPy arrays (results come back as NumPy) or CuPy arrays on any GPU (results on
        that GPU, which need not be one of ``devices``).
    devices : sequence of int
        Distinct CUDA device ids; ``[0]`` runs everything on GPU 0.
    causal, scale, softcap, layout, deterministic
        As for `cupyflash.attention`.
    window, dropout_p, seed, alibi_slopes
        As for `cupyflash.attention`: each block's call is placed in the whole problem,
        so the band, the ALiBi distances and the dropout mask are the unsharded call's
        (with a seed, exactly its mask; without one the call claims its streams once
        from cupyflash's process RNG). A window's blocks copy only the keys they see.
    return_lse : bool, default False
        Also return the log-sum-exp.

    Returns
    -------
    o : array
        As `cupyflash.attention` returns it (and ``lse`` with ``return_lse=True``).

    Raises
    ------
    TypeError, ValueError
        A bad argument, named, before anything is allocated (devices that repeat or do not
        exist included).
    RuntimeError
        No usable GPU.
    """
    return_lse = _validate.check_flag(return_lse, "return_lse")
    options = _options(causal, scale, softcap, layout, deterministic, window, dropout_p, seed,
                       alibi_slopes)
    devices = _check_devices(devices)
    o, lse, _ = _run_forward(q, k, v, devices, options, layout, want_ctx=False)
    return (o, lse) if return_lse else o


def multi_device_attention_vjp(q, k, v, *, devices, causal=False, scale=None, softcap=0.0,
                               layout="bhsd", deterministic=False, window=None, dropout_p=0.0,
                               seed=None, alibi_slopes=None):
    """`multi_device_attention` and its vector-Jacobian product.

    Returns
    -------
    o : array
    vjp : callable
        ``vjp(do, *, dlse=None) -> (dq, dk, dv)``: each device runs the backward pass of
        its calls (dropout regenerates the forward's mask); dq comes back row by row, dk
        and dv are summed over the devices in float32 (float64 for float64 inputs) where
        the inputs are. ``vjp.lse`` is the forward's log-sum-exp.
    """
    options = _options(causal, scale, softcap, layout, deterministic, window, dropout_p, seed,
                       alibi_slopes)
    devices = _check_devices(devices)
    o, lse, state = _run_forward(q, k, v, devices, options, layout, want_ctx=True)

    def vjp(do, *, dlse=None):
        return _run_backward(do, dlse, state)

    vjp.lse = lse
    return o, vjp
