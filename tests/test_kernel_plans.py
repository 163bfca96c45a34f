"""CPU tier: the GPU kernels' tile tables and launch plans, without a GPU."""

import re

import numpy as np
import pytest

from cupyflash import _cuda, _kernels, _mods, _nvrtc

DTYPES = ("float16", "bfloat16", "float32", "float64")
HOPPER_SMEM = 227 * 1024   # opt-in shared memory per block on H100/H200


def _candidate_lists(dtype, D, cuda_cores=False):
    """Each launch's tile candidates, in order of preference: the forward's, and those of
    the backward's key-block and dQ kernels in both modes, for the dense and the
    options' kernels."""
    lists = []
    for mode in (_kernels.MODE_DENSE, _kernels.MODE_EXT):
        lists.append(_kernels.forward_variants(dtype, D, mode))
        for deterministic in (False, True):
            plan = _kernels.backward_plan(dtype, D, deterministic, mode, cuda_cores)
            lists += [c for _, c in plan.kv] + ([plan.dq] if plan.dq else [])
    return lists


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", _kernels.HEAD_DIMS)
def test_first_tiles_fit_hopper_and_last_fit_100kb(dtype, D):
    for candidates in _candidate_lists(dtype, D):
        assert candidates[0].total_smem <= HOPPER_SMEM, candidates[0].name_expression
    # Where a tensor-core backward tile does not fit ~100 KB (fp32/fp64 at the largest
    # head dims), device_backward_plan falls back to the CUDA-core plan, which does.
    wide = dtype not in _kernels.HALF_DTYPES
    for candidates in _candidate_lists(dtype, D, cuda_cores=wide):
        assert candidates[-1].total_smem <= _kernels.PORTABLE_SMEM, candidates[-1].name_expression


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_wide_backward_is_one_launch_at_every_head_dim(dtype, deterministic):
    # dK and dV come from one key-block launch; where a warp's dK and dV do not fit its
    # registers (fp64 from d = 96, fp32 from 192), two warps hold half of their columns
    # each, four or eight from fp64's d = 192 (bwd_wide.cu HALVES), instead of a second
    # launch recomputing P.
    G = _kernels
    for D, tiles in G.BWD_WIDE_KV_TILES[dtype].items():
        (grads, candidates), = G.backward_plan(dtype, D, deterministic).kv
        assert grads & (G.GRAD_DK | G.GRAD_DV) == G.GRAD_DK | G.GRAD_DV
        halves = {tile[-1] for tile in tiles}
        shares = {2} if D >= {"float32": 192, "float64": 96}[dtype] else {1}
        if dtype == "float64" and D >= 192:
            shares = {4} if D == 192 else {4, 8}
        assert halves == shares, (D, tiles)
        wide = [v for v in candidates if v.family is G.BWD_WIDE]   # (fp32's Hopper kernel ahead: below)
        assert all(f", {grads}, {tiles[i][-1]}, " in v.name_expression for i, v in enumerate(wide))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 192])
