"""`python -m cupyflash.bench`: its command line, table and plots without a GPU, and one
tiny grid on a GPU."""

import json
import subprocess
import sys

import pytest

from cupyflash import bench


def _row(impl, pass_, N, tflops, dtype="float16", d=64, causal=False):
    ms = None if tflops is None else 1.0
    return {"impl": impl, "pass": pass_, "dtype": dtype, "d": d, "causal": causal, "N": N,
            "B": 16384 // N, "H": 2048 // d, "ms": ms, "tflops": tflops,
            "peak_mem_bytes": None if tflops is None else 2**26 * (N if impl == "naive-cupy" else 1)}


RESULT = {
    "gpu": "Test GPU", "date": "2026-01-01T00:00:00+00:00", "commit": "0" * 40,
    "versions": {"cupyflash": "0.1.0", "cupy": "14.0.0", "cuda_runtime": 13020, "driver": 13000,
                 "torch": None, "python": "3.12.0"},
    "rows": [_row("cupyflash", "fwd", 512, 100.0), _row("cupyflash", "fwd", 1024, 150.0),
             _row("torch-flash", "fwd", 512, 200.0), _row("torch-flash", "fwd", 1024, None),
             _row("naive-cupy", "fwd", 512, 5.0), _row("cupyflash", "bwd", 512, None),
             _row("cupyflash", "fwd", 1024, 20.0, dtype="float64", d=128)],
}


def test_help_and_plot_only_import_neither_cupy_nor_torch(tmp_path):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(RESULT))
    probe = ("import runpy, sys\n"
             f"sys.argv = ['bench', '--plot-only', {str(saved)!r}]\n"
             "try:\n    runpy.run_module('cupyflash.bench', run_name='__main__')\n"
             "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
             "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]"
    for quantity in ("tflops", "memory"):
        png = tmp_path / f"results-{quantity}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = subprocess.run([sys.executable, "-m", "cupyflash.bench", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--plot-only" in run.stdout


def test_plot_needs_out():
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot"])


def test_summary_table(capsys):
    bench.summary(RESULT["rows"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["pass", "dtype"]  # bench/gpu_session.sh prints from here
    assert lines[1].split() == ["fwd", "float16", "64", "0", "512", "100.0", "200.0", "-", "0.50"]
    assert len(lines) == 4  # failed cupyflash rows are left out of the table


@pytest.mark.gpu
def test_tiny_grid_on_gpu(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--seqlens", "512", "--head-dims", "64", "--dtypes", "float16",
                       "--wide-dtypes-seqlens", "--passes", "fwd", "--peers", "naive-cupy",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"gpu", "date", "commit", "versions", "rows"} <= result.keys()
    ours = [r for r in result["rows"] if r["impl"] == "cupyflash"]
    assert len(ours) == 2 and all(r["tflops"] and r["peak_mem_bytes"] for r in ours)
