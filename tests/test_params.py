"""CPU tier: the kernels' one contract. cupyflash/_params.py mirrors kernels_cu/params.cuh
field by field; NVRTC compiles static_asserts of every offset and size generated from
the mirror, so a field changed on one side only fails here, without a GPU."""

import numpy as np
import pytest

from cupyflash import _kernels, _nvrtc, _params

try:
    _nvrtc.nvrtc_version()
    _NVRTC = None
except Exception as exc:  # pragma: no cover - depends on the machine
    _NVRTC = f"NVRTC not loadable ({type(exc).__name__}); install cupyflash[cuda12] or [cuda13]"


@pytest.mark.skipif(_NVRTC is not None, reason=str(_NVRTC))
@pytest.mark.parametrize("arch", _kernels.BUILD_ARCHS)
def test_host_layout_matches_the_header(arch):
    _nvrtc.check_source(_params.layout_asserts(), "params_layout.cu", arch)


@pytest.mark.skipif(_NVRTC is not None, reason=str(_NVRTC))
def test_a_drifted_field_fails_the_check():
    drifted = _params.layout_asserts().replace("OFFSET(AttnParams, nk) == ", "OFFSET(AttnParams, nk) == 4 + ")
    with pytest.raises(_nvrtc.KernelBuildError, match="AttnParams::nk"):
        _nvrtc.check_source(drifted, "params_drift.cu", _kernels.BUILD_ARCHS[0])


@pytest.mark.skipif(_NVRTC is not None, reason=str(_NVRTC))
def test_template_constants_match_the_headers():
    # The modes and gradient bits the host writes into template arguments (mods.cuh,
    # bwd.cuh), one static_assert each, and which modes run the dense path (lean_mode:
    # the host's persistent grid follows it).
    names = ("MODE_DENSE", "MODE_EXT", "MODE_BIAS", "MODE_TF32", "MODE_BAND", "MODE_ALIBI", "MODE_SOFTCAP",
             "MODE_DROPOUT", "GRAD_DV", "GRAD_DK", "GRAD_DQ", "GRAD_DQ_ORDERED", "BWD_ROW_PAD")
    source = '#include "bwd.cuh"\n' + "".join(
        f'static_assert({name} == {getattr(_kernels, name)}, "{name}");\n' for name in names)
    source += "".join(f'static_assert(lean_mode({mode}) == {str(_kernels.lean_mode(mode)).lower()}, "lean {mode}");\n'
                      for mode in range(128))
    _nvrtc.check_source(source, "template_constants.cu", _kernels.BUILD_ARCHS[0])


def test_tensor_maps_are_64_byte_aligned_and_come_first():
    assert [_params.ATTN.fields[f][1] for f in ("q_map", "k_map", "v_map")] == [0, 128, 256]
    assert _params.ATTN.itemsize % _params.TMA_MAP_ALIGN == 0


def test_params_pack_into_one_void_scalar():
    p = _params.Params().set(nq=17, nk=5, scale_log2=0.25).mods(win_left=3, drop_threshold=26)
    arg = p.arg
    assert isinstance(arg, np.void) and arg.dtype.itemsize == _params.ATTN.itemsize
    back = np.frombuffer(arg.tobytes(), _params.ATTN)[0]
    assert (back["nq"], back["nk"], back["scale_log2"]) == (17, 5, 0.25)
    assert (back["mods"]["win_left"], back["mods"]["drop_threshold"]) == (3, 26)
    assert back["mods"]["bias"] == 0 and back["lse"] == 0   # unused fields are zero