def test_fp32_backward_on_hopper_takes_bwd_sm90(D, deterministic):
    # fp32 runs bwd_sm90.cu over fp16 halves in the roles (dQ added in both modes, in turns
    # when deterministic) up to d = 128, ahead of bwd_wide.cu, in every mode (the bias read
    # by the passes); from d = 192 bwd_wide.cu alone.
    G = _kernels
    lean = (G.MODE_DENSE, G.MODE_BAND, *(G.MODE_BAND | term for term in G.DENSE_PATH_TERMS.values()))
    for mode in (*lean, G.MODE_EXT, G.MODE_EXT | G.MODE_BIAS):
        (grads, candidates), = G.backward_plan("float32", D, deterministic, mode).kv
        hopper = [v for v in candidates if v.family is G.BWD_SM90]
        if D <= 128:
            assert candidates[0] is hopper[0] and len(hopper) == 1 and G.bwd_sm90_roles(hopper[0])
            assert hopper[0].mode == mode
            assert hopper[0].grads == G.GRAD_DV | G.GRAD_DK | G.GRAD_DQ | (G.GRAD_DQ_ORDERED if deterministic else 0)
            assert hopper[0].name_expression.startswith(f"flash_bwd_dkdv_sm90<float, {64 if D <= 64 else 128}, 64, 2, ")
            assert not G.bwd_sm90_splits_units(hopper[0])
        else:
            assert not hopper


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_plans_add_dq_only_in_order(dtype):
    """A deterministic plan's key-block candidates either add dQ in turns (the Hopper
    kernel, GRAD_DQ_ORDERED) or leave dQ to the query-block kernel; a non-deterministic
    plan's add it (atomically) in the launch that computes dK, but from
    BWD_SM80_DQ_KERNEL_MIN_HEAD_DIM the 16-bit plans leave it to the query-block kernel
    in both modes (where the Hopper kernel is not taken)."""
    G = _kernels
    for D in G.HEAD_DIMS:
        det = G.backward_plan(dtype, D, True)
        assert det.dq is not None and det.convert is not None
        for grads, candidates in det.kv:
            assert not grads & G.GRAD_DQ
            for v in candidates:
                ordered = v.family is G.BWD_SM90
                assert bool(v.grads & G.GRAD_DQ) == ordered and bool(v.grads & G.GRAD_DQ_ORDERED) == ordered
        atomic = G.backward_plan(dtype, D, False)
        assert not any(v.grads & G.GRAD_DQ_ORDERED for _, c in atomic.kv for v in c)
        if dtype in G.HALF_DTYPES and D >= G.BWD_SM80_DQ_KERNEL_MIN_HEAD_DIM:
            assert atomic.dq is not None and not atomic.kv[-1][0] & G.GRAD_DQ
            assert all(bool(v.grads & G.GRAD_DQ) == (v.family is G.BWD_SM90) for _, c in atomic.kv for v in c)
        else:
            assert atomic.dq is None and atomic.convert is not None
            assert atomic.kv[-1][0] & G.GRAD_DQ
        for plan in (det, atomic):
            for grads, candidates in plan.kv:
                assert all(v.grads & grads == grads for v in candidates)
            # dK and dV each come from exactly one launch.
            for bit in (G.GRAD_DK, G.GRAD_DV):
                assert sum(bool(grads & bit) for grads, _ in plan.kv) == 1


def _kernel_templates(source):
    """{kernel name: number of template parameters} of the __global__ functions in a
    source (0: not a template)."""
    pattern = re.compile(r"(?:template\s*<([^>]*)>\s*)?__global__\s+void\s+"
                         r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
    code = re.sub(r"//[^\n]*", "", source)
    return {name: len(params.split(",")) if params else 0 for params, name in pattern.findall(code)}


def test_every_variant_names_a_kernel_template_of_its_source():
    templates = {}
    for v in _kernels.all_variants():
        if v.source not in templates:
            templates[v.source] = _kernel_templates((_nvrtc.KERNEL_DIR / v.source).read_text())
        name, args = re.fullmatch(r"(\w+)(?:<(.*)>)?", v.name_expression).groups()
        assert name in templates[v.source], f"{v.name_expression}: no kernel {name} in {v.source}"
        assert (len(args.split(",")) if args else 0) == templates[v.source][name], v.name_expression


@pytest.mark.parametrize("arch, source", [("sm_90a", "fwd_sm90.cu"), ("sm_80", "fwd_sm80.cu"),
                                          ("sm_89", "fwd_sm80.cu")])
def test_hopper_forward_only_where_it_builds(monkeypatch, arch, source):
    # _choose skips a kernel built for another target (fwd_sm90.cu is sm_90a-only wgmma).
    # The options run the same family: on Hopper its instantiation carries the call's
    # policies (MODE_BIAS too), elsewhere fwd_sm80.cu's one option kernel serves them all.
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: (arch, HOPPER_SMEM))
    assert _cuda._choose(_kernels.forward_variants("bfloat16", 128), 0).source == source
    for mode in _kernels.MODES[1:]:
        chosen = _cuda._choose(_kernels.forward_variants("bfloat16", 128, mode), 0)
        assert chosen.source == source
        assert chosen.mode == (mode if source == "fwd_sm90.cu" else _kernels.MODE_EXT)
        assert f", {chosen.mode}, {chosen.smem_bytes}>" in chosen.name_expression
    assert all(v.builds_for(arch) for v in (_cuda._choose(_kernels.forward_variants("float16", D), 0)
                                           for D in _kernels.HEAD_DIMS))


@pytest.mark.parametrize("arch, source", [("sm_90a", "bwd_sm90.cu"), ("sm_80", "bwd_sm80.cu"),
                                          ("sm_89", "bwd_sm80.cu")])
