// Backward attention's key-block kernel on Hopper's warpgroup MMA (sm_90a, fp16/bf16,
// dense mode): bwd_sm80.cu's flash_bwd_dkdv_sm80 with its five products on wgmma.
//
// A CTA owns BLOCK_N = 64 WARPGROUPS keys of one kv head, 64 per warpgroup, and walks the
// (query head, query tile) pairs that see them (bwd.cuh KeyBlockPairs), with Q, dO and
// the row workspaces double-buffered by cp.async. Per query tile of BLOCK_M rows, each
// warpgroup computes for its keys
//   S^T  = K Q^T      A: K (K-major, its 64 rows)   B: Q  (K-major)        wgmma ss
//   dP^T = V dO^T     A: V (K-major)                B: dO (K-major)        wgmma ss
//   P^T = exp2(S^T scale log2 e - lse2), dS^T = P^T o (dP^T - delta)   (bwd.cuh, in registers)
//   dV  += P^T dO     A: P^T (registers)            B: dO (MN-major)       wgmma rs
//   dK  += dS^T Q     A: dS^T (registers)           B: Q  (MN-major)       wgmma rs
// with dK and dV in registers for the whole key block. The transposed products put the
// keys on the accumulator rows, so P^T and dS^T come out of their C fragments directly
// as the A operands of the next products (wgmma.cuh: each warp holds 16 rows in the
// mma.sync layout), as in the sm80 kernel.
// With GRAD_DQ (the non-deterministic mode) the warpgroups also write dS^T into shared
// memory and compute dQ = dS K over all BLOCK_N keys, the BLOCK_M x D tile split into one
// 64 x DQ_N piece per warpgroup (A: dS^T read MN-major, i.e. transposed; B: K, MN-major),
// then add their piece into the fp32 dQ workspace with two-float reductions. The
// deterministic mode runs bwd_sm80.cu's dQ kernel instead.
// All tiles use the 128-byte-swizzled layout (wgmma.cuh Swizzle128).
#include "elem.cuh"
#include "copy.cuh"
#include "mods.cuh"
#include "tensor.cuh"
#include "warp_mm.cuh"
#include "wgmma.cuh"
#include "bwd.cuh"

template <typename T, int D, int BLOCK_M, int WARPGROUPS, int GRADS>
struct Sm90BwdKVTile {
    static constexpr int THREADS = WARPGROUPS * 128;
    static constexpr int BLOCK_N = WARPGROUPS * 64;
    static constexpr int QT = BLOCK_M / 8;           // query n-tiles of S^T, dP^T per warp
    static constexpr int DT = D / 8;                 // n-tiles of dK, dV per warp
    static constexpr int KSTEPS = D / 16;            // k-steps of K Q^T and V dO^T
    static constexpr int QSTEPS = BLOCK_M / 16;      // k-steps of P^T dO and dS^T Q
    static constexpr int NSTEPS = BLOCK_N / 16;      // k-steps of dS K
    static constexpr bool DQ = GRADS & GRAD_DQ;
    // dQ's BLOCK_M x D tile in one 64 x DQ_N piece per warpgroup: DQ_COLS pieces across.
    static constexpr int DQ_N = BLOCK_M * D / (64 * WARPGROUPS);
    static constexpr int DQ_COLS = D / DQ_N;
    // Shared memory, each tile 1024-byte aligned (cupyflash/_cuda.py mirrors the sizes):
    // K, V, Q and dO twice, dS^T (with dQ); lse2 and delta twice.
    static constexpr int KV_ELEMS = BLOCK_N * D, QO_ELEMS = BLOCK_M * D;
    static constexpr int DS_ELEMS = DQ ? BLOCK_N * BLOCK_M : 0;
    static constexpr int ALIGN = 1024;
    static constexpr int SMEM_BYTES = (2 * KV_ELEMS + 4 * QO_ELEMS + DS_ELEMS) * sizeof(T) + 4 * BLOCK_M * sizeof(float) + ALIGN;
    static_assert((GRADS & (GRAD_DV | GRAD_DK)) == (GRAD_DV | GRAD_DK), "dV and dK in one pass");
    static_assert(D % 64 == 0 && D <= 128 && BLOCK_M % 64 == 0 && BLOCK_M <= 128, "tile shape");
    static_assert(DQ_N % 64 == 0 && D % DQ_N == 0 && (BLOCK_M / 64) * DQ_COLS == WARPGROUPS, "dQ pieces");
    static_assert(BWD_ROW_PAD % BLOCK_M == 0, "query tiles read the padded row workspaces whole");
    static_assert(2 * KV_ELEMS >= BLOCK_N * SmemTile<T, D>::stride, "epilogue staging");
};

