"""Every check of the modifier options: the error type and a message that starts with
the argument's name, raised before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _validate

B, HQ, HK, NQ, NK, D = 2, 4, 2, 37, 41, 8


def _qkv():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, HQ, NQ, D)).astype(np.float32),
            rng.standard_normal((B, HK, NK, D)).astype(np.float32),
            rng.standard_normal((B, HK, NK, D)).astype(np.float32))


BAD_OPTIONS = [
    ("window", (-2, 0), ValueError, "window sides must be >= 0, or -1"),
    ("window", (3, -5), ValueError, "window sides must be >= 0, or -1"),
    ("block_size", 8, ValueError, "block_size must be multiples of 16"),
    ("block_size", (32, 24), ValueError, "block_size must be multiples of 16"),
    ("block_size", (16, 16, 16), TypeError, "block_size must be an integer or a pair"),
    ("block_size", 16.0, TypeError, "block_size must be an integer"),
    ("block_mask", np.ones((3, 2, 3), bool), ValueError, "block_mask must be broadcastable to"),
    ("block_mask", np.ones((HQ, 1, 2)), TypeError, "block_mask must be a bool or integer array"),
    ("bias", np.zeros((HQ, NQ, NK), np.float64), TypeError, "bias must have the dtype of q"),
    ("bias", np.zeros((HQ, NQ, 2), np.float32), ValueError, "bias must be broadcastable to"),
    ("bias", np.zeros((3, B, HQ, NQ, NK), np.float32), ValueError, "bias must be broadcastable to"),
    ("alibi_slopes", np.ones(3, np.float32), ValueError, "alibi_slopes must be broadcastable to"),
    ("alibi_slopes", np.ones(HQ, np.int32), TypeError, "alibi_slopes must be a float array"),
    ("alibi_slopes", [0.5] * HQ, TypeError, "alibi_slopes must be None or an array"),
    ("seqlens_k", np.array([1, 2, 3]), ValueError, "seqlens_k must have q's batch shape"),
    ("seqlens_k", np.array([1.0, 2.0]), TypeError, "seqlens_k must be an integer array"),
    ("seqlens_k", np.array([1, NK + 1]), ValueError, r"seqlens_k values must be in \[0, Nk=41\]"),
    ("seqlens_k", np.array([-1, 3]), ValueError, r"seqlens_k values must be in \[0, Nk=41\]"),
    ("seqlens_k", [1, 2], TypeError, "seqlens_k must be None or an array"),
    ("precision", "fp16", ValueError, "precision must be one of 'highest', 'tf32'"),
    ("precision", None, TypeError, "precision must be a string"),
]


@pytest.mark.parametrize("function", [cf.attention, cf.attention_forward, cf.attention_vjp],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("option, value, error, message", BAD_OPTIONS,
                         ids=[f"{o}-{i}" for i, (o, *_) in enumerate(BAD_OPTIONS)])
def test_bad_options_are_refused_before_allocation(function, option, value, error, message,
                                                   monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the check")
    monkeypatch.setattr("cupyflash._arrays.empty", no_allocation)
    with pytest.raises(error, match="^" + message):
        function(*_qkv(), backend="numpy", **{option: value})


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_tf32_precision_is_for_float32_inputs(dtype, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the check")
    monkeypatch.setattr("cupyflash._arrays.empty", no_allocation)
    q, k, v = (x.astype(dtype) for x in _qkv())
    with pytest.raises(ValueError, match="^precision='tf32' applies to float32 inputs"):
        cf.attention(q, k, v, backend="numpy", precision="tf32")


def test_tf32_precision_on_the_numpy_backend_is_float32_accurate():
    # The NumPy backend has no TF32 products: the permission changes nothing there.
    q, k, v = _qkv()
    assert np.array_equal(cf.attention(q, k, v, backend="numpy", precision="tf32"),
                          cf.attention(q, k, v, backend="numpy"))


def test_good_broadcast_shapes_are_accepted():
    q, k, v = _qkv()
    for opts in (dict(block_mask=np.ones((1, 3), bool), block_size=(16, 16)),
                 dict(block_mask=np.ones((B, HQ, 2, 1), np.int8), block_size=(32, 48)),
                 dict(bias=np.zeros((NK,), np.float32)), dict(bias=np.zeros((B, 1, 1, 1, NK), np.float32)[0]),
                 dict(alibi_slopes=np.ones((B, 1), np.float64)), dict(seqlens_k=np.array([0, NK], np.uint8)),
                 dict(window=(0, 0)), dict(window=[-1, 3])):
        cf.attention(q, k, v, backend="numpy", **opts)


def _packed():
    rng = np.random.default_rng(1)
    return (rng.standard_normal((10, 2, 4)), rng.standard_normal((12, 1, 4)),
            rng.standard_normal((12, 1, 4)))


GOOD_VARLEN = (np.array([0, 4, 10]), np.array([0, 5, 12]), 6, 7)
BAD_VARLEN = [
    (0, [0, 4, 10], TypeError, "cu_seqlens_q must be an integer array"),
    (0, np.array([0.0, 4, 10]), TypeError, "cu_seqlens_q must be an integer array"),
    (0, np.array([[0, 4, 10]]), ValueError, "cu_seqlens_q must be 1-D with S"),
    (0, np.array([0]), ValueError, "cu_seqlens_q must be 1-D with S"),
    (0, np.array([1, 4, 10]), ValueError, "cu_seqlens_q must start at 0"),
    (0, np.array([0, 6, 4, 10]), ValueError, "cu_seqlens_q must be non-decreasing"),
    (0, np.array([0, 4, 9]), ValueError, "cu_seqlens_q must end at the number of packed tokens, 10"),
    (1, np.array([0, 5, 13]), ValueError, "cu_seqlens_k must end at the number of packed tokens, 12"),
    (1, np.array([0, 5, 5, 12]), ValueError, "cu_seqlens_k has 4 entries but cu_seqlens_q has 3"),
    (2, 5, ValueError, "max_seqlen_q must be >= 6"),
    (3, 6.0, TypeError, "max_seqlen_k must be an integer"),
    (3, 6, ValueError, "max_seqlen_k must be >= 7"),
]


@pytest.mark.parametrize("index, value, error, message", BAD_VARLEN,
                         ids=[f"{i}-{m[:20]}" for i, _, _, m in BAD_VARLEN])
def test_bad_varlen_arguments(index, value, error, message):
    args = list(GOOD_VARLEN)
    args[index] = value
    with pytest.raises(error, match="^" + message):
        cf.varlen_attention(*_packed(), *args, backend="numpy")


def test_varlen_inputs_must_be_packed_3d():
    q, k, v = _packed()
    with pytest.raises(ValueError, match=r"^q must be 3-D \(total_q, H, d\)"):
        cf.varlen_attention(q[None], k, v, *GOOD_VARLEN)
    with pytest.raises(ValueError, match=r"^v must be 3-D \(total_k, H, d\)"):
        cf.varlen_attention(q, k, v[0], *GOOD_VARLEN)


def test_varlen_has_no_bias_block_mask_or_key_padding():
    for option in ("bias", "block_mask", "seqlens_k"):
        with pytest.raises(TypeError, match=option):
            cf.varlen_attention(*_packed(), *GOOD_VARLEN, **{option: None})
    # The shared check also refuses them, for any internal caller that passes them.
    options = _validate.check_options(
        causal=False, scale=None, window=None, dropout_p=0.0, seed=None, block_mask=None,
        bias=np.zeros(3), alibi_slopes=None, softcap=0.0, layout="bshd", deterministic=False,
        backend="numpy")
    problem = _validate.Problem(kind="numpy", device=None, dtype=np.dtype(np.float64), batch=1,
                                head_dim=4, value_dim=4, lead=(1,), heads=2, q_len=10, k_len=12)
    with pytest.raises(ValueError, match="^bias does not combine with varlen attention"):
        _validate.check_modifiers(options, problem, sequences=2)
