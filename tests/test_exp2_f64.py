"""The fp64 kernels' exp2 (kernels_cu/exp2_f64.cuh).

CPU tier: the table and the polynomial's coefficients against their definitions computed
to 60 digits, the algorithm emulated operation by operation (every FMA rounded once, from
exact rationals) against 2^x to 60 digits, and the test kernel building for sm_80 and
sm_90a. GPU tier: that kernel against the emulation, bit for bit, so what the CPU tier
measures is what the GPU computes.
"""

import math
import re
import struct
from decimal import Context, Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest

from cupyflash import _nvrtc
from kernel_tests import ARCHS, assert_builds, gpu_kernel

HEADER = _nvrtc.KERNEL_DIR / "exp2_f64.cuh"
TABLE_SIZE = 128
# The bound the header states: the table entry's rounding and the last FMA's, about 1 ulp.
MAX_ULPS = 1.0

# 2^x, the table and the coefficients to 60 digits, in a context of this module's own.
DIGITS = Context(prec=60)
LN2 = DIGITS.ln(Decimal(2))


def _header_table_and_coefficients():
    text = HEADER.read_text()
    body = re.search(r"EXP2_FRACTIONS\[\d+\] = \{(.*?)\};", text, re.S).group(1)
    table = [float.fromhex(word) for word in body.replace(",", " ").split()]
    coefficients = {int(k): float.fromhex(v) for k, v in re.findall(r"#define EXP2_C(\d) (\S+)", text)}
    return table, [coefficients[k] for k in sorted(coefficients)]


def test_table_entries_are_correctly_rounded():
    table, _ = _header_table_and_coefficients()
    assert len(table) == TABLE_SIZE
    for j, entry in enumerate(table):
        # float(Decimal) goes through a correctly rounded decimal-to-binary conversion.
        assert entry == float(DIGITS.exp(DIGITS.multiply(DIGITS.divide(j, TABLE_SIZE), LN2))), j


def test_coefficients_are_the_taylor_ones():
    _, coefficients = _header_table_and_coefficients()
    assert len(coefficients) == 5
    with localcontext(DIGITS):
        for k, c in enumerate(coefficients, start=1):
            assert c == float(LN2**k / math.factorial(k)), k


def _fma(a, b, c):
    """a * b + c rounded once (float(Fraction) rounds to nearest, ties to even)."""
    if not all(map(math.isfinite, (a, b, c))):
        return a * b + c
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def _lo_hi(x):
    lo, hi = struct.unpack("<iI", struct.pack("<d", x))
    return lo, hi


def _from_hi_lo(hi, lo):
    return struct.unpack("<d", struct.pack("<iI", lo, hi & 0xFFFFFFFF))[0]


def emulate_exp2_f64(x, table, coefficients):
    """exp2_f64 of the header, operation by operation in fp64."""
    c1, c2, c3, c4, c5 = coefficients
    shifter = float.fromhex("0x1.8p52")
    t = _fma(x, 128.0, shifter)
    k_d = t - shifter
    r = _fma(k_d, -1.0 / 128, x)
    k = _lo_hi(t)[0] if math.isfinite(t) else 0
    u = _fma(c5, r, c4)
    u = _fma(u, r, c3)
    u = _fma(u, r, c2)
    u = _fma(u, r, c1)
    q = u * r
    frac_lo, frac_hi = _lo_hi(table[k & 127])
    entry = _from_hi_lo(frac_hi + (k >> 7) * (1 << 20), frac_lo)
    y = _fma(entry, q, entry)
    hi = _lo_hi(x)[1]
    return 0.0 if (hi - 0xC08FF001) % 2**32 <= 0xFFF00000 - 0xC08FF001 else y


def _samples():
    rng = np.random.default_rng(20261128)
    steps = np.arange(-300, 40) / 128.0   # on the table's grid, and half a step off it
    xs = [
        rng.uniform(-60.0, 14.0, 4000),
        rng.uniform(-1, 1, 1000) * 2.0 ** rng.integers(-60, 0, 1000),   # small |x|, r = x
        steps, steps + 1 / 256, steps - 1 / 256, steps + 2.0 ** -40,
        rng.uniform(-1030.0, -1000.0, 300),
        np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, -1022.0, -1022.0 - 2.0 ** -12, -1022.01, -1074.0,
                  -1075.0, -1.0e300, 1.0e-300, -1.0e-300, 13.3, 1023.5, -np.inf, np.nan]),
    ]
    return np.concatenate(xs)


def _ulps(y, x):
    with localcontext(DIGITS):
        exact = (Decimal(float(x)) * LN2).exp()
        return float(abs(Decimal(y) - exact) / Decimal(math.ulp(float(exact))))


def test_emulated_exp2_within_one_ulp():
    table, coefficients = _header_table_and_coefficients()
    worst = 0.0
    for x in _samples():
        y = emulate_exp2_f64(float(x), table, coefficients)
        if math.isnan(x):
            assert math.isnan(y)
        elif x < -1022.0 - 2.0 ** -11:   # below the domain's normal results, and -inf
            assert y == 0.0, x
        else:
            ulps = _ulps(y, x)
            assert ulps <= MAX_ULPS, (x, y, ulps)
            worst = max(worst, ulps)
    # Exact where the answer is a power of two.
    for n in range(-1022, 1024, 7):
        assert emulate_exp2_f64(float(n), table, coefficients) == 2.0**n
    assert worst > 0.3   # the samples reach the rounding, not only exact cases


@pytest.mark.parametrize("arch", ARCHS)
def test_test_kernel_builds(arch):
    assert_builds("exp2_f64_test.cu", ["exp2_f64_kernel"], arch)


@pytest.mark.gpu
def test_gpu_exp2_matches_the_emulation():
    import cupy

    kernel = gpu_kernel("exp2_f64_test.cu", "exp2_f64_kernel")
    xs = _samples()
    x = cupy.asarray(xs)
    y = cupy.full_like(x, 12345.0)   # poisoned: every element must be written
    kernel(((xs.size + 127) // 128,), (128,), (x, y, np.int32(xs.size)))
    got = cupy.asnumpy(y)
    table, coefficients = _header_table_and_coefficients()
    want = np.array([emulate_exp2_f64(float(v), table, coefficients) for v in xs])
    np.testing.assert_array_equal(got, want)   # NaN where NaN