// Two floats added into global memory as one reduction (sm_90: red.global.add.v2.f32);
// p must be 8-byte aligned.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
}

// One CTA per SM: the tiles take most of the shared memory, and the bound lets ptxas
// give each thread the registers of dK, dV and the score tiles. The signature is
// flash_bwd_dkdv_sm80's, so the host launches either the same way (BLOCK_M is its
// query tile, the grid's first axis counts key blocks of BLOCK_N).
template <typename T, int D, int BLOCK_M, int WARPGROUPS, int GRADS, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPGROUPS * 128, 1)
flash_bwd_dkdv_sm90(const __grid_constant__ AttnParams p)
{
    static_assert(MODE == MODE_DENSE, "the options run in bwd_sm80.cu");
    typedef Sm90BwdKVTile<T, D, BLOCK_M, WARPGROUPS, GRADS> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_cuda.py)");
    BWD_SCALARS(p, float);
    constexpr int BLOCK_N = C::BLOCK_N, QT = C::QT, DT = C::DT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw + (C::ALIGN - smem_addr(smem_raw) % C::ALIGN) % C::ALIGN);
    T* sV = sK + C::KV_ELEMS;
    T* sQ = sV + C::KV_ELEMS;               // two buffers
    T* sdO = sQ + 2 * C::QO_ELEMS;          // two buffers
    T* sdS = sdO + 2 * C::QO_ELEMS;
    float* sLse = reinterpret_cast<float*>(sdS + C::DS_ELEMS);   // two buffers
    float* sDelta = sLse + 2 * BLOCK_M;                           // two buffers

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int wg = warp / 4;
    const int warp_row0 = warp * 16;        // this warp's keys in the block
    const int hk = blockIdx.y, b = blockIdx.z;
    const int hq = gridDim.y * group;
    MODS_SETUP(T, float, MODE, p, b, hq);
    const auto& mask = mods.mask;
    const int k0 = blockIdx.x * BLOCK_N;
    const int k_rows = min(BLOCK_N, mask.nk - k0);
    if (k_rows <= 0) return;
    const KeyBlockPairs pairs(mask, hk, group, k0, BLOCK_N, BLOCK_M);
    const int n_iter = pairs.count();

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<const T> dO = tensor<const T>(p.dout);

    load_tile_swizzled<T, BLOCK_N, D, C::THREADS>(sK, K.at(mods.tb, hk, mods.k_base + k0), K.row, k_rows, d, vec);
    load_tile_swizzled<T, BLOCK_N, D, C::THREADS>(sV, V.at(mods.tb, hk, mods.k_base + k0), V.row, k_rows, dim_v, vec);

    // As in bwd_sm80.cu: Q, dO, lse2 and delta of iteration `it` into buffer `buf`.
    const bool rows_vec = mods.q_base % 4 == 0;
    auto load_query_tile = [&](int it, int buf) {
        const int h = pairs.head(it), q0 = pairs.q0(it);
        const int rows = min(BLOCK_M, mask.nq - q0);
        load_tile_swizzled<T, BLOCK_M, D, C::THREADS>(sQ + buf * C::QO_ELEMS, Q.at(mods.tb, h, mods.q_base + q0), Q.row, rows, d, vec);
        load_tile_swizzled<T, BLOCK_M, D, C::THREADS>(sdO + buf * C::QO_ELEMS, dO.at(mods.tb, h, mods.q_base + q0), dO.row, rows, dim_v, vec);
        const i64 at = row_workspace_offset(mods.tb, h, hq, nq_pad) + mods.q_base + q0;
        load_tile<float, 1, BLOCK_M, C::THREADS>(sLse + buf * BLOCK_M, lse2 + at, 0, 1, BLOCK_M, rows_vec);
        load_tile<float, 1, BLOCK_M, C::THREADS>(sDelta + buf * BLOCK_M, delta + at, 0, 1, BLOCK_M, rows_vec);
        cp_async_commit();
    };
    int it = pairs.next(0, mask);
    if (it < n_iter) load_query_tile(it, 0);
    cp_async_commit();

    float acc_dv[1][DT][4], acc_dk[1][DT][4];
    zero_frags(acc_dv);
    zero_frags(acc_dk);
    // This warpgroup's piece of the dQ tile (C::DQ_N columns of 64 query rows).
    const int dq_row0 = (wg / C::DQ_COLS) * 64, dq_col0 = (wg % C::DQ_COLS) * C::DQ_N;

    for (int step = 0; it < n_iter; ++step) {
        const int h = pairs.head(it), q0 = pairs.q0(it);
        const int next = pairs.next(it + 1, mask);
        const int buf = step % 2;
        const T* sQb = sQ + buf * C::QO_ELEMS;
        const T* sdOb = sdO + buf * C::QO_ELEMS;
        const float* sLseb = sLse + buf * BLOCK_M;
        const float* sDeltab = sDelta + buf * BLOCK_M;
        cp_async_wait<0>();   // this iteration's tiles (and K, V) have landed
        fence_async_smem();
        __syncthreads();      // ... for every thread; iteration it-1's products are complete
        if (next < n_iter) load_query_tile(next, buf ^ 1);

        // S^T and dP^T as two batches: P^T is computed while dP^T still runs.
        float s[1][QT][4], dp[1][QT][4];
        wgmma_fence();
        Wgmma<T, BLOCK_M>::template ss<false>(s[0], kmajor_desc<T, BLOCK_N>(sK, wg * 64, 0), kmajor_desc<T, BLOCK_M>(sQb, 0, 0));
        #pragma unroll
        for (int ks = 1; ks < C::KSTEPS; ++ks)
            Wgmma<T, BLOCK_M>::template ss<true>(s[0], kmajor_desc<T, BLOCK_N>(sK, wg * 64, ks), kmajor_desc<T, BLOCK_M>(sQb, 0, ks));
        wgmma_commit();
        Wgmma<T, BLOCK_M>::template ss<false>(dp[0], kmajor_desc<T, BLOCK_N>(sV, wg * 64, 0), kmajor_desc<T, BLOCK_M>(sdOb, 0, 0));
        #pragma unroll
        for (int ks = 1; ks < C::KSTEPS; ++ks)
            Wgmma<T, BLOCK_M>::template ss<true>(dp[0], kmajor_desc<T, BLOCK_N>(sV, wg * 64, ks), kmajor_desc<T, BLOCK_M>(sdOb, 0, ks));
        wgmma_commit();

        const bool needs_mask = mask.tile_needs_mask(q0, q0 + BLOCK_M, k0, k0 + BLOCK_N, h);
        float unused_dtanh[1][1][4];
        wgmma_wait<1>();
        reg_fence(s[0]);
        recompute_p<MODE, true>(s, unused_dtanh, mods, mods.at_head(h), k0 + warp_row0, q0,
                                [&](int, int nt, int e) { return sLseb[nt * 8 + 2 * t + (e % 2)]; },
                                scale_log2, needs_mask);
        u32 p_frag[C::QSTEPS][4];
        #pragma unroll
        for (int ks = 0; ks < C::QSTEPS; ++ks) c_to_a_frag<T>(p_frag[ks], s, 0, ks);
        wgmma_wait<0>();
        reg_fence(dp[0]);
        grad_scores<MODE, true>(s, dp, unused_dtanh, mods, mods.at_head(h), k0 + warp_row0, q0,
                                [&](int, int nt, int e) { return sDeltab[nt * 8 + 2 * t + (e % 2)]; },
                                nullptr, 0, 0, 0);
        u32 ds_frag[C::QSTEPS][4];
        #pragma unroll
        for (int ks = 0; ks < C::QSTEPS; ++ks) c_to_a_frag<T>(ds_frag[ks], s, 0, ks);

        // dV += P^T dO and dK += dS^T Q, one batch.
        wgmma_fence();
        #pragma unroll
        for (int ks = 0; ks < C::QSTEPS; ++ks)
            Wgmma<T, D>::template rs<true>(acc_dv[0], p_frag[ks], mnmajor_desc<T, BLOCK_M>(sdOb, ks));
        #pragma unroll
        for (int ks = 0; ks < C::QSTEPS; ++ks)
            Wgmma<T, D>::template rs<true>(acc_dk[0], ds_frag[ks], mnmajor_desc<T, BLOCK_M>(sQb, ks));
        wgmma_commit();

        if constexpr (C::DQ) {
            // dS^T into shared memory (its A fragments are the rounded values: fragment
            // word i holds rows g + 8 (i % 2), columns 16 ks + 8 (i / 2) + 2 t, + 1) ...
            #pragma unroll
            for (int ks = 0; ks < C::QSTEPS; ++ks)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int col = ks * 16 + (i / 2) * 8;
                    *reinterpret_cast<u32*>(Swizzle128<T, BLOCK_N>::at(sdS, warp_row0 + g + (i % 2) * 8, col) + 2 * t) = ds_frag[ks][i];
                }
            fence_async_smem();
            __syncthreads();
            // ... then this warpgroup's piece of dQ = dS K over every key of the block.
            float dq[1][C::DQ_N / 8][4];
            wgmma_fence();
            Wgmma<T, C::DQ_N>::template ss_mn<false>(dq[0], mnmajor_desc<T, BLOCK_N>(sdS, 0, dq_row0), mnmajor_desc<T, BLOCK_N>(sK, 0, dq_col0));
            #pragma unroll
            for (int ks = 1; ks < C::NSTEPS; ++ks)
                Wgmma<T, C::DQ_N>::template ss_mn<true>(dq[0], mnmajor_desc<T, BLOCK_N>(sdS, ks, dq_row0), mnmajor_desc<T, BLOCK_N>(sK, ks, dq_col0));
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(dq[0]);
            float* dq_head = dq_accum + (((i64)mods.tb * hq + h) * nq + mods.q_base) * (i64)d;
            const bool pairs_aligned = d % 2 == 0;
            #pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int row = q0 + dq_row0 + (warp % 4) * 16 + g + hh * 8;
                if (row >= mask.nq) continue;
                float* dq_row = dq_head + (i64)row * d;
                #pragma unroll
                for (int nt = 0; nt < C::DQ_N / 8; ++nt) {
                    const int col = dq_col0 + nt * 8 + 2 * t;
                    if (pairs_aligned && col + 1 < d) {
                        red_add2(dq_row + col, dq[0][nt][2 * hh], dq[0][nt][2 * hh + 1]);
                    } else {
                        if (col < d) atomicAdd(dq_row + col, dq[0][nt][2 * hh]);
                        if (col + 1 < d) atomicAdd(dq_row + col + 1, dq[0][nt][2 * hh + 1]);
                    }
                }
            }
        } else {
            wgmma_wait<0>();
        }
        reg_fence(acc_dv[0]);
        reg_fence(acc_dk[0]);
        it = next;
    }

    // Epilogue as in bwd_sm80.cu, each gradient staged with padded rows over K and V.
    cp_async_wait<0>();
    __syncthreads();
    const Strided<T> dV = tensor<T>(p.dv), dK = tensor<T>(p.dk);
    warp_store_c<T, D>(sK, warp_row0, acc_dv, 1.f);
    __syncthreads();
    store_tile<T, BLOCK_N, D, C::THREADS>(dV.at(mods.tb, hk, mods.k_base + k0), dV.row, sK, k_rows, dim_v, vec);
    __syncthreads();
    warp_store_c<T, D>(sK, warp_row0, acc_dk, scale);
    __syncthreads();
    store_tile<T, BLOCK_N, D, C::THREADS>(dK.at(mods.tb, hk, mods.k_base + k0), dK.row, sK, k_rows, d, vec);
}
