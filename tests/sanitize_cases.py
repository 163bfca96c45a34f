"""Small odd shapes through every GPU kernel, for compute-sanitizer (not a pytest file).

    compute-sanitizer --tool memcheck  python tests/sanitize_cases.py
    compute-sanitizer --tool racecheck python tests/sanitize_cases.py float16 float32

Optional arguments restrict the dtypes and head dims (racecheck is slow), e.g.
`bfloat16 192 256`: bf16's shapes of d = 192 and 256.

Exits non-zero if any output is NaN; the sanitizer reports memory errors and races.
"""

import contextlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

import cupyflash  # noqa: E402

# (Nq, Nk, d); (129, 200, 64) has whole tiles that no mask touches, which the Hopper
# backward at d = 64 runs without the selects when there is no dropout ("terms" below).
# Where Nk % 8 == 0 (200, 136) the Hopper backward reads a bias by TMA. (70, 33, 192): the
# key-block kernels whose warps share each key tile (d = 256 too), a partial query tile;
# (65, 136, 192): the bias by TMA in the Hopper roles (one Q/dO stage).
SHAPES = ((1, 1, 32), (17, 33, 72), (33, 47, 64), (129, 65, 128), (65, 129, 256), (129, 200, 64),
          (65, 136, 128), (70, 33, 192), (65, 136, 192))


