"""Gaussian-kernel smoothing (Nadaraya-Watson regression) of scattered data as exact attention.

Given samples ``(y_j, f_j)`` and query points ``x_i`` in R^p, the Nadaraya-Watson estimate
with a Gaussian kernel of bandwidth h is

    fhat(x_i) = sum_j w_ij f_j,    w_ij = softmax_j( -|x_i - y_j|^2 / (2 h^2) ),

a softmax over the samples weighting their values: attention. Expanding the square,

    -|x - y|^2 / (2h^2) = (x . y) / h^2  -  |x|^2 / (2h^2)  -  |y|^2 / (2h^2).

The middle term depends on the row (query) only, and a softmax is unchanged by adding a
constant to a row, so it drops out. The last term depends on the key; it is folded into
the dot product by giving q and k one extra coordinate each:

    q_i = (x_i / h^2, 1),    k_j = (y_j, -|y_j|^2 / (2h^2)),    v_j = f_j,    scale = 1,

so that ``q_i . k_j = (x_i . y_j) / h^2 - |y_j|^2 / (2h^2)`` and
``fhat = cupyflash.attention(q, k, v, scale=1.0)``, exactly, without the Nq x Nk matrix of
weights. (Centring the points first keeps |y|^2 / h^2 small, which limits rounding in the
folded term: the dropped row term is never formed, so it costs nothing.)

The script compares cupyflash with a direct SciPy computation (``cdist`` and ``softmax``)
on a problem small enough for the dense weight matrix, then smooths a problem whose dense
matrix would not fit in memory, checking a random sample of its rows the direct way.
On a GPU it runs there with CuPy arrays; otherwise on the NumPy backend with smaller
sizes. It needs SciPy, which cupyflash itself does not (``pip install scipy``, or the
``test`` extra).

    python examples/kernel_smoothing.py [--queries NQ] [--samples NK] [--bandwidth H]
        [--dtype float64] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy.spatial.distance import cdist
from scipy.special import softmax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout too

import cupyflash  # noqa: E402
from cupyflash import _cuda  # noqa: E402

# Relative error of the attention result against the direct float64 computation. The
# folded key term |y|^2 / (2h^2) reaches hundreds for small h and carries its rounding,
# eps * |y|^2 / (2h^2), into every weight: fine in float64, ~1e-5 in float32.
TOLERANCE = {"float64": 1e-12, "float32": 1e-4}
# Large-problem sizes: (queries, samples). The dense float64 weight matrix would take
# 32 GiB on the CPU default and 2 TiB on the GPU one.
CPU_LARGE, GPU_LARGE = (2**15, 2**17), (2**19, 2**19)
SMALL = (2000, 3000)
NOISE = 0.1


def array_module(x):
    """numpy for NumPy arrays, cupy for CuPy arrays (cupy is imported only when in use)."""
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


def smooth(x, y, values, bandwidth, **attention_options):
    """Gaussian-kernel (Nadaraya-Watson) estimate at ``x`` from samples ``(y, values)``.

    Parameters
    ----------
    x : array, shape (Nq, p)
        Query points. NumPy or CuPy; the result is of the same kind.
    y : array, shape (Nk, p)
        Sample points, same dtype as x (float32 or float64).
    values : array, shape (Nk,) or (Nk, c)
        Values at the samples.
    bandwidth : float
        Kernel width h: weights are ``exp(-|x - y|^2 / (2 h^2))``, normalised per query.
    **attention_options
        Passed to `cupyflash.attention` (e.g. ``backend``).

    Returns
    -------
    array, shape (Nq,) or (Nq, c)
    """
    xp = array_module(x)
    inv_h2 = 1.0 / bandwidth**2
    q = xp.concatenate([x * inv_h2, xp.ones_like(x[:, :1])], axis=1)
    k = xp.concatenate([y, (-0.5 * inv_h2) * (y * y).sum(axis=1, keepdims=True)], axis=1)
    v = values.reshape(len(y), -1)
    out = cupyflash.attention(q, k, v.astype(x.dtype, copy=False), scale=1.0, **attention_options)
    return out.reshape((len(x),) + values.shape[1:])


def smooth_direct(x, y, values, bandwidth):
    """The same estimate through the dense (Nq, Nk) weight matrix, in float64 with SciPy."""
    x, y, values = (np.asarray(a, dtype=np.float64) for a in (x, y, values))
    weights = softmax(-cdist(x, y, "sqeuclidean") / (2 * bandwidth**2), axis=1)
    return weights @ values


def surface(points):
    """The function the samples measure: a smooth 2-D wave."""
    return np.sin(2 * np.pi * points[:, 0]) * np.cos(2 * np.pi * points[:, 1])


def make_problem(rng, queries, samples, dtype):
    """Query points on [-1/2, 1/2]^2 (centred, see the module notes), noisy samples of
    `surface` at random points, and the noise-free surface at the queries."""
    x = rng.uniform(-0.5, 0.5, (queries, 2))
    y = rng.uniform(-0.5, 0.5, (samples, 2))
    f = surface(y) + NOISE * rng.standard_normal(samples)
    return x.astype(dtype), y.astype(dtype), f.astype(dtype), surface(x)


def relative_error(got, ref):
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def default_bandwidth(samples):
    """A bandwidth that shrinks with the sample density (h ~ n^(-1/6) is the rate for
    twice-differentiable functions in two dimensions)."""
    return 0.2 * samples ** (-1 / 6)


def to_host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def compare_small(rng, xp, dtype, bandwidth):
    """Relative error of `smooth` against `smooth_direct` on the small problem."""
    x, y, f, _ = make_problem(rng, *SMALL, dtype)
    got = to_host(smooth(xp.asarray(x), xp.asarray(y), xp.asarray(f), bandwidth))
    return relative_error(got, smooth_direct(x, y, f, bandwidth))


def run_large(rng, xp, dtype, queries, samples, bandwidth, check_rows):
    """Smooth the large problem; returns (seconds, error on sampled rows, RMSE to the
    noise-free surface)."""
    x, y, f, truth = make_problem(rng, queries, samples, dtype)
    x_dev, y_dev, f_dev = (xp.asarray(a) for a in (x, y, f))
    start = time.perf_counter()
    fhat = smooth(x_dev, y_dev, f_dev, bandwidth)
    fhat = to_host(fhat)  # waits for the GPU
    seconds = time.perf_counter() - start
    rows = rng.choice(queries, size=min(check_rows, queries), replace=False)
    error = relative_error(fhat[rows], smooth_direct(x[rows], y, f, bandwidth))
    rmse = float(np.sqrt(np.mean((fhat.astype(np.float64) - truth) ** 2)))
    return seconds, error, rmse


def parse_args(argv, on_gpu):
    queries, samples = GPU_LARGE if on_gpu else CPU_LARGE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Defaults are this machine's (GPU or NumPy backend).")
    p.add_argument("--queries", type=int, default=queries, help="query points of the large problem (default: %(default)s)")
    p.add_argument("--samples", type=int, default=samples, help="sample points of the large problem (default: %(default)s)")
    p.add_argument("--bandwidth", type=float, help="kernel width h (default: from the sample count)")
    p.add_argument("--dtype", default="float64", choices=sorted(TOLERANCE),
                   help="dtype of the attention inputs (default: %(default)s)")
    p.add_argument("--check-rows", type=int, default=64, help="large-problem rows checked directly (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None):
    on_gpu = _cuda.gpu_available()
    args = parse_args(argv, on_gpu)
    if on_gpu:
        import cupy as xp
        where = "GPU (CuPy arrays)"
    else:
        xp = np
        where = "no GPU found: NumPy backend, smaller default size"
    rng = np.random.default_rng(args.seed)
    tolerance = TOLERANCE[args.dtype]
    print(f"cupyflash {cupyflash.__version__} on {where}; {args.dtype}")

    h_small = default_bandwidth(SMALL[1])
    error = compare_small(rng, xp, args.dtype, h_small)
    ok = error <= tolerance
    print(f"small: {SMALL[0]} queries x {SMALL[1]} samples, h = {h_small:.3f}: relative error "
          f"against scipy cdist + softmax {error:.2e} ({'ok' if ok else 'TOO LARGE'}, limit {tolerance:.0e})")

    h = args.bandwidth or default_bandwidth(args.samples)
    dense_gib = args.queries * args.samples * 8 / 2**30
    print(f"large: {args.queries} queries x {args.samples} samples, h = {h:.4f}; the dense "
          f"float64 weight matrix would take {dense_gib:,.0f} GiB")
    seconds, large_error, rmse = run_large(rng, xp, args.dtype, args.queries, args.samples, h,
                                           args.check_rows)
    large_ok = large_error <= tolerance
    print(f"  smoothed in {seconds:.2f} s; {args.check_rows} random rows against the direct "
          f"computation: relative error {large_error:.2e} ({'ok' if large_ok else 'TOO LARGE'})")
    print(f"  RMSE to the noise-free surface {rmse:.4f} (sample noise {NOISE})")
    return 0 if ok and large_ok else 1


if __name__ == "__main__":
    sys.exit(main())
