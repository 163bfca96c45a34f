// Backward attention's key-block kernel on Hopper (sm_90a, fp16/bf16, and fp32 below;
// dense, dense with the options that only bound the keys a row sees (MODE_BAND, mods.cuh:
// a window, varlen, key padding, a block mask of whole tiles) and one of ALiBi, softcap or
// dropout beside them (MODE_ALIBI, MODE_SOFTCAP, MODE_DROPOUT), every option (MODE_EXT),
// and the bias with them (MODE_EXT | MODE_BIAS)):
// warp-specialised, the tiles moved by the tensor memory accelerator, the products on
// warpgroup MMA, dQ added into its fp32 workspace by bulk reductions.
//
// A CTA owns BLOCK_N = 64 CONSUMERS keys of one kv head at a time, a unit, and walks the
// (query head, query tile) pairs that see them (bwd.cuh KeyBlockPairs); the dense kernels'
// CTAs are persistent, taking one unit after another (Sm90BwdUnits), so that the next
// unit's K, V and first tiles load while the last one's dK and dV are written (the lean
// kernels, dense and MODE_BAND with or without one of those terms, C::LEAN below, are
// the dense ones here). It has
// CONSUMERS + 1 warpgroups:
//   consumers (warpgroups 0 .. CONSUMERS-1, 64 keys each): per query tile of BLOCK_M rows
//     S^T  = K Q^T      A: K (K-major, its 64 rows)   B: Q  (K-major)        wgmma ss
//     dP^T = V dO^T     A: V (K-major)                B: dO (K-major)        wgmma ss
//     P^T = exp2(S^T scale log2 e - lse2), dS^T = P^T o (dP^T - delta)   (bwd.cuh, in registers;
//       the options' terms in the same passes, softcap's in one pass once dP^T is in;
//       their mask and dropout as a bit per score, worked out while the products run)
//     dV  += P^T dO     A: P^T (registers)            B: dO (MN-major)       wgmma rs
//     dK  += dS^T Q     A: dS^T (registers)           B: Q  (MN-major)       wgmma rs
//   with dK and dV in registers for the whole key block. The transposed products put the
//   keys on the accumulator rows, so P^T and dS^T come out of their C fragments directly
//   as the A operands of the next products (wgmma.cuh: each warp holds 16 rows in the
//   mma.sync layout). They also write dS^T into shared memory (two buffers, so one
//   consumer barrier per tile suffices) and compute dQ = dS K over all BLOCK_N keys, the BLOCK_M x D tile split into one
//   64 x DQ_N piece per warpgroup (A: dS^T read MN-major, i.e. transposed; B: K,
//   MN-major), issued at the start of the next tile ahead of its S^T, and stage it in
//   fp32 in shared memory;
//   producer (the last warpgroup): its walker warp (Sm90BwdKVTile::WALKER) walks the
//     unit's pairs and publishes each visited tile (Sm90BwdTileInfo: head, rows, which
//     sub-tiles need the mask, the unit's last tile) in a ring that the other producer
//     roles read; its first warp loads a unit's K and V and streams each tile's Q and dO,
//     its lse2 and delta rows (TMA, AttnParams::rows_map) and its Sm90BwdTileInfo through
//     STAGES stages, each guarded by a "full" mbarrier and an "empty" one (every consumer
//     warp has finished reading it); its second warp adds each staged dQ tile into the dQ workspace with one bulk reduction
//     (cp.reduce.async.bulk; the workspace's rows are padded like the staging tile's, so
//     a tile is one contiguous range) and hands the staging buffer back once the copy
//     engine has read it; its third warp (MODE_BIAS) streams the bias of each sub-tile,
//     SUB_M queries x the block's keys as the bias lies in memory, through one stage (two
//     do not fit beside dS^T and dQ). The consumers start S^T's accumulator from it
//     (bias^T / scale, read by ldmatrix.trans: bwd.cuh KeyRowBias) and give the stage
//     back at once, so the next sub-tile's bias loads while this one's products run;
//     with softcap, which caps the product alone, and for fp32 (BIAS_IN_ACC) the passes
//     add it and give the stage back after them.
// From d = 192, where one warpgroup's dK and dV do not fit its registers, the two consumer
// warpgroups own the same 64 keys in two roles (Sm90BwdKVTile::ROLES, Sm90BwdRole): one
// computes S^T, P^T and dV, the other dP^T, dS^T and dK, P^T passing between them through
// shared memory; each finishes a tile's dQ product of its columns before the next tile's
// products, so one dS^T buffer serves, and d = 256 fits one Q/dO stage.
// fp32 (T = float, every mode; the passes add the bias: BIAS_IN_ACC) runs on fp16 halves, as
// fwd_sm90.cu does (halves.cuh: q, k, v and dO scaled by powers of two and split by
// split_f32.cu into high and low planes, which TMA brings as the planes of each tile), each
// product as three fp16 products, in the roles at every head dim (a warpgroup's dV or dK
// and its tile's sum: the tensor cores truncate as they accumulate, so each query tile's
// dV and dK products are summed from zero and added in the FPU, which needs the second
// set of registers). P^T goes in scaled by P_SCALE, dS^T by a power of two below its
// bound 2 d max|dO| max|V| (ds_scale), both split in registers; dQ is unscaled before its
// reduction, dK and dV as they are stored, from the registers.
// So the consumers issue no atomics (but the bias gradient's, where a call asks for it), no
// loads from global memory and no walk of the pairs:
// the mainloop is their products and the softmax's gradient. In the deterministic mode (GRAD_DQ_ORDERED)
// the key blocks take turns on each dQ tile in a fixed order (bwd.cuh DqTurns): the
// dQ writer waits for the tile's turn and waits for its reduction to complete before it
// passes the turn on (the dense d = 128 kernel has two writers taking the tiles in turn,
// Sm90BwdKVTile::DQ_WRITERS; where a head's blocks all fit the CTAs at once, their walks
// start staggered, DqTurns::ahead_rotated).
// All operand tiles use the 128-byte-swizzled layout (wgmma.cuh Swizzle128): TMA's
// boxes of 64 columns land as its panels.
#include "elem.cuh"
#include "copy.cuh"
#include "halves.cuh"
#include "mods.cuh"
#include "tensor.cuh"
#include "tma.cuh"
#include "warp_mm.cuh"
#include "wgmma.cuh"
#include "bwd.cuh"

// A visited query tile of a unit, as the walker publishes it (Sm90BwdKVTile::WALKER) and
// the producer passes it on to the consumers with the tile's stage, so that no other role
// walks the pairs or tests mask bounds (a block-mask walk per tile was ~600 instructions
// a consumer warp: ncu at 65a9d89, block density 1, d = 64; the band's test of each
// sub-tile, on the option state in shared memory, ~5% of the option kernels' stall
// samples at e81debe; and with a sparse block mask each walker's chain of dependent mask
// reads fell behind the consumers).
struct Sm90BwdTileInfo {
    enum { LAST = 1,           // the unit's last tile
           MASKED = 2 };       // MASKED << sub: sub-tile sub needs the elementwise mask
                               // (MaskInfo::tile_needs_mask)
    int h, q0;                 // the pair's query head and first query row
    int flags;
    int it;                    // the pair's place in the walk (the rotated dQ turns)

    // Written by one lane with atomics, read with plain loads by every lane of the reader
    // warps: mbarriers order them, which racecheck does not follow (plain writes were
    // reported as hazards), and atomics it leaves alone. (Reading with atomics too, lane 0
    // then a shuffle, cost the option kernels 5-12%: h100 2026-11-25 A/B at 4013483.)
    __device__ __forceinline__ void publish(const Sm90BwdTileInfo& v) {
        atomicExch(&h, v.h);
        atomicExch(&q0, v.q0);
        atomicExch(&flags, v.flags);
        atomicExch(&it, v.it);
    }
    __device__ __forceinline__ static int ld(const int* p) {   // kept after the mbarrier wait before it
        int v;
        asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr(p)) : "memory");
        return v;
    }
    __device__ __forceinline__ Sm90BwdTileInfo read() {
        return {ld(&h), ld(&q0), ld(&flags), ld(&it)};
    }
    // The consumers read the flags where they use them, not once a tile: held in registers
    // across the tile they spilled the bias kernels at d = 128 (build check).
    __device__ __forceinline__ bool has(int flag) { return (ld(&flags) & flag) != 0; }
};

// The pipeline's mbarriers, after the tiles in shared memory.
template <int STAGES, int WALK_SLOTS>
struct Sm90BwdBarriers {
    u64 kv_full;                        // a unit's K and V
    u64 full[STAGES], empty[STAGES];    // a query tile's Q and dO
    u64 dq_full[2], dq_empty;           // the staged dQ tile: written (full[the tile's writer]) / read by
                                        // the copy engine
    u64 bias_full, bias_empty;          // a sub-tile's bias (MODE_BIAS)
    u64 kv_empty;                       // the consumers are done with K and V (a unit's last dQ product)
    u64 unit_full[2], unit_empty[2];    // a unit's number, published in unit[k % 2] (Sm90BwdUnits)
    int unit[2];
    Sm90BwdTileInfo tile[STAGES];       // each stage's query tile
    u64 walk_full[WALK_SLOTS], walk_empty[WALK_SLOTS];   // the walk's ring (Sm90BwdKVTile::WALKER)
    Sm90BwdTileInfo walk[WALK_SLOTS];
    int consumers_split, unused;        // the consumers' unit: its index among the split units, or -1
};

