"""The kernel instantiations: which templates of ``kernels_cu/`` exist, for which dtypes,
head dims and option modes, with which tiles, and how a backward pass is made of them.

Pure tables and arithmetic, no device and no CuPy: the build check compiles every
`all_variants()` instantiation from here, and `cupyflash._cuda` picks among a problem's
candidates the first that fits the device, then launches it. Each variant's shared-memory
figure mirrors its kernel's layout, which the kernel static_asserts (template argument).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Head dims the kernels are instantiated for; any d <= 256 runs in the smallest one that
# holds it, its padding columns zero-filled on load.
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# mods.cuh: the kernels' MODE template argument. MODE_BIAS is a policy of its own only in
# fwd_sm90.cu (the bias's reads need registers its widest tiles spend on S and P); the
# other families compile the bias into MODE_EXT.
MODE_DENSE, MODE_EXT, MODE_BIAS = 0, 1, 2
MODES = (MODE_DENSE, MODE_EXT, MODE_EXT | MODE_BIAS)
# precision="tf32" (mods.cuh MODE_TF32): not an option but a policy of fp32 products in
# fwd_sm90.cu, one TF32 product instead of three; the other families ignore it.
MODE_TF32 = 4
TF32_MODES = tuple(mode | MODE_TF32 for mode in MODES)
# mods.cuh MODE_BAND: options that only bound the keys a row sees (window, seqlens_k,
# varlen, a placed call: Modifiers.band_only) on bwd_sm90.cu's dense path (persistent
# CTAs, the lean passes); the other families and the forward run such calls in MODE_EXT.
MODE_BAND = 8
# mods.cuh MODE_ALIBI, MODE_SOFTCAP, MODE_DROPOUT: with MODE_BAND, ALiBi, softcap or
# dropout on that dense path too, where it is the call's one such option
# (Modifiers.dense_path_term).
MODE_ALIBI = 16
MODE_SOFTCAP = 32
MODE_DROPOUT = 64
DENSE_PATH_TERMS = {"alibi": MODE_ALIBI, "softcap": MODE_SOFTCAP, "dropout": MODE_DROPOUT}
BACKWARD_MODES = (*MODES, MODE_BAND, *(MODE_BAND | term for term in DENSE_PATH_TERMS.values()))


def lean_mode(mode: int) -> bool:
    """mods.cuh lean_mode: whether a kernel of this mode runs the dense path (no option
    but at most the mask's band and a block mask of whole tiles, MODE_BAND, and one of
    ALiBi, softcap and dropout, MODE_ALIBI, MODE_SOFTCAP, MODE_DROPOUT; MODE_TF32 is no
    option either)."""
    return mode & (MODE_EXT | MODE_BIAS) == 0

# Tensor-core forward tiles per head dim, (BLOCK_M, BLOCK_N, WARPS), in order of
# preference; the first that fits the device's shared memory is used. The later entries
# serve GPUs with ~100 KB per block (sm_86/sm_89) and A100's 164 KB.
FWD_SM80_TILES = {
    32: ((128, 64, 4),),
    # d = 64, H200, bf16, N = 16k: (128, 64, 4) 293-295 TFLOP/s, (128, 32, 4) 272, (128, 128, 8) 245.
    64: ((128, 64, 4),),
    # From d = 96, S and O of two 16-row m-tiles per warp fit 255 registers only with
    # 32-key tiles. d = 128, same runs: (128, 32, 4) 323-324, (128, 128, 8) 286,
    # (128, 64, 8) 266; (128, 64, 4) 333-342 but it spills (16 bytes on sm_90a).
    96: ((128, 32, 4),),
    128: ((128, 32, 4), (64, 64, 4)),
    192: ((128, 64, 8), (64, 32, 4)),
    256: ((128, 64, 8), (128, 32, 8), (32, 32, 2)),
}
# Hopper forward tiles (fwd_sm90.cu: warp-specialised, TMA and wgmma; sm_90a only, dense
# mode, inputs a tensor map can describe) per head dim, (BLOCK_N, CONSUMERS, STAGES): keys
# per tile, consumer warpgroups of 64 query rows each (BLOCK_M = 64 CONSUMERS), K/V stages
# in shared memory. One CTA per SM. Calls padded to d = 32 or 96 run the 64 or 128
# kernels (sm90_head_dim); other GPUs and rows that are not 16-byte aligned use the sm80
# tables.
# H100, bf16, TFLOP/s at N = 2k/4k/16k non-causal, then causal (bench/results/
# h100-2026-11-23-tune-sm90-tma.log, one run): d = 64 (128, 3, 2) 406/442/491, 301/371/437
# against (128, 2, 2) 318/352/389, 282/327/378 and (128, 3, 3), (128, 2, 4), (64, 3, 4),
# (192, 2, 2) between; d = 128 three stages beat two (557/607/631, 382/502/626 against
# 559/565/617, 358/472/590); d = 192 two and three stages within 4%. FlashAttention-3's
# warpgroup ping-pong gained 7-16% at d = 128 but drew a racecheck report it did not
# explain, and was taken out (bench/NOTES.md, session 6; the code is in b26d7f8).
FWD_SM90_TILES = {
    64: ((128, 3, 2),),
    128: ((128, 2, 3),),
    192: ((64, 2, 2),),
    256: ((64, 2, 2),),
}
# The same kernel with the options as policies of the same pipeline. MODE_EXT (every option
# but the bias, switched on at run time): at d = 64 the dense tile's 192 rows only where no
# band or 128-row mask block would make many tiles partial (with 128-row blocks half the
# tiles of a block mask needed the element mask: H100, bf16, N = 16k, density 1/2, 26 ms
# against the dense call's 4.8), else 128 rows (two consumers). With the bias (MODE_EXT | MODE_BIAS) a bias tile
# shares each stage (by TMA where the bias has whole rows) and its pairs take registers:
# 64-key tiles from d = 128 (128 keys spill there, build check). d = 256 with options runs
# in fwd_sm80.cu: its consumers need all of 240 registers, but the option kernels'
# producer keeps 56 (it walks the schedule and the work tiles), which leaves them 224 (84
# bytes of spills); with a bias it spilled even before.
FWD_SM90_EXT_TILES = {
    # d = 64: 192-row tiles for calls without a causal or window band and whose block mask
    # (if any) does not split them, else 128 rows (forward_variants_for). H100, N = 16k,
    # --mods (bench/NOTES.md, session 8): 192 rows gained dropout 9-10%, softcap 3-5%,
    # and lost ALiBi (causal) 7-9%: more of a band's diagonal falls into masked tiles.
    64: ((64, 3, 3), (128, 2, 3)),
    128: ((128, 2, 3),),
    192: ((64, 2, 2),),
}
FWD_SM90_BIAS_TILES = {
    64: ((128, 2, 3),),
    128: ((64, 2, 4),),
    192: ((64, 2, 2),),
}
_FWD_SM90_TABLES = {MODE_DENSE: FWD_SM90_TILES, MODE_EXT: FWD_SM90_EXT_TILES, MODE_EXT | MODE_BIAS: FWD_SM90_BIAS_TILES}
# fp32 in the same kernel on fp16 halves (fwd_sm90.cu, kernels_cu/halves.cuh): every tile
# holds a high and a low plane, so a stage's K and V take as many bytes as fp32's, and
# each product is three fp16 products; every mode (the bias read from global memory, no
# bias stage). Measured (H200, N = 1k / 4k, bench/results/h200-2026-11-29-42097c4-tune-fp32-tf32-halves.log):
# d = 64 (128, 2, 2) 125 / 171 TFLOP/s, causal 82 / 143, against (128, 2, 3) 120 / 164 and
# (64, 2, 4) 123 / 165 (causal within 1%); d = 128 (64, 2, 2) 150 / 212, 94 / 183, the
# one that fits (128-key tiles need 320 KB).
FWD_SM90_F32_TILES = {
    64: ((128, 2, 2), (64, 2, 2)),
    128: ((64, 2, 2),),
}
FWD_SM90_F32_EXT_TILES = {
    64: ((64, 2, 2),),
    128: ((64, 2, 2),),
}
_FWD_SM90_F32_TABLES = {MODE_DENSE: FWD_SM90_F32_TILES, MODE_EXT: FWD_SM90_F32_EXT_TILES,
                        MODE_EXT | MODE_BIAS: FWD_SM90_F32_EXT_TILES}
# precision="tf32": the high halves alone, one product each: the 16-bit tiles, but at d =
# 64 a stage more (below) and at d = 128 two stages (H200, N = 1k / 4k,
# bench/results/h200-2026-11-29-42097c4-tune-fp32-tf32-halves.log:
# (128, 2, 2) 243 / 467 TFLOP/s, causal 140 / 347, against three stages' 243 / 439, 138 /
# 328), and with the bias, whose fp32 pairs (two words each, read from global memory)
# spilled those tiles (build check), 64 keys and two consumers, to d = 128.
FWD_SM90_TF32_BIAS_TILES = {
    64: ((64, 2, 3),),
    128: ((64, 2, 2),),
}
# At d = 64 also 256 query rows (four consumers, 64-key tiles) for lengths that the 16-bit
# tile's 192 rows would pad (forward_variants_for, ROW_PADDING_SLACK): against it in one
# process (H200, bench/results/h200-2026-12-04-5b0ce3a-ab-tf32-d64-256-row-tile-vs-192.log)
# 1.07-1.10x at N = 1k (192 rows pad 1024 to 1152), 1.01x at 2k, 0.96-0.99x at 4k (3%).
# Both with a stage more than the 16-bit tile, which the shared memory that the kernel's
# own split of q leaves allows (fwd_sm90.cu QSplit; …-12-04-*-ab-tf32-d64-stages-*.log:
# best of two 1.03-1.04x at 4k, 0.99-1.05x at 1k and 2k, within the runs' spread).
FWD_SM90_TF32_TILES = {**FWD_SM90_TILES, 64: ((128, 3, 3), (64, 4, 4)), 128: ((128, 2, 2),)}
# A later Hopper tile of the same table goes first where the first would pad the call's
# query rows by more than this fraction over it: the 256-row tile runs ~7% slower a row.
ROW_PADDING_SLACK = 1.07
_FWD_SM90_TF32_TABLES = {MODE_DENSE: FWD_SM90_TF32_TILES, MODE_EXT: FWD_SM90_EXT_TILES,
                         MODE_EXT | MODE_BIAS: FWD_SM90_TF32_BIAS_TILES}
# The same with the options of _mods (window, dropout, bias, ...; the MODE_EXT kernels):
# their per-score work and the option state need registers that the dense tiles with 64
# keys or two m-tiles per warp do not have (build check), so 32-key tiles (16 at d = 192).
FWD_SM80_EXT_TILES = {
    32: ((128, 32, 4),),
    64: ((128, 32, 4),),
    96: ((128, 32, 4),),
    128: ((128, 32, 4), (64, 32, 4)),
    192: ((64, 16, 4), (32, 16, 2)),
    256: ((64, 32, 4), (32, 16, 2)),
}
# fp32 (3xTF32) and fp64 (DMMA) tensor-core forward tiles per head dim, (BLOCK_M, BLOCK_N,
# SUB_N, WARPS, DV_TILE), in order of preference as above: fwd_wide.cu computes SUB_N keys
# of each loaded BLOCK_N-key tile at a time, and DV_TILE < D splits the output columns
# over D / DV_TILE CTAs. From the build check (no spills) and shared memory: two 4-warp
# CTAs per H100/H200 SM where they fit (fp64 d = 64: three, fwd_wide.cu MIN_BLOCKS), else
# one of 6-8 warps; then A100's 163 KB; the last entry fits ~100 KB.
# Measured on an H200 (bench/bench_attention.py --tune, N = 16k, non-causal): fp32 d = 64
# (128, 64, 32, 8) 57.9 TFLOP/s against (64, 64, 32, 4) 56.4; d = 128 (128, 64, 32, 8) 58.7
# against (64, 32, 32, 4) 55.1; fp64 d = 128 (128, 16, 16, 8) 38.9 against (128, 16, 8, 8)
# 32.2 and (64, 16, 16, 4) 24.3; fp64 d = 64 (64, 32, 32, 4) 33.2, the best of three then,
# since session 36 (64, 16, 16, 4) with three CTAs an SM (below).
FWD_WIDE_TILES = {
    "float32": {
        32: ((64, 64, 32, 4, 32),),
        64: ((128, 64, 32, 8, 64), (64, 64, 32, 4, 64)),
        96: ((64, 32, 32, 4, 96),),
        128: ((128, 64, 32, 8, 128), (64, 32, 32, 4, 128), (64, 16, 16, 4, 128)),
        # Six or three warps: 192 threads move whole 48-chunk rows (copy.cuh's fast path).
        # 16-key tiles: with 32 the registers spill since the kernels read one parameter
        # struct (build check, NVRTC 12.9 and 13).
        192: ((96, 16, 16, 6, 192), (48, 16, 16, 3, 192)),
        # The 4-warp entry splits the output columns: with all 256 it spilled on sm_80
        # (ptxas' allocation at 255 registers moves with the loaders' address forms).
        256: ((128, 16, 16, 8, 256), (64, 16, 16, 4, 128), (32, 16, 16, 2, 128)),
    },
    "float64": {
        32: ((64, 64, 32, 4, 32),),
        # 16-key tiles of 72 KB: three CTAs an SM on Hopper (fwd_wide.cu MIN_BLOCKS), Q
        # re-read from shared memory. H200, in one process: 34.8 TFLOP/s at N = 1k against
        # 33.1 for (64, 32, 32, 4, 64), two CTAs with Q in registers; equal at 4k, causal
        # 1.01-1.03x (bench/results/h200-2026-12-04-probe-f64-d64-fwd-tiles.log, …-79ac903-ab-…).
        # It fits every GPU the former fallback (32, 32, 16, 2, 64), 89 KB, did.
        64: ((64, 16, 16, 4, 64),),
        96: ((64, 16, 16, 4, 96), (48, 16, 16, 3, 96)),
        # The 2- and 1-warp fallbacks split the output columns further than before the
        # kernels read one parameter struct: with it, their former tiles spilled.
        128: ((128, 16, 16, 8, 128), (64, 16, 8, 4, 128), (32, 8, 8, 2, 64)),
        192: ((64, 16, 8, 4, 96), (32, 8, 8, 2, 96)),
        256: ((64, 8, 8, 4, 128), (32, 8, 8, 2, 128), (16, 8, 8, 1, 32)),
    },
}
# MODE_EXT kernels where the dense tile spills with the options' registers (build check).
FWD_WIDE_EXT_TILES = {
    "float32": {**FWD_WIDE_TILES["float32"],
                192: ((96, 16, 16, 6, 96), (48, 16, 16, 3, 96)),
                256: ((64, 16, 16, 4, 128), (32, 16, 16, 2, 128))},
    "float64": {**FWD_WIDE_TILES["float64"],
                64: ((64, 32, 16, 4, 64), (32, 32, 16, 2, 64)),
                256: ((64, 8, 8, 4, 128), (32, 8, 8, 2, 64), (16, 8, 8, 1, 64))},
}
PORTABLE_SMEM = 99 * 1024
# mods.cuh MODS_SETUP: the option state of a MODE_EXT kernel in static shared memory,
# beside the dynamic tiles (an upper bound of sizeof(Mods)).
MODS_STATIC_SMEM = 256
# fwd_sm90.cu SM90_FWD_Q_SPLIT_SMEM: the most dynamic shared memory of a forward with a
# second Q buffer (sm_90's 227 KB a block less two Mods).
SM90_FWD_Q_SPLIT_SMEM = 232448 - 2 * MODS_STATIC_SMEM


def q_split_chunk_rows(D: int) -> int:
    """fwd_sm90.cu QSplit::CHUNK_ROWS: the fp32 rows of q a TMA copy brings (its box)."""
    return 64 if D <= 64 else 32 if D <= 128 else 16

CPP_TYPE = {"float16": "half_t", "bfloat16": "bfloat16_t", "float32": "float", "float64": "double"}
# dtypes served by the m16n8k16 kernels (fwd_sm80.cu, bwd_sm80.cu); the others by fwd_wide.cu
# and bwd_wide.cu (bwd_simt.cu where those do not fit).
HALF_DTYPES = ("float16", "bfloat16")
MIN_COMPUTE_CAPABILITY = 80   # cp.async, ldmatrix, mma.sync m16n8k16 bf16, DMMA
BUILD_ARCHS = ("sm_80", "sm_90a")


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family: the source its instantiations come from and what they need.

    Every kernel of every family takes the contract's one ``AttnParams``
    (`cupyflash._params`), so launches differ only in what the family asks for here.
    """

    source: str
    arch: str | None = None      # the one NVRTC target it builds and runs on; None: every one
    tensor_maps: bool = False    # reads q, k, v through TMA tensor maps (the host encodes them)
    spill_free: bool = True      # tuned to live in registers for every dtype (the build check refuses spills)
    # Static shared memory of its kernels in every mode (the build check holds ptxas' figure
    # to it); 0: only the MODE_EXT kernels', MODS_STATIC_SMEM.
    static_smem: int = 0