@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_backward_only_where_it_builds(monkeypatch, arch, source, deterministic):
    # The key-block launch takes bwd_sm90.cu on Hopper at d = 64 and 128, with the options
    # and the bias too (its dQ kernel stays bwd_sm80.cu's); at d = 192 and 256 (its
    # warpgroups in two roles) every call but a bias at d = 256, which runs bwd_sm80.cu
    # (one launch, its warps sharing each key tile's columns, then the dQ kernel).
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: (arch, HOPPER_SMEM))

    def kv_sources(dtype, D, mode=_kernels.MODE_DENSE):
        plan = _kernels.backward_plan(dtype, D, deterministic, mode)
        return [_cuda._choose(candidates, 0).source for _, candidates in plan.kv]

    for D in (64, 128):
        assert kv_sources("bfloat16", D) == [source]
        assert kv_sources("bfloat16", D, _kernels.MODE_EXT) == [source]
        assert kv_sources("bfloat16", D, _kernels.MODE_EXT | _kernels.MODE_BIAS) == [source]
    for D in (192, 256):
        assert kv_sources("float16", D) == [source]
        assert kv_sources("float16", D, _kernels.MODE_BAND) == [source]
        assert kv_sources("float16", D, _kernels.MODE_EXT) == [source]
        bias_source = source if D <= _kernels.BWD_SM90_BIAS_MAX_HEAD_DIM else "bwd_sm80.cu"
        assert kv_sources("float16", D, _kernels.MODE_EXT | _kernels.MODE_BIAS) == [bias_source]
    plan = _kernels.backward_plan("float16", 128, deterministic)
    assert plan.dq is None or _cuda._choose(plan.dq, 0).source == "bwd_sm80.cu"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_hopper_kernels_serve_the_padded_head_dims(monkeypatch, dtype, arch):
    # Calls padded to d = 32 and 96 run the Hopper kernels of 64 and 128 (TMA zero-fills
    # their padding columns; _kernels.sm90_head_dim), the forward in every mode and the
    # 16-bit backward in both determinism modes, with the exact kernels behind them for
    # rows TMA cannot describe; the dense backward at d = 192 and 256 takes Hopper's too
    # (its warpgroups in two roles); other GPUs the exact instantiations.
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: (arch, HOPPER_SMEM))
    G = _kernels
    for D, E in ((32, 64), (96, 128)):
        for mode in (G.MODE_DENSE, G.MODE_EXT, G.MODE_EXT | G.MODE_BIAS):
            variants = G.forward_variants(dtype, D, mode)
            chosen = _cuda._choose(variants, 0)
            assert chosen.head_dim == (E if arch == "sm_90a" else D), chosen.name_expression
            assert variants[-1].family is not G.FWD_SM90 and variants[-1].head_dim == D
            if dtype == "float32":
                continue
            for deterministic in (False, True):
                (_, candidates), = G.backward_plan(dtype, D, deterministic, mode).kv
                chosen = _cuda._choose(candidates, 0)
                assert (chosen.family is G.BWD_SM90) == (arch == "sm_90a"), chosen.name_expression
                assert chosen.head_dim == (E if arch == "sm_90a" else D) and chosen.dq_ld in (0, E + 8)
                assert candidates[-1].family is G.BWD_SM80 and candidates[-1].head_dim == D
    if dtype != "float32":
        for D in (192, 256):
            (_, candidates), = G.backward_plan(dtype, D, False).kv
            assert candidates[0].family is G.BWD_SM90 and candidates[0].head_dim == D
            assert candidates[-1].family is G.BWD_SM80


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_band_options_run_the_hopper_backward_dense_path(monkeypatch, arch, deterministic):
    # Options that only bound the keys a row sees (a window, seqlens_k, varlen, a place
    # in a larger problem) hide keys and skip tiles, nothing more: the backward's mode is
    # MODE_BAND, which bwd_sm90.cu runs on its dense path (persistent CTAs). So is a block
    # mask whose blocks are whole tiles of the Hopper kernels of the head dim (128 x 128
    # blocks: tiles of 128 x 128 at d = 64, 64 queries x 128 keys at d = 128, 64 x 64 from
    # d = 192), with or without a band, in the default mode; and ALiBi, softcap or dropout
    # beside them, where it is the call's one such option (MODE_ALIBI, MODE_SOFTCAP,
    # MODE_DROPOUT). With any other option, blocks that cut tiles, or a block mask in the
    # deterministic mode, they take the option kernels (MODE_EXT), and so do every other
    # family and the forward.
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: (arch, HOPPER_SMEM))
    index = np.zeros(3, np.int32)
    for band in (_mods.Modifiers(window=(256, 0)), _mods.Modifiers(seqlens_k=index),
                 _mods.Modifiers(cu_seqlens_q=index, cu_seqlens_k=index, window=(-1, 8)),
                 _mods.Modifiers(diagonal=0, row0=32)):
        assert band.band_only and _kernels.backward_mode(band, 128, deterministic) == _kernels.MODE_BAND
        assert _kernels.kernel_mode(band) == _kernels.MODE_EXT
    for blocks, dims in ((_mods.Modifiers(block_mask=index), (32, 64, 96, 128, 192, 256)),
                         (_mods.Modifiers(block_mask=index, window=(256, 0)), (64, 128)),
                         (_mods.Modifiers(block_mask=index, block_size=(64, 128)), (128, 192)),
                         (_mods.Modifiers(block_mask=index, block_size=(64, 64)), (192, 256))):
        assert not blocks.band_only and blocks.skips_tiles_only
        # The deterministic MODE_BAND kernels read no block mask (Sm90BwdKVTile::BAND_BLOCKS).
        expected = _kernels.MODE_EXT if deterministic else _kernels.MODE_BAND
        assert all(_kernels.backward_mode(blocks, D, deterministic) == expected for D in dims)
    for cut, dims in ((_mods.Modifiers(block_mask=index, block_size=(64, 128)), (64,)),
                      (_mods.Modifiers(block_mask=index, block_size=(64, 64)), (64, 128)),
                      (_mods.Modifiers(block_mask=index, block_size=(16, 16)), (64, 128, 192))):
        assert all(_kernels.backward_mode(cut, D, deterministic) == _kernels.MODE_EXT for D in dims)
    # ALiBi, softcap or dropout as the one such option, alone or beside a band or such a
    # block mask: MODE_BAND | MODE_ALIBI, MODE_SOFTCAP or MODE_DROPOUT.
    for name, term in (("alibi", dict(alibi_slopes=index)), ("softcap", dict(softcap=30.0)),
                       ("dropout", dict(dropout_p=0.1))):
        mode = _kernels.MODE_BAND | _kernels.DENSE_PATH_TERMS[name]
        for terms in (_mods.Modifiers(**term), _mods.Modifiers(**term, window=(256, 0)),
                      _mods.Modifiers(**term, cu_seqlens_q=index, cu_seqlens_k=index)):
            assert terms.dense_path_term == name and not terms.skips_tiles_only
            assert all(_kernels.backward_mode(terms, D, deterministic) == mode for D in (64, 128, 192, 256))
        with_blocks = _mods.Modifiers(block_mask=index, **term)
        assert _kernels.backward_mode(with_blocks, 128, deterministic) == (_kernels.MODE_EXT if deterministic else mode)
        assert _kernels.backward_mode(_mods.Modifiers(block_mask=index, block_size=(16, 16), **term), 128,
                                      deterministic) == _kernels.MODE_EXT
    for other in (_mods.Modifiers(seqlens_k=index, dropout_p=0.1, softcap=30.0),
                  _mods.Modifiers(softcap=30.0, dropout_p=0.1), _mods.Modifiers(alibi_slopes=index, softcap=30.0),
                  _mods.Modifiers(alibi_slopes=index, dropout_p=0.1), _mods.Modifiers(bias=index),
                  _mods.Modifiers(bias=index, alibi_slopes=index), _mods.Modifiers(bias=index, dropout_p=0.1)):
        assert not other.band_only and not other.skips_tiles_only and other.dense_path_term is None
        assert _kernels.backward_mode(other, 128, deterministic) == _kernels.MODE_EXT | (
            _kernels.MODE_BIAS if other.bias is not None else 0)
    assert not _mods.Modifiers(tf32=True).band_only
    assert _kernels.backward_mode(_mods.Modifiers(tf32=True), 128, deterministic) == _kernels.MODE_DENSE
    for D in (64, 128):
        (_, candidates), = _kernels.backward_plan("bfloat16", D, deterministic, _kernels.MODE_BAND).kv
        chosen = _cuda._choose(candidates, 0)
        if arch == "sm_90a":
            assert chosen.family is _kernels.BWD_SM90 and chosen.mode == _kernels.MODE_BAND
            assert _kernels.bwd_sm90_persistent(chosen)
            assert f", {_kernels.MODE_BAND}, {chosen.smem_bytes}>" in chosen.name_expression
        else:
            assert chosen.source == "bwd_sm80.cu" and chosen.mode == _kernels.MODE_EXT
    # fp64 has no Hopper backward: its plan is the option kernels'; fp32's is the same past
    # its Hopper kernel of the mode (test_fp32_backward_on_hopper_takes_bwd_sm90).
    assert _kernels.backward_plan("float64", 64, deterministic, _kernels.MODE_BAND) == _kernels.backward_plan(
        "float64", 64, deterministic, _kernels.MODE_EXT)
    (_, band), = _kernels.backward_plan("float32", 64, deterministic, _kernels.MODE_BAND).kv
    (_, ext), = _kernels.backward_plan("float32", 64, deterministic, _kernels.MODE_EXT).kv
    assert band[0].family is ext[0].family is _kernels.BWD_SM90 and band[0].mode == _kernels.MODE_BAND
    assert band[1:] == ext[1:]


