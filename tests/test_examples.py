"""The examples' own numerics on tiny sizes: the training example's hand-written
gradients against finite differences, and the kernel-smoothing example against SciPy."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name):
    """Import examples/<name>.py as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_transformer():
    return load_example("train_tiny_transformer")


@pytest.mark.parametrize("heads", [1, 2])
def test_transformer_gradients_match_finite_differences(tiny_transformer, rng, heads):
    ex = tiny_transformer
    # Odd N: more queries than pairs, so some keys are asked twice.
    cfg = ex.Config(seq_len=7, vocab=5, d_model=4, heads=heads, dtype="float64")
    params = ex.init_params(rng, cfg)
    batch = ex.make_batch(rng, cfg, 3)

    def loss_of(p):
        return float(ex.forward(p, batch, cfg, backend="numpy")[0])

    grads = ex.forward(params, batch, cfg, backend="numpy")[2]()
    assert grads.keys() == params.keys()
    eps = 1e-6
    for name, p in params.items():
        assert grads[name].shape == p.shape, name
        numeric = np.empty_like(p)
        for idx in np.ndindex(p.shape):  # every entry: the tiny model has a few hundred
            saved = p[idx]
            p[idx] = saved + eps
            up = loss_of(params)
            p[idx] = saved - eps
            down = loss_of(params)
            p[idx] = saved
            numeric[idx] = (up - down) / (2 * eps)
        err = np.linalg.norm(grads[name] - numeric) / max(np.linalg.norm(numeric), 1e-12)
        assert err < 1e-6, f"{name}: relative error {err:.2e}"


def test_transformer_batch_asks_for_stored_values(tiny_transformer, rng):
    ex = tiny_transformer
    cfg = ex.Config(seq_len=9, vocab=6, d_model=4, heads=1)
    key_ids, value_ids, targets = ex.make_batch(rng, cfg, 5)
    P = cfg.pairs
    for keys, values, target in zip(key_ids, value_ids, targets):
        assert len(set(keys[:P])) == P  # distinct keys, so each question has one answer
        stored = dict(zip(keys[:P], values[:P]))
        assert (values[P:] == cfg.blank).all()
        assert [stored[key] for key in keys[P:]] == list(target)


def test_transformer_learns_recall(tiny_transformer):
    ex = tiny_transformer
    cfg = ex.Config(seq_len=16, vocab=8, d_model=32, heads=2)
    params, losses = ex.train(cfg, steps=150, batch=32, lr=1e-2, seed=0, xp=np,
                              log=lambda _: None, backend="numpy")
    loss, accuracy = ex.evaluate(params, cfg, batches=2, batch=32, seed=1, xp=np, backend="numpy")
    assert losses[-1] < 0.5 * losses[0]
    assert accuracy > 0.9, (loss, accuracy)


@pytest.fixture(scope="module")
def kernel_smoothing():
    return load_example("kernel_smoothing")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("bandwidth", [0.02, 0.3])
def test_smoothing_as_attention_matches_scipy(kernel_smoothing, rng, dtype, bandwidth):
    ex = kernel_smoothing
    x, y, f, _ = ex.make_problem(rng, 37, 301, dtype)  # sizes off the 128-row blocks
    got = ex.smooth(x, y, f, bandwidth, backend="numpy")
    assert got.shape == (37,) and got.dtype == np.dtype(dtype)
    assert ex.relative_error(got, ex.smooth_direct(x, y, f, bandwidth)) <= ex.TOLERANCE[dtype]


def test_smoothing_vector_values_away_from_the_origin(kernel_smoothing, rng):
    # Uncentred 3-D points and several value columns per sample.
    ex = kernel_smoothing
    x, y = rng.uniform(2.0, 3.0, (50, 3)), rng.uniform(2.0, 3.0, (200, 3))
    values = rng.standard_normal((200, 4))
    got = ex.smooth(x, y, values, 0.25, backend="numpy")
    assert got.shape == (50, 4)
    assert ex.relative_error(got, ex.smooth_direct(x, y, values, 0.25)) <= 1e-12


def test_out_of_core_example_runs_and_checks(capsys):
    """The streamed example on a small case (the NumPy backend here; the GPU where one is):
    many chunks under the limit, sampled rows within float64's limit."""
    ex = load_example("out_of_core")
    status = ex.main(["--seqlen", "700", "--heads", "2", "--head-dim", "16", "--dtype", "float64",
                      "--device-memory-limit", "700000", "--check-rows", "8"])
    out = capsys.readouterr().out
    assert status == 0 and "within the float64 limit" in out
    assert ", 1 (query, key) chunk pairs" not in out