def _options(kind, nq, nk, rng):
    """The options' kernels: every option at once ("all"); every option but the bias ("no
    bias": on Hopper the bias is a policy of its own, MODE_EXT and MODE_EXT | MODE_BIAS);
    the score terms alone, without a mask or dropout ("terms"); a bias with a window and
    dropout but no softcap ("bias": the Hopper backward starts S^T from it); a window and
    key padding alone ("band": the Hopper backward's dense path, MODE_BAND); a block mask
    of 128 x 128 blocks, whole tiles of the Hopper backward, with a window ("blocks": its
    dense path too, in the default mode); ALiBi with a window ("alibi": the dense path
    with MODE_ALIBI); softcap with a window ("softcap": the dense path with MODE_SOFTCAP);
    dropout with a window ("dropout": the dense path with MODE_DROPOUT)."""
    slopes = cp.asarray(rng.random(4).astype(np.float32))
    if kind == "terms":
        return dict(alibi_slopes=slopes, softcap=5.0)
    if kind == "band":
        return dict(window=(40, 7), seqlens_k=np.array([max(1, nk - 9)], np.int32))
    if kind == "alibi":
        return dict(alibi_slopes=slopes, window=(40, 7))
    if kind == "softcap":
        return dict(softcap=3.0, window=(40, 7))
    if kind == "dropout":
        return dict(dropout_p=0.2, seed=4, window=(40, 7))
    if kind == "blocks":
        return dict(block_mask=rng.random((4, -(-nq // 128), -(-nk // 128))) < 0.7, block_size=128, window=(100, 7))
    if kind == "bias":
        return dict(bias=cp.asarray(rng.standard_normal((4, nq, nk)).astype(np.float32)), window=(40, 7),
                    dropout_p=0.2, seed=5)
    blocks = rng.random((4, -(-nq // 16), -(-nk // 16))) < 0.7
    options = dict(window=(40, 7), dropout_p=0.2, seed=5, block_mask=blocks, block_size=16,
                   alibi_slopes=slopes, softcap=5.0)
    if kind == "all":
        options["bias"] = cp.asarray(rng.standard_normal((4, nq, nk)).astype(np.float32))
    return options



@contextlib.contextmanager
def _persistent_ctas(ctas):
    """The Hopper forward's persistent grid held to ``ctas`` CTAs (0: as many as SMs),
    with no plan kept from before (a plan keeps its grid)."""
    from cupyflash import _cuda

    if not ctas:
        yield
        return
    sm_count, plans = _cuda._sm_count, dict(_cuda._FORWARD_PLANS)
    _cuda._sm_count = lambda device_id: ctas
    _cuda._FORWARD_PLANS.clear()
    try:
        yield
    finally:
        _cuda._sm_count = sm_count
        _cuda._FORWARD_PLANS.clear()
        _cuda._FORWARD_PLANS.update(plans)


def main():
    rng = np.random.default_rng(0)
    bad = 0
    dtypes = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
    head_dims = {int(a) for a in sys.argv[1:] if a.isdigit()}
    for dtype in [dtypes[name] for name in sys.argv[1:] if not name.isdigit()] or dtypes.values():
        for nq, nk, d in SHAPES:
            if head_dims and d not in head_dims:
                continue
            for causal, options, deterministic in ((False, None, False), (True, None, False),
                                                   (True, None, True), (True, "all", False),
                                                   (False, "no bias", False), (False, "terms", False),
                                                   (True, "bias", True), (True, "band", False),
                                                   (False, "band", True), (False, "blocks", False),
                                                   (True, "alibi", False), (False, "alibi", True),
                                                   (True, "softcap", False), (False, "softcap", True),
                                                   (True, "dropout", False), (False, "dropout", True)):
                q = cp.asarray(rng.standard_normal((1, 4, nq, d)).astype(dtype))
                k, v = (cp.asarray(rng.standard_normal((1, 2, nk, d)).astype(dtype)) for _ in range(2))
                extra = _options(options, nq, nk, rng) if options else {}
                if "bias" in extra:
                    extra["bias"] = extra["bias"].astype(dtype)
                # Where a launch fails, the sanitizer log shows which case was running.
                print(f"case {np.dtype(dtype).name} {nq}x{nk} d={d} causal={causal} options={options} "
                      f"deterministic={deterministic}", flush=True)
                o, vjp = cupyflash.attention_vjp(q, k, v, causal=causal, deterministic=deterministic,
                                                 backend="cuda", **extra)
                # The bias's cases ask for dbias ("all": within softcap's pass).
                grads = vjp(cp.asarray(rng.standard_normal(o.shape).astype(dtype)), return_dbias="bias" in extra)
                for x in (o, *grads):
                    bad += bool(cp.isnan(x.astype(np.float32)).any())
        # varlen: sequences of 5, 0 and 37 queries over 9, 3 and 40 keys (d = 64: the
        # Hopper kernel reads them by TMA at the sequences' row offsets; d = 72: fwd_sm80),
        # with dropout (the option kernels) and without (the Hopper backward's MODE_BAND).
        cu_q, cu_k = cp.asarray([0, 5, 5, 42], np.int32), cp.asarray([0, 9, 12, 52], np.int32)
        for d, dropout_p in ((72, 0.1), (64, 0.1), (64, 0.0)):
            if head_dims and d not in head_dims:
                continue
            q = cp.asarray(rng.standard_normal((42, 4, d)).astype(dtype))
            k, v = (cp.asarray(rng.standard_normal((52, 2, d)).astype(dtype)) for _ in range(2))
            print(f"case {np.dtype(dtype).name} varlen d={d} dropout_p={dropout_p}", flush=True)
            o, vjp = cupyflash.varlen_attention_vjp(q, k, v, cu_q, cu_k, 37, 40, causal=True,
                                                    dropout_p=dropout_p, seed=3, backend="cuda")
            for x in (o, *vjp(cp.asarray(rng.standard_normal(o.shape).astype(dtype)))):
                bad += bool(cp.isnan(x.astype(np.float32)).any())
        # fp32 with precision="tf32": the Hopper forward's one-product kernels (d = 64, 128;
        # the dense ones split q themselves, fwd_sm90.cu QSplit: the last cases with a
        # persistent grid of two CTAs, each taking its Q buffers in turn, some tiles without
        # keys).
        if dtype == np.float32:
            for (nq, nk, d), causal, options, ctas in (((33, 47, 64), False, None, 0),
                                                       ((129, 65, 128), True, None, 0),
                                                       ((129, 200, 64), True, "no bias", 0),
                                                       ((700, 300, 64), False, None, 2),
                                                       ((1000, 200, 64), True, None, 2)):
                if head_dims and d not in head_dims:
                    continue
                q = cp.asarray(rng.standard_normal((1, 4, nq, d)).astype(dtype))
                k, v = (cp.asarray(rng.standard_normal((1, 2, nk, d)).astype(dtype)) for _ in range(2))
                extra = _options(options, nq, nk, rng) if options else {}
                print(f"case float32 tf32 {nq}x{nk} d={d} causal={causal} options={options} ctas={ctas or 'all'}",
                      flush=True)
                with _persistent_ctas(ctas):
                    o = cupyflash.attention(q, k, v, causal=causal, precision="tf32", backend="cuda", **extra)
                bad += bool(cp.isnan(o).any())
    cp.cuda.runtime.deviceSynchronize()
    print(f"sanitize cases done, {bad} outputs with NaN")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
