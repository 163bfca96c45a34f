"""Why the GPU backend cannot run on this machine, in words a user can act on.

`cupyflash._cuda.gpu_available` answers yes or no; the calls that cannot do without a
GPU (``precompile``, ``backend="cuda"``, the GPU benchmark, the GPU tests) say which
step failed instead: CuPy missing, NVRTC missing, a driver too old for CuPy's CUDA
runtime, or no device.
"""

from __future__ import annotations

__all__ = ["why_not_usable"]

_EXTRA = "pip install 'cupyflash[cuda12]' (or [cuda13] with a CUDA 13 driver)"


def why_not_usable() -> str | None:
    """None where the GPU backend can run, else the reason, e.g. ``"cupy is not
    installed (...)"`` or ``"the CUDA driver cannot run CuPy's CUDA runtime
    (cudaErrorInsufficientDriver: ...)"``."""
    try:
        import cupy
    except Exception as exc:
        return f"cupy is not installed or not importable ({type(exc).__name__}: {exc}); {_EXTRA}"
    from . import _nvrtc
    try:
        _nvrtc.nvrtc_version()
    except Exception as exc:
        return f"NVRTC is not loadable ({type(exc).__name__}: {exc}); {_EXTRA}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        if "InsufficientDriver" in text:
            return f"the CUDA driver cannot run CuPy's CUDA runtime, or there is none ({text})"
        if "NoDevice" in text:
            return f"there is no CUDA device ({text})"
        return f"the CUDA runtime cannot reach a GPU ({text})"
    return None if count > 0 else "there is no CUDA device (the driver reports 0 GPUs)"
