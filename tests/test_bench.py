"""`python -m cupyflash.bench`: its command line, table and plots without a GPU, and one
tiny grid on a GPU."""

import json
import subprocess
import sys

import numpy as np
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


@pytest.mark.gpu
def test_tiny_grid_in_rounds_keeps_the_median_and_range(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--seqlens", "512", "--head-dims", "64", "--dtypes", "float16",
                       "--wide-dtypes-seqlens", "--passes", "fwd", "bwd", "--peers",
                       "--rounds", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["pass"] for r in rows} == {"fwd", "bwd"}
    for r in rows:
        assert r["rounds"] == 3 and r["ms_min"] <= r["ms"] <= r["ms_max"]


def test_one_round_by_default():
    assert bench.parse_args([]).rounds == 1


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_rounds_time_each_implementation_in_turn(monkeypatch):
    """bench_case without a GPU (cupyflash, torch and the timer stand-ins): each round
    times every implementation once, in order; a row keeps the median and the range of
    its readings; each torch row runs its own backend; one that fails is recorded as
    failed and not timed again."""
    import contextlib
    import types

    import cupyflash

    log, failures = [], []
    backend = [None]

    @contextlib.contextmanager
    def sdpa_kernel(b):
        backend[0] = b
        yield

    def grad(out, xs, tdo, retain_graph):
        log.append(("bwd", out))
        if out == "EFFICIENT":
            failures.append(out)
            raise RuntimeError("no such kernel here")

    class Tensor:
        def detach(self):
            return self

        def requires_grad_(self):
            return self

    torch = types.SimpleNamespace(
        nn=types.SimpleNamespace(functional=types.SimpleNamespace(
            scaled_dot_product_attention=lambda *a, **k: (log.append(("fwd", backend[0])), backend[0])[1])),
        autograd=types.SimpleNamespace(grad=grad))
    backends = types.SimpleNamespace(FLASH_ATTENTION="FLASH", CUDNN_ATTENTION="CUDNN",
                                     EFFICIENT_ATTENTION="EFFICIENT", MATH="MATH")
    monkeypatch.setattr(bench, "_torch", lambda: (torch, backends, sdpa_kernel))
    monkeypatch.setattr(bench, "make_inputs", lambda *a: ((1, 2, 3, 4), tuple(Tensor() for _ in range(4))))
    monkeypatch.setattr(bench, "cupy_peak", lambda run: 7)
    monkeypatch.setattr(bench, "torch_peak", lambda torch, run: 5)
    monkeypatch.setattr(cupyflash, "attention", lambda *a, **k: log.append(("fwd", "cupyflash")))
    monkeypatch.setattr(cupyflash, "attention_forward", lambda *a, **k: (None, "ctx"))
    monkeypatch.setattr(cupyflash, "attention_backward", lambda do, ctx: log.append(("bwd", "cupyflash")))
    readings = iter(range(1, 100))

    def time_ms(run):
        log.clear()
        run()
        return float(next(readings))

    monkeypatch.setattr(bench, "time_ms", time_ms)
    rows = []
    bench.bench_case("float16", 64, False, 512, ["bwd"], ["torch-flash", "torch-efficient", "torch-cudnn"],
                     rows, 0, rounds=3)
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"cupyflash", "torch-flash", "torch-efficient", "torch-cudnn"}
    # Round 1 reads 1 (cupyflash), 2 (flash), efficient fails, 3 (cuDNN); rounds 2 and 3 read
    # 4-6 and 7-9 without the failed one.
    assert [(by_impl[i]["ms_min"], by_impl[i]["ms"], by_impl[i]["ms_max"]) for i in ("cupyflash", "torch-flash", "torch-cudnn")] \
        == [(1.0, 4.0, 7.0), (2.0, 5.0, 8.0), (3.0, 6.0, 9.0)]
    assert all(by_impl[i]["rounds"] == 3 for i in ("cupyflash", "torch-flash", "torch-cudnn"))
    failed = by_impl["torch-efficient"]
    assert failed["ms"] is None and failed["tflops"] is None and "rounds" not in failed
    assert failures == ["EFFICIENT"]   # timed once, not in every round
    assert by_impl["torch-cudnn"]["peak_mem_bytes"] == 5 and by_impl["cupyflash"]["peak_mem_bytes"] == 7
    # The last reading was cuDNN's own backward: each row's closure ran its own backend.
    assert log == [("bwd", "CUDNN")]