template <typename T, int D, int BLOCK_M, int CONSUMERS, int GRADS, int MODE>
struct Sm90BwdKVTile {
    // From d = 192 a warpgroup's dK and dV of 64 keys (2 D registers a thread) exceed the
    // registers: there the two consumer warpgroups own the same 64 keys in two roles
    // (Sm90BwdRole). The dV role computes S^T, P^T and dV += P^T dO; the dK role dP^T,
    // dS^T (with P^T from the dV role, traded through shared memory in fp32) and dK +=
    // dS^T Q; each adds its columns of dQ. So every product is still computed once. With
    // the options (the bias up to d = 192, with one Q/dO stage there: at d = 256 its stage
    // does not fit beside the trade) the dV role
    // trades S^T as computed, and each role runs the options' passes on it: the dV role
    // for the P that multiplies dO, the dK role for dS (softcap's derivative needs S).
    // fp32 (above): fp16 halves in PLANES planes, PRODUCTS products a product, the roles at
    // every head dim.
    static constexpr bool F32 = sizeof(T) == 4;
    typedef typename HalvesOf<T>::type E;   // the tiles' elements
    static constexpr int PLANES = F32 ? 2 : 1, PRODUCTS = F32 ? 3 : 1;
    static constexpr bool ROLES = D > 128 || F32;
    // Q and dO stages: at d = 256 one (the tiles, the trade and the dQ tile take the rest:
    // FlashAttention-3 keeps one there too), its next tile loading while the consumers'
    // dQ products run; fp32's two planes from d = 128 one too, and d = 192 with the bias
    // (its stage beside the trade; at d = 256 there is no room for it).
    static constexpr int STAGES = ROLES && (D > 192 || (F32 && D > 64) || ((MODE & MODE_BIAS) && D > 128)) ? 1 : 2;
    // fp32: P^T's scale before it is split (P <= 1 from the exact LSE; 2^13 leaves room for
    // the forward's rounding) and dS^T's (ds_scale).
    static constexpr float P_SCALE = F32 ? 8192.f : 1.f;
    // Named barrier of the consumers alone (0 is __syncthreads').
    static constexpr int CONSUMER_BARRIER = 1;
    static constexpr int CONSUMER_THREADS = CONSUMERS * 128;
    static constexpr int THREADS = CONSUMER_THREADS + 128;   // + the producer warpgroup
    static constexpr int BLOCK_N = ROLES ? 64 : CONSUMERS * 64;
    // The roles' trade: the dV role has written a tile's P^T (named barrier of both roles).
    // Both wait there: with the dV role only arriving (bar.arrive), racecheck reported
    // write-after-write hazards between the dK role's dQ staging and the dV role's
    // epilogue in the one-stage kernel (d = 256), none with both waiting (H200, 2026-11-29).
    static constexpr int TRADE_BARRIER = 3;
    // Dropout's draws split between the two warps of a pair, w and w ^ 1 (philox.cuh
    // WarpPair: the keys 16 apart share each Philox call), in the kernels with dropout: each
    // warp writes the other's bits into the pair's slots and both meet at the pair's named
    // barrier (DROP_PAIR_BARRIER0 + w / 2). Two slots, alternating per sub-tile: a warp
    // writes a slot again only after the next barrier, which the other passes once it has
    // read it.
    static constexpr int DROP_PAIR_BARRIER0 = 4;
    // The query tile is computed in sub-tiles of SUB_M queries (S^T, dP^T, P^T, dS^T of a
    // whole 128-query tile would not fit the registers beside dK and dV at d = 64).
    static constexpr int SUB_M = 64;
    static constexpr int SUBTILES = BLOCK_M / SUB_M;
    static constexpr int QT = SUB_M / 8;             // query n-tiles of a sub-tile's S^T, dP^T per warp
    static constexpr int DT = D / 8;                 // n-tiles of dK, dV per warp
    static constexpr int KSTEPS = D / 16;            // k-steps of K Q^T and V dO^T (16-bit elements)
    static constexpr int QSTEPS = SUB_M / 16;        // k-steps of a sub-tile's P^T dO and dS^T Q
    static constexpr int NSTEPS = BLOCK_N / 16;      // k-steps of dS K
    static constexpr int PANEL = 64;                 // columns per TMA box (128 bytes, the swizzle span)
    static constexpr bool ORDERED_DQ = GRADS & GRAD_DQ_ORDERED;   // deterministic dQ (bwd.cuh DqTurns)
    // The dense path (MODE_DENSE, or MODE_BAND: the mask's band on it, mods.cuh): the
    // option state in registers, persistent CTAs, the passes without the options' terms.
    static constexpr bool LEAN = lean_mode(MODE);
    // MODE_BAND takes block masks of whole tiles (mask.cuh BLOCKS) in the default mode. Not
    // in the deterministic one, whose dQ writers have no registers for the mask's reads
    // (NVRTC 13 build check: 76 bytes spilled at 40 a thread, and at 48 the consumers spill):
    // the host sends those calls to the option kernels (cupyflash/_kernels.py backward_mode).
    static constexpr bool BAND_BLOCKS = (MODE & MODE_BAND) != 0 && !ORDERED_DQ;
    static constexpr bool BIAS = (MODE & MODE_BIAS) != 0;
    // The dense path with softcap (MODE_SOFTCAP, mods.cuh): the option kernels' one pass for
    // P and dS. Alone: with ALiBi or dropout too such calls take the option kernels.
    static constexpr bool LEAN_SOFTCAP = LEAN && (MODE & MODE_SOFTCAP) != 0;
    // Dropout on the dense path (MODE_DROPOUT): the option kernels' draws and selects.
    static constexpr bool LEAN_DROPOUT = LEAN && (MODE & MODE_DROPOUT) != 0;
    static_assert(((MODE & MODE_ALIBI) != 0) + LEAN_SOFTCAP + LEAN_DROPOUT <= 1,
                  "one of ALiBi, softcap and dropout on the dense path");
    // Softcap with a bias: softcap's pass adds the bias from its stage (bwd.cuh
    // KeyRowBias). In the deterministic kernels those reads spill (8 bytes at d = 64, 28
    // at d = 128 with the consumers' 224 registers, build check): the host sends such
    // calls to the sm80 kernels (cupyflash/_cuda.py _sm90_backward_map_specs).
    static constexpr bool SOFTCAP_BIAS = BIAS && !ORDERED_DQ;
    // Whether the kernel serves softcap at all: its pass is compiled out of the
    // deterministic bias kernels, which never get it (their consumers spilled in it at
    // d = 128 once the producer described the tiles: 24 bytes, build check).
    static constexpr bool SOFTCAP = !BIAS || SOFTCAP_BIAS;
    // The bias gradient within softcap's pass (bwd.cuh DbiasAdder): not where one warpgroup
    // holds dK and dV at d = 128, whose consumers then spilled 216 bytes (build check); the
    // host sends such calls to the sm80 kernels (cupyflash/_kernels.py bwd_sm90_softcap_dbias).
    static constexpr bool SOFTCAP_DBIAS = SOFTCAP_BIAS && (ROLES || D <= 64);
    // With the options, tiles that no mask or dropout touches take passes without the
    // selects (bwd.cuh BITS), but in the d = 128 kernels with the bias, where the second
    // copy of the passes spills (deterministic: 48 bytes; since the producer describes
    // the tiles, 4 bytes in the other too: NVRTC 12.9 build check), nor in the
    // deterministic option kernels of the roles at d = 256 (8 bytes).
    static constexpr bool SELECT_FREE_TILES = (D <= 64 || !BIAS) && !(ROLES && ORDERED_DQ && D > 192);
    // The warpgroup index as the compiler can see it is warp-uniform (wgmma.cuh
    // warp_uniform), so that the descriptors stay in uniform registers, where that does not
    // spill (NVRTC 12.9, build check): not in the option kernels at d = 128 with the bias
    // or ordered dQ (232 or 224 registers a consumer thread). (A query pair's lse2 and
    // delta as one 8-byte load and dS^T stored by stmatrix, once also limited to some
    // kernels, fit every kernel since the producer describes the tiles.)
    static constexpr bool UNIFORM_WG = D <= 64 || LEAN || !(BIAS || ORDERED_DQ);
    // dQ's BLOCK_M x D tile in one 64 x DQ_N piece per warpgroup: DQ_COLS pieces across
    // (with the roles, Sm90BwdRole's columns).
    static constexpr int DQ_N = BLOCK_M * D / (64 * CONSUMERS);
    static constexpr int DQ_COLS = D / DQ_N;
    // The staged dQ tile's rows, in floats: 8 past D, so that a warp's two-float writes
    // (8 rows x 4 column pairs) fall into distinct banks; a multiple of 4 (16-byte rows).
    // The dQ workspace's rows have the same stride (the host pads them: dq_ld), so that a
    // tile goes there in one bulk reduction.
    static constexpr int DQ_LD = D + 8;
    // Shared memory (cupyflash/_kernels.py mirrors it), from a 1024-byte aligned base: K, V,
    // Q x STAGES, dO x STAGES, dS^T x 2 (with dQ), a sub-tile's bias (MODE_BIAS), each a
    // multiple of 1024 bytes; the staged dQ tile (fp32, with dQ); a tile's lse2 and delta
    // rows, one buffer a stage; the barriers.
    // A plane's elements (the planes of a tile follow one another).
    static constexpr int KV_ELEMS = BLOCK_N * D, QO_ELEMS = BLOCK_M * D;
    static constexpr int DS_ELEMS = BLOCK_N * BLOCK_M;
    // dS^T buffers: two, so that the next tile's dS^T goes to the other while the dQ
    // products, issued ahead of its S^T, read this one; with the roles, whose dQ products
    // complete before the next tile's S^T (their registers), one.
    static constexpr int DS_BUFFERS = ROLES ? 1 : 2;
    static constexpr int TRADE_FLOATS = ROLES ? BLOCK_N * SUB_M : 0;   // a sub-tile's P^T (the roles)
    static constexpr int DROP_PAIR_WORDS = LEAN && !LEAN_DROPOUT ? 0 : 2 * CONSUMER_THREADS;   // two slots (DROP_PAIR_BARRIER0)
    static constexpr int BIAS_ELEMS = BIAS ? SUB_M * BLOCK_N : 0;
    static constexpr u32 BIAS_BYTES = BIAS_ELEMS * sizeof(T);
    static constexpr int BIAS_PANEL = 128 / sizeof(T);   // keys per swizzled row of the bias stage
    // S^T's accumulator starts at the bias (16-bit, without softcap). fp32's passes add it
    // instead: its S^T is a sum of the halves' products, scaled by s_q s_k, and the bias
    // over those scales could overflow.
    static constexpr bool BIAS_IN_ACC = BIAS && !F32;
    static constexpr int DQ_FLOATS = BLOCK_M * DQ_LD;
    static constexpr u32 KV_BYTES = 2 * PLANES * KV_ELEMS * sizeof(E);   // K and V
    static constexpr u32 QO_BYTES = 2 * PLANES * QO_ELEMS * sizeof(E);   // Q and dO of a stage
    // A tile's lse2 and delta rows come by TMA, whose box must start 16-byte aligned: from
    // the tile's first row rounded down to a multiple of 4 (under varlen a sequence starts
    // at any row), ROWS_BOX rows, each box ROWS_LD floats apart (128-byte aligned).
    static constexpr int ROWS_BOX = BLOCK_M + 4, ROWS_LD = (ROWS_BOX + 31) / 32 * 32;
    static constexpr u32 ROWS_BYTES = 2 * ROWS_BOX * sizeof(float);   // lse2 and delta of a stage
    static constexpr int ALIGN = 1024;
    static constexpr int TILE_BYTES = PLANES * (2 * KV_ELEMS + 2 * STAGES * QO_ELEMS + DS_BUFFERS * DS_ELEMS) * sizeof(E) + BIAS_BYTES +
                                      (DQ_FLOATS + TRADE_FLOATS + STAGES * 2 * ROWS_LD) * sizeof(float) +
                                      DROP_PAIR_WORDS * sizeof(u32);
    // The walk's ring (Sm90BwdTileInfo): the loader runs up to STAGES tiles ahead of the
    // consumers and a dQ writer a tile behind them, so four slots let the walker run ahead
    // of every reader.
    static constexpr int WALK_SLOTS = 4;
    static constexpr int SMEM_BYTES = TILE_BYTES + ALIGN + sizeof(Sm90BwdBarriers<STAGES, WALK_SLOTS>);
    // Register budgets after setmaxnreg: the producer warpgroup keeps 40 a thread (the
    // walker's block-mask reads, the loader's addresses under varlen); 56 with the options
    // and ordered dQ, whose turn count reads the block mask too (at 40 those kernels
    // spilled 44-92 bytes, build check at b1f3630). The consumers share the rest of the
    // launch's registers (tma.cuh WarpgroupRegs: 232, 224 with 56).
    static constexpr int PRODUCER_REGS = LEAN ? 40 : (ORDERED_DQ ? 56 : 40);
    static constexpr int CONSUMER_REGS = WarpgroupRegs<THREADS, PRODUCER_REGS>::CONSUMER;
    // Deterministic: two dQ writers (the producer warpgroup's second and fourth warps), taking
    // the tiles in turn, so that one's wait for its reduction to complete (before it passes
    // the turn on) overlaps the other's reduction: with one, the consumers waited for the
    // staging tile ~15% of the time at d = 128 (ncu at 28fb6d0, N = 2k; two: 1.07-1.25x;
    // from d = 192, the roles, 1.09-1.30x on an H200, bench/NOTES.md session 30).
    // Dense only: the option kernels' consumers spilled 12-40 bytes with a second full
    // barrier to choose. Not at d = 64, whose 128-query tiles take longer to compute than
    // a writer's turn: 0.93-1.01x there.
    static constexpr int DQ_WRITERS = ORDERED_DQ && LEAN && D >= 128 ? 2 : 1;
    static constexpr int WRITERS_BARRIER = 2;   // named barrier of the two writers
    // The walker: the producer warpgroup's warp that no other role takes (the third, or
    // with the bias, whose loader is the third, the fourth).
    static constexpr int WALKER = BIAS ? 3 : 2;
    static_assert(!(BIAS && DQ_WRITERS == 2), "the bias loader, two dQ writers and the walker: one warp short");
    // The warps that read each walked tile from the ring: the loader, the dQ writers and
    // (MODE_BIAS) the bias loader.
    static constexpr int WALK_READERS = 1 + DQ_WRITERS + (BIAS ? 1 : 0);
    // The warps that read a unit's number from its slot (Sm90BwdUnits): the consumers', the
    // dQ writers, (MODE_BIAS) the bias loader and the walker.
    static constexpr int UNIT_READERS = CONSUMERS * 4 + DQ_WRITERS + (BIAS ? 1 : 0) + 1;
    // Persistent CTAs (Sm90BwdUnits) on the dense path. The option kernels have no registers
    // for a loop over units (build check: the consumers spilled 60-220 bytes; with the
    // walker, each role's option state in shared memory, the producer 28-290 bytes at 40-48
    // registers): they run one CTA per unit, the same role code once. Measured with its
    // spills the persistent form read 0.96-1.09x (H100, N = 4k-16k, bench/NOTES.md
    // session 18): at these lengths a unit's fill and drain are ~1% of it.
    static constexpr bool PERSISTENT = LEAN;
    // Units in pieces (Sm90BwdUnits): the dense kernels of the default mode (the host splits
    // only calls without a causal band, whose units are all as long; the deterministic
    // mode's turns follow whole units).
    static constexpr bool SPLITS = MODE == MODE_DENSE && !ORDERED_DQ && !ROLES;
    static_assert(!SPLITS || 2 * DS_ELEMS * sizeof(T) + DQ_FLOATS * sizeof(float) >= BLOCK_N * D * sizeof(float),
                  "a piece's fp32 gradient staged over dS^T and the dQ tile");
    static_assert((GRADS & (GRAD_DV | GRAD_DK)) == (GRAD_DV | GRAD_DK), "dV and dK in one pass");
    // dQ in both modes (ordered in the deterministic one): the host never asks for less.
    static_assert((GRADS & GRAD_DQ) != 0, "bwd_sm90.cu adds dQ");
    static_assert(D % PANEL == 0 && D <= 256 && BLOCK_M % 64 == 0 && BLOCK_M <= 128, "tile shape");
    static_assert(ROLES || (DQ_N % 64 == 0 && D % DQ_N == 0 && (BLOCK_M / 64) * DQ_COLS == CONSUMERS), "dQ pieces");
    static_assert(!ROLES || (CONSUMERS == 2 && BLOCK_M == SUB_M), "the roles: two warpgroups, one sub-tile");
    static_assert(!BIAS || D <= 192, "a bias stage up to d = 192 (at 256 no room beside the trade)");
    static_assert(DROP_PAIR_BARRIER0 + CONSUMERS * 2 <= 16, "named barriers");
    static_assert(BWD_ROW_PAD % BLOCK_M == 0, "query tiles read the padded row workspaces whole");
    static_assert(2 * BLOCK_M <= CONSUMER_THREADS, "a consumer thread fetches one word of a tile's rows");
    static_assert(F32 || DQ_FLOATS * sizeof(float) >= (ROLES ? 2 : 1) * BLOCK_N * SmemTile<T, D>::stride * sizeof(T),
                  "epilogue staging in the dQ tile (with the roles, dV and dK at once; fp32 stores from registers)");
};

