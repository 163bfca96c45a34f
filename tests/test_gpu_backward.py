"""GPU tier: the backward kernels against the float64 NumPy reference.

Each case draws fresh random inputs and compares dq, dk and dv with the reference
gradients computed in float64 from the same rounded inputs (the exact gradient of the
attention the kernels were asked to differentiate). Half of the cases go through the public
``attention_vjp``; the other half call ``_cuda.attention_backward`` directly on outputs
poisoned with NaN, so an element the kernels never wrote shows up.
"""

import itertools

import numpy as np
import pytest
from gpu_cases import DTYPES, HEAD_DIMS, TOLERANCE, bhsd64, make_inputs, rel_err

import cupyflash
from cupyflash import _reference

pytestmark = pytest.mark.gpu

SEQLENS = ((1, 1), (17, 17), (127, 129), (128, 128), (129, 127), (1000, 1000), (17, 1000),
           (1000, 17), (1, 128), (129, 1), (128, 1000), (1000, 127))


def _cases():
    """A rotating sample of the full product: every dtype x head dim x causal, twice, with
    the sequence lengths, GQA ratio, layout, deterministic mode and call path cycled so
    that each value appears with each dtype."""
    combos = list(itertools.product(DTYPES, HEAD_DIMS, (False, True)))
    for i, (dtype, d, causal) in enumerate(combos):
        for j in range(2):
            nq, nk = SEQLENS[(5 * i + 7 * j) % len(SEQLENS)]
            group = (1, 4)[(i + j) % 2]
            layout = ("bhsd", "bshd")[(i // 4 + j) % 2]
            deterministic = bool((i // 2 + j) % 2)
            path = ("vjp", "poisoned")[j]
            yield pytest.param(
                dtype, d, causal, nq, nk, group, layout, deterministic, path,
                id=f"{dtype}-d{d}-{'causal' if causal else 'full'}-{nq}x{nk}-g{group}-{layout}"
                   f"-{'det' if deterministic else 'atomic'}-{path}")


def _inputs(rng, dtype, d, nq, nk, group, layout, **kwargs):
    """Host arrays (q, k, v, do) and their CuPy copies; the float64 reference gradients
    cost more than the forward's, so cases shrink from 10**5 query-key pairs."""
    return make_inputs(rng, dtype, d, nq, nk, group, layout, with_do=True, max_pairs=10**5, **kwargs)


def _reference_grads(host, layout, *, causal):
    """Float64 reference gradients in (B, H, N, d), each with the norm its error is measured
    against: its own norm, except where the gradient vanishes by cancellation. With a single
    key the softmax is constant (P = 1), so dS = P o (dP - D) = 0 and dq = dk = 0 exactly:
    what the kernels return is rounding noise, measured against the norm of the terms they
    sum, scale * (P o (|dP| + |D|)) K for dq and its transpose times Q for dk."""
    q, k, v, do = (bhsd64(x, layout) for x in host)
    scale = 1.0 / np.sqrt(q.shape[-1])
    o, lse = _reference.attention_forward(q, k, v, scale=scale, causal=causal)
    grads = _reference.attention_backward(do, q, k, v, o, lse, scale=scale, causal=causal)
    norms = [np.linalg.norm(g.ravel()) for g in grads]
    if k.shape[2] == 1:
        group = q.shape[1] // k.shape[1]
        k_rep, v_rep = (np.repeat(x, group, axis=1) for x in (k, v))
        seen = ~np.isneginf(lse)[..., None]   # causal rows before the key see nothing
        p = np.where(seen, np.exp(np.where(seen, scale * q @ k_rep.swapaxes(-1, -2) - lse[..., None], 0.0)), 0.0)
        ds_terms = p * (np.abs(do @ v_rep.swapaxes(-1, -2)) + np.abs((do * o).sum(-1))[..., None])
        dq_terms = scale * ds_terms @ k_rep
        dk_terms = scale * (ds_terms.swapaxes(-1, -2) @ q).reshape(k.shape[0], k.shape[1], group, 1, -1).sum(2)
        norms[0] = max(norms[0], np.linalg.norm(dq_terms.ravel()))
        norms[1] = max(norms[1], np.linalg.norm(dk_terms.ravel()))
    return grads, norms


def _poisoned_backward(q, k, v, do, *, causal, layout, deterministic):
    """Forward through the public API, then the backward kernels straight into NaN-filled
    gradients in the caller's layout."""
    import cupy as cp
    from cupyflash import _arrays, _cuda

    o, lse = cupyflash.attention(q, k, v, causal=causal, layout=layout, return_lse=True,
                                 backend="cuda")
    grads = [cp.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v)]
    views = [_arrays.bhsd_view(x, layout) for x in (do, q, k, v, o)]
    _cuda.attention_backward(*views, _arrays.lse_bhs_view(lse, layout),
                             *(_arrays.bhsd_view(g, layout) for g in grads),
                             scale=1.0 / np.sqrt(q.shape[-1]), causal=causal,
                             deterministic=deterministic)
    return grads


def _check(grads, reference, dtype, layout):
    import cupy as cp
    ref, norms = reference
    for name, g, r, norm in zip(("dq", "dk", "dv"), grads, ref, norms):
        out = bhsd64(cp.asnumpy(g), layout)
        assert not np.isnan(out).any(), f"{name}: unwritten or NaN elements"
        err = np.linalg.norm((out - r).ravel()) / max(norm, 1e-300)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype,d,causal,nq,nk,group,layout,deterministic,path", list(_cases()))
def test_backward_matches_reference(rng, dtype, d, causal, nq, nk, group, layout, deterministic, path):
    host, (q, k, v, do) = _inputs(rng, dtype, d, nq, nk, group, layout)
    if path == "vjp":
        _, vjp = cupyflash.attention_vjp(q, k, v, causal=causal, layout=layout,
                                         deterministic=deterministic, backend="cuda")
        grads = vjp(do)
    else:
        grads = _poisoned_backward(q, k, v, do, causal=causal, layout=layout,
                                   deterministic=deterministic)
    _check(grads, _reference_grads(host, layout, causal=causal), dtype, layout)


@pytest.mark.parametrize("dtype,d,dv", [("float16", 64, 32), ("bfloat16", 40, 136),
                                        ("float32", 96, 24), ("float64", 16, 72)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_value_dim_differs(rng, dtype, d, dv, deterministic):
    host, (q, k, v, do) = _inputs(rng, dtype, d, 129, 200, 2, "bhsd", dv=dv)
    grads = _poisoned_backward(q, k, v, do, causal=True, layout="bhsd", deterministic=deterministic)
    _check(grads, _reference_grads(host, "bhsd", causal=True), dtype, "bhsd")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dv", [24, 72, 136])
def test_value_dim_differs_from_head_dim(rng, dtype, d, dv):
    """dv != d, smaller and larger (136 > 128 pads both to the 192 kernels), both modes
    and both layouts."""
    layout = "bshd" if d == 128 else "bhsd"
    deterministic = dv != 72
    host, (q, k, v, do) = _inputs(rng, dtype, d, 129, 200, 2, layout, dv=dv)
    grads = _poisoned_backward(q, k, v, do, causal=True, layout=layout, deterministic=deterministic)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    _check(grads, _reference_grads(host, layout, causal=True), dtype, layout)


def test_batch_beyond_the_grid_limit(rng):
    """70000 batch entries, more than the grid's 65535 z extent: both passes run in
    slices of the batch, and every slice matches the NumPy backend in float64."""
    import cupy as cp
    from cupyflash import _cuda
    shape = (70000, 1, 3, 32)
    assert shape[0] > _cuda.MAX_GRID_YZ
    host = [rng.standard_normal(shape).astype(np.float16) for _ in range(4)]
    q, k, v, do = (cp.asarray(x) for x in host)
    o, vjp = cupyflash.attention_vjp(q, k, v, causal=True, backend="cuda")
    grads = vjp(do)
    ref_o, ref_vjp = cupyflash.attention_vjp(*(x.astype(np.float64) for x in host[:3]),
                                             causal=True, backend="numpy")
    ref_grads = ref_vjp(host[3].astype(np.float64))
    for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref_o, *ref_grads)):
        got = cp.asnumpy(got).astype(np.float64)
        for part in (slice(0, _cuda.MAX_GRID_YZ), slice(_cuda.MAX_GRID_YZ, None)):
            err = rel_err(got[part], ref[part])
            assert err < TOLERANCE["float16"], f"{name}[{part.start}:{part.stop}]: relative error {err:.3g}"


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_empty_batch(layout):
    """A batch of 0 on the GPU backend: empty CuPy results of the right shapes from both
    passes, nothing launched."""
    import cupy as cp
    shape = (0, 2, 5, 32)
    q, k, v, do = (cp.zeros(shape, np.float16) for _ in range(4))
    o, ctx = cupyflash.attention_forward(q, k, v, layout=layout, backend="cuda")
    assert ctx.backend == "cuda"
    assert isinstance(o, cp.ndarray) and o.shape == shape and o.dtype == q.dtype
    assert ctx.lse.shape == ((0, 2, 5) if layout == "bhsd" else (0, 5, 2))
    grads = cupyflash.attention_backward(do, ctx)
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, cp.ndarray) and g.shape == x.shape and g.dtype == x.dtype


@pytest.mark.parametrize("dtype,d", [("float16", 128), ("bfloat16", 256), ("bfloat16", 72),
                                     ("float32", 64), ("float32", 256), ("float64", 128), ("float64", 192)])
def test_deterministic_is_bitwise_reproducible(rng, dtype, d):
    import cupy as cp
    host, (q, k, v, do) = _inputs(rng, dtype, d, 300, 257, 4, "bshd")
    runs = [_poisoned_backward(q, k, v, do, causal=True, layout="bshd", deterministic=True)
            for _ in range(3)]
    for name, first, *others in zip(("dq", "dk", "dv"), *runs):
        bits = cp.asnumpy(first).view(np.uint8)
        for other in others:
            assert np.array_equal(bits, cp.asnumpy(other).view(np.uint8)), f"{name} differs between runs"
    _check(runs[0], _reference_grads(host, "bshd", causal=True), dtype, "bshd")


# Sizes where many key blocks add into each query tile's dQ: on Hopper the deterministic
# mode orders those additions (ascending key blocks without a right edge to the mask,
# descending with causal), so the turn-taking is what these cases exercise (from d = 128
# with two dQ writers taking the tiles in turn).
@pytest.mark.parametrize("dtype,d,causal,nq,nk,group,layout", [
    ("bfloat16", 128, False, 700, 2100, 1, "bhsd"),
    ("float16", 64, True, 2100, 1900, 2, "bshd"),
    ("bfloat16", 64, False, 333, 1337, 4, "bhsd"),
    ("float16", 128, True, 600, 2500, 1, "bhsd"),
    ("bfloat16", 192, False, 700, 2100, 1, "bhsd"),   # the roles, two dQ writers taking turns
    ("float16", 256, True, 600, 2500, 2, "bshd"),
])
def test_deterministic_bits_with_many_key_blocks(rng, dtype, d, causal, nq, nk, group, layout):
    import cupy as cp
    host, (q, k, v, do) = _inputs(rng, dtype, d, nq, nk, group, layout)
    runs = [_poisoned_backward(q, k, v, do, causal=causal, layout=layout, deterministic=True)
            for _ in range(3)]
    for name, first, *others in zip(("dq", "dk", "dv"), *runs):
        bits = cp.asnumpy(first).view(np.uint8)
        for other in others:
            assert np.array_equal(bits, cp.asnumpy(other).view(np.uint8)), f"{name} differs between runs"
    _check(runs[0], _reference_grads(host, layout, causal=causal), dtype, layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_rows_without_keys_get_zero_dq(rng, dtype, deterministic):
    """Causal with Nq > Nk: the first Nq - Nk query rows see no key (LSE -inf); their dq
    is exactly 0 and no gradient holds a NaN."""
    import cupy as cp
    nq, nk = 200, 37
    host, (q, k, v, do) = _inputs(rng, dtype, 64, nq, nk, 4, "bhsd")
    grads = _poisoned_backward(q, k, v, do, causal=True, layout="bhsd", deterministic=deterministic)
    dq = cp.asnumpy(grads[0]).astype(np.float64)
    assert np.all(dq[:, :, : nq - nk] == 0)
    _check(grads, _reference_grads(host, "bhsd", causal=True), dtype, "bhsd")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_strided_inputs_without_alignment(rng, dtype):
    """Every other row of one buffer whose rows are 8 bytes longer than a multiple of 16
    (72 elements and 8 bytes), as in the forward test: q's rows are 16-byte aligned, but k
    and do start half a buffer row into theirs, so their rows are not, and the kernels
    take the element-wise copy path instead of 16-byte copies."""
    import cupy as cp
    from cupyflash import _arrays
    width = 72 + 8 // np.dtype(dtype).itemsize
    base = cp.asarray(rng.standard_normal((1, 3, 2 * 257, width)).astype(dtype))
    q, k = base[:, :, ::2, :72], base[:, :, 1::2, :72]
    v = cp.asarray(rng.standard_normal((1, 3, 257, 72)).astype(dtype))
    do = cp.asarray(rng.standard_normal((1, 3, 2 * 257, width)).astype(dtype))[:, :, 1::2, :72]
    assert not _arrays.rows_16b_aligned(q, k, do)
    host = [cp.asnumpy(x) for x in (q, k, v, do)]
    for deterministic in (False, True):
        grads = _poisoned_backward(q, k, v, do, causal=False, layout="bhsd", deterministic=deterministic)
        _check(grads, _reference_grads(host, "bhsd", causal=False), dtype, "bhsd")


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_backward_reads_through_tensor_maps(rng, d):
    """On Hopper, dense 16-bit backward calls whose rows are 16-byte aligned run
    bwd_sm90.cu (TMA, dQ rows padded for its bulk reductions), not the sm80 fallback that
    unaligned rows take (test_strided_inputs_without_alignment)."""
    import cupy as cp
    from cupyflash import _arrays, _cuda, _kernels, _mods
    device = cp.cuda.Device().id
    if _cuda._device_info(device)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    _, (q, k, v, do) = _inputs(rng, "bfloat16", d, 300, 301, 2, "bhsd")
    (_, candidates), = _cuda.device_backward_plan("bfloat16", d, False, _kernels.MODE_DENSE, device).kv
    variant = _cuda._choose(candidates, device)
    assert variant.family is _kernels.BWD_SM90 and variant.dq_ld == d + 8
    views = [_arrays.bhsd_view(x, "bhsd") for x in (q, k, v, do)]
    assert _cuda._sm90_backward_map_specs(variant, *views, _mods.NONE, None) is not None


@pytest.mark.parametrize("dtype,d,causal,nq,nk,group,layout", [
    ("bfloat16", 192, False, 333, 1000, 1, "bhsd"),
    ("float16", 192, True, 1000, 777, 2, "bshd"),
    ("bfloat16", 160, True, 129, 300, 4, "bhsd"),    # padded into the 192 kernel
    ("float16", 136, False, 65, 1, 1, "bhsd"),       # one key
    ("bfloat16", 192, False, 1, 129, 1, "bshd"),     # one query
    ("float16", 256, True, 1000, 777, 2, "bshd"),
    ("bfloat16", 200, False, 65, 1, 1, "bhsd"),      # padded into 256; one key
    ("bfloat16", 256, False, 1, 129, 1, "bshd"),     # one query
])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_hopper_backward_roles_from_d192(rng, monkeypatch, dtype, d, causal, nq, nk, group, layout, deterministic):
    """From d = 192 the Hopper key-block kernel's two warpgroups share each 64-key block
    in two roles (dV and dK, P^T traded through shared memory, dQ split by columns):
    dense calls run it, against the float64 reference, into NaN-poisoned gradients."""
    import cupy as cp
    from cupyflash import _cuda, _kernels
    if _cuda._device_info(cp.cuda.Device().id)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    launched = []
    launch = _cuda._launch
    monkeypatch.setattr(_cuda, "_launch", lambda variant, *a: (launched.append(variant), launch(variant, *a)))
    host, (q, k, v, do) = _inputs(rng, dtype, d, nq, nk, group, layout)
    grads = _poisoned_backward(q, k, v, do, causal=causal, layout=layout, deterministic=deterministic)
    _check(grads, _reference_grads(host, layout, causal=causal), dtype, layout)
    key_block = [variant for variant in launched if variant.grads & _kernels.GRAD_DK]
    assert [variant.family for variant in key_block] == [_kernels.BWD_SM90], [v.name_expression for v in launched]
    assert key_block[0].head_dim >= _kernels.BWD_SM90_ROLES_MIN_HEAD_DIM


@pytest.mark.parametrize("dtype,d,group,nq,left", [("bfloat16", 64, 1, 300, "few"), ("float16", 128, 2, 300, "few"),
                                                    ("bfloat16", 128, 1, 2048, "half"), ("bfloat16", 96, 2, 300, "few")])
def test_hopper_backward_splits_the_last_rounds_units(rng, dtype, d, group, nq, left):
    """A non-causal call of more (key block, kv head) units than SMs: the last round's
    units run in pieces on the idle SMs (bwd_sm90.cu Sm90BwdUnits), whose dK and dV sums
    the last piece of each stores; a few units left (a pair a piece, one round), or half
    the SMs' worth (pieces in rounds of their own); d = 96 in the d = 128 kernel, whose
    sums are sized by its own head dim. Against the float64 reference, into NaN-poisoned
    gradients, with a partial last key block and (nq = 300) query tile."""
    import cupy as cp
    from cupyflash import _arrays, _cuda, _mods
    device = cp.cuda.Device().id
    if _cuda._device_info(device)[0] != "sm_90a":
        pytest.skip("not a Hopper GPU")
    nk = 200   # 2 key blocks of 128
    sms = _cuda._sm_count(device)
    kv_heads = sms // 2 + 1 if left == "few" else (sms + sms // 2 + 2) // 2
    host, (q, k, v, do) = make_inputs(rng, dtype, d, nq, nk, group, "bhsd", with_do=True, batch=1,
                                      kv_heads=kv_heads, max_pairs=10**6)
    o = cupyflash.attention(q, k, v, backend="cuda")
    views = [_arrays.bhsd_view(x, "bhsd") for x in (do, q, k, v, o)]
    grads = [cp.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v)]
    plan = _cuda._plan_backward(*views, *grads, scale=d ** -0.5, causal=False, deterministic=False, mods=_mods.NONE,
                                dbias=None)
    pieces = plan.params.get("unit_pieces")
    assert plan.split_units > 0 and pieces > 1, "the call was meant to split units"
    assert (plan.split_units * pieces > sms) == (left == "half")
    grads = _poisoned_backward(q, k, v, do, causal=False, layout="bhsd", deterministic=False)
    _check(grads, _reference_grads(host, "bhsd", causal=False), dtype, "bhsd")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backward_calls_of_one_signature_share_a_plan(rng, dtype):
    """Backward calls whose arrays have one layout reuse one launch plan
    (`_cuda._BACKWARD_PLANS`) but each reads its own inputs and writes its own gradients;
    the deterministic mode and an input whose rows are not 16-byte aligned get plans of
    their own (no 16-byte copies, no tensor maps) and are still right."""
    import cupy as cp
    from cupyflash import _cuda

    def check(host, device, **options):
        _, vjp = cupyflash.attention_vjp(*device[:3], causal=True, backend="cuda", **options)
        _check(vjp(device[3]), _reference_grads(host, "bhsd", causal=True), dtype, "bhsd")

    _cuda._BACKWARD_PLANS.clear()
    for _ in range(3):
        check(*_inputs(rng, dtype, 64, 200, 333, 2, "bhsd"))
    assert len(_cuda._BACKWARD_PLANS) == 1
    check(*_inputs(rng, dtype, 64, 200, 333, 2, "bhsd"), deterministic=True)
    assert len(_cuda._BACKWARD_PLANS) == 2
    host, (q, k, v, do) = _inputs(rng, dtype, 64, 200, 200, 1, "bhsd")
    base = cp.zeros((q.size + 8,), q.dtype)
    unaligned = base[1:1 + q.size].reshape(q.shape)
    unaligned[...] = q
    check(host, (unaligned, k, v, do))
    assert len(_cuda._BACKWARD_PLANS) == 3


def test_runs_on_the_current_stream(rng):
    import cupy as cp
    host, (q, k, v, do) = _inputs(rng, "bfloat16", 128, 512, 512, 2, "bhsd")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _, vjp = cupyflash.attention_vjp(q, k, v, causal=True, backend="cuda")
        grads = vjp(do)
        stream.synchronize()
    _check(grads, _reference_grads(host, "bhsd", causal=True), "bfloat16", "bhsd")


@pytest.mark.parametrize("causal", [False, True])
def test_fp64_gradients_match_finite_differences_of_the_gpu_forward(rng, causal):
    """<dq, u> + <dk, w> + <dv, z> from the GPU backward against the central difference of
    the GPU forward's loss <o, do> along the direction (u, w, z), in fp64."""
    import cupy as cp
    q, k, v, do, u, w, z = (cp.asarray(rng.standard_normal((1, 2, n, 24))) for n in (19, 23, 23, 19, 19, 23, 23))
    o, vjp = cupyflash.attention_vjp(q, k, v, causal=causal, backend="cuda")
    dq, dk, dv = vjp(do)
    directional = float(cp.sum(dq * u) + cp.sum(dk * w) + cp.sum(dv * z))

    def loss(t):
        return float(cp.sum(cupyflash.attention(q + t * u, k + t * w, v + t * z, causal=causal, backend="cuda") * do))

    eps = 1e-5
    numeric = (loss(eps) - loss(-eps)) / (2 * eps)
    assert abs(numeric - directional) <= 1e-7 * max(1.0, abs(directional))


def test_gradient_descent_matches_the_numpy_backend():
    """A few steps of gradient descent on q, k and v through attention_vjp (fp64, causal,
    GQA) lower the loss 0.5 |o - target|^2 on the GPU exactly as on the NumPy backend."""
    import cupy as cp
    rng = np.random.default_rng(7)
    start = [rng.standard_normal((1, h, 37, 16)) for h in (4, 2, 2)]
    target = rng.standard_normal((1, 4, 37, 16))
    losses = {}
    for backend, xp in (("cuda", cp), ("numpy", np)):
        q, k, v = (xp.asarray(x) for x in start)
        t = xp.asarray(target)
        history = []
        for _ in range(6):
            o, vjp = cupyflash.attention_vjp(q, k, v, causal=True, backend=backend)
            history.append(float(0.5 * xp.sum((o - t) ** 2)))
            dq, dk, dv = vjp(o - t)
            q, k, v = q - 0.02 * dq, k - 0.02 * dk, v - 0.02 * dv
        losses[backend] = np.array(history)
    assert np.all(np.diff(losses["cuda"]) < 0)
    np.testing.assert_allclose(losses["cuda"], losses["numpy"], rtol=1e-12)
