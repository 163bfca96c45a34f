"""The NumPy backend on several threads: the same results as on one, the same bits call
after call, BLAS on one thread inside a call and restored after it, and the thread
count's validation. (Its speed is the CPU benchmark's business, never a test's.)"""

from __future__ import annotations


import numpy as np
import pytest

from cupyflash import _cpu_threads, _reference
from cupyflash._reference import attention_backward, attention_forward
from oracle import naive_attention
from test_mods_reference import MOD_CASES, MOD_PARAMS, assert_grad_close, run_case
from test_reference import assert_close

# Cases that split into many tasks of uneven length: causal, GQA, options that make
# tasks differ (block mask, key padding, varlen-like pieces), broadcasting bias.
THREAD_CASES = [c for c in MOD_CASES if c.name in (
    "causal+window", "seqlens_k", "block_mask+causal", "bias-broadcast+causal", "bias-full",
    "dropout+gqa", "everything")]


@pytest.fixture
def threads(monkeypatch):
    def use(n):
        monkeypatch.setenv(_cpu_threads.ENV_THREADS, str(n))
    return use


@pytest.mark.parametrize("case", THREAD_CASES, ids=str)
def test_threads_give_the_one_thread_results(case, rng, threads):
    q, k, v, do, _, mods, scale = run_case(case, rng, np.float64)
    results = {}
    for n in (1, 3):
        threads(n)
        o, lse = attention_forward(q, k, v, scale=scale, causal=case.causal, mods=mods,
                                   block_q=16, block_k=16)
        dbias = None if mods.bias is None else np.zeros(mods.bias.shape, q.dtype)
        grads = attention_backward(do, q, k, v, o, lse, scale=scale, causal=case.causal,
                                   mods=mods, dbias=dbias, block_q=16, block_k=16)
        results[n] = (o, lse, *grads, *(() if dbias is None else (dbias,)))
    one, three = results[1], results[3]
    # The forward's tasks are independent: the same arithmetic on any thread.
    np.testing.assert_array_equal(one[0], three[0])
    np.testing.assert_array_equal(one[1], three[1])
    # The backward sums dQ over sets of key blocks that depend on the thread count.
    for a, b in zip(one[2:], three[2:]):
        assert_grad_close(b, a, 1e-13)


def test_repeated_calls_give_the_same_bits(rng, threads):
    threads(4)
    q, k, v, do = (rng.standard_normal((2, 4, 300, 32)).astype(np.float32) for _ in range(4))
    k, v = k[:, :2], v[:, :2]   # GQA: two query heads per kv head
    runs = []
    for _ in range(3):
        o, lse = attention_forward(q, k, v, scale=0.2, causal=True, block_q=32, block_k=48)
        runs.append((o, lse, *attention_backward(do, q, k, v, o, lse, scale=0.2, causal=True,
                                                 block_q=32, block_k=48)))
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            np.testing.assert_array_equal(a, b)


def test_default_tiles_on_several_threads_match_the_oracle(rng, threads):
    # The default tile sizes (not the tests' small ones) on more threads than tiles.
    from oracle import naive_attention, naive_attention_grads
    threads(3)
    q, k, v, do = (rng.standard_normal((1, 2, 700, 16)) for _ in range(4))
    o, lse = attention_forward(q, k, v, scale=0.25, causal=True)
    grads = attention_backward(do, q, k, v, o, lse, scale=0.25, causal=True)
    o_ref, lse_ref = naive_attention(q, k, v, scale=0.25, causal=True)
    assert_close(o, o_ref, 1e-12)
    assert_close(lse, lse_ref, 1e-12)
    for got, ref in zip(grads, naive_attention_grads(do, q, k, v, scale=0.25, causal=True)):
        assert_close(got, ref, 1e-12)


def test_blas_runs_one_thread_inside_a_call_and_is_restored(rng, monkeypatch, threads):
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return {i["filepath"]: i["num_threads"] for i in threadpoolctl.threadpool_info()
                if i["user_api"] == "blas"}

    before = blas_threads()
    seen = []
    forward_block = _reference._forward_block

    def spy(*args, **kwargs):
        seen.append(set(blas_threads().values()))
        return forward_block(*args, **kwargs)

    monkeypatch.setattr(_reference, "_forward_block", spy)
    threads(2)
    q = rng.standard_normal((1, 2, 600, 8))
    attention_forward(q, q, q, scale=0.3, causal=False, block_q=64)
    assert seen and all(s <= {1} for s in seen)
    assert blas_threads() == before


def test_a_failing_task_raises_and_stops_the_others():
    done = []

    def ok():
        done.append(1)

    def fail():
        raise ZeroDivisionError("task failed")

    with pytest.raises(ZeroDivisionError, match="task failed"):
        _cpu_threads.run([fail] + [ok] * 50, threads=2)
    assert len(done) < 50   # the thread that failed stopped taking tasks, the other soon after
    _cpu_threads.run([ok] * 3, threads=2)   # the pool still works
    assert len(done) >= 3


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_thread_count_from_the_environment_is_validated(value, monkeypatch):
    monkeypatch.setenv(_cpu_threads.ENV_THREADS, value)
    with pytest.raises(ValueError, match=f"{_cpu_threads.ENV_THREADS} must be a positive integer"):
        _cpu_threads.num_threads()


def test_thread_count_default_is_the_usable_cpus(monkeypatch):
    monkeypatch.delenv(_cpu_threads.ENV_THREADS, raising=False)
    assert _cpu_threads.num_threads() >= 1
    monkeypatch.setenv(_cpu_threads.ENV_THREADS, "3")
    assert _cpu_threads.num_threads() == 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("group", [1, 2, 8, 64])
@pytest.mark.parametrize("banded", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_tile_sizes_fit_the_cache_budget(dtype, group, banded, backward):
    rows, cols = _reference.tile_sizes(dtype, group, banded, backward=backward)
    assert rows >= 16 and rows % 16 == 0 and cols % 16 == 0
    scores = rows * cols * group * np.dtype(dtype).itemsize
    budget = _reference._TILES["backward" if backward else "forward"][banded][0]
    assert scores <= budget or rows == 16


@MOD_PARAMS
def test_forward_steps_of_several_key_tiles_match_the_oracle(case, rng, monkeypatch):
    # Default sizes let a forward step take a run of key tiles (`_FORWARD_STEP_BYTES`);
    # tiny ones here make runs of up to three 16 x 16 tiles (one with GQA's two heads) out
    # of each query tile's range of key tiles (with a block mask a step is one tile).
    tile = 16 * 16 * 8
    monkeypatch.setitem(_reference._TILES, "forward", {False: (tile, 16), True: (tile, 16)})
    monkeypatch.setattr(_reference, "_FORWARD_STEP_BYTES", 3 * tile)
    q, k, v, _, opts, mods, scale = run_case(case, rng, np.float64)
    o, lse = attention_forward(q, k, v, scale=scale, causal=case.causal, mods=mods)
    o_ref, lse_ref = naive_attention(q, k, v, scale=scale, causal=case.causal, **opts)
    assert_close(o, o_ref, 1e-12)
    assert_close(lse, lse_ref, 1e-12)


def test_runs_of_tiles():
    assert list(_reference._runs(range(2, 9), 3)) == [(2, 5), (5, 8), (8, 9)]
    assert list(_reference._runs([0, 1, 3, 4, 5, 9], 2)) == [(0, 2), (3, 5), (5, 6), (9, 10)]
    assert list(_reference._runs(range(0), 4)) == []