@pytest.mark.parametrize("deterministic", [False, True])
def test_hopper_backward_bias_calls_it_cannot_serve_take_the_next_kernel(monkeypatch, deterministic):
    # bwd_sm90.cu's MODE_BIAS kernel reads the bias through a tensor map of whole (Nq, Nk)
    # rows (boxes of BWD_SM90_SUB_M queries) and adds dbias where asked. A bias broadcast
    # over queries or keys, and softcap beside a bias in the deterministic kernel or (at d =
    # 128, 16-bit) beside dbias get no specs, so _plan_backward takes the sm80 kernels.
    from types import SimpleNamespace
    monkeypatch.setattr(_cuda, "_map_specs", lambda *boxes: tuple(rows for _, rows in boxes))
    (_, candidates), = _kernels.backward_plan("bfloat16", 128, deterministic,
                                              _kernels.MODE_EXT | _kernels.MODE_BIAS).kv
    hopper = candidates[0]
    assert hopper.family is _kernels.BWD_SM90 and hopper.mode & _kernels.MODE_BIAS
    q = do = np.zeros((2, 4, 100, 128))
    k = v = np.zeros((2, 2, 64, 128))

    def specs(bias_shape, softcap=0.0, dbias=None, kernel=hopper):
        mods = SimpleNamespace(bias=np.zeros(bias_shape), softcap=softcap)
        return _cuda._sm90_backward_map_specs(kernel, q, k, v, do, mods, dbias)

    assert specs((1, 1, 100, 64)) == (64, 64, 128, 128, _kernels.BWD_SM90_SUB_M)
    assert specs((2, 4, 100, 64)) is not None
    assert specs((1, 1, 1, 64)) is None and specs((1, 1, 100, 1)) is None   # broadcast rows
    assert (specs((1, 1, 100, 64), softcap=30.0) is None) == deterministic
    dbias = np.zeros((1, 1, 100, 64))
    assert specs((1, 1, 100, 64), dbias=dbias) is not None
    assert specs((1, 1, 100, 64), softcap=30.0, dbias=dbias) is None   # d = 128: not in softcap's pass
    (_, candidates), = _kernels.backward_plan("bfloat16", 64, deterministic, _kernels.MODE_EXT | _kernels.MODE_BIAS).kv
    assert _kernels.bwd_sm90_softcap_dbias(candidates[0]) and not _kernels.bwd_sm90_softcap_dbias(hopper)
    assert (specs((1, 1, 100, 64), softcap=30.0, dbias=dbias, kernel=candidates[0]) is None) == deterministic
    # fp32's kernel: its maps describe the halves, made per call, and the bias's as above.
    (_, candidates), = _kernels.backward_plan("float32", 128, deterministic, _kernels.MODE_EXT | _kernels.MODE_BIAS).kv
    (_, plain), = _kernels.backward_plan("float32", 128, deterministic, _kernels.MODE_EXT).kv

    def halves(bias_shape, kernel=candidates[0], softcap=0.0):
        mods = SimpleNamespace(bias=np.zeros(bias_shape), softcap=softcap)
        return _cuda._sm90_halves_specs(kernel, q, k, mods, dbias)

    assert halves((1, 1, 100, 64)) == _cuda.HalvesMaps((_kernels.BWD_SM90_SUB_M,))
    assert halves((1, 1, 100, 1)) is None   # broadcast rows
    assert (halves((1, 1, 100, 64), softcap=30.0) is None) == deterministic   # fp32: the roles, softcap beside dbias
    assert halves((1, 1, 100, 64), kernel=plain[0]) == _cuda.HalvesMaps()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_wide_backward_runs_on_the_tensor_cores_where_it_fits(dtype):
    # Every head dim's key-block kernel is bwd_wide.cu's (3xTF32 / DMMA; fp32 has
    # bwd_sm90.cu's ahead of it up to d = 128, the test above), and so is the
    # deterministic dQ kernel but fp64's from d = 192, whose 16 query rows of dQ a warp
    # exceed the registers: that one runs on the CUDA cores.
    for D in _kernels.HEAD_DIMS:
        for deterministic in (False, True):
            for mode in (_kernels.MODE_DENSE, _kernels.MODE_EXT):
                plan = _kernels.backward_plan(dtype, D, deterministic, mode)
                hopper = {"bwd_sm90.cu"} if dtype == "float32" and D <= 128 else set()
                assert {v.source for _, c in plan.kv for v in c} == {"bwd_wide.cu"} | hopper, (D, deterministic, mode)
                wide_dq = dtype == "float32" or D <= 128
                assert {v.source for v in plan.dq or ()} <= {"bwd_wide.cu" if wide_dq else "bwd_simt.cu"}


