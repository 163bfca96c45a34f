"""Helpers of the tests that run test kernels (kernels_cu/*_test.cu): the build for the
architectures CI checks, and loading a kernel on this machine's GPU."""

import pytest

from cupyflash import _nvrtc

ARCHS = ("sm_80", "sm_90a")

try:
    _nvrtc.nvrtc_version()
    NO_NVRTC = None
except Exception as exc:  # pragma: no cover - depends on the machine
    NO_NVRTC = f"NVRTC not loadable ({type(exc).__name__}); install cupyflash[cuda12] or [cuda13]"


def assert_builds(source, expressions, arch):
    """Every instantiation in `expressions` of `source` compiles for `arch` without spills
    (skipped where NVRTC cannot load)."""
    if NO_NVRTC:
        pytest.skip(NO_NVRTC)
    for expr in expressions:
        compiled = _nvrtc.compile_kernel(source, expr, arch)
        assert compiled.lowered_name and compiled.binary_path.stat().st_size > 0
        assert compiled.spill_stores == 0 and compiled.spill_loads == 0


def gpu_kernel(source, expr):
    """`expr` of `source` compiled for this GPU and loaded through cupy.RawModule, as
    cupyflash._cuda._load does."""
    import cupy

    from cupyflash import _cuda

    arch, _ = _cuda._device_info(cupy.cuda.Device().id)
    compiled = _nvrtc.compile_kernel(source, expr, arch)
    return cupy.RawModule(path=str(compiled.binary_path)).get_function(compiled.lowered_name)