// The kernel's work: a unit is (key block, kv head, batch entry), numbered with the key
// block fastest, then the head, as a grid of one CTA per unit would be. Persistent CTAs
// (one per SM) take units from a counter the host zeroes, in increasing order, so that a
// CTA free early takes more of them; its producer's first warp claims each unit and
// publishes it to the other roles. The deterministic dQ's turns (bwd.cuh DqTurns) follow
// the units' order: a unit waits only for units taken before it, by CTAs that are running
// and take their units in increasing order, so the waits cannot deadlock.
// The units past AttnParams::whole_units (the last round's, where fewer units than CTAs
// are left: without a causal band every unit is as long, and those few CTAs ran alone
// for a whole unit, ~3% of a call) come in unit_pieces pieces each, every piece a run of
// the unit's walk: a piece adds its dK and dV into the fp32 workspace kv_partial, and the
// last piece to do so stores them (Sm90BwdKVTile::SPLITS).
struct Sm90BwdUnit {
    int x;       // the key block's place in its head's order (DqTurns)
    int hk, b;
    int piece;   // the piece of a split unit, or -1: the whole unit
};
struct Sm90BwdUnits {
    int blocks, kv_heads, whole, pieces, count;

    __device__ __forceinline__ explicit Sm90BwdUnits(const AttnParams& p)
        : blocks(p.grid_n), kv_heads(p.grid_heads / p.group), whole(p.whole_units), pieces(p.unit_pieces),
          count(whole + (p.grid_n * (p.grid_heads / p.group) * p.grid_batch - whole) * pieces) {}
    template <bool SPLITS>
    __device__ __forceinline__ Sm90BwdUnit decode(int u) const {
        const int piece = !SPLITS || u < whole ? -1 : (u - whole) % pieces;
        if (piece >= 0) u = whole + (u - whole) / pieces;
        const int rest = u / blocks;
        return {u - rest * blocks, rest % kv_heads, rest / kv_heads, piece};
    }
    // A split unit's index among the split ones (its dK/dV workspace and piece counter).
    __device__ __forceinline__ int split_index(const Sm90BwdUnit& unit) const {
        return (unit.b * kv_heads + unit.hk) * blocks + unit.x - whole;
    }
};

// A dQ writer's index, as a type (Sm90BwdKVTile::DQ_WRITERS).
template <int N> struct Sm90BwdWriter { static constexpr int INDEX = N; };

// A consumer warpgroup's role, as a type (Sm90BwdKVTile::ROLES): BOTH below d = 192 (each
// warpgroup its own 64 keys, every product); from d = 192 DV or DK, over the same 64 keys.
template <int D, int ROLE>
struct Sm90BwdRole {
    enum { BOTH = -1, DV = 0, DK = 1 };
    static constexpr bool SHARED_KEYS = ROLE != BOTH;
    static constexpr bool S = ROLE != DK;    // computes S^T, P^T and dV += P^T dO
    static constexpr bool DP = ROLE != DV;   // computes dP^T, dS^T and dK += dS^T Q
    // Its columns of dQ: the dV role's the first 128, the dK role's the rest (d = 192:
    // 64, where its share of the score passes is larger: it reads P^T from the trade and
    // stores dS^T). Each a whole number of 64-column panels, as the B operand's
    // descriptor wants (wgmma.cuh mnmajor_desc).
    // Below d = 192 (fp32's roles): d = 128 in two panels, one a role; d = 64 the dV
    // role's alone (DQ_N 0: the dK role only takes part in the staging's barriers).
    static constexpr int DQ_COL0 = ROLE == DK ? (D > 128 ? 128 : D / 2) : 0;
    static constexpr int DQ_N = D > 128 ? (ROLE == DV ? 128 : D - 128) : D == 128 ? 64 : (ROLE == DV ? D : 0);
};

// What every role derives from a unit and its option state: its key block and the pairs
// that see it (bwd.cuh KeyBlockPairs), which every role walks in the same order.
template <typename ModsT, bool SPLITS>
struct Sm90BwdUnitState {
    const ModsT& mods;
    Sm90BwdUnit unit;
    DqTurns turns;          // the key block, numbered against the dQ order
    int k0;                 // its first key
    KeyBlockPairs pairs;
    int walked;             // the pairs this unit walks: pairs.count(), or a piece's

    __device__ __forceinline__ Sm90BwdUnitState(const ModsT& mods_, Sm90BwdUnit unit_, bool ordered_dq, int blocks,
                                                int group, int block_n, int block_m, bool rotated_turns, int pieces)
        : mods(mods_), unit(unit_), turns(mods_.mask, ordered_dq, unit_.x, blocks), k0(turns.key_block * block_n),
          pairs(mods_.mask, unit_.hk, group, k0, block_n, block_m), walked(pairs.count()) {
        if (rotated_turns) pairs.rotate_start(unit_.x, blocks);
        // A piece walks pairs [rot, rot + walked) of the list (the host keeps each nonempty).
        if (SPLITS && unit_.piece >= 0) {
            const int per = (walked + pieces - 1) / pieces;
            pairs.rot = unit_.piece * per;
            walked = min(per, walked - pairs.rot);
        }
    }
    // Whether the block has keys (under varlen the grid covers the longest sequence).
    __device__ __forceinline__ bool has_keys() const { return k0 < mods.mask.nk; }
    __device__ __forceinline__ int count() const { return SPLITS ? walked : pairs.count(); }
    // Every lane of the warp calls these (KeyBlockPairs::next_in_warp).
    __device__ __forceinline__ int first() const { return pairs.next_in_warp(0, mods.mask); }
    __device__ __forceinline__ int after(int it) const { return pairs.next_in_warp(it + 1, mods.mask); }
};

// fp32 (halves.cuh): the power of two dS^T is scaled by before its split. |dS| = P |dP -
// delta| <= 2 max|dP| <= 2 d max|dO| max|V| < D2 2^(e_dO + e_V + 3), D2 = 2^L the power of
// two at or above D and e_x the exponent of max|x| (halves_exponent), so 2^(11 - e_dO -
// e_V - L) keeps the scaled dS below 2^14. The exponent is held to [-100, 100]: at an
// all-zero dO (e_dO at its floor, -112) the product of the halves' scales overflowed to
// inf, and the scaled dS, 0 times inf, was NaN; a smaller scale only rounds dS's
// smallest values sooner, a larger one cannot be needed below fp32's own range.
template <int D>
__device__ __forceinline__ float ds_scale(u32 max_do_bits, u32 max_v_bits) {
    constexpr int L = D <= 64 ? 6 : D <= 128 ? 7 : 8;
    const int e = min(max(11 - halves_exponent(max_do_bits) - halves_exponent(max_v_bits) - L, -100), 100);
    return __uint_as_float(u32(e + 127) << 23);
}

