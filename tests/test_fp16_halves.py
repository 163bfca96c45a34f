"""CPU tier: the fp16 halves of the fp32 Hopper forward (kernels_cu/halves.cuh, split_f32.cu,
fwd_sm90.cu), emulated in NumPy.

What the kernels do and these tests pin:
- A tensor's scale is 2^(14 - e), e the exponent of its largest finite |x| (at least -112),
  so the scaled tensor's largest magnitude lies in [2^14, 2^15), inside fp16's range.
- x s = hi + lo: hi = fp16(x s), lo = fp16(x s - hi); hi + lo holds x s to 2^-22 relative
  (fp16's normal range), and to ~2^-25 absolute in its subnormals, ~2^-39 of the largest.
- A product is hi_a hi_b + hi_a lo_b + lo_a hi_b (three fp16 products; one with
  precision="tf32"), accumulated on the tensor cores, which truncate (measured on an H200:
  bench/wgmma_accumulation_probe.py), modelled as tests/test_tf32_split.py models TF32's:
  so each key tile's P V is summed from zero and added in the FPU.
- P goes in scaled by 2^6: the online softmax lets P reach 2^8, 2^14 stays in range.

These tests pin that design in NumPy, not the kernels (the GPU forward tests check those,
tests/test_gpu_mods.py test_hopper_fp32_forward_on_fp16_halves).
"""

import numpy as np
from gpu_cases import TOLERANCE
from test_tf32_split import mma_step, online_softmax_tiles, reference, rel_err

from cupyflash._kernels import HALVES_ROWS  # noqa: I001  (a chunk of rows with its own scale, split_f32.cu)

P_SCALE = np.float32(64.0)   # fwd_sm90.cu Sm90FwdTile::P_SCALE
RESCALE_SLACK = 8            # softmax.cuh: P <= 2^8 under a stale max


def halves_scale(x):
    """halves.cuh halves_scale of a tensor: from the bits of its largest finite |x|."""
    mags = np.abs(np.asarray(x, np.float32)).ravel()
    largest = mags[np.isfinite(mags)].max(initial=np.float32(0))
    e = max(int(largest.view(np.uint32) >> 23) - 127, -112)
    return np.float32(2.0 ** (14 - e))


def split(x, scale):
    """halves.cuh split_half of x * scale: (hi, lo) as fp16, lo = 0 where hi is not finite."""
    xs = (np.asarray(x, np.float32) * scale).astype(np.float32)
    hi = xs.astype(np.float16)
    with np.errstate(invalid="ignore"):
        rest = (xs - hi.astype(np.float32)).astype(np.float32)
    return hi, np.where(np.isnan(rest), np.float32(0), rest).astype(np.float16)


def matmul_halves(a_parts, b_parts, products=3):
    """a (M, K) @ b (N, K)^T from zero over halves (hi, lo), 16-wide k-steps of `products`
    fp16 products each, truncating as the tensor cores do (K % 16 == 0)."""
    (a_hi, a_lo), (b_hi, b_lo) = a_parts, b_parts
    pairs = ((a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi))[:products]
    c = np.zeros((a_hi.shape[0], b_hi.shape[0]), np.float32)
    for k in range(0, a_hi.shape[1], 16):
        ks = slice(k, k + 16)
        for x, y in pairs:
            c = mma_step(c, x[:, None, ks], y[None, :, ks])
    return c


def attention_halves(q, k, v, scale, block_n=64, products=3, per_tile=True, chunked=False):
    """fwd_sm90.cu's fp32 forward for one head over the halves: S unscaled as it lands, P
    times P_SCALE split in registers, P V per key tile from zero (per_tile) or straight
    into the output accumulator, O unscaled at the end. ``chunked``: the forward's scales,
    one a chunk of rows (split_f32.cu), here a key tile's (block_n = HALVES_CHUNK_ROWS, q
    one chunk): S unscaled per tile; a per-tile P V unscaled as it is added, else the
    accumulator kept in the scale of the largest V tile so far (rescaled where a tile
    raises it, P of a smaller tile times the ratio of the scales)."""
    sq = halves_scale(q)
    qh = split(q, sq)
    p_scale = P_SCALE if products == 3 else np.float32(1)
    state = dict(sv=halves_scale(v), out=None)   # V's scale of the tile and of the accumulator

    def scores(kt):
        sk = halves_scale(kt) if chunked else halves_scale(k)
        if chunked:
            state["sv"] = halves_scale(v[state.setdefault("k0", 0):][:block_n])
            state["k0"] += block_n
        return (matmul_halves(qh, split(kt, sk), products) / (sq * sk)).astype(np.float32)

    def add_pv(acc, p, vt):
        sv = state["sv"]
        if chunked and not per_tile:
            if state["out"] is None or sv < state["out"]:
                acc = acc * (sv / state["out"]) if state["out"] is not None else acc
                state["out"] = sv
            p = (p * (state["out"] / sv)).astype(np.float32)
        ph, pl = split(p, p_scale)
        vh, vl = split(vt.T.copy(), sv)
        if per_tile:
            tile = matmul_halves((ph, pl), (vh, vl), products)
            return (acc + tile / p_scale / sv if chunked else acc + tile).astype(np.float32)
        for j in range(0, block_n, 16):
            js = slice(j, j + 16)
            for x, y in ((ph, vh), (ph, vl), (pl, vh))[:products]:
                acc = mma_step(acc, x[:, None, js], y[None, :, js])
        return acc

    acc, row_sum = online_softmax_tiles(q, k, v, scale, block_n, scores, add_pv)
    if chunked:
        return acc / (row_sum[:, None] * (1 if per_tile else state["out"]))
    return acc / (row_sum[:, None] * p_scale * state["sv"])


