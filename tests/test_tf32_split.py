"""CPU tier: the 3xTF32 arithmetic of the fp32 tensor-core forward (kernels_cu/fwd_wide.cu,
mma_wide.cuh), emulated in NumPy bit for bit where the hardware is specified and
pessimistically where it is not.

What the kernel does and these tests pin:
- x = big + small with big = x rounded to TF32 (10 stored mantissa bits, to nearest, ties
  away: cvt.rna), formed as (bits(x) + 0x1000) with the low 13 bits ignored;
  small = x - big, exact in fp32, handed to the tensor core unrounded (it truncates).
- a b ~ small_a big_b + big_a small_b + big_a big_b, three m16n8k8 TF32 MMAs per k-step.
- The tensor cores' fp32 accumulation is modelled as in Fasi, Higham, Mikaitis, Pranesh,
  "Numerical behavior of NVIDIA tensor cores" (PeerJ CS, 2021): exact products, all terms
  aligned to the largest with the bits below its 24th truncated, the sum rounded toward
  zero. That bias is why the kernel sums P V per key tile from zero and adds tiles in
  the FPU: accumulated over the whole sequence it grows with the number of keys.

These tests pin the 3xTF32 design in NumPy (the split, its error, and that this
arithmetic with per-tile P V sums meets the fp32 tolerance), not the kernel: no GPU code
runs here. The GPU forward tests (tests/test_gpu_forward.py) check the kernel's fp32
results.
"""

import numpy as np
from gpu_cases import TOLERANCE

TOLERANCE_FP32 = TOLERANCE["float32"]   # what the GPU forward tests ask of the kernel


def tf32_big(x):
    """big as the kernel forms it: bits + half a TF32 ulp, low 13 bits dropped."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def tf32_truncate(x):
    """What a tensor core reads of a .tf32 operand: the top 19 bits."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def split(x):
    big = tf32_big(x)
    return big, tf32_truncate((x - big).astype(np.float32))


def _round_toward_zero_f32(y):
    f = y.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(y)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def mma_step(c, a, b):
    """One k-step (last axis of a and b, 8 long) added to c, as modelled above."""
    terms = np.concatenate([c.astype(np.float64)[..., None], a.astype(np.float64) * b.astype(np.float64)], -1)
    top = np.abs(terms).max(-1, keepdims=True)
    quantum = np.exp2(np.floor(np.log2(np.where(top > 0, top, 1.0))) - 23)
    return _round_toward_zero_f32((np.trunc(terms / quantum) * quantum).sum(-1))


def matmul_3xtf32(a, b):
    """a (M, K) @ b (N, K)^T from zero, 8-wide k-steps of three MMAs each (K % 8 == 0)."""
    a_big, a_small = split(a)
    b_big, b_small = split(b)
    c = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for k in range(0, a.shape[1], 8):
        ks = slice(k, k + 8)
        for x, y in ((a_small, b_big), (a_big, b_small), (a_big, b_big)):
            c = mma_step(c, x[:, None, ks], y[None, :, ks])
    return c


def online_softmax_tiles(q, k, v, scale, block_n, scores, add_pv):
    """The kernels' forward loop for one head in fp32: key tiles of block_n (a zero-filled
    tail, masked), S = scores(k_tile) unscaled, the online softmax, the output accumulator
    rescaled and then add_pv(acc, p, v_tile) for the tile. Returns (acc, row sums)."""
    nq = q.shape[0]
    scale_log2 = np.float32(scale * np.log2(np.e))
    row_max = np.full(nq, -np.inf, np.float32)
    row_sum = np.zeros(nq, np.float32)
    acc = np.zeros((nq, v.shape[1]), np.float32)
    for k0 in range(0, k.shape[0], block_n):
        n = min(block_n, k.shape[0] - k0)
        kt = np.pad(k[k0:k0 + n], ((0, block_n - n), (0, 0)))
        vt = np.pad(v[k0:k0 + n], ((0, block_n - n), (0, 0)))
        s = scores(kt)
        s[:, n:] = -np.inf
        new_max = np.maximum(row_max, (s.max(1) * scale_log2).astype(np.float32))
        alpha = np.exp2(row_max - new_max).astype(np.float32)
        row_max = new_max
        p = np.exp2((s * scale_log2 - row_max[:, None]).astype(np.float32)).astype(np.float32)
        row_sum = (row_sum * alpha + p.sum(1, dtype=np.float32)).astype(np.float32)
        acc = add_pv((acc * alpha[:, None]).astype(np.float32), p, vt)
    return acc, row_sum