# --------------------------------------------------------------------------- --mods


def test_mods_is_opt_in():
    assert not bench.parse_args([]).mods
    args = bench.parse_args(["--mods"])
    assert args.mods and args.mods_seqlens == [4096, 16384] and args.mods_dtypes == ["bfloat16"]
    assert args.head_dims == [64, 128] and args.passes == ["fwd", "bwd"]
    args = bench.parse_args(["--mods", "--mods-seqlens", "512", "--mods-dtypes", "float16", "float32"])
    assert args.mods_seqlens == [512] and args.mods_dtypes == ["float16", "float32"]


@pytest.mark.parametrize("density", bench.MOD_DENSITIES)
def test_random_block_mask_density(density):
    rng = np.random.default_rng(0)
    mask = bench.random_block_mask(rng, 16, 32, 32, density)
    assert mask.shape == (1, 16, 32, 32) and mask.dtype == bool
    assert np.all(mask.sum(-1) == round(32 * density))   # every query tile the same work
    assert mask.mean() == density
    if density < 1:
        assert not np.array_equal(mask[0, 0], mask[0, 1])  # one pattern per head
    assert bench.random_block_mask(rng, 1, 3, 5, 0.01).sum() == 3   # at least one block per row


def test_varlen_lengths():
    rng = np.random.default_rng(1)
    for count in (1, 8, 64):
        lengths = bench.varlen_lengths(rng, count, 16384)
        assert len(lengths) == count and lengths.sum() == 16384 and lengths.min() >= bench.VARLEN_MIN
    assert len(set(bench.varlen_lengths(rng, 8, 16384).tolist())) > 1
    with pytest.raises(ValueError):
        bench.varlen_lengths(rng, 100, 16384)


@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 17), (40, 25), (25, 40), (300, 300)])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (7, 0)),
                                           (False, (5, 3)), (False, (-1, 4)), (False, (9, -1))])
def test_visible_pairs_counts_the_mask(nq, nk, causal, window):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    diag = i + nk - nq
    seen = np.ones((nq, nk), bool)
    if causal:
        seen &= j <= diag
    if window[0] >= 0:
        seen &= j >= diag - window[0]
    if window[1] >= 0:
        seen &= j <= diag + window[1]
    assert bench.visible_pairs(nq, nk, causal=causal, window=window) == seen.sum()


def test_make_row_and_flop_counts():
    row = bench.make_row("cupyflash", "bwd", "bfloat16", 128, False, 4096, 4, 16, 2.0, 123, 4e9,
                         variant="block_sparse density=0.5", speedup_vs_dense=1.9)
    assert row == {"impl": "cupyflash", "pass": "bwd", "dtype": "bfloat16", "d": 128, "causal": False,
                   "N": 4096, "B": 4, "H": 16, "ms": 2.0, "tflops": 2.0, "peak_mem_bytes": 123,
                   "variant": "block_sparse density=0.5", "speedup_vs_dense": 1.9}
    assert bench.make_row("x", "fwd", "float16", 64, True, 512, 32, 32, None, None, 1e9)["tflops"] is None
    # the grid's keys are those of the plain rows, so saved results stay comparable
    assert bench.make_row("x", "fwd", "float16", 64, True, 512, 32, 32, 1.0, 0, 1e9).keys() == _row("x", "fwd", 512, 1.0).keys()
    # a full window is dense: the pair count gives the grid's FLOPs
    n, h, d = 1024, 16, 128
    for pass_ in ("fwd", "bwd"):
        assert bench.pair_flops(bench.visible_pairs(n, n), h, d, pass_) == bench.flops(1, h, n, d, False, pass_)