@pytest.mark.parametrize("block_size, causal, window, rows", [
    (None, False, None, 192), (None, True, None, 128), (None, False, (256, 0), 128),
    ((128, 128), False, None, 128), ((64, 32), False, None, 192), ((16, 16), False, None, 192)])
def test_hopper_option_tile_at_d64(monkeypatch, block_size, causal, window, rows):
    # d = 64 with options takes 192-row tiles, but 128 rows under a causal or window band
    # (more of its diagonal would need the element mask) or where a block mask's row
    # blocks would split them (every tile would).
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: ("sm_90a", HOPPER_SMEM))
    mods = _mods.Modifiers(softcap=30.0, window=window or (-1, -1))
    if block_size is not None:
        mods = _mods.Modifiers(block_mask=np.ones((1, 1, 4, 4), bool), block_size=block_size)
    chosen = _cuda._choose(_kernels.forward_variants_for("bfloat16", 64, mods, causal=causal), 0)
    assert chosen.family is _kernels.FWD_SM90 and chosen.block_m == rows


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_tf32_takes_the_16_bit_tiles(monkeypatch, D, causal):
    # precision="tf32" runs the fp16 high halves' one product (fwd_sm90.cu): the 16-bit
    # kernels' tiles, but at d = 64 with three stages and at d = 128 with two (tuned), and
    # splits q itself (QSplit: a second Q buffer and two slots of fp32 rows beside the
    # tiles).
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: ("sm_90a", HOPPER_SMEM))
    mods = _mods.Modifiers(tf32=True)
    chosen = _cuda._choose(_kernels.forward_variants_for("float32", D, mods, causal=causal), 0)
    assert chosen.family is _kernels.FWD_SM90 and chosen.mode == _kernels.MODE_DENSE | _kernels.MODE_TF32
    half = _cuda._choose(_kernels.forward_variants_for("float16", D, _mods.NONE, causal=causal), 0)
    assert chosen.tile == {64: half.tile[:2] + (3,), 128: (128, 2, 2)}[D]
    assert chosen.splits_q and not half.splits_q


