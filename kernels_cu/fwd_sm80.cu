// Forward attention on the tensor cores (sm_80 and newer, fp16/bf16).
//
// FlashAttention-2 partitioning: one CTA per (query block, batch*head); the query rows
// are split across warps (ROWS_PER_WARP each, in 16-row m-tiles) and every warp streams
// the same K/V tiles from shared memory, so no warp ever reduces through shared memory.
// K and V tiles are double-buffered with cp.async: the next key tile of K loads while the
// warps run the softmax of this one, and the next of V while they multiply P by V.
// MODE (mods.cuh) adds the options: tiles the window or the block mask leave out are
// never loaded, scores go through HeadMods::score_log2, and dropout zeroes P after the row
// sums took it (the LSE is that of the undropped softmax).
#include "elem.cuh"
#include "copy.cuh"
#include "mma.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "tensor.cuh"
#include "warp_mm.cuh"

template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS>
struct FwdTile {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int ROWS_PER_WARP = BLOCK_M / WARPS;
    static constexpr int MT = ROWS_PER_WARP / 16;   // m-tiles per warp
    static constexpr int NT = BLOCK_N / 8;          // n-tiles of S
    static constexpr int DT = D / 8;                // n-tiles of O
    static constexpr int KSTEPS = D / 16;           // k-steps of Q K^T
    static constexpr int PSTEPS = BLOCK_N / 16;     // k-steps of P V
    static constexpr int LD = SmemTile<T, D>::stride;
    // Q fragments stay in registers when they fit beside S and O; otherwise each warp
    // re-reads its own Q rows from shared memory for every K tile.
    static constexpr bool Q_IN_REGS = MT * D <= 128;
    static constexpr int SMEM_ELEMS = (BLOCK_M + 4 * BLOCK_N) * LD;
    static constexpr int SMEM_BYTES = SMEM_ELEMS * sizeof(T);
    static_assert(ROWS_PER_WARP % 16 == 0 && D % 16 == 0 && BLOCK_N % 16 == 0, "tile shape");
};

