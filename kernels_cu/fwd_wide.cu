// Forward attention on the tensor cores for fp32 and fp64 inputs, at the inputs' own
// precision (sm_80 and newer): fp64 on DMMA, fp32 as 3xTF32 (mma_wide.cuh).
//
// The FlashAttention-2 structure of fwd_sm80.cu: one CTA per (query block, head, batch),
// query rows split across warps in 16-row m-tiles, every warp streaming the same K and V
// tiles from shared memory. Differences, all from the wider elements:
//  - K and V tiles of BLOCK_N keys are double-buffered with cp.async and one barrier per
//    tile: after it, tile j+1 is requested into the buffers tile j-1 left, and lands
//    while the warps compute tile j. They do so SUB_N keys at a time (S, softmax, P V), so
//    S takes registers for SUB_N keys while barriers and copies are paid per BLOCK_N.
//  - Fragments come from plain 8/16-byte shared loads with their own paddings, and P goes
//    from the S accumulators to the P V operands without any data movement (mma_wide.cuh).
//  - For fp32, O = P V is accumulated per 16-column pair over one sub-tile from zero and
//    then added into the output accumulator in the FPU. The tensor cores truncate (round
//    toward zero) as they accumulate TF32 products; over the whole key sequence that bias
//    would grow with Nk, per sub-tile it does not (tests/test_tf32_split.py). DMMA rounds
//    to nearest and accumulates into O directly.
//  - Where O does not fit the registers beside S (fp64 from d = 192), the output columns
//    are split into D / DV_TILE passes run by separate CTAs (blockIdx.x = query block *
//    passes + pass), each recomputing S and streaming only its own V columns.
//  - The output is written from registers: each thread holds four consecutive columns of
//    a row (16 or 32 bytes), so a quad writes 64 or 128 contiguous bytes.
#include "elem.cuh"
#include "copy.cuh"
#include "mma_wide.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "tensor.cuh"

template <typename T, int D, int DV_TILE, int BLOCK_M, int BLOCK_N, int SUB_N, int WARPS>
struct WideFwdTile {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int ROWS_PER_WARP = BLOCK_M / WARPS;
    static constexpr int MT = ROWS_PER_WARP / 16;   // m-tiles per warp
    static constexpr int SUBS = BLOCK_N / SUB_N;    // sub-tiles per loaded tile
    static constexpr int NT = SUB_N / 8;            // n-tiles of S, k-steps of P V
    static constexpr int KSTEPS = D / 8;            // k-steps of Q K^T
    static constexpr int DT = DV_TILE / 8;          // n-tiles of O in one column pass
    // Independent MMA chains of S (mma_wide.cuh wide_mm_ABt_from): fp32's 16-key sub-tiles
    // (d >= 192) have two products a k-step, each three dependent TF32 MMAs (four chains:
    // 1.03x at d = 192 and 256, H200, session 22); fp64 and wider sub-tiles need none.
    static constexpr int CHAINS = sizeof(T) == 4 ? 4 : 1;
    typedef PairRows<T, D> QKRows;                             // Q and K
    typedef RowMajor<SmemTile<T, DV_TILE>::stride> VRows;
    static constexpr int LDQ = QKRows::stride, LDV = VRows::stride;
    static constexpr int SMEM_ELEMS = BLOCK_M * LDQ + 2 * BLOCK_N * LDQ + 2 * BLOCK_N * LDV;
    static constexpr int SMEM_BYTES = SMEM_ELEMS * sizeof(T);
    // fp64 on Hopper (sm_90, 228 KB of shared memory an SM): as many CTAs an SM as its
    // shared memory holds (up to 4; 1 KB a CTA reserved; MODE_EXT's static option state,
    // 512 bytes at most, is not counted: it moves none of the tables' fp64 tiles across a
    // count), given to ptxas as the launch bound's
    // minimum, so that each thread keeps to its share of the registers and the CTAs are
    // resident at once: more warps a scheduler to cover the DMMA and fp64 latencies.
    // Elsewhere one, as before: other GPUs (and a PTX target standing for a newer GPU)
    // have other shared memory and were not measured, and fp32 runs these kernels only
    // before Hopper.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)   // sm_90a, the Hopper target (_nvrtc.target_for)
    static constexpr int SM_SMEM = 233472;
#else
    static constexpr int SM_SMEM = 0;
#endif
    static constexpr int FIT = SM_SMEM / (SMEM_BYTES + 1024);
    static constexpr int MIN_BLOCKS = sizeof(T) == 8 && FIT > 1 ? (FIT < 4 ? FIT : 4) : 1;
    // Q's operands (split into TF32 pairs for fp32) stay in registers when they fit beside
    // S, P and O, with all 255 registers a thread; otherwise each warp re-reads its own Q
    // rows for every sub-tile.
    static constexpr bool Q_IN_REGS = MT * D <= 64 && 65536 / (MIN_BLOCKS * THREADS) >= 255;
    static_assert(ROWS_PER_WARP % 16 == 0 && SUB_N % 8 == 0 && BLOCK_N % SUB_N == 0, "tile shape");
    static_assert(D % 32 == 0 && DV_TILE % 16 == 0 && D % DV_TILE == 0, "conflict-free shared strides");
};

