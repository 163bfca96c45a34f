// Forward attention on Hopper's warpgroup MMA (sm_90a, fp16/bf16).
//
// The partitioning and the online softmax of fwd_sm80.cu, with the products on wgmma:
// a CTA of WARPGROUPS warpgroups owns 64 query rows per warpgroup; for each key tile
// every warpgroup computes its S = Q K_j^T (both operands read from shared memory by
// descriptor) and O += P V_j (P from its registers, V read N-major), 64 x BLOCK_N and
// 64 x D per instruction sequence instead of a warp's 16 x 8 pieces. Each warp then
// holds one 16-row m-tile of S and O in the mma.sync fragment layout (wgmma.cuh), so
// masks and the softmax are fwd_sm80's, with MT = 1. Dense mode only (plain and causal):
// with the options' registers every tile spilled (build check), so fwd_sm80 serves those.
// Q, K and V sit in shared memory in the 128-byte-swizzled layout that the descriptors
// address; K and V are double-buffered by cp.async as in fwd_sm80.cu. Each warpgroup
// overlaps its softmax of one key tile with its P V of the previous one (the pipeline
// in the main loop), and the warpgroups wait for their own products only.
#include "elem.cuh"
#include "copy.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "tensor.cuh"
#include "warp_mm.cuh"
#include "wgmma.cuh"

template <typename T, int D, int BLOCK_N, int WARPGROUPS>
struct Sm90FwdTile {
    static constexpr int THREADS = WARPGROUPS * 128;
    static constexpr int BLOCK_M = WARPGROUPS * 64;
    static constexpr int NT = BLOCK_N / 8;          // n-tiles of S per warp
    static constexpr int DT = D / 8;                // n-tiles of O per warp
    static constexpr int KSTEPS = D / 16;           // k-steps of Q K^T
    static constexpr int PSTEPS = BLOCK_N / 16;     // k-steps of P V
    static constexpr int Q_ELEMS = BLOCK_M * D, KV_ELEMS = BLOCK_N * D;
    // Shared memory (cupyflash/_cuda.py mirrors it): Q, then K and V twice each; the
    // epilogue stages O over Q and K with padded rows.
    static constexpr int ALIGN = 1024;              // Swizzle128 tiles start on 1024 bytes
    static_assert(D % 64 == 0 && BLOCK_N % 64 == 0 && BLOCK_N <= 256 && D <= 256, "tile shape");
    static_assert(Q_ELEMS + 2 * KV_ELEMS >= BLOCK_M * SmemTile<T, D>::stride, "epilogue staging");
};