@pytest.mark.parametrize("rows,block_m", [(1024, 256), (1000, 256), (2048, 192), (4096, 192), (768, 192), (0, 192)])
def test_tf32_d64_tile_by_row_padding(monkeypatch, rows, block_m):
    # precision="tf32" at d = 64: the 192-row tile, but 256 rows where 192 would pad the
    # query rows by more than ROW_PADDING_SLACK over them (1024 -> 1152 against 1024;
    # 2048 -> 2112 against 2048 keeps 192; 768 is whole in both); 0: rows unknown (varlen).
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: ("sm_90a", HOPPER_SMEM))
    variants = _kernels.forward_variants_for("float32", 64, _mods.Modifiers(tf32=True), causal=False, rows=rows)
    assert _cuda._choose(variants, 0).block_m == block_m
    assert {v.block_m for v in variants if v.family is _kernels.FWD_SM90} == {192, 256}


@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("options", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_fp32_forward_on_hopper_and_its_precision(monkeypatch, tf32, options, D):
    # fp32 runs fwd_sm90.cu on Hopper (3xTF32, or one TF32 product with precision="tf32":
    # the MODE_TF32 bit in its mode), fwd_wide.cu elsewhere; the backward is the same
    # fp32-accurate plan either way.
    mods = _mods.Modifiers(softcap=30.0 if options else 0.0, tf32=tf32)
    mode = _kernels.kernel_mode(mods)
    assert bool(mode & _kernels.MODE_TF32) == tf32 and bool(mode & _kernels.MODE_EXT) == options
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: ("sm_90a", HOPPER_SMEM))
    chosen = _cuda._choose(_kernels.forward_variants_for("float32", D, mods, causal=True), 0)
    assert chosen.family is _kernels.FWD_SM90 and chosen.mode == mode
    assert chosen.name_expression.startswith(f"flash_fwd_sm90<float, {D}, ")
    assert _kernels.backward_plan("float32", D, False, mode) == _kernels.backward_plan(
        "float32", D, False, mode & ~_kernels.MODE_TF32)
    monkeypatch.setattr(_cuda, "_device_info", lambda device_id: ("sm_80", 163 * 1024))
    assert _cuda._choose(_kernels.forward_variants_for("float32", D, mods, causal=True), 0).source == "fwd_wide.cu"