def attention_3xtf32(q, k, v, scale, block_n=64, per_tile=True):
    """fwd_wide.cu's forward for one head: P V summed per tile from zero (per_tile) or
    straight into the output accumulator."""
    def add_pv(acc, p, vt):
        if per_tile:
            return (acc + matmul_3xtf32(p, vt.T.copy())).astype(np.float32)
        p_big, p_small = split(p)
        v_big, v_small = split(vt.T.copy())
        for j in range(0, block_n, 8):
            js = slice(j, j + 8)
            for x, y in ((p_small, v_big), (p_big, v_small), (p_big, v_big)):
                acc = mma_step(acc, x[:, None, js], y[None, :, js])
        return acc

    acc, row_sum = online_softmax_tiles(q, k, v, scale, block_n, lambda kt: matmul_3xtf32(q, kt), add_pv)
    return acc / row_sum[:, None]


def reference(q, k, v, scale):
    s = q.astype(np.float64) @ k.astype(np.float64).T * scale
    p = np.exp(s - s.max(1, keepdims=True))
    return (p @ v.astype(np.float64)) / p.sum(1, keepdims=True)


def rel_err(x, ref):
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def test_big_is_round_to_nearest_ties_away(rng):
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * np.float32(1e3),
                        # exact ties: 11 significant bits and a trailing half ulp
                        ((rng.integers(1 << 10, 1 << 11, 1000) * 2 + 1) * 2.0 ** -12).astype(np.float32),
                        -((rng.integers(1 << 10, 1 << 11, 1000) * 2 + 1) * 2.0 ** -12).astype(np.float32)])
    big = tf32_big(x)
    assert np.array_equal(tf32_truncate(big), big)   # a TF32 value
    x64, big64 = x.astype(np.float64), big.astype(np.float64)
    ulp = np.exp2(np.floor(np.log2(np.abs(x64))) - 10)
    assert np.all(np.abs(x64 - big64) <= ulp / 2)
    ties = np.abs(np.abs(x64 - big64) - ulp / 2) == 0
    assert ties.sum() >= 2000 and np.all(np.abs(big64[ties]) > np.abs(x64[ties]))


def test_split_error_is_below_2_to_the_minus_21(rng):
    x = (rng.standard_normal(1_000_000) * np.exp2(rng.integers(-60, 60, 1_000_000))).astype(np.float32)
    big, small = split(x)
    small_exact = (x - big).astype(np.float32)
    assert np.array_equal(small_exact.astype(np.float64), x.astype(np.float64) - big.astype(np.float64))
    err = np.abs(x.astype(np.float64) - big.astype(np.float64) - small.astype(np.float64))
    assert np.all(err <= np.abs(x.astype(np.float64)) * 2.0 ** -21)


def test_3xtf32_scores_are_fp32_accurate_at_d256(rng):
    """Attention-sized dot products (d = 256, unit normal) through the truncating model:
    the error relative to sum |q_i k_i| stays near fp32 rounding."""
    q = rng.standard_normal((64, 256)).astype(np.float32)
    k = rng.standard_normal((64, 256)).astype(np.float32)
    exact = q.astype(np.float64) @ k.astype(np.float64).T
    bound = np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).T
    err = np.abs(matmul_3xtf32(q, k) - exact) / bound
    assert err.max() < 1.5e-6
    assert np.sqrt(np.mean(err ** 2)) < 2e-7


def test_attention_meets_fp32_tolerance_with_per_tile_sums(rng):
    """The whole forward at d = 256 with a key tail, against float64: well inside the GPU
    tests' 1e-5, and accumulating P V across tiles instead is measurably worse."""
    d, nq, nk = 256, 8, 1000 + 37
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (nq, nk, nk))
    ref = reference(q, k, v, 1 / np.sqrt(d))
    per_tile = rel_err(attention_3xtf32(q, k, v, 1 / np.sqrt(d)), ref)
    across = rel_err(attention_3xtf32(q, k, v, 1 / np.sqrt(d), per_tile=False), ref)
    assert per_tile < TOLERANCE_FP32 / 3
    assert across > 1.2 * per_tile
