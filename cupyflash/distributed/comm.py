"""Communicators for the ring: one exchange operation, two implementations.

The ring algorithm needs one primitive: send some arrays to the next rank while receiving
as many into buffers from the previous one, ordered on a stream. `Communicator` is that
protocol; `NcclCommunicator` implements it over NCCL through CuPy (``cupyx.distributed``,
one process per GPU), and `LocalRing` simulates R ranks in one process (threads, arrays
handed over through a shared dict), NumPy or CuPy, so the same algorithm runs on one GPU
and, with the NumPy backend, on a CPU.

Starting the NCCL processes: `from_env` reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
(and LOCAL_RANK for the GPU, default RANK), as ``python -m cupyflash.distributed.launch``
or torchrun set them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import Protocol, runtime_checkable

from .. import _arrays
from ._place import DevicePlace, HostPlace, copy_into

__all__ = ["Communicator", "LocalRing", "NcclCommunicator", "from_env"]


@runtime_checkable
class Communicator(Protocol):
    """What `ring_attention` needs of a communicator.

    Attributes
    ----------
    rank, size : int
        This rank and the number of ranks, ``0 <= rank < size``.
    device : int or None
        The GPU this rank's arrays must be on, or None where it takes any (LocalRing).
    """

    rank: int
    size: int
    device: int | None

    def sendrecv(self, send, dst, recv, src, stream):
        """Send the C-contiguous arrays ``send`` to rank ``dst`` and receive into the
        C-contiguous arrays ``recv`` (same count, each the size of its peer's) from rank
        ``src``, ordered on ``stream`` (None on the host). The buffers must stay untouched
        until the stream has passed the exchange; the call may return before that on a GPU.
        """


class _Aborted(RuntimeError):
    """Raised in the ranks of a LocalRing that wait on a rank that has failed."""


class LocalRing:
    """``size`` simulated ranks in one process, for testing the ring algorithm.

    ``ring[r]`` (or ``ring.ranks[r]``) is rank r's communicator; `run` calls a function
    once per rank, each in its own thread, and returns the results in rank order. Arrays
    may be NumPy or CuPy (one rank's arrays on one device). A sendrecv hands the receiver
    the sender's buffer and waits until it has been copied, as a rendezvous: on a GPU the
    copy runs on the receiver's stream after an event of the sender's, and the sender's
    stream waits for the copy, so the buffers follow NCCL's rules.

    On a GPU each rank must compute on a stream of its own: ranks sharing one in-order
    stream would wait in it for each other's exchanges and deadlock the device. `run`
    does that: where a GPU is usable, each rank's thread runs with its device current
    (``devices[r]``, default the caller's) and a new non-blocking stream current, which
    is synchronised before `run` returns, so the results are ready on any stream.

    Parameters
    ----------
    size : int
        The number of ranks, >= 1.
    devices : sequence of int, optional
        Rank r's GPU (its arrays must be there: ``ring[r].device``); None leaves the
        ranks unbound (NumPy arrays, or CuPy arrays on the caller's device).
    timeout : float, default 120
        Seconds a rank waits for a peer's message before TimeoutError (a mismatched
        sequence of calls would otherwise hang).

    Examples
    --------
    >>> ring = LocalRing(4)
    >>> outs = ring.run(lambda comm, q, k, v: ring_attention(q, k, v, comm, causal=True),
    ...                 q_shards, k_shards, v_shards)                # doctest: +SKIP
    """

    def __init__(self, size, *, devices=None, timeout=120.0):
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an integer, got {size!r} ({type(size).__name__})")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if devices is not None:
            devices = list(devices)
            if len(devices) != size or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                           for d in devices):
                raise ValueError(f"devices must list one GPU id per rank ({size}), got {devices}")
        self.size = size
        self.devices = devices
        self.timeout = float(timeout)
        self._cond = threading.Condition()
        self._box = {}
        self._failed = None
        self.ranks = tuple(_LocalRank(self, r) for r in range(size))

    def __getitem__(self, rank):
        return self.ranks[rank]

    def __len__(self):
        return self.size

    def run(self, fn, *per_rank, **kwargs):
        """``[fn(ring[r], *(a[r] for a in per_rank), **kwargs) for r in range(size)]``, the
        ranks in concurrent threads. The first exception of a rank is raised here, after
        every thread has stopped (the others stop waiting for it)."""
        for i, a in enumerate(per_rank):
            if not hasattr(a, "__len__") or len(a) != self.size:
                got = len(a) if hasattr(a, "__len__") else type(a).__name__
                raise ValueError(f"per-rank argument {i} must hold one entry per rank "
                                 f"(LocalRing size {self.size}), got {got}")
        if self._failed is not None:
            raise RuntimeError(f"this LocalRing is broken by an earlier failure ({self._failed!r}); "
                               "make a new one")
        results, errors = [None] * self.size, [None] * self.size

        gpu_device = self._gpu_device()

        def body(r):
            try:
                with contextlib.ExitStack() as scope:
                    stream = None
                    if gpu_device is not None:
                        cp = _arrays.cupy_module()
                        device = gpu_device if self.devices is None else self.devices[r]
                        scope.enter_context(cp.cuda.Device(device))
                        stream = scope.enter_context(cp.cuda.Stream(non_blocking=True))
                    results[r] = fn(self.ranks[r], *(a[r] for a in per_rank), **kwargs)
                    if stream is not None:
                        stream.synchronize()
            except BaseException as exc:   # every failure must release the other ranks
                errors[r] = exc
                self._fail(exc)

        threads = [threading.Thread(target=body, args=(r,), name=f"LocalRing-rank{r}")
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, _Aborted)),
                     next((e for e in errors if e is not None), None))
        if first is not None:
            raise first
        return results

    def _gpu_device(self):
        """The caller's current GPU where the ranks may compute on GPUs (devices given, or
        CuPy loaded with a usable GPU), else None (host ranks need no streams)."""
        if self.devices is None and "cupy" not in sys.modules:
            return None
        from .._gpu_status import why_not_usable
        if why_not_usable() is not None:
            if self.devices is not None:
                raise RuntimeError(f"LocalRing(devices={self.devices}) needs GPUs, but {why_not_usable()}")
            return None
        return _arrays.current_device()

    def _fail(self, exc):
        with self._cond:
            if self._failed is None and not isinstance(exc, _Aborted):
                self._failed = exc
            self._cond.notify_all()

    def _post(self, key, value):
        with self._cond:
            self._box[key] = value
            self._cond.notify_all()

    def _take(self, key):
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._box or self._failed is not None,
                                     timeout=self.timeout)
            if key in self._box:
                return self._box.pop(key)
            if self._failed is not None:
                raise _Aborted(f"rank {key[1]} stopped: another rank failed ({self._failed!r})")
            assert not ok
            raise TimeoutError(f"LocalRing: rank {key[1]} waited {self.timeout:g} s for message "
                               f"{key[2]} ({key[3]}) of rank {key[0]}; do all ranks make the same calls?")


class _LocalRank:
    """Rank ``rank`` of a `LocalRing` (a `Communicator`)."""

    def __init__(self, ring, rank):
        self._ring = ring
        self.rank = rank
        self.device = None if ring.devices is None else ring.devices[rank]
        self.size = ring.size
        self._sent = [0] * ring.size
        self._received = [0] * ring.size

    def __repr__(self):
        return f"<LocalRing rank {self.rank} of {self.size}>"

    def sendrecv(self, send, dst, recv, src, stream):
        ring, me = self._ring, self.rank
        send, recv = list(send), list(recv)
        _check_buffers(send, "send")
        _check_buffers(recv, "recv")
        place = _place_for(send + recv)
        out_seq, in_seq = self._sent[dst], self._received[src]
        self._sent[dst] += 1
        self._received[src] += 1
        ring._post((me, dst, out_seq, "data"), (send, place.record(stream)))
        theirs, ready = ring._take((src, me, in_seq, "data"))
        if len(theirs) != len(recv) or any(a.nbytes != b.nbytes or a.dtype != b.dtype
                                           for a, b in zip(theirs, recv)):
            error = ValueError(
                f"rank {src} sent {[(a.shape, str(a.dtype)) for a in theirs]} but rank {me} "
                f"receives into {[(b.shape, str(b.dtype)) for b in recv]}; every rank must pass "
                "arrays of one shape and dtype (equal shards)")
            ring._post((me, src, in_seq, "done"), None)
            raise error
        with place.activate():
            place.wait(stream, ready)
            for buf, data in zip(recv, theirs):
                copy_into(buf, data, stream)
            ring._post((me, src, in_seq, "done"), place.record(stream))
        copied = ring._take((dst, me, out_seq, "done"))
        with place.activate():
            place.wait(stream, copied)


def _check_buffers(arrays, name):
    for i, x in enumerate(arrays):
        if _arrays.kind_of(x) is None or not x.flags.c_contiguous:
            raise ValueError(f"{name}[{i}] must be a C-contiguous NumPy or CuPy array")


def _place_for(arrays):
    if all(_arrays.kind_of(x) == _arrays.HOST for x in arrays):
        return HostPlace()
    return DevicePlace(_arrays.device_of(arrays[0]))


class NcclCommunicator:
    """A `Communicator` over NCCL, one process per GPU.

    Parameters
    ----------
    comm : cupyx.distributed NCCLBackend or cupy.cuda.nccl.NcclCommunicator
        From ``cupyx.distributed.init_process_group(world, rank, backend="nccl", ...)``
        (or `from_env`), made while this rank's GPU was the current device.
    device : int, optional
        This rank's GPU; default the current device.

    Notes
    -----
    Arrays travel as raw bytes (any dtype, bfloat16 included), each exchange as one NCCL
    group of sends and receives, so that every rank's send to its successor and receive
    from its predecessor proceed together without deadlock.
    """

    def __init__(self, comm, *, device=None):
        from cupy.cuda import nccl
        if not nccl.available:
            raise RuntimeError("NCCL is not available to CuPy (pip install nvidia-nccl-cu12, "
                               "or nvidia-nccl-cu13 for CUDA 13)")
        self._nccl = nccl
        inner = getattr(comm, "_comm", comm)
        if not hasattr(inner, "send") or not hasattr(inner, "recv"):
            raise TypeError("comm must be a cupyx.distributed NCCL backend or a "
                            f"cupy.cuda.nccl.NcclCommunicator, got {type(comm).__name__}")
        self._comm = inner
        self.rank = int(inner.rank_id())
        self.size = int(inner.size())
        self.device = int(_arrays.current_device() if device is None else device)
        self._backend = comm   # keeps a cupyx backend (and its TCP store) alive

    def __repr__(self):
        return f"<NcclCommunicator rank {self.rank} of {self.size} on GPU {self.device}>"

    def sendrecv(self, send, dst, recv, src, stream):
        send, recv = list(send), list(recv)
        _check_buffers(send, "send")
        _check_buffers(recv, "recv")
        nccl, ptr = self._nccl, stream.ptr
        nccl.groupStart()
        try:
            for x in send:
                self._comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, dst, ptr)
            for x in recv:
                self._comm.recv(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, src, ptr)
        finally:
            nccl.groupEnd()


def from_env():
    """An `NcclCommunicator` for this process, from the environment a launcher sets.

    Reads RANK and WORLD_SIZE (required), MASTER_ADDR (default 127.0.0.1), MASTER_PORT
    (default 13333) and LOCAL_RANK (the GPU, default RANK); makes that GPU current and
    joins the process group through ``cupyx.distributed.init_process_group``.

    Raises
    ------
    ValueError
        A missing or malformed variable, or a LOCAL_RANK beyond this machine's GPUs
        (named, before any communication).
    """
    def number(name, default=None):
        raw = os.environ.get(name)
        if raw is None:
            if default is None:
                raise ValueError(f"{name} is not set; start the processes with "
                                 "python -m cupyflash.distributed.launch --nproc N script.py "
                                 "(or torchrun), or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {raw!r}") from None

    world, rank = number("WORLD_SIZE"), number("RANK")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE) = [0, {world}), got {rank}")
    local = number("LOCAL_RANK", rank)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = number("MASTER_PORT", 13333)
    from .._gpu_status import why_not_usable
    reason = why_not_usable()
    if reason is not None:
        raise RuntimeError(f"NCCL ring attention needs a usable GPU in each process, but {reason}")
    cp = _arrays.cupy_module()
    count = cp.cuda.runtime.getDeviceCount()
    if not 0 <= local < count:
        raise ValueError(f"LOCAL_RANK={local} names GPU {local}, but this machine has {count} "
                         "GPU(s); start at most one process per GPU")
    cp.cuda.Device(local).use()
    import cupyx.distributed
    backend = cupyx.distributed.init_process_group(world, rank, backend="nccl", host=host, port=port)
    _stop_at_exit(backend)
    return NcclCommunicator(backend, device=local)


def _stop_at_exit(backend):
    """Stop ``backend`` (rank 0's rendezvous server) when the interpreter exits.

    cupyx.distributed's rank 0 serves the rendezvous from a child process until the backend
    is stopped, and the backend's finaliser does nothing once exit has begun; multiprocessing
    joins the child at exit, so a script that keeps its communicator to the end (a module
    global) never exited (seen on 4 H200s: every rank done, the launcher waiting). Registered
    after cupyx's own exit hook (its import comes first), this runs before it."""
    atexit.register(backend.stop)
