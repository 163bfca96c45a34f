"""Where a rank computes: the array module, the attention backend and stream ordering.

The ring algorithm (`ring.py`) is written once against this small interface. On the host
the streams and events are None and every operation has finished when it returns; on a
GPU the compute runs on CuPy's current stream and the communication on a stream of its
own, ordered by events, so transfers overlap the kernels.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .. import _arrays


class HostPlace:
    """NumPy arrays and the NumPy backend (`cupyflash.api._NUMPY_BACKEND`)."""

    kind = _arrays.HOST
    device = None
    xp = np

    @property
    def backend(self):
        from ..api import _backend_module
        return _backend_module("numpy")

    def current_stream(self):
        return None

    def new_stream(self):
        return None

    def record(self, stream):
        return None

    def wait(self, stream, event):
        pass

    def on(self, stream):
        return contextlib.nullcontext()

    def activate(self):
        return contextlib.nullcontext()


class DevicePlace:
    """CuPy arrays on one GPU and the CUDA backend (`cupyflash._cuda`)."""

    kind = _arrays.DEVICE

    def __init__(self, device):
        self.device = int(device)
        self.xp = _arrays.cupy_module()

    @property
    def backend(self):
        from ..api import _backend_module
        return _backend_module("cuda")

    def current_stream(self):
        with self.xp.cuda.Device(self.device):
            return self.xp.cuda.get_current_stream()

    def new_stream(self):
        with self.xp.cuda.Device(self.device):
            return self.xp.cuda.Stream(non_blocking=True)

    def record(self, stream):
        with self.xp.cuda.Device(self.device):
            event = self.xp.cuda.Event(disable_timing=True)
            event.record(stream)
        return event

    def wait(self, stream, event):
        if event is not None:   # None: nothing to wait for (a failed LocalRing peer's reply)
            stream.wait_event(event)

    def on(self, stream):
        return stream

    def activate(self):
        return self.xp.cuda.Device(self.device)


def place_of(x):
    """The place of an adopted NumPy or CuPy array."""
    return HostPlace() if _arrays.kind_of(x) == _arrays.HOST else DevicePlace(_arrays.device_of(x))


def copy_into(dst, src, stream):
    """Copy C-contiguous ``src`` into C-contiguous ``dst`` of the same size, on ``stream``
    (GPU arrays, which may be on different devices) or at once (host arrays)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src, casting="no")
    else:
        dst.data.copy_from_device_async(src.data, src.nbytes, stream)
