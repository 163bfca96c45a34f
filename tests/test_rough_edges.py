"""What a new user meets first: errors that say what is wrong (no GPU, a window too
wide), the command lines' help, where the tests put their kernels, the build's progress,
and the tolerances written down beside the tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from cupyflash import _gpu_status, _nvrtc, bench

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = _gpu_status.why_not_usable()
needs_no_gpu = pytest.mark.skipif(NO_GPU is None, reason="checks the behaviour without a GPU")


@pytest.mark.parametrize("window", [(2**63, 0), (0, 2**64), (2**31, 5)])
def test_window_sides_past_int32_are_refused_by_name(window):
    q = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"window sides must be at most 2\*\*31 - 1"):
        cupyflash.attention(q, q, q, window=window)


def test_window_side_at_the_limit_is_unbounded(rng):
    q, k, v = (rng.standard_normal((1, 2, 40, 8)).astype(np.float32) for _ in range(3))
    wide = cupyflash.attention(q, k, v, window=(2**31 - 1, 2**31 - 1), backend="numpy")
    np.testing.assert_allclose(wide, cupyflash.attention(q, k, v, backend="numpy"), rtol=1e-6)


@needs_no_gpu
def test_precompile_without_a_gpu_says_why():
    with pytest.raises(RuntimeError, match="precompile builds kernels for a GPU") as info:
        cupyflash.precompile(dtypes=["float16"], head_dims=[64])
    assert NO_GPU in str(info.value) and "build_check" in str(info.value)


def test_no_gpu_reason_names_a_missing_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # import cupy now raises ImportError
    assert _gpu_status.why_not_usable().startswith("cupy is not installed")


def test_no_gpu_reason_names_the_driver(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(_nvrtc, "nvrtc_version", lambda: (12, 9))

    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    reason = _gpu_status.why_not_usable()
    assert "CUDA driver cannot run CuPy's CUDA runtime" in reason
    assert "cudaErrorInsufficientDriver" in reason


def test_gpu_tests_skip_with_the_actual_reason():
    from conftest import gpu_skip_reason
    reason = gpu_skip_reason()
    assert (reason is None) == (NO_GPU is None)
    if reason is not None:
        assert NO_GPU in reason and "cupy not installed or no device" not in reason


@needs_no_gpu
def test_bench_without_a_gpu_runs_the_cpu_rows(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    code = bench.main(["--cpu-seqlens", "64", "--cpu-peers", "naive-numpy", "--cpu-passes", "fwd",
                       "--cpu-min-time", "0", "--out", str(out)])
    assert code == 0
    assert "no usable CUDA GPU here: running the CPU benchmark" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["matmul_gflops"] > 0 and result["commit"]
    impls = {(r["impl"], r["causal"]) for r in result["rows"] if r["seconds"]}
    assert ("cupyflash", False) in impls and ("naive-numpy", True) in impls


def test_bench_cpu_naive_peers_compute_attention(rng):
    # The naive peer must compute what cupyflash computes, or the comparison means nothing.
    from cupyflash import _bench_cpu
    q, k, v, do = (rng.standard_normal((1, 2, 50, 8)) for _ in range(4))
    for causal in (False, True):
        o, ctx = cupyflash.attention_forward(q, k, v, causal=causal, scale=0.3)
        np.testing.assert_allclose(_bench_cpu.naive_forward(q, k, v, 0.3, causal), o, rtol=1e-10)
        grads = cupyflash.attention_backward(do, ctx)
        for got, ref in zip(_bench_cpu.naive_forward_backward(q, k, v, do, 0.3, causal), grads):
            np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


def _run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT)


def test_module_help_exits_0_and_lists_the_commands():
    run = _run("-m", "cupyflash", "--help")
    assert run.returncode == 0, run.stderr
    assert "info" in run.stdout and "cupyflash.bench" in run.stdout
    run = _run("-m", "cupyflash")
    assert run.returncode == 2 and "usage: python -m cupyflash" in run.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_help_shows_every_default(script):
    run = _run(str(ROOT / "examples" / script), "--help")
    assert run.returncode == 0, run.stderr
    # One chunk per option: its name, metavar and help up to the next option.
    chunks = re.split(r"\n  (?=-)", run.stdout.split("options:", 1)[1])[1:]
    assert len(chunks) > 3
    for chunk in chunks:
        name = chunk.split()[0].rstrip(",")
        if name in ("-h", "--plot"):   # help, and an output path that is off without it
            continue
        assert "default" in chunk, (script, chunk)


def test_tests_keep_kernels_outside_the_home_cache():
    if os.environ.get("CUPYFLASH_CACHE_DIR") != str(ROOT / ".pytest_cache" / "cupyflash-kernels"):
        pytest.skip("CUPYFLASH_CACHE_DIR was set by the user: the tests use it")
    assert _nvrtc.cache_dir() == ROOT / ".pytest_cache" / "cupyflash-kernels"
    assert Path.home() / ".cupy" not in _nvrtc.cache_dir().parents


def test_kernel_compilation_reports_progress(monkeypatch):
    monkeypatch.setattr(_nvrtc, "compile_kernel", lambda source, name, arch: (source, name, arch))
    lines = []
    jobs = [("f.cu", f"kernel<{i}>", "sm_80") for i in range(25)]
    got = _nvrtc.compile_many(jobs, workers=1, progress=lines.append)
    assert got == jobs
    assert len(lines) == 13   # every 2 jobs (a tenth of 25, rounded down), and the last
    assert lines[-1].startswith("NVRTC: 25/25 kernel instantiations built or loaded from")


def test_tolerances_are_written_down_as_the_tests_use_them():
    from gpu_cases import TOLERANCE
    from test_reference import TOL
    text = (ROOT / "tests" / "TOLERANCES.md").read_text()
    table = dict(re.findall(r"^\| (\w+) \| ([0-9e.-]+) \|", text, flags=re.M))
    assert {name: float(x) for name, x in table.items()} == TOLERANCE
    assert TOL == {np.float32: TOLERANCE["float32"], np.float64: TOLERANCE["float64"]}
