"""CPU tier: the GPU backward's launch plans, without a GPU."""

import pytest

from cupyflash import _cuda

DTYPES = ("float16", "bfloat16", "float32", "float64")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_tiles_fit_hopper_and_last_fit_100kb(dtype, deterministic):
    for D in _cuda.HEAD_DIMS:
        plan = _cuda.backward_plan(dtype, D, deterministic)
        for candidates in [c for _, c in plan.kv] + ([plan.dq] if plan.dq else []):
            assert candidates[0].smem_bytes <= 227 * 1024
            assert candidates[-1].smem_bytes <= _cuda.PORTABLE_SMEM


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_the_non_deterministic_plan_adds_dq_atomically(dtype):
    for D in _cuda.HEAD_DIMS:
        det = _cuda.backward_plan(dtype, D, True)
        assert det.dq is not None and det.convert is None
        assert not any(grads & _cuda.GRAD_DQ for grads, _ in det.kv)
        atomic = _cuda.backward_plan(dtype, D, False)
        assert atomic.dq is None and atomic.convert is not None
        assert [bool(grads & _cuda.GRAD_DQ) for grads, _ in atomic.kv][-1]
        # dK and dV each come from exactly one launch.
        for plan in (det, atomic):
            for bit in (_cuda.GRAD_DK, _cuda.GRAD_DV):
                assert sum(bool(grads & bit) for grads, _ in plan.kv) == 1


def test_backward_kernels_are_in_the_build_check():
    names = {v.name_expression for v in _cuda.all_variants()}
    for dtype in DTYPES:
        for D in _cuda.HEAD_DIMS:
            assert {v.name_expression for v in _cuda.backward_variants(dtype, D)} <= names