MOD_ROWS = [
    bench.make_row("cupyflash", "fwd", "bfloat16", 128, False, 4096, 4, 16, 4.0, 1, 1e12, variant="dense",
                   speedup_vs_dense=None),
    bench.make_row("cupyflash", "fwd", "bfloat16", 128, False, 4096, 4, 16, 1.0, 1, 1e12,
                   variant="block_sparse density=0.25", speedup_vs_dense=4.0),
    bench.make_row("torch-flash", "fwd", "bfloat16", 128, True, 4096, 4, 16, None, None, 1e12,
                   variant="dropout p=0.1", speedup_vs_dense=None),
    bench.make_row("cupyflash", "fwd", "bfloat16", 128, False, 4096, 4, 16, 2.0, 1, 1e12, variant="dropout p=0.1",
                   speedup_vs_dense=2.0),
    bench.make_row("torch-flash", "fwd", "bfloat16", 128, False, 4096, 4, 16, 4.0, 1, 1e12,
                   variant="dropout p=0.1", speedup_vs_dense=None),
]


def test_mods_summary_and_grid_summary_keep_apart(capsys):
    bench.mods_summary(MOD_ROWS + RESULT["rows"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["pass", "dtype"]
    assert len(lines) == 4   # the header and cupyflash's three variant rows; peers ride along
    assert "block_sparse density=0.25" in lines[2] and lines[2].split()[-3:] == ["1000.0", "4.00", "0.25"]
    # dropout: 500 TFLOP/s, 2x the dense call's per pair, half its wall time; torch-flash
    # at 250 in the same case (its causal row is another case).
    assert lines[3].split()[-6:] == ["500.0", "2.00", "0.50", "torch-flash", "250.0", "2.00x"]
    bench.summary(MOD_ROWS + RESULT["rows"])   # the variant rows stay out of the grid's table
    assert len(capsys.readouterr().out.strip().splitlines()) == 4


def test_plot_only_draws_the_mods_figure(tmp_path):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "mods.json"
    saved.write_text(json.dumps(dict(RESULT, rows=MOD_ROWS)))
    assert bench.main(["--plot-only", str(saved)]) == 0
    assert (tmp_path / "mods-mods.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "mods-tflops.png").exists()


@pytest.mark.gpu
def test_tiny_mods_on_gpu(tmp_path):
    out = tmp_path / "mods.json"
    assert bench.main(["--mods", "--mods-seqlens", "1024", "--head-dims", "64", "--passes", "fwd",
                       "--peers", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["variant"] and r["ms"] for r in rows)
    sparse = [r for r in rows if r["variant"].startswith("block_sparse")]
    assert len(sparse) == len(bench.MOD_DENSITIES) and all(r["speedup_vs_dense"] for r in sparse)
    assert {r["variant"] for r in rows} == {
        "dense", "window left=256 right=0", "window left=2048 right=0", "varlen 8 seqs", "seqlens_k", "gqa 8:1",
        "block_sparse density=1", "block_sparse density=0.5", "block_sparse density=0.25",
        "block_sparse density=0.125", "dropout p=0.1", "softcap 30", "alibi", "bias (Nq,Nk)"}
    assert all(r["visible_pairs"] > 0 for r in rows)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_load_process_stops_when_the_benchmark_is_killed(tmp_path):
    """`--load`'s spinning process ends with the benchmark even when a signal kills the
    benchmark without running its cleanup (SIGTERM)."""
    import signal
    import time
    from pathlib import Path

    script = tmp_path / "bench_with_load.py"
    script.write_text("import time\nfrom cupyflash import _bench_cpu\n"
                      "with _bench_cpu.busy_process(True) as spinner:\n"
                      "    print(spinner.pid, flush=True)\n    time.sleep(60)\n")
    root = Path(__file__).resolve().parent.parent
    bench_proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                  env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    spinner = int(bench_proc.stdout.readline())
    bench_proc.send_signal(signal.SIGTERM)
    bench_proc.wait(10)

    def spinning() -> bool:
        try:
            state = Path(f"/proc/{spinner}/status").read_text()
        except FileNotFoundError:
            return False
        return "\nState:\tZ" not in state   # a zombie no longer runs

    deadline = time.monotonic() + 10
    while spinning() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not spinning()
