"""Block-sparse pattern helpers, and block-sparse attention through the API: zero blocks
are skipped (the result equals the oracle with those blocks hidden)."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash as cf
from oracle import naive_attention
from test_reference import assert_close


def test_local_global_pattern_by_brute_force():
    for nqb, nkb in ((1, 1), (4, 6), (7, 3), (9, 9)):
        for local, glob, stride, causal in ((0, 0, None, False), (1, 1, None, True),
                                            (2, 0, 3, False), (1, 2, 4, True)):
            mask = cf.local_global_block_mask(nqb, nkb, local=local, global_blocks=glob,
                                              stride=stride, causal=causal)
            assert mask.shape == (nqb, nkb) and mask.dtype == bool
            for r in range(nqb):
                diag = r + nkb - nqb
                for c in range(nkb):
                    want = (abs(c - diag) <= local or c < glob or r < glob
                            or (stride is not None and c % stride == stride - 1))
                    assert mask[r, c] == (want and (not causal or c <= diag))


def test_butterfly_pattern():
    mask = cf.butterfly_block_mask(16)
    assert mask.shape == (16, 16) and (mask == mask.T).all() and mask.diagonal().all()
    assert (mask.sum(axis=1) == 1 + 4).all()          # the diagonal and one block per bit
    assert cf.block_mask_density(mask) == pytest.approx(5 / 16)
    assert mask[5, 4] and mask[5, 7] and mask[5, 13] and not mask[5, 6]
    causal = cf.butterfly_block_mask(6, causal=True)
    assert not np.triu(causal, 1).any() and causal[5, 4] and not causal[5, 3]


def test_density():
    assert cf.block_mask_density(np.array([[1, 0], [0, 0]], np.uint8)) == 0.25
    assert cf.block_mask_density(np.ones((2, 3, 4), bool)) == 1.0
    with pytest.raises(TypeError, match="^mask must be a bool or integer array"):
        cf.block_mask_density(np.ones(3))
    with pytest.raises(ValueError, match="^mask must have at least one block"):
        cf.block_mask_density(np.ones((0, 2), bool))
    with pytest.raises(TypeError, match="^mask must be an array"):
        cf.block_mask_density([[1]])


@pytest.mark.parametrize("call, message", [
    (lambda: cf.local_global_block_mask(0, 3, local=1), "n_query_blocks must be >= 1"),
    (lambda: cf.local_global_block_mask(2, 3, local=-1), "local must be >= 0"),
    (lambda: cf.local_global_block_mask(2, 3, local=1, stride=0), "stride must be >= 1"),
    (lambda: cf.local_global_block_mask(2, 3, local=1, global_blocks=1.5), "global_blocks must be an integer"),
    (lambda: cf.local_global_block_mask(2, 3, local=1, causal=1), "causal must be True or False"),
    (lambda: cf.butterfly_block_mask(0), "n_blocks must be >= 1"),
])
def test_helper_arguments_are_checked(call, message):
    with pytest.raises((TypeError, ValueError), match="^" + message):
        call()


@pytest.mark.parametrize("pattern", ["butterfly", "local_global"])
def test_patterns_run_as_block_masks(pattern, rng):
    """A 6 x 6 block pattern at block size 16 on N = 89 (the last block partial)."""
    n, bs = 89, 16
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for _ in range(3))
    mask = (cf.butterfly_block_mask(6) if pattern == "butterfly"
            else cf.local_global_block_mask(6, 6, local=1, global_blocks=1, causal=True))
    o = cf.attention(q, k, v, causal=True, block_mask=mask, block_size=bs, backend="numpy")
    ref, _ = naive_attention(q, k, v, scale=8 ** -0.5, causal=True, block_mask=mask,
                             block_size=(bs, bs))
    assert_close(o, ref, 1e-12)