# fwd_sm90.cu keeps two copies of the option state in static shared memory, in dense mode too.
FWD_SM90 = Family("fwd_sm90.cu", arch="sm_90a", tensor_maps=True, static_smem=2 * MODS_STATIC_SMEM)
FWD_SM80 = Family("fwd_sm80.cu")
FWD_WIDE = Family("fwd_wide.cu")
BWD_SM90 = Family("bwd_sm90.cu", arch="sm_90a", tensor_maps=True)
BWD_SM80 = Family("bwd_sm80.cu")
# The fp32/fp64 backward keeps dK and dV of 16 keys per warp at 255 registers and spills a
# few bytes from d = 128 (the tile tables say where): reported, not refused.
BWD_WIDE = Family("bwd_wide.cu", spill_free=False)
BWD_SIMT = Family("bwd_simt.cu", spill_free=False)
BWD_PREP = Family("bwd_prep.cu", spill_free=False)
# The fp32 Hopper kernels' passes before them: q, k, v (the backward's dO too) as fp16
# halves (split_f32.cu: HALVES_ROWS rows a CTA of HALVES_THREADS threads, rows of at most
# HALVES_MAX_COLS; a word a warp of static shared memory). A chunk of HALVES_ROWS rows takes
# its own scale in the forward (kernels_cu/halves.cuh HALVES_CHUNK_ROWS).
HALVES_ROWS = 128
HALVES_THREADS = 512
HALVES_MAX_COLS = 256
HALVES_STAGED_COLS = 128   # the one-pass split stages rows up to this wide (split_f32.cu)
HALVES_STAGED_BYTES = HALVES_ROWS * HALVES_STAGED_COLS * 4
SPLIT_F32 = Family("split_f32.cu", static_smem=HALVES_THREADS // 32 * 4)
HALVES_MAX_PASS = "f32_halves_max"   # the tensors' largest magnitudes (not for chunked scales)


def halves_passes(mode: int, *, chunked: bool = False) -> tuple:
    """The launches before an fp32 Hopper kernel of ``mode`` (split_f32.cu) that write the
    halves (both planes, or for the forward's precision="tf32", MODE_TF32, the high one):
    ``chunked`` (the forward but under varlen), one pass that scales each chunk of rows on
    its own; else the tensors' largest magnitudes, then the halves."""
    planes = 1 if mode & MODE_TF32 else 2
    split = Variant(SPLIT_F32, f"f32_halves<{planes}, {str(chunked).lower()}>", HALVES_THREADS, HALVES_ROWS,
                    HALVES_STAGED_BYTES if chunked else 0)
    return (split,) if chunked else (Variant(SPLIT_F32, HALVES_MAX_PASS, HALVES_THREADS, HALVES_ROWS, 0), split)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel instantiation and its launch shape."""

    family: Family
    name_expression: str
    threads: int
    block_m: int
    smem_bytes: int
    column_passes: int = 1   # CTAs per query block, each computing some output columns
    mode: int = MODE_DENSE
    tile: tuple = ()         # the tile-table entry it was made from
    dq_ld: int = 0           # a key-block kernel's row stride of the dQ workspace; 0: the head dim
    # The head dim D it is instantiated for (a Hopper kernel may serve calls padded to a
    # smaller one: sm90_head_dim); 0 for the element-wise passes, which serve every one.
    head_dim: int = 0
    grads: int = 0           # a key-block kernel's GRADS bits (bwd.cuh)
    splits_q: bool = False   # an fp32 Hopper forward that splits Q into halves itself (fwd_sm90.cu QSplit)

    @property
    def source(self) -> str:
        return self.family.source

    def builds_for(self, arch: str) -> bool:
        return self.family.arch is None or self.family.arch == arch

    @property
    def total_smem(self) -> int:
        return self.smem_bytes + self.static_smem

    @property
    def static_smem(self) -> int:
        """The static shared memory reserved for it (an upper bound; the build check)."""
        return self.family.static_smem or (MODS_STATIC_SMEM if self.mode else 0)


def padded_head_dim(d: int, dv: int) -> int:
    need = max(d, dv)
    for D in HEAD_DIMS:
        if D >= need:
            return D
    raise ValueError(f"head dim {need} exceeds the largest supported ({HEAD_DIMS[-1]})")


def sm90_head_dim(D: int, table: dict) -> int | None:
    """The head dim of the Hopper instantiation in ``table`` (a tile table by head dim)
    that serves calls padded to D: D's own, else the next larger one; None where the
    table has none.

    So d <= 32 runs in the 64 kernels and 64 < d <= 96 in the 128 ones, as any d below
    its instantiation's does: TMA zero-fills the columns past d, and the products over
    them are wasted (a third more at d = 96, twice at 32), yet wgmma on the padded tiles
    beats mma.sync on the exact ones. H200, bf16, one process against the sm80 kernels
    (bench/results/h200-2026-11-29-pad-hopper-ab.log, N = 2k / 8k): backward d = 96
    2.4-3.0x (0.33-0.40x cuDNN before, 0.97-1.06x after), d = 32 1.06-1.22x;
    deterministic 2.6-2.7x and 1.4x; forward d = 96 1.8-2.0x, d = 32 1.09-1.42x; fp32
    (3xTF32) forward d = 96 1.39-1.47x, d = 32 1.09-1.18x but 0.91x causal at N = 1k."""
    return min((E for E in table if E >= D), default=None)


# Each kernel takes the host's figure of its dynamic shared memory as its last template
# argument and static_asserts it against its own layout: the build check (NVRTC, no GPU)
# catches a formula below that drifted from the C++.


def _sm80_forward(dtype_name: str, D: int, tile, mode: int) -> Variant:
    block_m, block_n, warps = tile
    smem = (block_m + 4 * block_n) * (D + 8) * 2   # fwd_sm80.cu FwdTile: Q, K and V twice
    expr = f"flash_fwd_sm80<{CPP_TYPE[dtype_name]}, {D}, {block_m}, {block_n}, {warps}, {mode}, {smem}>"
    return Variant(FWD_SM80, expr, warps * 32, block_m, smem, mode=mode, head_dim=D)


def _sm90_forward(dtype_name: str, D: int, tile, mode: int) -> Variant:
    block_n, consumers, stages = tile
    block_m = 64 * consumers
    f32 = dtype_name == "float32"
    # fwd_sm90.cu Sm90FwdTile: Q (once or twice), then a K tile and a V tile per stage,
    # swizzled, of 16-bit elements (fp32: fp16 halves, two planes each, one with
    # precision="tf32"), with the bias a (block_m, block_n) bias tile per stage (fp32:
    # none); 1024 bytes to align them; then Sm90FwdBarriers (2 Q_BUFFERS + 6 STAGES
    # mbarriers of 8 bytes, then the schedule's STAGES + Q_BUFFERS ints, padded to 8 bytes),
    # fp32's words first (Sm90FwdF32Words: 4 mbarriers, 4 Q_BUFFERS + STAGES + 17 ints,
    # padded to 8 bytes). fp32 in dense mode splits Q itself where a second Q buffer and
    # QSplit's two slots of fp32 rows fit (SM90_FWD_Q_SPLIT_SMEM).
    planes = 2 if f32 and not mode & MODE_TF32 else 1
    bias = stages * block_m * block_n if mode & MODE_BIAS and not f32 else 0

    def smem_bytes(q_buffers: int) -> int:
        pad8 = lambda n: -(-n // 8) * 8   # noqa: E731
        f32_words = 8 * 4 + pad8(4 * (4 * q_buffers + stages + 17)) if f32 else 0
        ring = 2 * q_split_chunk_rows(D) * D * 4 if q_buffers == 2 else 0   # QSplit::RING_BYTES
        return ((planes * (q_buffers * block_m + 2 * stages * block_n) * D + bias) * 2 + ring + 1024
                + f32_words + 8 * (2 * q_buffers + 6 * stages) + pad8(4 * (stages + q_buffers)))

    splits_q = (f32 and mode & ~MODE_TF32 == MODE_DENSE and 96 % (D // 4) == 0   # QSplit::SERVES
                and smem_bytes(2) <= SM90_FWD_Q_SPLIT_SMEM)
    smem = smem_bytes(2 if splits_q else 1)
    expr = f"flash_fwd_sm90<{CPP_TYPE[dtype_name]}, {D}, {block_n}, {consumers}, {stages}, {mode}, {smem}>"
    return Variant(FWD_SM90, expr, (consumers + 1) * 128, block_m, smem, mode=mode, tile=tuple(tile), head_dim=D,
                   splits_q=splits_q)


def _wide_forward(dtype_name: str, D: int, tile, mode: int) -> Variant:
    block_m, block_n, sub_n, warps, dv_tile = tile
    item = np.dtype(dtype_name).itemsize
    # fwd_wide.cu WideFwdTile: Q, and K twice with rows of D + 8; V twice, padded 16 bytes.
    smem = ((block_m + 2 * block_n) * (D + 8) + 2 * block_n * (dv_tile + 16 // item)) * item
    expr = (f"flash_fwd_wide<{CPP_TYPE[dtype_name]}, {D}, {dv_tile}, {block_m}, {block_n}, "
            f"{sub_n}, {warps}, {mode}, {smem}>")
    return Variant(FWD_WIDE, expr, warps * 32, block_m, smem, D // dv_tile, mode, head_dim=D)


def forward_variants(dtype_name: str, D: int, mode: int = MODE_DENSE) -> list[Variant]:
    """Every forward instantiation that may serve (dtype, D, mode), in order of preference."""
    if dtype_name != "float32":
        mode &= ~MODE_TF32   # a policy of fp32 products only
    if dtype_name in HALF_DTYPES:
        table = _FWD_SM90_TABLES[mode]
        E = sm90_head_dim(D, table)
        hopper = [_sm90_forward(dtype_name, E, tile, mode) for tile in table.get(E, ())]
        mode = _one_ext_mode(mode)   # the other families: one kernel for every option
        tiles = (FWD_SM80_EXT_TILES if mode else FWD_SM80_TILES)[D]
        return hopper + [_sm80_forward(dtype_name, D, tile, mode) for tile in tiles]
    hopper = []
    if dtype_name == "float32":
        tables = _FWD_SM90_TF32_TABLES if mode & MODE_TF32 else _FWD_SM90_F32_TABLES
        table = tables.get(mode & ~MODE_TF32, {})
        E = sm90_head_dim(D, table)
        hopper = [_sm90_forward(dtype_name, E, tile, mode) for tile in table.get(E, ())]
    mode = _one_ext_mode(mode & ~MODE_TF32)
    tiles = (FWD_WIDE_EXT_TILES if mode else FWD_WIDE_TILES)[dtype_name][D]
    return hopper + [_wide_forward(dtype_name, D, tile, mode) for tile in tiles]


def forward_variants_for(dtype_name: str, D: int, mods, *, causal: bool, rows: int = 0) -> list[Variant]:
    """forward_variants of the call's mode, less the Hopper option tiles that do not
    suit it: 192-row tiles (three consumers) under a causal or window band, and tiles
    whose query rows a block of the block mask would split (every tile would then need
    the element mask: 192 rows and blocks of 128). In dense mode, with the call's query
    ``rows``, a second Hopper tile that pads them less goes first by ROW_PADDING_SLACK
    (measured for precision="tf32" at d = 64; the option tiles keep their order)."""
    mode = kernel_mode(mods)
    variants = forward_variants(dtype_name, D, mode)
    if rows and mode & ~MODE_TF32 == MODE_DENSE and len(variants) > 1 and variants[1].family is FWD_SM90:
        padded = [-(-rows // v.block_m) * v.block_m for v in variants[:2]]
        if padded[0] > ROW_PADDING_SLACK * padded[1]:
            variants = [variants[1], variants[0], *variants[2:]]

    def suits(v: Variant) -> bool:
        if v.family is not FWD_SM90:
            return True
        options = v.mode & ~MODE_TF32 != MODE_DENSE
        # The dense tiles keep their 192 rows under a causal band (their table's
        # measurements); the option tiles do not.
        if (causal or mods.windowed) and v.block_m > 128 and options:
            return False
        block_q = mods.block_size[0]
        return not options or mods.block_mask is None or v.block_m % block_q == 0 or block_q % v.block_m == 0

    return [v for v in variants if suits(v)]


def all_variants() -> list[Variant]:
    """Every instantiation the package can launch (what the build check compiles)."""
    unique = {}   # the backward's per-dtype kernels serve every head dim
    for name in CPP_TYPE:
        for D in HEAD_DIMS:
            for mode in MODES:
                for v in forward_variants(name, D, mode):
                    unique.setdefault((v.source, v.name_expression), v)
            for mode in BACKWARD_MODES:
                for v in backward_variants(name, D, mode):
                    unique.setdefault((v.source, v.name_expression), v)
            for mode in TF32_MODES if name == "float32" else ():
                for v in forward_variants(name, D, mode):
                    unique.setdefault((v.source, v.name_expression), v)
    for mode in (MODE_DENSE, MODE_TF32):
        for chunked in (False, True):
            for v in halves_passes(mode, chunked=chunked):
                unique.setdefault((v.source, v.name_expression), v)
    return list(unique.values())


def kernel_mode(mods) -> int:
    """The policies a call needs: the dense fast path where no option of ``mods`` is on,
    else MODE_EXT, with MODE_BIAS where it has a bias; MODE_TF32 for precision="tf32"."""
    tf32 = MODE_TF32 if mods.tf32 else 0
    if not mods.active:
        return MODE_DENSE | tf32
    return MODE_EXT | (MODE_BIAS if mods.bias is not None else 0) | tf32


def backward_mode(mods, D: int, deterministic: bool) -> int:
    """kernel_mode for the backward at padded head dim D: MODE_BAND where the options only
    bound the keys a row sees (Modifiers.band_only), or, in the default mode, also leave
    out blocks of scores by a block mask whose blocks are whole tiles of every bwd_sm90.cu
    kernel of D (Modifiers.skips_tiles_only, mask.cuh BLOCKS; the deterministic MODE_BAND
    kernels read no block mask: Sm90BwdKVTile::BAND_BLOCKS); with MODE_ALIBI,
    MODE_SOFTCAP or MODE_DROPOUT where that option is the call's one beyond those
    (Modifiers.dense_path_term). The backward has no precision="tf32"."""
    blocks_fit = mods.block_mask is None or (not deterministic and _blocks_are_sm90_tiles(mods.block_size, D))
    if mods.band_only or (mods.skips_tiles_only and blocks_fit):
        return MODE_BAND
    if mods.dense_path_term and blocks_fit:
        return MODE_BAND | DENSE_PATH_TERMS[mods.dense_path_term]
    return kernel_mode(mods) & ~MODE_TF32


def _one_ext_mode(mode: int) -> int:
    """The mode of a family that keeps no policy apart: MODE_EXT serves every option
    (MODE_BAND's too)."""
    return MODE_EXT if mode else MODE_DENSE


# --------------------------------------------------------------------------- backward
#
# A backward pass is a pre-pass (bwd_prep.cu: the per-row workspaces lse2 and delta), one
# or two key-block launches that write dk and dv, and for dq either additions from the
# key-block kernel into an fp32 (fp64) workspace followed by a scaling/conversion kernel
# (atomics with deterministic=False; on Hopper deterministically too, the key blocks
# taking turns on each dQ tile), or the deterministic query-block kernel.

# Tensor-core backward tiles per head dim, in order of preference; each kernel takes the
# first that fits the device's shared memory. The first entries serve H100/H200 (227 KB
# per block), then A100 (163 KB), the last ~100 KB GPUs (sm_86/sm_89).
# dK/dV kernel, (BLOCK_M, BLOCK_N, WARPS[, HALVES]): query tile, key block, warps (16
# keys or more each; two m-tiles of 16 keys per warp halve the fragment loads per MMA
# where the accumulators allow), and from d = 192, where a warp's dK and dV do not fit its
# registers, the 2 warps that share each 16-key m-tile (half of their columns each,
# S^T and dP^T computed once and traded: one launch, where two launches, dV and then dK,
# computed P twice; 221 KB at (64, 64, 8, 2), d = 256; the A100 and 100 KB fallbacks
# after it). H200, bf16, N = 8192, deterministic/atomic TFLOP/s (2.5x forward
# FLOPs): d = 64 (64, 128, 4) 219/219, (64, 128, 8) 178/168; d = 128 (64, 128, 8) 185/188,
# (64, 64, 4) 198/150; d = 256 (32, 128, 8) 122/141, (64, 64, 4) 97/89.
BWD_SM80_KV_TILES = {
    32: ((64, 128, 4),),
    64: ((64, 128, 4),),
    96: ((64, 64, 4),),
    128: ((64, 128, 8), (32, 64, 4)),
    # The 2-warp fallbacks take 16 queries: with 32 they spill since the kernels read one
    # parameter struct (build check).
    192: ((64, 64, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2)),
    256: ((64, 64, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2)),
}
# Where the tiles share key m-tiles (HALVES above: from d = 192) the 16-bit sm80 path
# computes dQ in its own kernel in both modes (the shares' 64-key CTAs would add it with
# twice the atomics a pair; bwd_sm80.cu static_asserts that they never do). H200, bf16,
# N = 2k / 8k, against the two launches (dV, then dK + dQ) that the shares replaced:
# 1.03-1.10x; the shares adding dQ themselves read 0.86-0.98x (bench/NOTES.md session 29).
BWD_SM80_DQ_KERNEL_MIN_HEAD_DIM = min(D for D, tiles in BWD_SM80_KV_TILES.items() if any(t[3:] > (1,) for t in tiles))
# Deterministic dQ kernel, (BLOCK_M, BLOCK_N, WARPS): query block, key tile, warps (16 rows
# or more each). Same run, whole backward: d = 64 (128, 64, 4) 188, (64, 64, 4) 180;
# d = 256 (128, 32, 8) 106, (64, 64, 4) 98.
BWD_SM80_Q_TILES = {
    32: ((128, 64, 4),),
    64: ((128, 64, 4),),
    96: ((64, 64, 4),),
    128: ((128, 64, 8), (64, 32, 4)),
    192: ((128, 64, 8), (64, 64, 4), (32, 32, 2)),
    256: ((128, 32, 8), (64, 32, 4), (32, 16, 2)),
}
# The option kernels (MODE_EXT) where a tile above spills with the options' registers
# (build check, NVRTC 12.9 and 13; the softcap derivative is kept beside the scores): one
# m-tile per warp for dQ at d = 64, 32-query tiles for dK/dV at d = 64 and 128, smaller
# fallbacks at 192.
BWD_SM80_EXT_KV_TILES = {**BWD_SM80_KV_TILES, 64: ((32, 128, 4),), 128: ((32, 128, 8), (32, 64, 4))}
BWD_SM80_EXT_Q_TILES = {**BWD_SM80_Q_TILES, 64: ((64, 64, 4),),
                        192: ((128, 64, 8), (64, 32, 4), (32, 16, 2))}
# Hopper dK/dV kernel (bwd_sm90.cu, wgmma; sm_90a only), (BLOCK_M, WARPGROUPS): query
# tile, warpgroups of 64 keys each. Ahead of the sm80 tiles above where it builds; other
# head dims and GPUs use those. The options (MODE_EXT) take the same tiles, and so does
# the bias (MODE_EXT | MODE_BIAS: one stage of a 64-query sub-tile's bias beside them;
# the calls it cannot serve, a bias gradient or a bias without whole rows, take the sm80
# kernels: _cuda._plan_backward). From d = 192 the two warpgroups own the same 64 keys
# in two roles (Sm90BwdKVTile::ROLES), dense and with the options but the bias (whose
# stage does not fit beside the roles' trade: those calls take the sm80 kernels). H200,
# bf16, N = 2k / 8k, one process, dense: d = 192
# 3.2-3.5x the sm80 kernels (1.33-1.44x cuDNN), d = 256 3.0-3.3x (1.17-1.28x cuDNN;
# bench/NOTES.md session 29).
BWD_SM90_KV_TILES = {
    64: ((128, 2),),
    128: ((64, 2),),
    192: ((64, 2),),
    256: ((64, 2),),
}
# From this head dim bwd_sm90.cu's warpgroups take the roles (Sm90BwdKVTile::ROLES).
BWD_SM90_ROLES_MIN_HEAD_DIM = 192
# Up to this head dim bwd_sm90.cu has a bias stage (at d = 192 with one Q/dO stage; at 256
# it does not fit beside the roles' trade: such calls run the sm80 kernels).
BWD_SM90_BIAS_MAX_HEAD_DIM = 192
# fp32 in the same kernel on fp16 halves (kernels_cu/halves.cuh; split_f32.cu writes q, k, v
# and dO as high and low planes first), every mode (the bias added in the passes:
# Sm90BwdKVTile::BIAS_IN_ACC), in the roles at every head dim: a warpgroup's dV or dK
# beside its query tile's sum (the tensor cores truncate as they accumulate, so each
# tile's products are added in the FPU). H200, N = 1k / 4k, against bwd_wide.cu (3xTF32
# on mma.sync) in one process (bench/results/h200-2026-11-29-e71a374-ab-fp32-bwd-halves-vs-c5f2190.log):
# d = 64 122 / 152 TFLOP/s (2.6 / 3.1x), causal 88 / 135; d = 128 144 / 178 (3.7 / 4.4x),
# causal 104 / 163; with the options 1.3-5.3x (bench/results/h200-2026-11-30-*-ab-fp32-bwd-*).
BWD_SM90_F32_KV_TILES = {
    64: ((64, 2),),
    128: ((64, 2),),
}


def bwd_sm90_roles(variant: "Variant") -> bool:
    """Whether a bwd_sm90.cu kernel runs its warpgroups in the roles (Sm90BwdKVTile::ROLES:
    from BWD_SM90_ROLES_MIN_HEAD_DIM, and fp32 at every head dim): its key block (the
    variant's block_m) is 64 keys shared, not 64 a warpgroup."""
    return variant.family is BWD_SM90 and variant.block_m < 64 * variant.tile[1]


def bwd_sm90_softcap_dbias(variant: "Variant") -> bool:
    """Whether a bwd_sm90.cu kernel with the bias adds the bias's gradient beside softcap
    (Sm90BwdKVTile::SOFTCAP_DBIAS: in the roles and up to d = 64; where one warpgroup holds
    dK and dV at d = 128 it would spill)."""
    return bwd_sm90_roles(variant) or variant.head_dim <= 64


def _sm90_bwd_tile(D: int, tile) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a BWD_SM90_KV_TILES entry at head dim D: the query tile and
    the key block (64 keys a consumer warpgroup, or with the roles 64 shared)."""
    block_m, consumers = tile
    return block_m, 64 if D >= BWD_SM90_ROLES_MIN_HEAD_DIM else 64 * consumers


def _blocks_are_sm90_tiles(block_size, D: int) -> bool:
    """Whether blocks of ``block_size`` (block_q, block_k) are whole tiles of every
    bwd_sm90.cu kernel serving head dim D, so that its walk skips them and no element
    needs their mask (mask.cuh BLOCKS)."""
    E = sm90_head_dim(D, BWD_SM90_KV_TILES)
    return E is not None and all(block_size[0] % m == 0 and block_size[1] % n == 0
                                 for m, n in (_sm90_bwd_tile(E, t) for t in BWD_SM90_KV_TILES[E]))


def bwd_sm90_splits_units(variant: "Variant") -> bool:
    """Whether a key-block kernel can take the last round's units in pieces (bwd_sm90.cu
    Sm90BwdKVTile::SPLITS: the dense kernels of the default mode below the roles' head
    dims; `sm90_unit_split`)."""
    return (variant.family is BWD_SM90 and variant.mode == MODE_DENSE and not variant.grads & GRAD_DQ_ORDERED
            and not bwd_sm90_roles(variant))


def sm90_unit_split(units: int, ctas: int, pairs: int) -> tuple[int, int]:
    """(whole units, pieces a split unit) of bwd_sm90.cu's persistent backward (Sm90BwdUnits),
    for `units` units of `pairs` (query head, query tile) pairs each on `ctas` CTAs: the
    units of the last round, where fewer are left than CTAs, in the number of pieces
    (equal runs of pairs, each nonempty: the kernel walks pairs [piece * per, ...) with
    per = ceil(pairs / pieces)) that makes that round shortest, counting the rounds of
    pieces it takes and a pair's time of fixed cost a piece; (units, 1) where nothing
    splits."""
    left = units % ctas
    if units <= ctas or left == 0 or pairs < 2:
        return units, 1

    def last_round(pieces):   # in pairs' time
        return -(-left * pieces // ctas) * (-(-pairs // pieces) + (pieces > 1))

    pieces = min(range(1, pairs + 1), key=lambda n: (last_round(n), n))
    if pieces == 1:
        return units, 1
    return units - left, -(-pairs // -(-pairs // pieces))   # as many pieces as runs of per pairs


def bwd_sm90_persistent(variant: "Variant") -> bool:
    """Whether a key-block kernel runs persistent CTAs (bwd_sm90.cu Sm90BwdKVTile::PERSISTENT:
    the lean ones, dense and MODE_BAND), one per SM taking (key block, kv head, batch
    entry) units from a zeroed counter (AttnParams::work_counter); the others run one
    CTA per unit, on a grid of (key blocks, kv heads, batch entries)."""
    return variant.family is BWD_SM90 and lean_mode(variant.mode)


# bwd_sm90.cu's query sub-tile (SUB_M): the rows of its score tiles, and of a bias stage
# (its tensor map's box).
BWD_SM90_SUB_M = 64
BWD_SM90_WALK_SLOTS = 4   # bwd_sm90.cu Sm90BwdKVTile::WALK_SLOTS
# fp32 (3xTF32) and fp64 (DMMA) tensor-core backward (bwd_wide.cu), per dtype and head dim,
# in order of preference as above: the first entries fill H100/H200's 227 KB per block,
# then ~160 KB (A100); where none fits a ~100 KB GPU, device_backward_plan takes the
# CUDA-core kernels. dK/dV kernel, (BLOCK_M, BLOCK_N, WARPS, SLICE, HALVES): query tile,
# key block, warps, queries whose S^T and dP^T are live at once, and the warps that share
# each 16-key m-tile (1, or 2, 4 or 8 where a warp's dK and dV would not fit its
# registers: each holds a share of their columns; S^T and dP^T are computed once, with
# more than 2 shares each in parts of d, and traded). These kernels
# run at ptxas' 255 registers from d = 96 (fp32) or 64 (fp64), and SLICE (8 or 16) is the
# one with the fewest spill bytes under NVRTC 12.9 (build check), except where 16 measured
# faster (fp64 d = 64: 1.08x over 8, whose option kernel spills 12 bytes; d = 96/128, where
# a slice of 16 is the whole query tile and the trading slots share dS's buffer).
# H100, same run as torch (bench/results/h100-2026-11-24-5644760-wide.json), N = 4096:
# fp32 d = 64 49 TFLOP/s (1.40x torch's efficient backward), d = 128 39 (1.08x); fp64
# d = 64 35 (1.55x torch's math backward), d = 128 30 (0.88x; 17 with a dV and a dK launch
# of 4 warps before the halves and the staggered tiles).
BWD_WIDE_KV_TILES = {
    "float32": {
        32: ((64, 128, 8, 16, 1), (32, 64, 4, 16, 1), (16, 64, 4, 16, 1)),
        64: ((64, 128, 8, 16, 1), (32, 64, 4, 16, 1), (16, 64, 4, 16, 1)),
        96: ((32, 128, 8, 8, 1), (16, 64, 4, 8, 1), (16, 32, 2, 8, 1)),
        128: ((32, 128, 8, 8, 1), (16, 64, 4, 8, 1), (16, 32, 2, 8, 1)),
        192: ((16, 64, 8, 16, 2), (16, 32, 4, 16, 2), (16, 16, 2, 16, 2)),
        256: ((16, 64, 8, 16, 2), (16, 32, 4, 16, 2)),
    },
    "float64": {
        32: ((32, 128, 8, 16, 1), (16, 64, 4, 16, 1), (16, 32, 2, 16, 1)),
        64: ((16, 128, 8, 16, 1), (16, 64, 4, 8, 1), (16, 32, 2, 8, 1)),
        96: ((16, 64, 8, 16, 2), (16, 32, 4, 16, 2)),
        128: ((16, 64, 8, 16, 2), (16, 32, 4, 16, 2)),
        # Rows of 1.5-2 KB leave room for 32 keys (d = 192) or 16 (d = 256) beside two
        # query tiles: four warps a 16-key m-tile at d = 192, eight at 256 (1.10-1.11x four,
        # whose CTA has one warp a scheduler: H200, bench/results/h200-2026-11-29-ab-f64-bwd-eight-shares.log).
        192: ((16, 32, 8, 16, 4),),
        256: ((16, 16, 8, 16, 8), (16, 16, 4, 16, 4)),
    },
}
# Deterministic dQ kernel, (BLOCK_M, BLOCK_N, WARPS, SLICE): query block (16 rows per
# warp), key tile, keys whose S and dP are live at once.
BWD_WIDE_Q_TILES = {
    "float32": {
        32: ((128, 64, 8, 16), (64, 32, 4, 16)),
        64: ((128, 64, 8, 16), (64, 32, 4, 16)),
        96: ((128, 32, 8, 16), (64, 16, 4, 16)),
        128: ((128, 32, 8, 16), (64, 16, 4, 16), (32, 16, 2, 16)),
        192: ((64, 32, 4, 8), (32, 16, 2, 8)),
        256: ((64, 16, 4, 16), (32, 16, 2, 16)),
    },
    "float64": {
        32: ((128, 32, 8, 16), (64, 16, 4, 16)),
        64: ((128, 16, 8, 16), (64, 16, 4, 16), (32, 16, 2, 8)),
        96: ((64, 16, 4, 16), (32, 16, 2, 8)),
        128: ((64, 16, 4, 8), (32, 16, 2, 8)),
    },
}
# The CUDA-core kernels (bwd_simt.cu) serve fp32/fp64 where the tensor-core tiles do not
# fit the device (device_backward_plan), and fp64's deterministic dQ from d = 192 (16
# query rows of dQ a warp exceed the registers there): rows (= keys) per tile. fp64 takes
# 32 so that dK and dV (2 * 2 * D / 16 doubles per thread) stay in registers up to d = 256.
BWD_SIMT_BLOCK = {"float32": 64, "float64": 32}
# bwd.cuh: the row workspaces are padded to a multiple of this many rows.
BWD_ROW_PAD = 128
# Bits of the GRADS template argument (bwd.cuh).
GRAD_DV, GRAD_DK, GRAD_DQ, GRAD_DQ_ORDERED = 1, 2, 4, 8
PREP_ROWS = 32         # bwd_prep.cu: rows per CTA of the pre-pass (PREP_THREADS threads)
PREP_THREADS = 128
CONVERT_ELEMS = 1024   # bwd_prep.cu: elements per CTA of the dq conversion


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The launches of one backward pass, each a list of candidate tiles (in order of
    preference; the first that fits the device is used). In a Variant of a key-block
    kernel, ``block_m`` is its key block (the grid's first axis), ``grads`` what it
    computes. dQ comes either from the key-block kernel (added into an fp32 workspace,
    then converted by ``convert``) or from the query-block kernel ``dq``: deterministic
    plans have the second for the candidates that do not add dQ in a fixed order."""

    kv: tuple            # one or two key-block launches, each (GRADS bits every candidate has, [Variant, ...])
    dq: list | None      # the deterministic dQ kernel; None: every candidate adds dQ
    prep: Variant
    convert: Variant


def _sm80_dkdv(dtype_name: str, D: int, tile, grads: int, mode: int) -> Variant:
    block_m, block_n, warps = tile[:3]
    halves = tile[3] if len(tile) > 3 else 1
    ld = D + 8
    dk, dq = bool(grads & GRAD_DK), bool(grads & GRAD_DQ)
    # bwd_sm80.cu BwdKVTile: K, V (with dK), Q and dO twice, dS^T (with dQ); lse2 (and
    # delta) twice; the shares' trading slots (a 16-query slice's S^T or dP^T a warp).
    slice_ = 16 if block_m < 32 or D > 128 or block_n // (warps // halves) > 16 else 32   # BwdKVTile::SLICE
    trade = warps * (block_n // (warps // halves)) * slice_ if halves > 1 else 0
    elems = block_n * ld * (1 + dk) + 4 * block_m * ld + dq * block_n * (block_m + 8)
    smem = elems * 2 + ((4 if dk else 2) * block_m + trade) * 4
    expr = (f"flash_bwd_dkdv_sm80<{CPP_TYPE[dtype_name]}, {D}, {block_m}, {block_n}, {warps}, {grads}, {halves}, "
            f"{mode}, {smem}>")
    return Variant(BWD_SM80, expr, warps * 32, block_n, smem, mode=mode, tile=tuple(tile), grads=grads, head_dim=D)


def sm90_rows_box(block_m: int) -> int:
    """The rows of bwd_sm90.cu's lse2/delta box (Sm90BwdKVTile::ROWS_BOX): a query tile's,
    and 4 more, the box starting at a 16-byte aligned row."""
    return block_m + 4


def _sm90_rows_ld(block_m: int) -> int:
    return -(-sm90_rows_box(block_m) // 32) * 32   # Sm90BwdKVTile::ROWS_LD


def _sm90_dkdv(dtype_name: str, D: int, tile, grads: int, mode: int) -> Variant:
    consumers = tile[1]
    f32 = dtype_name == "float32"   # fp16 halves, two planes a tile, the roles at every head dim
    planes = 2 if f32 else 1
    # Sm90BwdKVTile::ROLES: both warpgroups on the same 64 keys
    roles = D >= BWD_SM90_ROLES_MIN_HEAD_DIM or f32
    block_m, block_n = tile[0], 64 if roles else 64 * consumers
    assert grads & GRAD_DQ, "bwd_sm90.cu adds dQ in both modes"
    bias = bool(mode & MODE_BIAS)
    assert not bias or D <= BWD_SM90_BIAS_MAX_HEAD_DIM, "no bias stage at d = 256"
    stages = 1 if roles and (D > 192 or (f32 and D > 64) or (bias and D > 128)) else 2
    ds_buffers, trade = (1, block_n * BWD_SM90_SUB_M) if roles else (2, 0)
    # bwd_sm90.cu Sm90BwdKVTile: K, V, Q and dO per stage, dS^T (DS_BUFFERS), the bias of
    # a sub-tile of BWD_SM90_SUB_M queries (MODE_BIAS, in the inputs' dtype), swizzled; the
    # staged fp32 dQ tile with rows of D + 8; the roles' fp32 P^T; a tile's lse2 and delta
    # rows a stage; the dropout exchange (two words a consumer thread, DROP_PAIR_WORDS;
    # with dropout); 1024 bytes to align the tiles; Sm90BwdBarriers (11 + 2 STAGES mbarriers of 8 bytes, two
    # unit words, a 16-byte Sm90BwdTileInfo a stage; the walk's ring: two mbarriers and a
    # tile info a slot, Sm90BwdKVTile::WALK_SLOTS; the consumers' split unit and a pad word).
    bias_bytes = BWD_SM90_SUB_M * block_n * (4 if f32 else 2) if bias else 0
    drop_pairs = 0 if lean_mode(mode) and not mode & MODE_DROPOUT else 2 * consumers * 128
    smem = ((2 * block_n * D + 2 * stages * block_m * D + ds_buffers * block_n * block_m) * planes * 2 + bias_bytes
            + (block_m * (D + 8) + trade + 2 * stages * _sm90_rows_ld(block_m) + drop_pairs) * 4 + 1024 + 8 * (12 + 2 * stages)
            + 16 * stages + (2 * 8 + 16) * BWD_SM90_WALK_SLOTS + 8)
    expr = f"flash_bwd_dkdv_sm90<{CPP_TYPE[dtype_name]}, {D}, {block_m}, {consumers}, {grads}, {mode}, {smem}>"
    # + the producer warpgroup; the dQ workspace's rows padded as the staged tile's (DQ_LD)
    return Variant(BWD_SM90, expr, (consumers + 1) * 128, block_n, smem, mode=mode, tile=tuple(tile),
                   dq_ld=D + 8, grads=grads, head_dim=D)


def _sm80_dq(dtype_name: str, D: int, tile, mode: int) -> Variant:
    block_m, block_n, warps = tile
    smem = (2 * block_m + 4 * block_n) * (D + 8) * 2   # bwd_sm80.cu BwdQTile: Q, dO, K and V twice
    expr = f"flash_bwd_dq_sm80<{CPP_TYPE[dtype_name]}, {D}, {block_m}, {block_n}, {warps}, {mode}, {smem}>"
    return Variant(BWD_SM80, expr, warps * 32, block_m, smem, mode=mode, head_dim=D)


def _both_ways_elems(dtype_name: str, rows: int, cols: int) -> int:
    """Elements of a rows x cols tile laid out as mma_wide.cuh BothWaysRows: rows of
    cols + 8, and for fp64 (PairRowsStaggered) 12 more elements per group of 8 rows."""
    return rows * (cols + 8) + (rows // 8 * 12 if dtype_name == "float64" else 0)


def _wide_dkdv(dtype_name: str, D: int, tile, grads: int, mode: int) -> Variant:
    block_m, block_n, warps, slice_, halves = tile
    dk, dq = bool(grads & GRAD_DK), bool(grads & GRAD_DQ)
    # bwd_wide.cu WideBwdKVTile: K, V (with dK), Q and dO twice, dS (with dQ), the halves'
    # trading slots (a slice's S^T or dP^T per warp; in dS's buffer with one slice a tile);
    # lse2 (and delta) twice.
    trade = warps * (block_n // (warps // halves)) * slice_ if halves > 1 else 0
    ds = dq * _both_ways_elems(dtype_name, block_m, block_n)
    ds_trade = max(ds, trade) if halves > 1 and slice_ == block_m else ds + trade
    elems = (_both_ways_elems(dtype_name, block_n, D) * (1 + dk) + 4 * _both_ways_elems(dtype_name, block_m, D)
             + ds_trade + (4 if dk else 2) * block_m)
    smem = elems * np.dtype(dtype_name).itemsize
    expr = (f"flash_bwd_dkdv_wide<{CPP_TYPE[dtype_name]}, {D}, {block_m}, {block_n}, {warps}, {slice_}, "
            f"{grads}, {halves}, {mode}, {smem}>")
    # fp64 dQ staged for bulk reductions at d = 128: the workspace's rows padded as the
    # staged tile's (WideBwdKVTile::STAGED_DQ, DQ_LD).
    dq_ld = D + 2 if dtype_name == "float64" and dq and halves > 1 and D >= 128 else 0
    return Variant(BWD_WIDE, expr, warps * 32, block_n, smem, mode=mode, tile=tuple(tile), grads=grads, dq_ld=dq_ld,
                   head_dim=D)


def _wide_dq(dtype_name: str, D: int, tile, mode: int) -> Variant:
    block_m, block_n, warps, slice_ = tile
    # bwd_wide.cu WideBwdQTile: Q, dO, K and V twice.
    elems = 2 * _both_ways_elems(dtype_name, block_m, D) + 4 * _both_ways_elems(dtype_name, block_n, D)
    smem = elems * np.dtype(dtype_name).itemsize
    expr = f"flash_bwd_dq_wide<{CPP_TYPE[dtype_name]}, {D}, {block_m}, {block_n}, {warps}, {slice_}, {mode}, {smem}>"
    return Variant(BWD_WIDE, expr, warps * 32, block_m, smem, mode=mode, head_dim=D)


def _simt_backward(dtype_name: str, D: int, kernel: str, grads: int | None, mode: int) -> Variant:
    block = BWD_SIMT_BLOCK[dtype_name]
    smem = (4 * block * 33 + 2 * block * (block + 1)) * np.dtype(dtype_name).itemsize   # BwdSimtTile
    targs = f"{CPP_TYPE[dtype_name]}, {D}, {block}" + ("" if grads is None else f", {grads}") + f", {mode}, {smem}"
    return Variant(BWD_SIMT, f"{kernel}<{targs}>", 256, block, smem, mode=mode, grads=grads or 0, head_dim=D)


def backward_plan(dtype_name: str, D: int, deterministic: bool, mode: int = MODE_DENSE,
                  cuda_cores: bool = False) -> BackwardPlan:
    """The kernels of a backward pass for (dtype, padded head dim D, mode); for fp32/fp64,
    ``cuda_cores`` asks for the CUDA-core kernels instead of the tensor cores' (the
    fallback of `device_backward_plan`)."""
    # bwd_sm90.cu keeps the bias apart (MODE_EXT | MODE_BIAS: a bias stage), as
    # fwd_sm90.cu, and runs the band options on its dense path (MODE_BAND); the other
    # families compile every option into MODE_EXT. The backward computes fp32 at fp32
    # accuracy whatever the precision (MODE_TF32).
    mode &= ~MODE_TF32
    hopper_mode, mode = mode, _one_ext_mode(mode)
    ctype = CPP_TYPE[dtype_name]
    dq_bit = 0 if deterministic else GRAD_DQ
    # The Hopper kernel adds dQ in both modes: deterministically, the key blocks take
    # turns on each dQ tile (bwd.cuh DqTurns).
    sm90_dq_bits = GRAD_DQ | (GRAD_DQ_ORDERED if deterministic else 0)
    prep = Variant(BWD_PREP, f"flash_bwd_prep<{ctype}>", PREP_THREADS, PREP_ROWS, 0)
    convert = Variant(BWD_PREP, f"flash_bwd_dq_convert<{ctype}>", 256, CONVERT_ELEMS, 0)
    if dtype_name in HALF_DTYPES:
        # The sm80 key-block kernel's shares leave dQ to the dQ kernel in both modes
        # (BWD_SM80_DQ_KERNEL_MIN_HEAD_DIM).
        dq_kernel = deterministic or D >= BWD_SM80_DQ_KERNEL_MIN_HEAD_DIM
        grads = GRAD_DV | GRAD_DK | (0 if dq_kernel else GRAD_DQ)
        E = sm90_head_dim(D, BWD_SM90_KV_TILES)
        tiles = (BWD_SM80_EXT_KV_TILES if mode else BWD_SM80_KV_TILES)[D]
        hopper = E is not None and (E <= BWD_SM90_BIAS_MAX_HEAD_DIM or not hopper_mode & MODE_BIAS)
        kv = ((grads, [*(_sm90_dkdv(dtype_name, E, t, grads | sm90_dq_bits, hopper_mode)
                         for t in (BWD_SM90_KV_TILES[E] if hopper else ())),
                       *(_sm80_dkdv(dtype_name, D, t, grads, mode) for t in tiles)]),)
        q_tiles = (BWD_SM80_EXT_Q_TILES if mode else BWD_SM80_Q_TILES)[D]
        dq = [_sm80_dq(dtype_name, D, t, mode) for t in q_tiles] if dq_kernel else None
    elif D in BWD_WIDE_KV_TILES[dtype_name] and not cuda_cores:
        grads = GRAD_DV | GRAD_DK | dq_bit
        # fp32 on Hopper: bwd_sm90.cu over fp16 halves first (it adds dQ in both modes, as
        # for 16-bit inputs).
        E = sm90_head_dim(D, BWD_SM90_F32_KV_TILES) if dtype_name == "float32" else None
        hopper = E is not None
        kv = ((grads, [*(_sm90_dkdv(dtype_name, E, t, GRAD_DV | GRAD_DK | sm90_dq_bits, hopper_mode)
                         for t in (BWD_SM90_F32_KV_TILES[E] if hopper else ())),
                       *(_wide_dkdv(dtype_name, D, t, grads, mode) for t in BWD_WIDE_KV_TILES[dtype_name][D])]),)
        dq = None
        if deterministic:
            dq = ([_wide_dq(dtype_name, D, t, mode) for t in BWD_WIDE_Q_TILES[dtype_name].get(D, ())]
                  or [_simt_backward(dtype_name, D, "flash_bwd_dq_simt", None, mode)])
    else:
        grads = GRAD_DV | GRAD_DK | dq_bit
        kv = ((grads, [_simt_backward(dtype_name, D, "flash_bwd_dkdv_simt", grads, mode)]),)
        dq = [_simt_backward(dtype_name, D, "flash_bwd_dq_simt", None, mode)] if deterministic else None
    return BackwardPlan(kv=kv, dq=dq, prep=prep, convert=convert)


def _plan_variants(plan: BackwardPlan) -> list[Variant]:
    return [v for v in (plan.prep, plan.convert, *(v for _, launch in plan.kv for v in launch), *(plan.dq or ()))
            if v is not None]


def backward_variants(dtype_name: str, D: int, mode: int = MODE_DENSE) -> list[Variant]:
    """Every backward instantiation that may serve (dtype, D, mode): both determinism
    modes, and the CUDA-core plan where device_backward_plan can fall back to it (a launch
    whose last tile needs more than a ~100 KB GPU has)."""
    seen = {}
    for deterministic in (True, False):
        plan = backward_plan(dtype_name, D, deterministic, mode)
        variants = _plan_variants(plan)
        launches = [c for _, c in plan.kv] + ([plan.dq] if plan.dq else [])
        if any(c[-1].total_smem > PORTABLE_SMEM for c in launches):
            variants += _plan_variants(backward_plan(dtype_name, D, deterministic, mode, cuda_cores=True))
        for v in variants:
            seen.setdefault(v.name_expression, v)
    return list(seen.values())
