"""CPU tier: every kernel instantiation compiles for sm_80 and sm_90a with NVRTC (no GPU
needed), the tensor-core kernels do not spill, and the sources ship with the package."""

import os
import subprocess
import sys

import pytest

from cupyflash import _cuda, _kernels, _nvrtc, build_check

try:
    _nvrtc.nvrtc_version()
    _NVRTC = None
except Exception as exc:  # pragma: no cover - depends on the machine
    _NVRTC = f"NVRTC not loadable ({type(exc).__name__}); install cupyflash[cuda12] or [cuda13]"


@pytest.fixture(scope="module")
def built(request):
    if _NVRTC:
        pytest.skip(_NVRTC)
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def progress(line):
        # Past pytest's capture: a cold build runs for minutes and should say so.
        with capture.global_and_fixture_disabled():
            print(f"\n{line}", file=sys.stderr, flush=True)

    return build_check.build_all(jobs=os.cpu_count() or 1, progress=progress)


def test_every_instantiation_builds_for_both_archs(built):
    for arch in _kernels.BUILD_ARCHS:
        names = {v.name_expression for v in _kernels.all_variants() if v.builds_for(arch)}
        assert {v.name_expression for v, c in built if c.arch == arch} == names
    assert any(v.family.arch == "sm_90a" for v in _kernels.all_variants())   # the Hopper kernels are in it
    assert all(c.lowered_name and c.binary_path.stat().st_size > 0 for _, c in built)


def test_tensor_core_kernels_do_not_spill(built):
    spilled = [(v.name_expression, c.arch, c.spill_stores, c.spill_loads)
               for v, c in built if build_check.must_not_spill(v) and (c.spill_stores or c.spill_loads)]
    assert not spilled


def test_warpgroup_mma_is_not_serialized(built):
    # ptxas serialises a Hopper kernel's wgmma where code reads an accumulator whose
    # product may still run (C7514): correct, but the overlap the kernel is built for is
    # gone.
    serialized = [(v.name_expression, c.arch) for v, c in built if build_check.WGMMA_SERIALIZED in c.log]
    assert not serialized


def test_static_shared_memory_is_within_the_hosts_reservation(built):
    # The host adds Variant.static_smem to a kernel's dynamic figure when it checks the
    # device's limit; a kernel with more would launch with more than was checked.
    over = [(v.name_expression, c.arch, c.static_smem, v.static_smem)
            for v, c in built if c.static_smem > v.static_smem]
    assert not over


def test_ptxas_report_is_parsed():
    log = ("ptxas info    : Function properties for k\nptxas         .     8 bytes stack frame, "
           "4 bytes spill stores, 12 bytes spill loads\nptxas info    : Used 96 registers, used 1 barriers")
    assert _nvrtc._parse_ptxas(log) == {"registers": 96, "spill_stores": 4, "spill_loads": 12,
                                        "stack_frame": 8, "static_smem": 0}


def test_kernel_sources_are_found_from_another_directory(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from cupyflash import _nvrtc; print(_nvrtc.KERNEL_DIR)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    kernel_dir = out.stdout.strip()
    assert os.path.isfile(os.path.join(kernel_dir, "fwd_sm80.cu"))


def test_info_command_runs_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "cupyflash", "info"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0
    assert "cupyflash" in out.stdout and "kernel cache" in out.stdout
    if not _cuda.gpu_available():
        assert "no GPU" in out.stdout