@pytest.mark.parametrize("ctas", [1, 2, 7, 114, 132])
def test_hopper_backward_splits_only_the_last_round_into_nonempty_pieces(ctas):
    # bwd_sm90.cu walks piece i of a split unit from pair i * per, per = ceil(pairs / pieces):
    # every piece must start inside the unit's pairs; only the last round splits, and only
    # where its pieces (in as many rounds as they take) finish before a whole unit would.
    for units in range(1, 3 * ctas + 2):
        for pairs in (1, 2, 3, 16, 32, 33, 100):
            whole, pieces = _kernels.sm90_unit_split(units, ctas, pairs)
            left = units - whole
            if pieces == 1:
                assert whole == units
                continue
            assert units > ctas and left == units % ctas and whole % ctas == 0
            assert 2 <= pieces <= pairs
            per = -(-pairs // pieces)
            assert (pieces - 1) * per < pairs
            assert -(-left * pieces // ctas) * (per + 1) < pairs


def test_hopper_backward_split_of_the_grid_shapes():
    # 4096 units of 16 pairs (d = 64, N = 2k) leave 4 on 132 SMs: a pair a piece; 2048 of
    # 32 (d = 128) leave 68: three pieces each, 204 pieces in two rounds.
    assert _kernels.sm90_unit_split(4096, 132, 16) == (4092, 16)
    assert _kernels.sm90_unit_split(2048, 132, 32) == (1980, 3)
    assert _kernels.sm90_unit_split(264, 132, 32) == (264, 1)


def test_which_hopper_backward_kernels_split_units():
    # bwd_sm90.cu's SPLITS against the host's bwd_sm90_splits_units, which sets the pieces
    # only for those kernels: every instantiation, one static_assert each.
    source = (_nvrtc.KERNEL_DIR / "bwd_sm90.cu").read_text()
    variants = [v for v in _kernels.all_variants() if v.family is _kernels.BWD_SM90]
    assert any(_kernels.bwd_sm90_splits_units(v) for v in variants)
    assert not all(_kernels.bwd_sm90_splits_units(v) for v in variants)
    for v in variants:
        args = v.name_expression[v.name_expression.index("<") + 1:v.name_expression.rindex(">")].split(", ")
        tile = f"Sm90BwdKVTile<{', '.join(args[:6])}>"
        source += (f"static_assert({tile}::SPLITS == {str(_kernels.bwd_sm90_splits_units(v)).lower()}, "
                   f'"{v.name_expression}");\n')
    _nvrtc.check_source(source, "splits.cu", "sm_90a")