// One CTA per SM: the tiles take most of the shared memory, and the bound lets setmaxnreg
// give each consumer thread the registers of dK, dV and the score tiles. The host
// launches it with q, k, v and dO tensor maps, persistent (C::PERSISTENT: as many CTAs as
// SMs, at most one per unit, and a zeroed work counter) or on a grid of (key blocks,
// kv heads, batch entries), one CTA per unit.
template <typename T, int D, int BLOCK_M, int CONSUMERS, int GRADS, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(Sm90BwdKVTile<T, D, BLOCK_M, CONSUMERS, GRADS, MODE>::THREADS, 1)
flash_bwd_dkdv_sm90(const __grid_constant__ AttnParams p)
{
    typedef Sm90BwdKVTile<T, D, BLOCK_M, CONSUMERS, GRADS, MODE> C;
    typedef Mods<T, float, MODE> ModsT;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    constexpr int STAGES = C::STAGES, BLOCK_N = C::BLOCK_N, QT = C::QT, DT = C::DT;
    BWD_SCALARS(p, float);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    typedef typename C::E E;
    constexpr int PLANES = C::PLANES;
    constexpr int KV_TILE = PLANES * C::KV_ELEMS, QO_TILE = PLANES * C::QO_ELEMS, DS_TILE = PLANES * C::DS_ELEMS;
    E* sK = reinterpret_cast<E*>(smem_raw + (C::ALIGN - smem_addr(smem_raw) % C::ALIGN) % C::ALIGN);
    E* sV = sK + KV_TILE;
    E* sQ = sV + KV_TILE;                     // STAGES buffers
    E* sdO = sQ + STAGES * QO_TILE;           // STAGES buffers
    E* sdS = sdO + STAGES * QO_TILE;          // C::DS_BUFFERS buffers
    T* sBias = reinterpret_cast<T*>(sdS + C::DS_BUFFERS * DS_TILE);   // one stage (MODE_BIAS)
    float* sdQ = reinterpret_cast<float*>(sBias + C::BIAS_ELEMS);   // also the epilogue's staging tile
    float* sTrade = sdQ + C::DQ_FLOATS;       // the roles' P^T (C::ROLES)
    float* sRows = sTrade + C::TRADE_FLOATS;  // a stage's lse2 then delta rows (C::ROWS_LD each), STAGES buffers
    u32* sDropPairs = reinterpret_cast<u32*>(sRows + STAGES * 2 * C::ROWS_LD);   // two slots (C::DROP_PAIR_WORDS)
    auto& bars = *reinterpret_cast<Sm90BwdBarriers<STAGES, C::WALK_SLOTS>*>(reinterpret_cast<unsigned char*>(sK) + C::TILE_BYTES);
    // The option kernels' state of the CTA's unit (mods.cuh Mods; in registers it would
    // spill the consumers). The persistent dense kernels keep each role's in registers.
    __shared__ ModsT cta_mods;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int hq = p.grid_heads;
    typedef Sm90BwdUnitState<ModsT, C::SPLITS> UnitState;
    // Deterministic dQ without a right edge (the blocks' turns ascending, each walk from
    // the first tile) makes block x begin x reductions late: at N <= 4k that cost ~1.2x the
    // time (bench/deterministic_cost.py). There the blocks of a head start their walks
    // staggered along the pair list and take turns in the order they reach a pair
    // (DqTurns::ahead_rotated), where every block of a head can run at once: persistent
    // CTAs at least as many as a head's blocks; and at least 4 heads' worth, as measured
    // (bf16 against the kernel before: d = 64 1.14-1.17x at N = 2k-4k, 0.96x at 16k; d = 128
    // 0.98-0.99x at 2k-4k, 0.93x at 8k-16k, where a head's 64-128 blocks advance in
    // lockstep with the last of them to be taken); the roles' (d >= 192) from 2 heads'
    // worth, which takes in N = 4k (H200, bf16, against 4: d = 192 1.00x, d = 256 1.07x).
    // Such a block waits for blocks of its head taken after it, so no CTA may hold two
    // units with turns to wait for: there the dQ writer, not the producer, claims the
    // units, once its last unit's reductions are done (the next unit's K and V then load
    // after those, not during the last unit's epilogue). Then if CTAs hold units of a
    // head not yet wholly taken, some other CTA holds a unit of a head wholly taken (there
    // are at least as many CTAs as a head's blocks), whose turns all come; that CTA then
    // takes the next unit, until the head is taken. (grid_m, the query tiles of a head,
    // times the group is a block's pair count: the rotation's arithmetic stays within an
    // int. The flag is evaluated where used, from the parameters: held across the roles'
    // split, it was spilled. Not with a band, MODE_BAND, whose blocks see different query
    // tiles: their lists differ.)
    auto rotated_turns = [&] {
        return C::ORDERED_DQ && MODE == MODE_DENSE && !p.causal && (C::ROLES ? 2 : 4) * p.grid_n <= int(gridDim.x) &&
               (i64)p.grid_m * group * (p.grid_n + 1) <= 0x7fffffff;
    };
    auto unit_state_of = [&](const ModsT& mods, Sm90BwdUnit unit) {
        return UnitState(mods, unit, C::ORDERED_DQ, p.grid_n, group, BLOCK_N, BLOCK_M, rotated_turns(), p.unit_pieces);
    };

    if (threadIdx.x == 0) {
        mbar_init(&bars.kv_full, 1);
        mbar_init(&bars.kv_empty, CONSUMERS * 4);
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&bars.full[s], 1);
            mbar_init(&bars.empty[s], CONSUMERS * 4);
        }
        mbar_init(&bars.dq_full[0], CONSUMERS * 4);
        mbar_init(&bars.dq_full[1], CONSUMERS * 4);
        mbar_init(&bars.dq_empty, 1);
        mbar_init(&bars.bias_full, 1);
        mbar_init(&bars.bias_empty, CONSUMERS * 4);
        #pragma unroll
        for (int s = 0; s < 2; ++s) {
            mbar_init(&bars.unit_full[s], 1);
            mbar_init(&bars.unit_empty[s], C::UNIT_READERS);
        }
        #pragma unroll
        for (int s = 0; s < C::WALK_SLOTS; ++s) {
            mbar_init(&bars.walk_full[s], 1);
            mbar_init(&bars.walk_empty[s], C::WALK_READERS);
        }
    }
    // One CTA per unit (C::PERSISTENT false): the block's unit, from the grid's three axes,
    // and its option state, set up once for every role before the roles split, as one
    // copy in shared memory (the option kernels' consumers have no registers to spare for
    // it; set up after the split, ptxas spilled 4-40 bytes of their tile loop).
    if constexpr (!C::PERSISTENT) {
        static_assert(!C::LEAN, "dense kernels are persistent: one copy of the state in registers");
        const ModsT made = ModsT::make(p, blockIdx.z, hq);
        if (threadIdx.x == 0) cta_mods = made;
    }
    mbar_init_fence();
    __syncthreads();
    const UnitState cta_unit = unit_state_of(cta_mods, {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), -1});
    if (!C::PERSISTENT && !cta_unit.has_keys()) return;

    // Unit k of this CTA (every role takes the same ones, in order), -1 after the last:
    // the producer's first warp (the dQ writer where the turns rotate, below) claims it
    // from the counter and publishes it in slot k % 2; the other roles read it there and
    // give the slot back at once (one arrival a warp).
    auto claim_unit = [&](int k) {
        int u = 0;
        if (lane == 0) {
            const int slot = k % 2;
            mbar_wait(&bars.unit_empty[slot], ((k / 2) & 1) ^ 1);
            u = atomicAdd(p.work_counter, 1);
            if (u >= Sm90BwdUnits(p).count) u = -1;
            atomicExch(&bars.unit[slot], u);
            mbar_arrive(&bars.unit_full[slot]);
        }
        return warp_uniform(u);
    };
    auto read_unit = [&](int k) {
        const int slot = k % 2;
        mbar_wait(&bars.unit_full[slot], (k / 2) & 1);
        const int u = read_published(&bars.unit[slot]);
        if (lane == 0) mbar_arrive(&bars.unit_empty[slot]);   // after its read: the slot may be written again
        return u;
    };
    // Runs a role's `work` on each unit it takes: the CTA's one unit, or (persistent, dense)
    // each unit claimed or read (`take`) that has keys, its state in registers.
    auto each_unit = [&](auto take, auto&& work) {
        if constexpr (!C::PERSISTENT) {
            work(cta_unit);
        } else {
            static_assert(C::LEAN, "each role's option state per unit: in registers, dense path only");
            for (int k = 0;; ++k) {
                const int u = take(k);
                if (u < 0) break;
                const Sm90BwdUnit unit = Sm90BwdUnits(p).template decode<C::SPLITS>(u);
                ModsT mods = ModsT::make(p, unit.b, hq);   // outlives w, which refers to it
                if constexpr (C::LEAN && !C::BAND_BLOCKS) mods.mask.blocks = nullptr;   // none read
                const UnitState w = unit_state_of(mods, unit);
                if (w.has_keys()) work(w);
            }
        }
    };

    // Runs a reader's `body(tile)` on each tile of unit w that the walker published, in
    // order: each taken from the ring (`e` counts the role's walked tiles over every unit)
    // and its slot given back at once (one arrival a warp).
    auto each_walked_tile = [&](const UnitState& w, int& e, auto&& body) {
        for (bool more = w.first() < w.count(); more; ++e) {
            const int slot = e % C::WALK_SLOTS;
            mbar_wait(&bars.walk_full[slot], (e / C::WALK_SLOTS) & 1);
            const Sm90BwdTileInfo tile = bars.walk[slot].read();
            __syncwarp();
            if (lane == 0) mbar_arrive(&bars.walk_empty[slot]);
            more = !(tile.flags & Sm90BwdTileInfo::LAST);
            body(tile);
        }
    };

    // ------------------------------------------------------------------ producer
    if (warp >= CONSUMERS * 4) {
        warpgroup_release_regs<C::PRODUCER_REGS>();
        const int role = warp - CONSUMERS * 4;
        if (role == 0) {
            int step = 0;   // query tiles loaded, over every unit: stage step % STAGES, walk tile step
            int kv_n = 0;   // K/V blocks loaded
            auto take = [&](int k) { return rotated_turns() ? read_unit(k) : claim_unit(k); };
            each_unit(take, [&](const UnitState& w) {
                const ModsT& mods = w.mods;
                if (w.first() >= w.count()) return;   // no query tile: the consumers write zeros
                // Rows in the tensor maps' coordinates: under varlen the sequence's offset; with
                // the tile's planes (fp32's halves).
                auto load_panels = [&](E* dst, const TmaMap& map, u64* bar, int rows, i64 row0, int head, int heads) {
                    tma_load_planes<PLANES, D, C::PANEL>(dst, map, bar, rows, int(row0), head, heads, mods.tb);
                };
                const int kv_heads = hq / group;
                // K and V once the consumers are done with the last unit's (its last dQ
                // product): they load while the consumers write that unit's dK and dV.
                mbar_wait(&bars.kv_empty, (kv_n & 1) ^ 1);
                if (lane == 0) {
                    mbar_arrive_expect_tx(&bars.kv_full, C::KV_BYTES);
                    load_panels(sK, p.k_map, &bars.kv_full, BLOCK_N, mods.k_base + w.k0, w.unit.hk, kv_heads);
                    load_panels(sV, p.v_map, &bars.kv_full, BLOCK_N, mods.k_base + w.k0, w.unit.hk, kv_heads);
                }
                ++kv_n;
                // Each walked tile into the next stage once the consumers gave it back.
                each_walked_tile(w, step, [&](const Sm90BwdTileInfo& tile) {
                    const int s = step % STAGES;
                    mbar_wait(&bars.empty[s], ((step / STAGES) & 1) ^ 1);   // the consumers' release of the round before
                    if (lane == 0) {
                        bars.tile[s].publish(tile);
                        mbar_arrive_expect_tx(&bars.full[s], C::QO_BYTES + C::ROWS_BYTES);
                        load_panels(sQ + s * QO_TILE, p.q_map, &bars.full[s], BLOCK_M, mods.q_base + tile.q0, tile.h, hq);
                        load_panels(sdO + s * QO_TILE, p.dout_map, &bars.full[s], BLOCK_M, mods.q_base + tile.q0, tile.h, hq);
                        // The tile's lse2 and delta rows (the padded row workspaces: read whole),
                        // from a 16-byte aligned row (C::ROWS_BOX).
                        float* rows = sRows + s * 2 * C::ROWS_LD;
                        const int row = (int(mods.q_base) + tile.q0) & ~3;
                        tma_load_4d(rows, p.rows_map, &bars.full[s], row, tile.h, mods.tb, 0);
                        tma_load_4d(rows + C::ROWS_LD, p.rows_map, &bars.full[s], row, tile.h, mods.tb, 1);
                    }
                    __syncwarp();
                });
            });
        } else if (role == 1 || (C::DQ_WRITERS == 2 && role == 3)) {
            // The dQ tile's rows (those in the sequence) into the workspace, whose rows
            // the host pads as the staging tile's (dq_ld = DQ_LD): one bulk reduction.
            // Deterministic: each tile's reduction waits for its turn (the key blocks
            // ahead of this one have added theirs), and passes the turn on once done;
            // writer 0 takes the even tiles, writer 1 the odd ones (C::DQ_WRITERS), each
            // tile staged once the other's reduction has read the last one.
            if (dq_ld != C::DQ_LD) __trap();   // a host that drifted from this layout
            // The writer's index at compile time (at run time it spilled the writers' registers).
            auto write_dq = [&](auto writer_index) {
                constexpr int writer = decltype(writer_index)::INDEX;
                int step = 0;   // dQ tiles staged, over every unit
                auto take = [&](int k) { return writer == 0 && rotated_turns() ? claim_unit(k) : read_unit(k); };
                each_unit(take, [&](const UnitState& w) {
                    const ModsT& mods = w.mods;
                    const auto& mask = mods.mask;
                    each_walked_tile(w, step, [&](const Sm90BwdTileInfo& tile) {
                        if (step % C::DQ_WRITERS != writer) return;
                        const int h = tile.h, q0 = tile.q0;
                        [[maybe_unused]] u32* turn = nullptr;
                        [[maybe_unused]] u32 ahead = 0;
                        if constexpr (C::ORDERED_DQ) {
                            turn = p.dq_order + ((i64)w.unit.b * hq + h) * p.grid_m + q0 / BLOCK_M;   // grid_m: query tiles a head
                            ahead = rotated_turns() ? w.turns.ahead_rotated(w.pairs, tile.it, p.grid_n)
                                                  : w.turns.ahead(mask, q0, BLOCK_M, BLOCK_N, h, lane);
                        }
                        // Each writer's own full barrier: on a shared one, a writer waiting for the
                        // tile after next could take the phase of the tile before for its own.
                        mbar_wait(&bars.dq_full[writer], (step / C::DQ_WRITERS) & 1);
                        if (lane == 0) {
                            if constexpr (C::ORDERED_DQ) wait_turn(turn, ahead);
                            const int rows = min(BLOCK_M, mask.nq - q0);
                            float* dq_tile = dq_accum + (((i64)mods.tb * hq + h) * nq + mods.q_base + q0) * (i64)C::DQ_LD;
                            bulk_reduce_add(dq_tile, sdQ, u32(rows * C::DQ_LD) * sizeof(float));
                            bulk_commit();
                            bulk_wait_read<0>();
                            mbar_arrive(&bars.dq_empty);
                            if constexpr (C::ORDERED_DQ) {
                                bulk_wait<0>();
                                pass_turn(turn);
                            }
                        }
                        __syncwarp();
                    });
                    // Both writers are done with the unit before the next is claimed (where
                    // writer 0 claims, no unit may have turns left to wait for: above).
                    if constexpr (C::DQ_WRITERS == 2) named_barrier(C::WRITERS_BARRIER, 64);
                });
                bulk_wait<0>();
            };
            if (role == 1) write_dq(Sm90BwdWriter<0>());
            else if constexpr (C::DQ_WRITERS == 2) write_dq(Sm90BwdWriter<1>());
        } else if (role == 2 && C::BIAS) {
            // Each sub-tile's bias, in the consumers' order, once they gave the stage back.
            // The host makes the bias map only for a bias with whole rows (Nq, Nk); axes
            // it broadcasts over (stride 0) are read at 0.
            // a host that drifted from this contract (dbias: whole rows, as the bias's)
            if (!p.mods.bias_tma || (!C::SOFTCAP && p.mods.softcap > 0) || p.dbias_sk > 1 ||
                (!C::SOFTCAP_DBIAS && p.mods.softcap > 0 && p.dbias != nullptr))
                __trap();
            int n = 0;   // sub-tiles loaded, over every unit
            int e = 0;   // walked tiles read
            each_unit(read_unit, [&](const UnitState& w) {
                each_walked_tile(w, e, [&](const Sm90BwdTileInfo& tile) {
                    const int h = tile.h, q0 = tile.q0;
                    for (int sub = 0; sub < C::SUBTILES; ++sub, ++n) {
                        mbar_wait(&bars.bias_empty, (n & 1) ^ 1);
                        if (lane == 0) {
                            mbar_arrive_expect_tx(&bars.bias_full, C::BIAS_BYTES);
                            #pragma unroll
                            for (int panel = 0; panel < BLOCK_N / C::BIAS_PANEL; ++panel)
                                tma_load_4d(sBias + panel * C::SUB_M * C::BIAS_PANEL, p.bias_map, &bars.bias_full,
                                            w.k0 + panel * C::BIAS_PANEL, q0 + sub * C::SUB_M, p.mods.bias_sh != 0 ? h : 0,
                                            p.mods.bias_sb != 0 ? w.unit.b : 0);
                        }
                        __syncwarp();
                    }
                });
            });
        } else if (role == C::WALKER) {
            // The walk: each unit's pairs that the mask leaves on (bwd.cuh
            // KeyBlockPairs::next_in_warp, 32 at a time), each published once every reader
            // has taken the tile WALK_SLOTS before, with what the consumers need to know of it.
            int e = 0;   // tiles published, over every unit
            each_unit(read_unit, [&](const UnitState& w) {
                const auto& mask = w.mods.mask;
                for (int it = w.first(); it < w.count(); ++e) {
                    const int next = w.after(it);
                    const int slot = e % C::WALK_SLOTS;
                    mbar_wait(&bars.walk_empty[slot], ((e / C::WALK_SLOTS) & 1) ^ 1);
                    if (lane == 0) {
                        const int h = w.pairs.head(it), q0 = w.pairs.q0(it);
                        // The block mask's state of the whole tile: mixed (2) masks both sub-tiles.
                        const bool mixed = mask.block_state(q0, q0 + BLOCK_M, w.k0, w.k0 + BLOCK_N, h) == 2;
                        int flags = next >= w.count() ? Sm90BwdTileInfo::LAST : 0;
                        #pragma unroll
                        for (int sub = 0; sub < C::SUBTILES; ++sub) {
                            const int r0 = q0 + sub * C::SUB_M;
                            if (mixed || mask.band_needs_mask(r0, r0 + C::SUB_M, w.k0, w.k0 + BLOCK_N))
                                flags |= Sm90BwdTileInfo::MASKED << sub;
                        }
                        bars.walk[slot].publish({h, q0, flags, it});
                        mbar_arrive(&bars.walk_full[slot]);
                    }
                    __syncwarp();
                    it = next;
                }
            });
        }
        return;
    }

    // ------------------------------------------------------------------ consumers
    warpgroup_claim_regs<C::CONSUMER_REGS>();
    const int g = lane / 4, t = lane % 4;
    const int wg = C::UNIFORM_WG ? warp_uniform(warp / 4) : warp / 4;   // the descriptors' operand rows
    auto release = [&](u64* bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };
    auto consumer_sync = [] { named_barrier(C::CONSUMER_BARRIER, C::CONSUMER_THREADS); };
    // fp32: what undoes the halves' scales s_x = 2^(14 - e_x) (powers of two, exact). S^T's
    // product carries s_q s_k, dP^T's s_dO s_v; P^T goes in times p_mul and dS^T times
    // ds_mul, so dV carries p_mul s_dO, dK ds_mul s_q and dQ ds_mul s_k. p_mul is P_SCALE
    // and ds_mul ds_scale, each less the power of two at or above dropout's scale 1 / (1 -
    // p), which the kept P and dS carry (bwd.cuh: the rows; 1 without dropout). Each
    // unscale from its exponent (ldexpf): a product of the scales themselves overflows
    // where a tensor's largest magnitude is tiny (an all-zero dO: s_dO = 2^126).
    [[maybe_unused]] float s_unscale = 1.f, dp_unscale = 1.f, p_mul = 1.f, ds_mul = 1.f;
    [[maybe_unused]] float dv_unscale = 1.f, dk_unscale = 1.f, dq_unscale = 1.f;
    if constexpr (C::F32) {
        const int eq = halves_exponent(p.halves_max[HALVES_Q]), ek = halves_exponent(p.halves_max[HALVES_K]);
        const int ev = halves_exponent(p.halves_max[HALVES_V]), edo = halves_exponent(p.halves_max[HALVES_DO]);
        const float drop = pow2_at_least(float(p.mods.drop_scale));
        p_mul = C::P_SCALE / drop;
        ds_mul = ds_scale<D>(p.halves_max[HALVES_DO], p.halves_max[HALVES_V]) / drop;
        s_unscale = ldexpf(1.f, eq + ek - 28);
        dp_unscale = ldexpf(1.f, edo + ev - 28);
        dv_unscale = ldexpf(1.f / p_mul, edo - 14);
        dk_unscale = ldexpf(1.f / ds_mul, eq - 14);
        dq_unscale = ldexpf(1.f / ds_mul, ek - 14);
    }
    // A warpgroup's work in its role (Sm90BwdRole); each role's accumulators are its own.
    auto consume = [&](auto role) {
        typedef decltype(role) R;
        // This warp's keys in the block (S^T's and dP^T's A operands start at its
        // warpgroup's, written out where used: as a variable the d = 128 option kernel
        // spilled 40 bytes, build check).
        const int warp_row0 = (R::SHARED_KEYS ? warp % 4 : warp) * 16;
        // This warpgroup's piece of the dQ tile (DQ_N columns of 64 query rows).
        constexpr int DQ_N = R::SHARED_KEYS ? R::DQ_N : C::DQ_N;
        const int dq_row0 = R::SHARED_KEYS ? 0 : (wg / C::DQ_COLS) * 64;
        const int dq_col0 = R::SHARED_KEYS ? R::DQ_COL0 : (wg % C::DQ_COLS) * C::DQ_N;
        // The roles' trade (C::TRADE_BARRIER): the dV role sends its P^T (with the options S^T)
        // to the dK role, each thread's fragments a float4 an n-tile, where the thread of the
        // same warp and lane in the other role receives them.
        [[maybe_unused]] auto traded = [&](int nt) { return reinterpret_cast<float4*>(sTrade) + (nt * 4 + warp % 4) * 32 + lane; };
        [[maybe_unused]] auto send_trade = [&](const float (&frag)[QT][4]) {
            #pragma unroll
            for (int nt = 0; nt < QT; ++nt) *traded(nt) = make_float4(frag[nt][0], frag[nt][1], frag[nt][2], frag[nt][3]);
            named_barrier(C::TRADE_BARRIER, C::CONSUMER_THREADS);
        };
        [[maybe_unused]] auto receive_trade = [&](float (&frag)[QT][4]) {
            named_barrier(C::TRADE_BARRIER, C::CONSUMER_THREADS);
            #pragma unroll
            for (int nt = 0; nt < QT; ++nt) {
                const float4 x = *traded(nt);
                frag[nt][0] = x.x, frag[nt][1] = x.y, frag[nt][2] = x.z, frag[nt][3] = x.w;
            }
        };

        int step = 0;   // query tiles, over every unit: stage step % STAGES, dQ tile step
        int kv_n = 0;   // K/V blocks waited for
        each_unit(read_unit, [&](const UnitState& w) {
            const ModsT& mods = w.mods;
            const auto& mask = mods.mask;
            const int k0 = w.k0;
            // Whether this unit's call caps its scores (the kernels without softcap compile it out).
            auto capped = [&] { return C::SOFTCAP && mods.softcap > 0.f; };
            // Whether the passes add the bias from its stage (then it goes back after them).
            auto bias_in_pass = [&] { return C::BIAS && (!C::BIAS_IN_ACC || capped()); };
            // The walker walks the pairs and the loader passes each tile's record on in its
            // stage (Sm90BwdTileInfo); the consumers only ask whether the unit has a tile.
            const bool has_tiles = w.first() < w.count();
            if constexpr (C::SPLITS) {   // in shared memory until the epilogue (held in registers, d = 128 spilled)
                if (threadIdx.x == 0) bars.consumers_split = w.unit.piece >= 0 ? Sm90BwdUnits(p).split_index(w.unit) : -1;
                consumer_sync();
            }
            const int unit_step0 = step;
            if (has_tiles) mbar_wait(&bars.kv_full, kv_n & 1);

            float acc_dv[1][R::S ? DT : 1][4], acc_dk[1][R::DP ? DT : 1][4];
            zero_frags(acc_dv);
            zero_frags(acc_dk);
            // fp32: a query tile's dV or dK products, summed from zero on the tensor cores and
            // added into acc_dv or acc_dk in the FPU (the tensor cores truncate; above).
            float dv_tile[1][C::F32 && R::S ? DT : 1][4], dk_tile[1][C::F32 && R::DP ? DT : 1][4];
            auto& dv_sum = [&]() -> auto& { if constexpr (C::F32) return dv_tile; else return acc_dv; }();
            auto& dk_sum = [&]() -> auto& { if constexpr (C::F32) return dk_tile; else return acc_dk; }();

            // A tile's dQ = dS K goes to the tensor cores at the start of the next tile, ahead of
            // its S^T, and is staged while S^T runs (dP^T is issued after: with it in flight too,
            // d = 128 spilled, build check). So the tile's tail (waiting for dQ, staging it, the
            // loop's turn) no longer leaves the tensor cores idle (ncu: the largest stall of the
            // consumers). Each iteration waits for every product it issues, so that ptxas can
            // follow the accumulators (with dQ in flight across iterations it serialised the
            // wgmmas); the unit's first iteration's dQ product reads a dS^T buffer of no tile of
            // this unit and is not staged. The last tile's dV and dK are done by then too, so
            // that its Q and dO stage is released there.
            // (fp32 at d = 64: the dK role has no columns of dQ, DQ_N 0; it issues nothing and
            // only takes part in the staging's barriers.)
            float dq[1][DQ_N > 0 ? DQ_N / 8 : 1][4];
            auto issue_dq = [&](const E* dS_tile) {
                if constexpr (DQ_N > 0) {
                    for_each_product<C::PRODUCTS>([&](int pa, int pb, bool first) {
                        #pragma unroll
                        for (int ks = 0; ks < C::NSTEPS; ++ks) {
                            const u64 a = mnmajor_desc<E, BLOCK_N>(dS_tile + pa * C::DS_ELEMS, ks, dq_row0);
                            const u64 b = mnmajor_desc<E, BLOCK_N>(sK + pb * C::KV_ELEMS, ks, dq_col0);
                            if (first && ks == 0) Wgmma<E, DQ_N>::template ss_mn<false>(dq[0], a, b);
                            else Wgmma<E, DQ_N>::template ss_mn<true>(dq[0], a, b);
                        }
                    });
                }
                wgmma_commit();
            };
            // The piece of tile `step` into the staging tile once the copy engine has read the
            // last one; the producer's second warp adds it into the workspace.
            auto stage_dq = [&](int dq_step) {
                reg_fence(dq[0]);
                mbar_wait(&bars.dq_empty, (dq_step & 1) ^ 1);
                #pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    float* row = sdQ + (dq_row0 + (warp % 4) * 16 + g + hh * 8) * C::DQ_LD;
                    #pragma unroll
                    for (int nt = 0; nt < DQ_N / 8; ++nt)
                        *reinterpret_cast<float2*>(row + dq_col0 + nt * 8 + 2 * t) =
                            make_float2(dq[0][nt][2 * hh] * dq_unscale, dq[0][nt][2 * hh + 1] * dq_unscale);
                }
                fence_async_smem();
                release(&bars.dq_full[dq_step % C::DQ_WRITERS]);
            };

            // A split unit's piece: a gradient's fp32 accumulators added into `sums` (BLOCK_N rows
            // of D floats) by one bulk reduction, staged where dS^T and the dQ tile lie (both
            // free once the unit's last dQ tile has been read).
            [[maybe_unused]] auto add_piece = [&](float* sums, const float (&acc)[1][DT][4]) {
                float* staged = reinterpret_cast<float*>(sdS);
                warp_store_c_f32(staged, D, warp_row0, acc);
                fence_async_smem();
                consumer_sync();
                if (threadIdx.x == 0) {
                    bulk_reduce_add(sums, staged, u32(BLOCK_N * D) * sizeof(float));
                    bulk_commit();
                    bulk_wait_read<0>();
                }
                consumer_sync();
            };
            for (bool more = has_tiles; more; ++step) {
                const int s_ = step % STAGES;
                const E* sQb = sQ + s_ * QO_TILE;
                const E* sdOb = sdO + s_ * QO_TILE;
                // The tile's rows from where the loader's aligned box put them (q_base 0 but
                // under varlen).
                const float* sLseb = sRows + s_ * 2 * C::ROWS_LD + (ModsT::BAND ? int(mods.q_base) & 3 : 0);
                const float* sDeltab = sLseb + C::ROWS_LD;
                if constexpr (R::SHARED_KEYS) {
                    // The last tile's dQ first, complete and staged before this tile's S^T or
                    // dP^T take the registers (with one stage, while this tile's Q and dO load).
                    if (step > unit_step0) {
                        wgmma_fence();
                        issue_dq(sdS + ((step - 1) % C::DS_BUFFERS) * DS_TILE);
                        wgmma_wait<0>();
                        stage_dq(step - 1);
                    }
                }
                mbar_wait(&bars.full[s_], (step / STAGES) & 1);
                Sm90BwdTileInfo& tile = bars.tile[s_];   // the stage's until the next tile releases it
                const int h = Sm90BwdTileInfo::ld(&tile.h), q0 = Sm90BwdTileInfo::ld(&tile.q0);

                // Per sub-tile: S^T and dP^T as two batches (P^T is computed while dP^T
                // still runs), then dV += P^T dO and dK += dS^T Q as one batch, which runs on
                // while the next sub-tile's S^T and dP^T are issued. dS^T goes to shared memory
                // for dQ (its A fragments are the rounded values: fragment word i holds rows
                // g + 8 (i % 2), columns 16 ks + 8 (i / 2) + 2 t, + 1); that buffer of two tiles
                // ago is free: every warpgroup passed the barrier below since, after its dQ
                // products of that tile completed.
                E* sdSb = sdS + (step % C::DS_BUFFERS) * DS_TILE;
                #pragma unroll
                for (int sub = 0; sub < C::SUBTILES; ++sub) {
                    const int r0 = sub * C::SUB_M;   // the sub-tile's first row in the query tile
                    float s[1][QT][4], dp[1][QT][4];
                    if constexpr (!R::DP && !C::LEAN) zero_frags(dp);   // the option passes' dS, unused by the dV role
                    if constexpr (C::BIAS) {
                        // S^T's accumulator starts at bias^T / scale, so that the P pass's
                        // S^T scale log2 e has the bias term in log2 units (HeadMods::score_log2)
                        // at no cost per score. Softcap caps the product alone: then it starts at
                        // 0 and the pass adds the bias, as fp32's passes do (BIAS_IN_ACC).
                        mbar_wait(&bars.bias_full, (step * C::SUBTILES + sub) & 1);
                        if constexpr (C::BIAS_IN_ACC && R::S) {   // (with the roles the dK role receives S^T)
                            if (capped()) {
                                zero_frags(s);
                            } else {
                                KeyRowBias<T, C::SUB_M> bias(sBias, warp_row0);
                                const float weight = 1.f / scale;
                                for_each_score<true>(s, 0, 0, [&](float& x, int, int, int, int nt, int e) {
                                    x = bias.at(nt, e) * weight;
                                });
                            }
                        }
                    }
                    wgmma_fence();
                    if constexpr (!R::SHARED_KEYS) {
                        if (sub == 0) issue_dq(sdS + ((step + 1) % 2) * DS_TILE);   // the last tile's
                    }
                    if constexpr (R::S) {
                        for_each_product<C::PRODUCTS>([&](int pa, int pb, bool first) {
                            #pragma unroll
                            for (int ks = 0; ks < C::KSTEPS; ++ks) {
                                const u64 a = kmajor_desc<E, BLOCK_N>(sK + pa * C::KV_ELEMS, R::SHARED_KEYS ? 0 : wg * 64, ks);
                                const u64 b = kmajor_desc<E, BLOCK_M>(sQb + pb * C::QO_ELEMS, r0, ks);
                                if (first && ks == 0) Wgmma<E, C::SUB_M>::template ss<C::BIAS_IN_ACC>(s[0], a, b);
                                else Wgmma<E, C::SUB_M>::template ss<true>(s[0], a, b);
                            }
                        });
                        wgmma_commit();
                    }
                    // The bias stage goes back only once the values read from it have been used:
                    // its ldmatrix loads may still be in flight after their last instruction, and
                    // the next TMA write (the async proxy) is not ordered after them by the
                    // barrier alone (the d = 64 kernels gave wrong gradients when the stage went
                    // back right after the loads). Here S^T's product, issued on the registers
                    // they fed, has taken them; with softcap, below, once the passes are done.
                    if (C::BIAS && !bias_in_pass()) release(&bars.bias_empty);
                    if constexpr (!R::SHARED_KEYS) {
                        if (sub == 0) {
                            wgmma_wait<1>();   // the last tile's dQ, dV and dK (S^T runs on)
                            if (step > unit_step0) {
                                release(&bars.empty[(step - 1) % STAGES]);
                                stage_dq(step - 1);
                            }
                        }
                    }
                    if constexpr (R::DP) {
                        for_each_product<C::PRODUCTS>([&](int pa, int pb, bool first) {
                            #pragma unroll
                            for (int ks = 0; ks < C::KSTEPS; ++ks) {
                                const u64 a = kmajor_desc<E, BLOCK_N>(sV + pa * C::KV_ELEMS, R::SHARED_KEYS ? 0 : wg * 64, ks);
                                const u64 b = kmajor_desc<E, BLOCK_M>(sdOb + pb * C::QO_ELEMS, r0, ks);
                                if (first && ks == 0) Wgmma<E, C::SUB_M>::template ss<false>(dp[0], a, b);
                                else Wgmma<E, C::SUB_M>::template ss<true>(dp[0], a, b);
                            }
                        });
                        wgmma_commit();
                    }

                    const bool needs_mask = tile.has(Sm90BwdTileInfo::MASKED << sub);
                    // A query pair's rows as one 8-byte load (the passes read each pair twice, for
                    // keys g and g + 8: the compiler reuses the load); with a band word by word
                    // (under varlen the rows may start at an odd word).
                    auto pair_at = [&](const float* rows, int nt, int e) {
                        if constexpr (!ModsT::BAND) {
                            const float2 pair = *reinterpret_cast<const float2*>(rows + r0 + nt * 8 + 2 * t);
                            return e % 2 ? pair.y : pair.x;
                        } else {
                            return rows[r0 + nt * 8 + 2 * t + e % 2];
                        }
                    };
                    auto lse2_at = [&](int, int nt, int e) {
                        return pair_at(sLseb, nt, e);
                    };
                    auto delta_at = [&](int, int nt, int e) {
                        return pair_at(sDeltab, nt, e);
                    };
                    u32 p_frag[C::QSTEPS][4], ds_frag[C::QSTEPS][4];
                    [[maybe_unused]] u32 p_low[C::F32 ? C::QSTEPS : 1][4], ds_low[C::F32 ? C::QSTEPS : 1][4];   // fp32's low halves
                    // The A fragments of k-step ks: of the P that multiplies dO (from s, a score
                    // whose bit of `kept` is clear as 0: with a constant ~0u the selects fold
                    // away), of dS (from `c`); fp32's as high and low halves, times p_mul and ds_mul.
                    auto kept_p_frags = [&](int ks, u32 kept) {
                        if constexpr (C::F32) c_to_split_a_frags(p_frag[ks], p_low[ks], s, 0, ks, p_mul, kept);
                        else kept_a_frag<T, true>(p_frag[ks], s, ks, kept);
                    };
                    auto ds_frags = [&](const float (&c)[1][QT][4], int ks) {
                        if constexpr (C::F32) c_to_split_a_frags(ds_frag[ks], ds_low[ks], c, 0, ks, ds_mul);
                        else c_to_a_frag<T>(ds_frag[ks], c, 0, ks);
                    };
                    // fp32: dP^T unscaled once it is in (S^T's scale rides in the passes' scale).
                    auto unscale_dp = [&] {
                        if constexpr (C::F32) for_each_score<true>(dp, 0, 0, [&](float& x, int, int, int, int, int) {
                            x *= dp_unscale;
                        });
                    };
                    const float pass_scale_log2 = scale_log2 * s_unscale;
                    const int kr0 = k0 + warp_row0, qc0 = q0 + r0;   // the warp's first key, the sub-tile's first query
                    // Dropout's keep bits of the warp's scores, the warps of a pair splitting each
                    // Philox call through this sub-tile's slots (DROP_PAIR_BARRIER0).
                    [[maybe_unused]] auto keep_bits = [&](const auto& hm) {
                        const SharedMemoryWarpPair pair{sDropPairs + ((step * C::SUBTILES + sub) & 1) * C::CONSUMER_THREADS,
                                                        C::DROP_PAIR_BARRIER0 + warp / 2};
                        // The key schedule from the parameters' table (philox.cuh RoundKeys) where
                        // the registers allow; at d = 128 its loads spilled the lean dropout
                        // consumers 20-24 bytes (build check), which add it up from the seed.
                        if constexpr (D <= 64) return hm.template keep_bits_key_rows<QT>(kr0, qc0, RoundKeys{p.mods.rng_round_keys}, pair);
                        else return hm.template keep_bits_key_rows<QT>(kr0, qc0, hm.seed, pair);
                    };
                    if constexpr (C::LEAN) {
                        float unused_dtanh[1][1][4];
                        // MODE_SOFTCAP: P and dS in one pass once both products are in (the
                        // derivative needs S): with the roles the dV role trades S^T as computed
                        // and caps it for P alone; the mask's verdict as bits, worked out while
                        // the products run. MODE_DROPOUT: the keep bits, drawn while the
                        // products run (each role its own), leave the dropped scores out of
                        // the P that multiplies dO and out of dP.
                        [[maybe_unused]] u32 visible = ~0u, keep = ~0u;
                        if constexpr (C::LEAN_SOFTCAP) {
                            if (needs_mask) visible = mask.template visible_bits<true, QT>(kr0, qc0, h);
                        }
                        if constexpr (C::LEAN_DROPOUT) keep = keep_bits(mods.at_head(h));
                        if constexpr (R::S && !(C::LEAN_SOFTCAP && R::DP)) {
                            wgmma_wait<R::DP ? 1 : 0>();
                            reg_fence(s[0]);
                            if constexpr (C::LEAN_SOFTCAP) send_trade(s[0]);   // S^T to the dK role
                            // A copy of the pass per case: with the flag at run time ptxas worked out
                            // every score's visibility and selected on it (~150 instructions a tile
                            // that no mask touches, ncu at 7f8a6b4).
                            if (needs_mask)
                                recompute_p<MODE, true>(s, unused_dtanh, mods, mods.at_head(h), kr0, qc0, lse2_at,
                                                        pass_scale_log2, true);
                            else
                                recompute_p<MODE, true>(s, unused_dtanh, mods, mods.at_head(h), kr0, qc0, lse2_at,
                                                        pass_scale_log2, false);
                            if constexpr (!R::DP && !C::LEAN_SOFTCAP) send_trade(s[0]);   // P^T to the dK role (its last reads were before the last tile's barrier)
                            #pragma unroll
                            for (int ks = 0; ks < C::QSTEPS; ++ks) kept_p_frags(ks, C::LEAN_DROPOUT ? keep : ~0u);
                        }
                        if constexpr (R::DP) {
                            if constexpr (!R::S && C::LEAN_SOFTCAP) receive_trade(s[0]);   // S^T, while dP^T runs
                            wgmma_wait<0>();
                            reg_fence(dp[0]);
                            unscale_dp();
                            if constexpr (C::LEAN_SOFTCAP) {
                                reg_fence(s[0]);
                                const auto hm = mods.at_head(h);
                                NoBias no_bias;
                                if (needs_mask)
                                    capped_p_and_grad<false, true, true>(s, dp, hm, kr0, qc0, lse2_at, delta_at, no_bias,
                                                                         visible, ~0u, pass_scale_log2);
                                else
                                    capped_p_and_grad<false, false, true>(s, dp, hm, kr0, qc0, lse2_at, delta_at, no_bias,
                                                                          ~0u, ~0u, pass_scale_log2);
                                #pragma unroll
                                for (int ks = 0; ks < C::QSTEPS; ++ks) {
                                    if constexpr (R::S) kept_p_frags(ks, ~0u);
                                    ds_frags(dp, ks);
                                }
                            } else {
                                if constexpr (!R::S) receive_trade(s[0]);   // P^T from the dV role
                                grad_pass<C::LEAN_DROPOUT, true>(s, dp, kr0, qc0, delta_at, keep);
                                #pragma unroll
                                for (int ks = 0; ks < C::QSTEPS; ++ks) ds_frags(s, ks);
                            }
                        }
                    } else {
                        // The options (bwd.cuh): which scores the mask shows and dropout keeps,
                        // while the products run; then P and dS as in dense mode, or with softcap
                        // in one pass once both products are in.
                        const auto hm = mods.at_head(h);
                        const u32 keep = hm.dropout() ? keep_bits(hm) : ~0u;
                        const u32 visible = needs_mask ? mask.template visible_bits<true, QT>(kr0, qc0, h) : ~0u;
                        const bool alibi = hm.slope_log2 != 0.f;
                        if constexpr (R::SHARED_KEYS) {
                            // S^T as computed, from the dV role to the dK role, whose dP^T runs on
                            // (after the bits above, which the dV role works out while S^T runs).
                            if constexpr (R::S) {
                                wgmma_wait<0>();
                                reg_fence(s[0]);
                                send_trade(s[0]);
                            } else {
                                receive_trade(s[0]);
                            }
                        }
                        // MODE_BIAS with softcap, and fp32's: the bias from its stage in the passes
                        // (softcap's one pass; fp32's P pass too); otherwise it rode in S^T's
                        // accumulator.
                        auto bias = [&] {
                            if constexpr (C::SOFTCAP_BIAS || (C::BIAS && !C::BIAS_IN_ACC)) return KeyRowBias<T, C::SUB_M>(sBias, warp_row0);
                            else return NoBias();
                        }();
                        [[maybe_unused]] NoBias no_bias;
                        auto& p_pass_bias = [&]() -> auto& {
                            if constexpr (C::BIAS_IN_ACC) return no_bias;
                            else return bias;
                        }();
                        // MODE_BIAS: the bias gradient where the call asks for it (p.dbias), from the
                        // dK role's dS: after grad_pass, or within softcap's pass (before its
                        // derivative).
                        [[maybe_unused]] NoDbias no_dbias;
                        auto dbias = [&] {
                            if constexpr (C::BIAS && R::DP)
                                return DbiasAdder{p.dbias == nullptr ? nullptr
                                                                     : static_cast<float*>(p.dbias) + w.unit.b * p.dbias_sb + h * p.dbias_sh,
                                                  int(p.dbias_sq), mask.nq, mask.nk};
                            else
                                return NoDbias();
                        }();
                        auto add_dbias_if_asked = [&] {
                            if constexpr (decltype(dbias)::ON) {
                                if (dbias.head != nullptr) add_dbias<true>(s, kr0, qc0, dbias);
                            }
                        };
                        auto& capped_dbias = [&]() -> auto& {
                            if constexpr (C::SOFTCAP_DBIAS) return dbias;
                            else return no_dbias;
                        }();
                        // BITS: whether the passes select by the bits; false where every score is
                        // shown and kept (bwd.cuh). The choice must be the same for the whole
                        // warpgroup (its wgmma waits are inside): from the tile and the call.
        #define CUPYFLASH_OPTION_SCORES(BITS)                                                                       \
            if (C::SOFTCAP && hm.softcap > 0.f) {   /* capped(), from the head's copy in registers */              \
                wgmma_wait<0>();                                                                                    \
                reg_fence(s[0]);                                                                                    \
                reg_fence(dp[0]);                                                                                   \
                unscale_dp();                                                                                       \
                if (alibi) capped_p_and_grad<true, BITS, true>(s, dp, hm, kr0, qc0, lse2_at, delta_at, bias, visible, keep, \
                                                               pass_scale_log2, capped_dbias);                      \
                else capped_p_and_grad<false, BITS, true>(s, dp, hm, kr0, qc0, lse2_at, delta_at, bias, visible,    \
                                                          keep, pass_scale_log2, capped_dbias);                     \
                _Pragma("unroll") for (int ks = 0; ks < C::QSTEPS; ++ks) {                                          \
                    kept_p_frags(ks, ~0u);                                                                          \
                    ds_frags(dp, ks);                                                                               \
                }                                                                                                   \
            } else {                                                                                                \
                wgmma_wait<1>();                                                                                    \
                reg_fence(s[0]);                                                                                    \
                if (alibi) p_pass<true, BITS, true>(s, hm, kr0, qc0, lse2_at, visible, pass_scale_log2, p_pass_bias); \
                else p_pass<false, BITS, true>(s, hm, kr0, qc0, lse2_at, visible, pass_scale_log2, p_pass_bias);    \
                _Pragma("unroll") for (int ks = 0; ks < C::QSTEPS; ++ks) kept_p_frags(ks, BITS ? keep : ~0u);       \
                wgmma_wait<0>();                                                                                    \
                reg_fence(dp[0]);                                                                                   \
                unscale_dp();                                                                                       \
                grad_pass<BITS, true>(s, dp, kr0, qc0, delta_at, keep);                                             \
                add_dbias_if_asked();                                                                               \
                _Pragma("unroll") for (int ks = 0; ks < C::QSTEPS; ++ks) ds_frags(s, ks);                           \
            }
                        if (C::SELECT_FREE_TILES && !needs_mask && !hm.dropout()) {
                            CUPYFLASH_OPTION_SCORES(false)
                        } else {
                            CUPYFLASH_OPTION_SCORES(true)
                        }
        #undef CUPYFLASH_OPTION_SCORES
                    }

                    // dV += P^T dO and dK += dS^T Q (fp32: the tile's sums, from zero).
                    wgmma_fence();
                    auto add_product = [&](auto& sum, const u32 (&high)[C::QSTEPS][4], const u32 (&low)[C::F32 ? C::QSTEPS : 1][4],
                                           const E* b_tile) {
                        for_each_product<C::PRODUCTS>([&](int pa, int pb, bool first) {
                            #pragma unroll
                            for (int ks = 0; ks < C::QSTEPS; ++ks) {
                                const u32 (&a)[4] = pa ? low[C::F32 ? ks : 0] : high[ks];
                                const u64 b = mnmajor_desc<E, BLOCK_M>(b_tile + pb * C::QO_ELEMS, r0 / 16 + ks);
                                if (C::F32 && first && ks == 0) Wgmma<E, D>::template rs<false>(sum[0], a, b);
                                else Wgmma<E, D>::template rs<true>(sum[0], a, b);
                            }
                        });
                    };
                    if constexpr (R::S) add_product(dv_sum, p_frag, p_low, sdOb);
                    if constexpr (R::DP) add_product(dk_sum, ds_frag, ds_low, sQb);
                    wgmma_commit();
                    if (bias_in_pass()) release(&bars.bias_empty);   // see above

                    // dS^T into shared memory for dQ: each k-step's A fragment with one stmatrix
                    // (quarter lane / 8 of the fragment at lane % 8's row).
                    #pragma unroll
                    for (int ks = 0; ks < (R::DP ? C::QSTEPS : 0); ++ks) {
                        const int quarter = lane / 8;
                        E* at = Swizzle128<E, BLOCK_N>::at(sdSb, warp_row0 + lane % 8 + (quarter % 2) * 8,
                                                           r0 + ks * 16 + (quarter / 2) * 8);
                        stmatrix_x4(at, ds_frag[ks]);
                        if constexpr (C::F32) stmatrix_x4(at + C::DS_ELEMS, ds_low[ks]);   // the low halves' plane
                    }
                }

                fence_async_smem();   // dS^T's writes, for the dQ products that read it
                named_barrier(C::CONSUMER_BARRIER, C::CONSUMER_THREADS);
                wgmma_wait<0>();   // dV and dK (ptxas follows the accumulators within an iteration)
                reg_fence(dv_sum[0]);
                reg_fence(dk_sum[0]);
                if constexpr (C::F32) {   // the tile's sums into dV, dK (rounding to nearest)
                    #pragma unroll
                    for (int i = 0; i < (R::S ? DT * 4 : 0); ++i) acc_dv[0][i / 4][i % 4] += dv_tile[0][i / 4][i % 4];
                    #pragma unroll
                    for (int i = 0; i < (R::DP ? DT * 4 : 0); ++i) acc_dk[0][i / 4][i % 4] += dk_tile[0][i / 4][i % 4];
                }
                more = !tile.has(Sm90BwdTileInfo::LAST);
                // The roles' dQ products read neither Q nor dO: the stage goes back now (its
                // record read above), where the others' goes back in the next tile.
                if constexpr (R::SHARED_KEYS) release(&bars.empty[s_]);
            }

            if (step > unit_step0) {   // the unit's last tile: its dQ, then K, V and its stage go back
                wgmma_fence();
                issue_dq(sdS + ((step - 1) % C::DS_BUFFERS) * DS_TILE);
                wgmma_wait<0>();
                if constexpr (!R::SHARED_KEYS) release(&bars.empty[(step - 1) % STAGES]);
                release(&bars.kv_empty);
                stage_dq(step - 1);
                ++kv_n;
            }
            // Epilogue as in bwd_sm80.cu, each gradient staged with padded rows in the dQ
            // staging tile once the copy engine has read the unit's last dQ tile from it (K and
            // V may be loading for the next unit meanwhile). The next unit's first dQ tile is
            // staged after its first consumer barrier, past these reads.
            T* sOut = reinterpret_cast<T*>(sdQ);
            const Strided<T> dV = tensor<T>(p.dv), dK = tensor<T>(p.dk);
            mbar_wait(&bars.dq_empty, (step & 1) ^ 1);
            // The wait orders every warp's staging of that tile before these writes (through the
            // dQ writer's barriers); this barrier says so to racecheck, which follows named
            // barriers but not mbarriers (400 hazards reported without it). Once a unit.
            consumer_sync();
            // dV, then dK, each staged by `stage_dv` / `stage_dk` and stored whole.
            auto store_grads = [&](auto&& stage_dv, auto&& stage_dk) {
                const int k_rows = min(BLOCK_N, mask.nk - k0);
                stage_dv();
                consumer_sync();
                store_tile<T, BLOCK_N, D, C::CONSUMER_THREADS>(dV.at(mods.tb, w.unit.hk, mods.k_base + k0), dV.row, sOut, k_rows,
                                                               dim_v, vec);
                consumer_sync();
                stage_dk();
                consumer_sync();
                store_tile<T, BLOCK_N, D, C::CONSUMER_THREADS>(dK.at(mods.tb, w.unit.hk, mods.k_base + k0), dK.row, sOut, k_rows,
                                                               d, vec);
            };
            // A piece of a split unit (Sm90BwdUnits): its dK and dV, in fp32, added into the
            // unit's sums (kv_partial: dK then dV, rows of D floats) by bulk reductions; the
            // piece whose reductions complete the unit's count (its counter after work_counter's
            // own) stores the sums. (A path of its own: with the accumulators' staging chosen
            // at run time, the d = 128 consumers spilled 8-32 bytes, build check.)
            if constexpr (C::SPLITS) {
                const int split = bars.consumers_split;
                if (split >= 0) {
                    float* sums = static_cast<float*>(p.kv_partial) + (i64)split * 2 * BLOCK_N * D;
                    add_piece(sums, acc_dk);
                    add_piece(sums + BLOCK_N * D, acc_dv);
                    bool last = false;
                    if (threadIdx.x == 0) {
                        bulk_wait<0>();
                        u32* pieces_done = reinterpret_cast<u32*>(p.work_counter) + 1 + split;
                        last = count_completed(pieces_done) + 1 == u32(p.unit_pieces);
                    }
                    if (!named_barrier_or(C::CONSUMER_BARRIER, C::CONSUMER_THREADS, last)) return;
                    fence_proxy_async_global();   // the other pieces' reductions, for the loads below
                    store_grads([&] { stage_sums<T, BLOCK_N, D, C::CONSUMER_THREADS>(sOut, sums + BLOCK_N * D, 1.f); },
                                [&] { stage_sums<T, BLOCK_N, D, C::CONSUMER_THREADS>(sOut, sums, scale); });
                    return;
                }
            }
            if constexpr (C::F32) {
                // Each role stores its gradient from its registers, a thread's pairs of columns
                // (fp32 rows: the 16-bit path's staging tile would not hold both), unscaled.
                const int k_rows = min(BLOCK_N, mask.nk - k0);
                auto store_rows = [&](const Strided<T>& X, const float (&acc)[1][DT][4], float mul, int cols) {
                    #pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int key = warp_row0 + g + 8 * hh;
                        if (key >= k_rows) continue;
                        T* row = X.at(mods.tb, w.unit.hk, mods.k_base + k0 + key);
                        #pragma unroll
                        for (int nt = 0; nt < DT; ++nt) {
                            const int col = nt * 8 + 2 * t;
                            if (vec && col + 1 < cols) {
                                *reinterpret_cast<float2*>(row + col) = make_float2(acc[0][nt][2 * hh] * mul, acc[0][nt][2 * hh + 1] * mul);
                            } else {
                                if (col < cols) row[col] = acc[0][nt][2 * hh] * mul;
                                if (col + 1 < cols) row[col + 1] = acc[0][nt][2 * hh + 1] * mul;
                            }
                        }
                    }
                };
                if constexpr (R::S) store_rows(dV, acc_dv, dv_unscale, dim_v);
                else store_rows(dK, acc_dk, scale * dk_unscale, d);
            } else if constexpr (R::SHARED_KEYS) {
                // Each role stages its gradient in its half of the staging tile and stores it.
                T* sMine = sOut + (R::S ? 0 : 1) * BLOCK_N * SmemTile<T, D>::stride;
                const int k_rows = min(BLOCK_N, mask.nk - k0), thread = threadIdx.x % 128;
                if constexpr (R::S) warp_store_c<T, D>(sMine, warp_row0, acc_dv, 1.f);
                else warp_store_c<T, D>(sMine, warp_row0, acc_dk, scale);
                consumer_sync();
                if constexpr (R::S)
                    store_tile<T, BLOCK_N, D, 128>(dV.at(mods.tb, w.unit.hk, mods.k_base + k0), dV.row, sMine, k_rows, dim_v, vec,
                                                   thread);
                else
                    store_tile<T, BLOCK_N, D, 128>(dK.at(mods.tb, w.unit.hk, mods.k_base + k0), dK.row, sMine, k_rows, d, vec,
                                                   thread);
            } else {
                store_grads([&] { warp_store_c<T, D>(sOut, warp_row0, acc_dv, 1.f); },
                            [&] { warp_store_c<T, D>(sOut, warp_row0, acc_dk, scale); });
            }
        });
    };
    if constexpr (C::ROLES) {
        if (wg == 0) consume(Sm90BwdRole<D, Sm90BwdRole<D, 0>::DV>());
        else consume(Sm90BwdRole<D, Sm90BwdRole<D, 0>::DK>());
    } else {
        consume(Sm90BwdRole<D, Sm90BwdRole<D, 0>::BOTH>());
    }
}