// Minimum one CTA per SM: without it ptxas aims at more resident CTAs than shared memory
// allows and spills (as in fwd_wide.cu). SMEM_BYTES is the host's figure of the dynamic
// shared memory (cupyflash/_kernels.py), checked against the tile's layout.
template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_fwd_sm80(const __grid_constant__ AttnParams p)
{
    typedef FwdTile<T, D, BLOCK_M, BLOCK_N, WARPS> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    const int group = p.group, nq = p.nq, d = p.d, dv = p.dim_v, vec = p.vec;
    const float scale_log2 = float(p.scale_log2);
    float* lse = static_cast<float*>(p.lse);
    constexpr int MT = C::MT, NT = C::NT, DT = C::DT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + BLOCK_M * C::LD;          // two buffers
    T* sV = sK + 2 * BLOCK_N * C::LD;      // two buffers

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // Heavy (late, causal) query blocks first so the tail of the grid is short.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    MODS_SETUP(T, float, MODE, p, b, gridDim.y);
    const auto& mask = mods.mask;
    const int q0 = m_block * BLOCK_M;
    const int q_rows = min(BLOCK_M, mask.nq - q0);
    if (q_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
    const int key_rows = mask.stop();   // rows past it are never read (key padding)

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<T> O = tensor<T>(p.o);
    const T* k_head = K.at(mods.tb, hk, mods.k_base);
    const T* v_head = V.at(mods.tb, hk, mods.k_base);
    auto load_k = [&](int j, int buf) {
        load_tile<T, BLOCK_N, D, C::THREADS>(sK + buf * BLOCK_N * C::LD, k_head + (i64)j * BLOCK_N * K.row,
                                             K.row, min(BLOCK_N, key_rows - j * BLOCK_N), d, vec);
    };
    auto load_v = [&](int j, int buf) {
        load_tile<T, BLOCK_N, D, C::THREADS>(sV + buf * BLOCK_N * C::LD, v_head + (i64)j * BLOCK_N * V.row,
                                             V.row, min(BLOCK_N, key_rows - j * BLOCK_N), dv, vec);
    };
    int j = mask.next_key_tile(tiles.x, tiles.y, q0, q0 + q_rows, BLOCK_N, h);

    load_tile<T, BLOCK_M, D, C::THREADS>(sQ, Q.at(mods.tb, h, mods.q_base + q0), Q.row, q_rows, d, vec);
    if (j < tiles.y) load_k(j, 0);
    cp_async_commit();
    if (j < tiles.y) load_v(j, 0);
    cp_async_commit();

    const int warp_row0 = warp * C::ROWS_PER_WARP;
    float acc[MT][DT][4];
    zero_frags(acc);
    OnlineSoftmax<MT> softmax;
    softmax.init();
    u32 q_frag[C::Q_IN_REGS ? MT : 1][C::Q_IN_REGS ? C::KSTEPS : 1][4];   // used when Q_IN_REGS

    for (int it = 0; j < tiles.y; ++it) {
        const int k0 = j * BLOCK_N;
        const int next = mask.next_key_tile(j + 1, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
        // The buffer of this tile: the dense path visits every tile, so j's parity serves
        // and the loop keeps one induction variable.
        const int buf = (MODE == MODE_DENSE ? j : it) % 2;
        const T* sKj = sK + buf * BLOCK_N * C::LD;
        const T* sVj = sV + buf * BLOCK_N * C::LD;
        cp_async_wait<1>();   // Q and K_j have landed
        __syncthreads();

        // S = Q K_j^T
        float s[MT][NT][4];
        zero_frags(s);
        if constexpr (C::Q_IN_REGS) {
            if (MODE == MODE_DENSE ? j == 0 : it == 0) {   // the first tile visited
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    #pragma unroll
                    for (int ks = 0; ks < C::KSTEPS; ++ks)
                        load_a_frag<T, D>(q_frag[mt][ks], sQ, warp_row0 + mt * 16, ks * 16);
            }
            warp_mm_ABt_from<T, D, MT, NT, C::KSTEPS>(
                s, [&](u32 (&a)[4], int mt, int ks) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) a[e] = q_frag[mt][ks][e];
                }, sKj);
        } else {
            warp_mm_ABt<T, D, MT, NT, C::KSTEPS>(s, sQ, warp_row0, sKj);
        }

        // Prefetch the next K tile into the other buffer: every warp finished reading it
        // (the previous tile) before the barrier above. An empty group keeps the wait
        // counts uniform.
        if (next < tiles.y) load_k(next, buf ^ 1);
        cp_async_commit();

        // Hide what a row may not see; the predicate runs only on tiles that are not
        // wholly visible (a uniform branch).
        const bool needs_mask = mask.tile_needs_mask(q0, q0 + q_rows, k0, k0 + BLOCK_N, h);
        if constexpr (MODE == MODE_DENSE) {
            if (needs_mask) mask.apply(s, q0 + warp_row0, k0);
            softmax.update(s, acc, scale_log2);
        } else {
            float unused[1][1][4];
            const auto hm = mods.at_head(h);
            hm.template scores_log2<false>(s, unused, q0 + warp_row0, k0, scale_log2, needs_mask);
            softmax.update(s, acc, 1.f);
            if (hm.dropout())
                for_each_score<false>(s, q0 + warp_row0, k0, [&](float& x, int i, int jj, int, int, int) {
                    if (!hm.keep(i, jj)) x = 0.f;
                });
        }

        cp_async_wait<1>();   // V_j has landed
        __syncthreads();

        // O += P V_j, P taken straight from the S accumulators
        warp_mm_AB<T, D, MT, NT, DT>(acc, s, sVj);

        if (next < tiles.y) load_v(next, buf ^ 1);
        cp_async_commit();
        j = next;
    }

    float row_lse[MT][2];
    softmax.finalize(acc, row_lse, mods.dropout() ? mods.drop_scale : 1.f);

    // Epilogue: each warp rounds its rows into its own rows of the Q tile (no other warp
    // reads them), then the CTA writes the tile out with wide, coalesced stores.
    cp_async_wait<0>();   // with no key tile, the Q copies may still be in flight
    __syncthreads();
    warp_store_c<T, D>(sQ, warp_row0, acc, 1.f);
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = warp_row0 + mt * 16 + g + hh * 8;
            if (t == 0 && r < q_rows) lse[((i64)mods.tb * gridDim.y + h) * nq + mods.q_base + q0 + r] = row_lse[mt][hh];
        }
    __syncthreads();
    store_tile<T, BLOCK_M, D, C::THREADS>(O.at(mods.tb, h, mods.q_base + q0), O.row, sQ, q_rows, dv, vec);
}