// The launch bound's minimum is the tile's MIN_BLOCKS: with none, ptxas aims at a third
// resident 4-warp CTA (168 registers) and spills tiles whose shared memory allows two;
// fp64 tiles state the count their shared memory allows. SMEM_BYTES is the host's figure
// of the dynamic shared memory, checked against the tile.
template <typename T, int D, int DV_TILE, int BLOCK_M, int BLOCK_N, int SUB_N, int WARPS, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, WideFwdTile<T, D, DV_TILE, BLOCK_M, BLOCK_N, SUB_N, WARPS>::MIN_BLOCKS)
flash_fwd_wide(const __grid_constant__ AttnParams p)
{
    typedef WideFwdTile<T, D, DV_TILE, BLOCK_M, BLOCK_N, SUB_N, WARPS> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    const int group = p.group, nq = p.nq, d = p.d, dv = p.dim_v, vec = p.vec;
    const T scale_log2 = T(p.scale_log2);
    T* lse = static_cast<T*>(p.lse);
    constexpr int MT = C::MT, NT = C::NT, DT = C::DT, LDQ = C::LDQ, LDV = C::LDV;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BLOCK_M * LDQ;            // two buffers
    T* sV = sK + 2 * BLOCK_N * LDQ;        // two buffers

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // blockIdx.x = query block * PASSES + column pass; heavy (late, causal) query blocks
    // first so the tail of the grid is short.
    constexpr int PASSES = D / DV_TILE;
    const int m_block = gridDim.x / PASSES - 1 - blockIdx.x / PASSES;
    const int c0 = blockIdx.x % PASSES * DV_TILE;   // first output column of this CTA
    if (c0 >= dv) return;        // dv < D may need fewer passes
    const int v_cols = dv - c0;  // its V and O columns that exist
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    MODS_SETUP(T, T, MODE, p, b, gridDim.y);
    const auto& mask = mods.mask;
    const int q0 = m_block * BLOCK_M;
    const int q_rows = min(BLOCK_M, mask.nq - q0);
    if (q_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
    // Sub-tiles from this key on are hidden from every row of the block: skipped.
    const int key_stop = min(mask.stop(), mask.key_hi(q0 + q_rows - 1));

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<T> O = tensor<T>(p.o);
    const T* k_head = K.at(mods.tb, hk, mods.k_base);
    const T* v_head = V.at(mods.tb, hk, mods.k_base) + c0;

    // Key tile j (its rows before the key stop) into buffer `buf`.
    auto load_kv = [&](int j, int buf) {
        const int n = min(BLOCK_N, mask.stop() - j * BLOCK_N);
        load_tile<T, BLOCK_N, D, C::THREADS, LDQ>(sK + buf * BLOCK_N * LDQ, k_head + (i64)j * BLOCK_N * K.row, K.row, n, d, vec);
        load_tile<T, BLOCK_N, DV_TILE, C::THREADS>(sV + buf * BLOCK_N * LDV, v_head + (i64)j * BLOCK_N * V.row, V.row, n, v_cols, vec);
    };
    int j = mask.next_key_tile(tiles.x, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
    load_tile<T, BLOCK_M, D, C::THREADS, LDQ>(sQ, Q.at(mods.tb, h, mods.q_base + q0), Q.row, q_rows, d, vec);
    if (j < tiles.y) load_kv(j, 0);
    cp_async_commit();

    const int warp_row0 = warp * C::ROWS_PER_WARP;
    Operand<T, 4> q_frag[C::Q_IN_REGS ? MT : 1][C::Q_IN_REGS ? C::KSTEPS : 1];
    T acc[MT][DT][4];
    zero_frags(acc);
    OnlineSoftmax<MT, T> softmax;
    softmax.init();

    for (int it = 0; j < tiles.y; ++it) {
        const int next = mask.next_key_tile(j + 1, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
        cp_async_wait<0>();   // tile j (and Q) have landed
        __syncthreads();      // ... for every thread, and every warp is done with the previous tile
        if (next < tiles.y) load_kv(next, (it + 1) % 2);
        cp_async_commit();

        if (C::Q_IN_REGS && it == 0) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int ks = 0; ks < C::KSTEPS; ++ks)
                    load_a<typename C::QKRows>(q_frag[C::Q_IN_REGS ? mt : 0][C::Q_IN_REGS ? ks : 0], sQ, warp_row0 + mt * 16, ks * 8);
        }

        #pragma unroll 1
        for (int sub = 0; sub < C::SUBS; ++sub) {
            const int k0 = j * BLOCK_N + sub * SUB_N;
            if (k0 >= key_stop) break;
            const T* sKs = sK + ((it % 2) * BLOCK_N + sub * SUB_N) * LDQ;
            const T* sVs = sV + ((it % 2) * BLOCK_N + sub * SUB_N) * LDV;

            // S = Q K_sub^T
            T s[MT][NT][4];
            zero_frags(s);
            wide_mm_ABt_from<typename C::QKRows, C::KSTEPS, C::CHAINS>(s, [&](Operand<T, 4>& a, int mt, int ks) {
                if (C::Q_IN_REGS) a = q_frag[C::Q_IN_REGS ? mt : 0][C::Q_IN_REGS ? ks : 0];
                else load_a<typename C::QKRows>(a, sQ, warp_row0 + mt * 16, ks * 8);
            }, sKs);

            // The predicate runs only on sub-tiles that are not wholly visible.
            const bool needs_mask = mask.tile_needs_mask(q0, q0 + q_rows, k0, k0 + SUB_N, h);
            if constexpr (MODE == MODE_DENSE) {
                if (needs_mask) mask.apply(s, q0 + warp_row0, k0);
                softmax.update(s, acc, scale_log2);
            } else {
                T unused[1][1][4];
                const auto hm = mods.at_head(h);
                hm.template scores_log2<false>(s, unused, q0 + warp_row0, k0, scale_log2, needs_mask);
                softmax.update(s, acc, T(1));
                if (hm.dropout())
                    for_each_score<false>(s, q0 + warp_row0, k0, [&](T& x, int i, int jj, int, int, int) {
                        if (!hm.keep(i, jj)) x = T(0);
                    });
            }

            // O += P V_sub.
            wide_mm_AB<typename C::VRows>(acc, s, sVs);
        }
        j = next;
    }
    cp_async_wait<0>();   // with no key tile the Q copies may still be in flight

    T row_lse[MT][2];
    softmax.finalize(acc, row_lse, mods.dropout() ? mods.drop_scale : T(1));

    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = warp_row0 + mt * 16 + g + hh * 8;
            if (r >= q_rows) continue;
            T* out = O.at(mods.tb, h, mods.q_base + q0 + r) + c0;
            #pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp)
                store_o_row(out + dp * 16, acc[mt][2 * dp], acc[mt][2 * dp + 1], hh, v_cols - dp * 16, vec);
            if (c0 == 0 && t == 0) lse[((i64)mods.tb * gridDim.y + h) * nq + mods.q_base + q0 + r] = row_lse[mt][hh];
        }
    }
}