def test_scale_puts_the_largest_magnitude_in_fp16_range(rng):
    for e in range(-120, 128, 7):
        x = (rng.standard_normal(1000) * 2.0 ** e).astype(np.float32)
        scaled = np.abs(x * halves_scale(x)).max()
        if e > -100:   # above the clamp: the largest lands in [2^14, 2^15)
            assert 2.0 ** 14 <= scaled < 2.0 ** 15, e
        assert np.isfinite(halves_scale(x)) and scaled < 65504
    assert halves_scale(np.zeros(4, np.float32)) == np.float32(2.0 ** 126)   # still a normal float
    inf_beside = np.array([np.inf, np.nan, 3.0, -5.0], np.float32)
    assert halves_scale(inf_beside) == halves_scale(np.array([5.0], np.float32))   # finite ones only


def test_halves_hold_22_bits_and_pass_infinities(rng):
    x = (rng.standard_normal(200_000) * np.exp2(rng.integers(-30, 30, 200_000))).astype(np.float32)
    s = halves_scale(x)
    hi, lo = split(x, s)
    xs = x.astype(np.float64) * np.float64(s)
    err = np.abs(hi.astype(np.float64) + lo.astype(np.float64) - xs)
    normal = np.abs(xs) >= 2.0 ** -3   # the low half a normal fp16 (|lo| >= 2^-14)
    assert np.all(err[normal] <= np.abs(xs[normal]) * 2.0 ** -22)
    assert np.all(err[~normal] <= 2.0 ** -25)   # below: half the subnormal spacing, 2^-39 of the largest
    hi, lo = split(np.array([np.inf, -np.inf, np.nan, 1.0], np.float32), np.float32(4))
    assert np.isposinf(hi[0]) and np.isneginf(hi[1]) and np.isnan(hi[2]) and np.all(lo[:3] == 0)


def test_scaled_p_stays_in_fp16_range():
    p_max = np.float32(2.0 ** RESCALE_SLACK)
    hi, lo = split(np.array([p_max, 1.0, 2.0 ** -9], np.float32), P_SCALE)
    assert np.all(np.isfinite(hi)) and hi[0] == np.float16(2.0 ** 14)
    assert np.abs(lo[2]) < 2.0 ** -14 or lo[2] == 0   # P = 2^-9 scaled is a whole fp16: nothing left


def test_attention_over_halves_meets_the_tolerances(rng):
    """The whole forward at d = 128 with a key tail and magnitudes far from fp16's,
    against float64: three products well inside fp32's 1e-5, one inside tf32's 3e-3, and
    accumulating P V across tiles on the tensor cores measurably worse."""
    d, nq, nk = 128, 8, 1000 + 37
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (nq, nk, nk))
    q, k, v = q * np.float32(3e-21), k * np.float32(3e20), v * np.float32(1e-9)
    ref = reference(q, k, v, 1 / np.sqrt(d))
    three = rel_err(attention_halves(q, k, v, 1 / np.sqrt(d)), ref)
    one = rel_err(attention_halves(q, k, v, 1 / np.sqrt(d), products=1), ref)
    across = rel_err(attention_halves(q, k, v, 1 / np.sqrt(d), per_tile=False), ref)
    assert three < TOLERANCE["float32"] / 3
    assert one < TOLERANCE["tf32"] / 2
    assert across > 1.2 * three


def test_attention_over_chunk_scales_meets_the_tolerances(rng):
    """The forward's scales a chunk of rows: with k and v chunks whose magnitudes differ by
    decades (v's by up to 10^16, a chunk of zeros), and with the magnitudes far from fp16's
    above, three products stay inside fp32's 1e-5 and one (the accumulator following V's
    largest tile) inside tf32's 3e-3."""
    d, nq, nk, block = 64, 8, 1000 + 37, HALVES_ROWS
    scale = 1 / np.sqrt(d)
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (nq, nk, nk))
    chunks = -(-nk // block)
    k_by_chunk = np.repeat(10.0 ** rng.uniform(-2, 0, chunks), block)[:nk, None]
    v_by_chunk = np.repeat(10.0 ** rng.uniform(-8, 8, chunks), block)[:nk, None]
    v_by_chunk[3 * block:4 * block] = 0
    for k_, v_ in ((k * k_by_chunk, v * v_by_chunk), (k * np.float32(3e20), v * np.float32(1e-9))):
        q_ = q * np.float32(3e-21) if k_.max() > 1e10 else q
        k_, v_ = k_.astype(np.float32), v_.astype(np.float32)
        ref = reference(q_, k_, v_, scale)
        three = rel_err(attention_halves(q_, k_, v_, scale, block, chunked=True), ref)
        one = rel_err(attention_halves(q_, k_, v_, scale, block, products=1, per_tile=False, chunked=True), ref)
        assert three < TOLERANCE["float32"] / 3
        assert one < TOLERANCE["tf32"] / 2