// CTAS_PER_SM resident CTAs: with one, the tiles may take most of the shared memory and
// each thread up to 255 registers for S, O and P; with two, ptxas must fit each thread in
// half the register file, and one CTA's load prologue, softmax and epilogue overlap the
// other's products (the warpgroups of one CTA meet at a barrier every key tile, so they
// leave the tensor cores idle at the same moments).
template <typename T, int D, int BLOCK_N, int WARPGROUPS, int CTAS_PER_SM, int MODE>
__global__ void __launch_bounds__(WARPGROUPS * 128, CTAS_PER_SM)
flash_fwd_sm90(TENSOR_ARG(const T, q), TENSOR_ARG(const T, k), TENSOR_ARG(const T, v),
               TENSOR_ARG(T, o), float* __restrict__ lse,
               int group, int nq, int nk, int d, int dv,
               float scale_log2, int causal, int vec, MODS_ARGS(T, float))
{
    static_assert(MODE == MODE_DENSE, "the options run in fwd_sm80.cu");
    typedef Sm90FwdTile<T, D, BLOCK_N, WARPGROUPS> C;
    constexpr int BLOCK_M = C::BLOCK_M, NT = C::NT, DT = C::DT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw + (C::ALIGN - smem_addr(smem_raw) % C::ALIGN) % C::ALIGN);
    T* sK = sQ + C::Q_ELEMS;               // two buffers
    T* sV = sK + 2 * C::KV_ELEMS;          // two buffers

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int wg_row0 = (warp / 4) * 64;   // this warpgroup's rows of the query tile
    const int warp_row0 = warp * 16;       // this warp's m-tile
    // Heavy (late, causal) query blocks first so the tail of the grid is short.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    MODS_SETUP(T, float, MODE, b, gridDim.y, nq, nk, causal);
    const auto& mask = mods.mask;
    const int q0 = m_block * BLOCK_M;
    const int q_rows = min(BLOCK_M, mask.nq - q0);
    if (q_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
    const int key_rows = mask.stop();   // rows past it are never read (key padding)

    const Strided<const T> Q = TENSOR(const T, q), K = TENSOR(const T, k), V = TENSOR(const T, v);
    const Strided<T> O = TENSOR(T, o);
    const T* k_head = K.at(mods.tb, hk, mods.k_base);
    const T* v_head = V.at(mods.tb, hk, mods.k_base);
    auto load_k = [&](int j, int buf) {
        load_tile_swizzled<T, BLOCK_N, D, C::THREADS>(sK + buf * C::KV_ELEMS, k_head + (i64)j * BLOCK_N * K.row,
                                                          K.row, min(BLOCK_N, key_rows - j * BLOCK_N), d, vec);
    };
    auto load_v = [&](int j, int buf) {
        load_tile_swizzled<T, BLOCK_N, D, C::THREADS>(sV + buf * C::KV_ELEMS, v_head + (i64)j * BLOCK_N * V.row,
                                                          V.row, min(BLOCK_N, key_rows - j * BLOCK_N), dv, vec);
    };
    const int first = mask.next_key_tile(tiles.x, tiles.y, q0, q0 + q_rows, BLOCK_N, h);

    load_tile_swizzled<T, BLOCK_M, D, C::THREADS>(sQ, Q.at(mods.tb, h, mods.q_base + q0), Q.row, q_rows, d, vec);
    if (first < tiles.y) load_k(first, 0);
    cp_async_commit();
    if (first < tiles.y) load_v(first, 0);
    cp_async_commit();

    float acc[1][DT][4];
    zero_frags(acc);
    OnlineSoftmax<1> softmax;
    softmax.init();
    float s[1][NT][4];
    u32 p[C::PSTEPS][4];   // P of the tile whose P V is next, as A fragments
    float alpha[1][2];

    // S = Q K^T of the key tile in buffer `buf` (this warpgroup's 64 rows), issued as one
    // batch; the caller waits for it.
    auto issue_s = [&](int buf) {
        const T* sKb = sK + buf * C::KV_ELEMS;
        wgmma_fence();
        Wgmma<T, BLOCK_N>::template ss<false>(s[0], kmajor_desc<T, BLOCK_M>(sQ, wg_row0, 0), kmajor_desc<T, BLOCK_N>(sKb, 0, 0));
        #pragma unroll
        for (int ks = 1; ks < C::KSTEPS; ++ks)
            Wgmma<T, BLOCK_N>::template ss<true>(s[0], kmajor_desc<T, BLOCK_M>(sQ, wg_row0, ks), kmajor_desc<T, BLOCK_N>(sKb, 0, ks));
        wgmma_commit();
    };
    // O += P V of the tile in buffer `buf`, issued as one batch.
    auto issue_pv = [&](int buf) {
        wgmma_fence();
        #pragma unroll
        for (int ks = 0; ks < C::PSTEPS; ++ks)
            Wgmma<T, D>::template rs<true>(acc[0], p[ks], mnmajor_desc<T, BLOCK_N>(sV + buf * C::KV_ELEMS, ks));
        wgmma_commit();
    };
    // The mask on the scores of key tile jt, folded into the softmax state: s becomes P.
    // Returns whether acc must be rescaled by alpha before this tile's P V is added.
    auto softmax_tile = [&](int jt) {
        const int k0 = jt * BLOCK_N;
        const bool needs_mask = mask.tile_needs_mask(q0, q0 + q_rows, k0, k0 + BLOCK_N, h);
        bool grew;
        if (needs_mask) mask.apply(s, q0 + warp_row0, k0);
        grew = softmax.fold(s, scale_log2, alpha);
        return grew;
    };
    // P into A fragments; p must not change while a P V that reads it is in flight.
    auto round_p = [&]() {
        #pragma unroll
        for (int ks = 0; ks < C::PSTEPS; ++ks) c_to_a_frag<T>(p[ks], s, 0, ks);
    };

    // Pipeline: the t-th key tile visited sits in buffer t % 2 (K and V alike). Before
    // the loop, S and P of the first tile; while there is a next tile, an iteration
    // issues S of the next tile and P V of this one back to back, and runs the softmax
    // of the next tile while the tensor cores still accumulate P V; acc is rescaled only
    // once that product has landed. The last P V follows the loop. (The issue order is
    // unconditional inside the loop: a wgmma batch issued on one path only would leave
    // register copies between the wgmmas and their wait.)
    int next = tiles.y, it = 0;
    if (first < tiles.y) {
        cp_async_wait<1>();   // Q and K of the first tile have landed
        fence_async_smem();
        __syncthreads();
        issue_s(0);
        next = mask.next_key_tile(first + 1, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
        if (next < tiles.y) load_k(next, 1);
        cp_async_commit();
        wgmma_wait<0>();
        reg_fence(s[0]);
        softmax_tile(first);   // acc is still 0: nothing to rescale
        round_p();
    }
    for (; next < tiles.y; ++it) {
        const int buf = it % 2;
        cp_async_wait<0>();   // V of this tile and K of the next have landed
        fence_async_smem();
        __syncthreads();      // ... for all threads, and no warpgroup reads the other buffers any more
        const int after = mask.next_key_tile(next + 1, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
        load_v(next, buf ^ 1);
        if (after < tiles.y) load_k(after, buf);
        cp_async_commit();

        issue_s(buf ^ 1);
        issue_pv(buf);
        wgmma_wait<1>();   // S of the next tile (P V may still run)
        reg_fence(s[0]);
        const bool grew = softmax_tile(next);
        wgmma_wait<0>();
        reg_fence(acc[0]);
        if (grew) softmax.rescale(acc, alpha);
        round_p();
        next = after;
    }
    if (first < tiles.y) {
        cp_async_wait<0>();   // V of the last tile has landed
        fence_async_smem();
        __syncthreads();
        issue_pv(it % 2);
        wgmma_wait<0>();
        reg_fence(acc[0]);
    }

    float row_lse[1][2];
    softmax.finalize(acc, row_lse);

    // Epilogue as in fwd_sm80.cu, the output staged with padded rows over Q and K (every
    // warpgroup is past its last product once all threads pass the barrier).
    cp_async_wait<0>();
    __syncthreads();
    warp_store_c<T, D>(sQ, warp_row0, acc, 1.f);
    #pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = warp_row0 + g + hh * 8;
        if (t == 0 && r < q_rows) lse[((i64)mods.tb * gridDim.y + h) * nq + mods.q_base + q0 + r] = row_lse[0][hh];
    }
    __syncthreads();
    store_tile<T, BLOCK_M, D, C::THREADS>(O.at(mods.tb, h, mods.q_base + q0), O.row, sQ, q_rows, dv, vec);
}
