// Backward attention on the tensor cores for fp32 and fp64 inputs, at the inputs' own
// precision (sm_80 and newer): fp64 on DMMA, fp32 as 3xTF32 (mma_wide.cuh). The
// algorithm and the kernel split are bwd_sm80.cu's (see there), with mma_wide.cuh's
// 16x8x8 steps in place of m16n8k16 and the row workspaces in the accumulation type:
//
// flash_bwd_dkdv_wide: a CTA owns BLOCK_N keys of one kv head, split across its warps in
//   16-key m-tiles, and walks every (query head, query tile) pair of its GQA group that
//   sees them (bwd.cuh KeyBlockPairs), Q, dO and the row workspaces double-buffered by
//   cp.async. S^T = K Q^T and dP^T = V dO^T are key-major, so their C fragments are the
//   A operands of dV += P^T dO and dK += dS^T Q as they stand (mma_wide.cuh: the k index
//   of a step is a label). dK and dV stay in registers. Where those of a warp's keys do
//   not fit (fp64 from d = 96, fp32 from d = 192: HALVES = 2; fp64 at 192: 4, 256: 8),
//   HALVES warps share each 16-key m-tile (warps HALVES i .. HALVES i + HALVES - 1:
//   current GPUs schedule warp w on scheduler w % 4, so a scheduler's two warps belong
//   to different groups and do not wait at each other's trade; 1.015-1.03x over pairs
//   w, w + 4), share h holding columns [h D/HALVES, (h + 1) D/HALVES) of both; per query
//   slice share 0 computes S^T and share 1 dP^T (with 2 P shares, shares 2 j and 2 j + 1
//   the same products over part j of P parts of d), and they trade them
//   through shared memory (trade_products), so no product is computed twice. With
//   GRAD_DQ the warps also write dS, query-major, to shared memory and add dQ = dS K over
//   the whole key block into the workspace, each (query m-tile, 16 columns) job a
//   complete sum: with atomics, or (fp64 from d = 128 on sm_90) staged for one bulk
//   reduction a tile.
//
// flash_bwd_dq_wide (the deterministic mode): a CTA owns BLOCK_M query rows of one head
//   and streams the key tiles its rows see, recomputing S, P, dP and dS per tile with dQ
//   in registers; no atomics, bitwise reproducible.
//
// Every tile sits in shared memory as BothWaysRows (rows of D + 8 elements, for fp64
// shifted by a few 32-byte chunks within each group of 8): Q, dO and K are read both as
// A or B^T operands (pairs along a row) and as B operands with k as their row
// (load_b_pair), which that layout serves without bank conflicts for fp64 and with
// 2-way conflicts down the rows for fp32 (mma_wide.cuh).
//
// For fp32 the products that sum over a sequence (dV, dK, dQ) are summed per query slice
// or key slice from zero in the tensor cores and added in the FPU (wide_mm_AB), as the
// forward does for O.
#include "elem.cuh"
#include "copy.cuh"
#include "mma_wide.cuh"
#include "mods.cuh"
#include "tensor.cuh"
#include "tma.cuh"
#include "bwd.cuh"

// Independent MMA chains of the products over d (S^T and dP^T here, S and dP in the dQ
// kernel; mma_wide.cuh wide_mm_ABt_from): four for fp32 at d = 128, whose warps have one
// product a k-step (1.06x, and 1.05x for the dQ kernel, H200, session 22); at d = 96 and
// 256 the extra accumulators cost more than they gave (0.96-0.98x); fp64 needs none.
template <typename T, int D> constexpr int wide_bwd_chains() { return sizeof(T) == 4 && D == 128 ? 4 : 1; }

// SLICE: queries of S^T and dP^T live at once beside the accumulators (8 or 16, per the
// tile table: spills and measurements). HALVES: 1, or the 2, 4 or 8 warps that share a key
// m-tile where its dK and dV do not fit one warp's registers (see the top of this file).
// The plans launch GRADS = dV | dK (| dQ); a GRADS without dK remains possible (no V
// tile, no dS).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int SLICE, int GRADS, int HALVES>
struct WideBwdKVTile {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int KEY_WARPS = WARPS / HALVES;  // warps with distinct keys (warp / HALVES)
    static constexpr int MT = BLOCK_N / KEY_WARPS / 16;   // key m-tiles per warp
    static constexpr int SNT = SLICE / 8;
    static constexpr int KSTEPS = D / 8;
    static constexpr int COLS = D / HALVES;           // columns of dK, dV per warp
    static constexpr int DT = COLS / 8;               // their n-tiles
    typedef typename BothWaysRows<T, D>::type Rows;          // K, V, Q, dO
    typedef typename BothWaysRows<T, BLOCK_N>::type DSRows;  // dS, query-major
    static constexpr bool DV = GRADS & GRAD_DV, DK = GRADS & GRAD_DK, DQ = GRADS & GRAD_DQ;
    static constexpr int CHAINS = wide_bwd_chains<T, D>();
    // Shared memory, in this order (cupyflash/_kernels.py mirrors the sizes):
    static constexpr int K_ELEMS = Rows::size(BLOCK_N);
    static constexpr int V_ELEMS = DK ? Rows::size(BLOCK_N) : 0;   // dP needs V; dV alone does not
    static constexpr int QDO_ELEMS = 4 * Rows::size(BLOCK_M);      // Q and dO, two buffers each
    static constexpr int DS_ELEMS = DQ ? DSRows::size(BLOCK_M) : 0;
    static constexpr int TRADE_ELEMS = HALVES > 1 ? WARPS * MT * SNT * 4 * 32 : 0;   // a slice's product a warp
    // With one slice a query tile, the trading slots share dS's buffer: each tile's trade
    // ends with a CTA barrier before dS is written (and the tile's first barrier orders
    // the dQ pass's reads of dS before the next trade).
    static constexpr bool TRADE_IN_DS = HALVES > 1 && SLICE == BLOCK_M;
    static constexpr int DS_TRADE_ELEMS = TRADE_IN_DS ? (DS_ELEMS > TRADE_ELEMS ? DS_ELEMS : TRADE_ELEMS)
                                                      : DS_ELEMS + TRADE_ELEMS;
    static constexpr int ROW_ELEMS = (DK ? 4 : 2) * BLOCK_M;  // lse2 (and delta), two buffers each
    // fp64 dQ on sm_90 from d = 128 (BULK_DQ in the kernel): the warps stage a query tile's
    // dQ in the tile's Q buffer, dead once dK's product has read it (dQ = dS K reads dS and
    // K), and one thread adds it into the workspace with one bulk reduction. Per element,
    // 2048 atomic adds a 16-query tile, the dQ phase took a third of the kernel's time for
    // a fifth of its products (ncu, H200, session 23: 60 ms against 40 without dQ); staged,
    // 1.08x. Where it was measured slower the atomics stay: d = 64 (one half of 128 keys,
    // half the atomics a product: 0.97x, the barrier and the wait cost more) and d = 96
    // (0.97-0.98x, with the load deferred as noted in the kernel); fp32 too. Staged rows are
    // DQ_LD = D + 2 elements apart, as the workspace's (the host pads them: _kernels.py
    // Variant.dq_ld), so that a tile is one range and the quarter-warps' 32-byte row writes
    // fall on distinct banks.
    static constexpr bool STAGED_DQ = DQ && sizeof(T) == 8 && HALVES > 1 && D >= 128;
    static constexpr int DQ_LD = STAGED_DQ ? D + 2 : D;
    static constexpr int SMEM_BYTES = (K_ELEMS + V_ELEMS + QDO_ELEMS + DS_TRADE_ELEMS + ROW_ELEMS) * sizeof(T);
    static_assert(BLOCK_N % (16 * KEY_WARPS) == 0 && BLOCK_M % SLICE == 0 && COLS % 16 == 0, "tile shape");
    static_assert(GRADS != 0 && (!DQ || DK), "dQ comes with dK (both need dS)");
    static_assert(HALVES == 1 || ((HALVES == 2 || HALVES == 4 || HALVES == 8) && DV && DK && WARPS % HALVES == 0),
                  "the shares trade S^T for dP^T");
    static_assert(HALVES == 1 || WARPS / HALVES < 16, "a group's named barrier id, 1 + warp / HALVES, is at most 15");
    // With 2 PARTS shares, each product is computed in PARTS parts of d (shares 2j, 2j + 1).
    static constexpr int PARTS = HALVES > 1 ? HALVES / 2 : 1;
    static_assert(KSTEPS % PARTS == 0, "the shares split d in equal parts");
    static_assert(BWD_ROW_PAD % BLOCK_M == 0, "query tiles read the padded row workspaces whole");
    static_assert(!STAGED_DQ || BLOCK_M * DQ_LD <= Rows::size(BLOCK_M), "dQ staged in a Q buffer");
};

// Minimum one CTA per SM: without it ptxas aims at more resident CTAs than shared memory
// allows and spills (as in fwd_wide.cu).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int SLICE, int GRADS, int HALVES, int MODE,
          int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_bwd_dkdv_wide(const __grid_constant__ AttnParams p)
{
    typedef WideBwdKVTile<T, D, BLOCK_M, BLOCK_N, WARPS, SLICE, GRADS, HALVES> C;
    typedef typename C::Rows Rows;
    typedef typename C::DSRows DSRows;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    BWD_SCALARS(p, T);
    constexpr int MT = C::MT, SNT = C::SNT, DT = C::DT, Q_TILE = Rows::size(BLOCK_M);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + C::K_ELEMS;
    T* sQ = sV + C::V_ELEMS;                  // two buffers
    T* sdO = sQ + 2 * Q_TILE;                 // two buffers
    T* sdS = sdO + 2 * Q_TILE;
    T* sTrade = C::TRADE_IN_DS ? sdS : sdS + C::DS_ELEMS;
    T* sLse = sdS + C::DS_TRADE_ELEMS;        // two buffers
    T* sDelta = sLse + 2 * BLOCK_M;           // two buffers (DK only)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int hq = gridDim.y * group;
    MODS_SETUP(T, T, MODE, p, b, hq);
    const auto& mask = mods.mask;
    const int k0 = blockIdx.x * BLOCK_N;
    const int k_rows = min(BLOCK_N, mask.nk - k0);
    if (k_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const KeyBlockPairs pairs(mask, hk, group, k0, BLOCK_N, BLOCK_M);
    const int n_iter = pairs.count();
    // The shares compute the same dS: one of them adds the bias gradient and writes dS.
    const int share = warp % HALVES;
    T* dbias_b = MODE != MODE_DENSE && dbias != nullptr && share == 0 ? dbias + b * dbias_sb : nullptr;

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<const T> dO = tensor<const T>(p.dout);

    load_tile_as<T, BLOCK_N, D, C::THREADS, Rows>(sK, K.at(mods.tb, hk, mods.k_base + k0), K.row, k_rows, d, vec);
    if constexpr (C::DK)
        load_tile_as<T, BLOCK_N, D, C::THREADS, Rows>(sV, V.at(mods.tb, hk, mods.k_base + k0), V.row, k_rows, dim_v, vec);

    // Q, dO, lse2 (and delta) of iteration `it` into buffer `buf` (as in bwd_sm80.cu: the
    // row workspaces are padded; under varlen the 16-byte copies need the start aligned).
    const bool rows_vec = (mods.q_base * (int)sizeof(T)) % 16 == 0;
    auto load_query_tile = [&](int it, int buf) {
        const int h = pairs.head(it), q0 = pairs.q0(it);
        const int rows = min(BLOCK_M, mask.nq - q0);
        load_tile_as<T, BLOCK_M, D, C::THREADS, Rows>(sQ + buf * Q_TILE, Q.at(mods.tb, h, mods.q_base + q0), Q.row, rows, d, vec);
        load_tile_as<T, BLOCK_M, D, C::THREADS, Rows>(sdO + buf * Q_TILE, dO.at(mods.tb, h, mods.q_base + q0), dO.row, rows, dim_v, vec);
        const i64 at = row_workspace_offset(mods.tb, h, hq, nq_pad) + mods.q_base + q0;
        load_tile<T, 1, BLOCK_M, C::THREADS, BLOCK_M>(sLse + buf * BLOCK_M, lse2 + at, 0, 1, BLOCK_M, rows_vec);
        if constexpr (C::DK) load_tile<T, 1, BLOCK_M, C::THREADS, BLOCK_M>(sDelta + buf * BLOCK_M, delta + at, 0, 1, BLOCK_M, rows_vec);
        cp_async_commit();
    };
    int it = pairs.next(0, mask);
    if (it < n_iter) load_query_tile(it, 0);
    cp_async_commit();

    const int warp_row0 = warp / HALVES * MT * 16;
    const int col0 = share * C::COLS;   // this warp's columns of dK and dV
    T acc_dv[C::DV ? MT : 1][C::DV ? DT : 1][4];
    T acc_dk[C::DK ? MT : 1][C::DK ? DT : 1][4];
    zero_frags(acc_dv);
    zero_frags(acc_dk);

    // The staged dQ (WideBwdKVTile::STAGED_DQ) where bulk reductions exist.
#if __CUDA_ARCH__ >= 900
    constexpr bool BULK_DQ = C::STAGED_DQ;
#else
    constexpr bool BULK_DQ = false;
#endif
    for (int step = 0; it < n_iter; ++step) {
        const int h = pairs.head(it), q0 = pairs.q0(it);
        const int next = pairs.next(it + 1, mask);
        const int buf = step % 2;
        const T* sQb = sQ + buf * Q_TILE;
        const T* sdOb = sdO + buf * Q_TILE;
        const T* sLseb = sLse + buf * BLOCK_M;
        const T* sDeltab = sDelta + buf * BLOCK_M;
        cp_async_wait<0>();   // this iteration's tiles (and K, V) have landed
        __syncthreads();      // ... for every thread, and iteration it-1 no longer reads the other buffer or sdS
        if (next < n_iter) load_query_tile(next, (step + 1) % 2);

        const bool needs_mask = mask.tile_needs_mask(q0, q0 + BLOCK_M, k0, k0 + BLOCK_N, h);
        #pragma unroll 1
        for (int q_s = 0; q_s < BLOCK_M; q_s += SLICE) {
            const T* sQs = sQb + Rows::block(q_s, 0);
            const T* sdOs = sdOb + Rows::block(q_s, 0);
            // S^T = K Q^T (and dP^T = V dO^T: with shares each computes one, or a part of
            // one, and they trade), then P^T = exp2(S^T scale log2 e - lse2[query]), 0 where
            // hidden.
            T s[MT][SNT][4];
            T dp[C::DK ? MT : 1][C::DK ? SNT : 1][4];
            T dtanh[MODE == MODE_EXT ? MT : 1][MODE == MODE_EXT ? SNT : 1][4];
            zero_frags(s);
            if constexpr (HALVES > 1) {
                // The share's part of d: all of it with two shares.
                constexpr int PART_KSTEPS = C::KSTEPS / C::PARTS;
                const int part0 = Rows::block(0, share / 2 * PART_KSTEPS * 8);
                zero_frags(dp);
                if (share % 2 == 0) wide_mm_ABt<Rows, PART_KSTEPS, C::CHAINS>(s, sK + part0, warp_row0, sQs + part0);
                else wide_mm_ABt<Rows, PART_KSTEPS, C::CHAINS>(dp, sV + part0, warp_row0, sdOs + part0);
                trade_products<C::TRADE_IN_DS, HALVES>(s, dp, sTrade, warp, share);
            } else {
                wide_mm_ABt<Rows, C::KSTEPS, C::CHAINS>(s, sK, warp_row0, sQs);
            }
            recompute_p<MODE, true>(s, dtanh, mods, mods.at_head(h), k0 + warp_row0, q0 + q_s,
                                    [&](int, int nt, int e) { return sLseb[q_s + nt * 8 + 2 * t + (e % 2)]; },
                                    scale_log2, needs_mask);

            if constexpr (C::DV) {
                if constexpr (MODE == MODE_DENSE) {
                    wide_mm_AB<Rows>(acc_dv, s, sdOs + col0);
                } else {   // dropout: the P that multiplies dO (bwd.cuh kept_p)
                    const bool dropout = mods.dropout();
                    wide_mm_AB<Rows>(acc_dv, s, sdOs + col0, [=](T p) { return dropout ? kept_p(p) : p; });
                }
            }

            if constexpr (C::DK) {
                // dP^T = V dO^T; dS^T = P^T o (dP^T - delta[query]), in place of P^T.
                if constexpr (HALVES == 1) {
                    zero_frags(dp);
                    wide_mm_ABt<Rows, C::KSTEPS, C::CHAINS>(dp, sV, warp_row0, sdOs);
                }
                grad_scores<MODE, true>(s, dp, dtanh, mods, mods.at_head(h), k0 + warp_row0, q0 + q_s,
                                        [&](int, int nt, int e) { return sDeltab[q_s + nt * 8 + 2 * t + (e % 2)]; },
                                        dbias_b, dbias_sh, dbias_sq, dbias_sk);
                wide_mm_AB<Rows>(acc_dk, s, sQs + col0);
            }

            if constexpr (C::DQ) {
                // dS into shared memory, query-major (its key pairs adjacent for load_a).
                if (share == 0)
                    for_each_score<true>(s, k0 + warp_row0, q0 + q_s, [&](T& x, int i, int j, int, int, int) {
                        sdS[DSRows::at(i - q0, j - k0)] = x;
                    });
            }
        }

        if constexpr (C::DQ) {
            __syncthreads();
            // dQ = dS K over all BLOCK_N keys, the warps taking (query m-tile, 16 columns)
            // jobs: each job is a complete sum, added once per element, by atomics or staged
            // for one bulk reduction of the tile (BULK_DQ).
            constexpr int JOBS = (BLOCK_M / 16) * (D / 16);
            T* dq_head = dq_accum + (((i64)mods.tb * hq + h) * nq + mods.q_base) * (i64)dq_ld;
            T* stage = sQ + buf * Q_TILE;   // this tile's Q buffer, as rows of C::DQ_LD
            for (int job = warp; job < JOBS; job += WARPS) {
                const int mq = job % (BLOCK_M / 16), job_col0 = (job / (BLOCK_M / 16)) * 16;
                if (job_col0 >= d) continue;   // padding columns: dQ is 0 there
                T part[1][2][4];
                zero_frags(part);
                wide_mm_AB_from<Rows, BLOCK_N / 8>(part, [&](Operand<T, 4>& a, int, int ks) {
                    load_a<DSRows>(a, sdS, mq * 16, ks * 8);
                }, sK + job_col0);
                #pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = q0 + mq * 16 + g + hh * 8;
                    T x[4];   // columns job_col0 + 4 t .. + 3 of the row
                    paired_row(x, part[0][0], part[0][1], hh, T(1));
                    if constexpr (BULK_DQ) {   // rows past nq are staged, not copied
                        store4(stage + (row - q0) * C::DQ_LD + job_col0 + 4 * t, x[0], x[1], x[2], x[3]);
                        continue;
                    }
                    if (row >= mask.nq) continue;
                    #pragma unroll
                    for (int i = 0; i < 4; ++i)
                        if (job_col0 + 4 * t + i < d) atomicAdd(dq_head + (i64)row * dq_ld + job_col0 + 4 * t + i, x[i]);
                }
            }
            if constexpr (BULK_DQ) {
                // Columns past d go into the workspace's padding, which nothing reads (jobs
                // from d on are skipped and leave their staged columns unwritten).
                fence_async_smem();
                __syncthreads();
                if (threadIdx.x == 0) {
                    // A host that drifted from the staged rows. (Checked once before the loop
                    // instead, by every thread, it cost this kernel 4 bytes of spills.)
                    if (dq_ld != C::DQ_LD) __trap();
                    const int rows = min(BLOCK_M, mask.nq - q0);
                    bulk_reduce_add(dq_head + (i64)q0 * C::DQ_LD, stage, u32(rows * C::DQ_LD) * sizeof(T));
                    bulk_commit();
                    // The next tile loads into this buffer after its first barrier. (Deferring
                    // that load to its dQ barrier instead, and this wait with it, measured no
                    // better: 1.07x at d = 128, H200.)
                    bulk_wait_read<0>();
                }
            }
        }
        it = next;
    }
    cp_async_wait<0>();
#if __CUDA_ARCH__ >= 900
    if (C::STAGED_DQ && threadIdx.x == 0) bulk_wait<0>();   // the last tile's reduction performed
#endif

    // Epilogue: each thread writes four consecutive columns of its rows (store_o_row).
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = warp_row0 + mt * 16 + g + hh * 8;
            if (r >= k_rows) continue;
            if constexpr (C::DV) {
                T* out = tensor<T>(p.dv).at(mods.tb, hk, mods.k_base + k0 + r) + col0;
                #pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp)
                    store_o_row(out + dp * 16, acc_dv[mt][2 * dp], acc_dv[mt][2 * dp + 1], hh, dim_v - col0 - dp * 16, vec);
            }
            if constexpr (C::DK) {
                T* out = tensor<T>(p.dk).at(mods.tb, hk, mods.k_base + k0 + r) + col0;
                #pragma unroll
                for (int dp = 0; dp < DT / 2; ++dp)
                    store_o_row(out + dp * 16, acc_dk[mt][2 * dp], acc_dk[mt][2 * dp + 1], hh, d - col0 - dp * 16, vec, scale);
            }
        }
    }
}

// SLICE: keys of S and dP live at once beside the dQ accumulator (as in WideBwdKVTile).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int SLICE>
struct WideBwdQTile {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int MT = BLOCK_M / WARPS / 16;   // query m-tiles per warp
    static constexpr int SNT = SLICE / 8;
    static constexpr int KSTEPS = D / 8;
    static constexpr int DT = D / 8;                  // n-tiles of dQ
    static constexpr int CHAINS = wide_bwd_chains<T, D>();
    typedef typename BothWaysRows<T, D>::type Rows;   // Q, dO, K, V
    // Shared memory: Q, dO, then K and V with two buffers each (cupyflash/_kernels.py mirrors it).
    static constexpr int SMEM_BYTES = (2 * Rows::size(BLOCK_M) + 4 * Rows::size(BLOCK_N)) * sizeof(T);
    static_assert(BLOCK_M % (16 * WARPS) == 0 && BLOCK_N % SLICE == 0 && D % 32 == 0, "tile shape");
    static_assert(BWD_ROW_PAD % BLOCK_M == 0, "query blocks read the padded row workspaces whole");
};

template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int SLICE, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_bwd_dq_wide(const __grid_constant__ AttnParams p)
{
    typedef WideBwdQTile<T, D, BLOCK_M, BLOCK_N, WARPS, SLICE> C;
    typedef typename C::Rows Rows;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    BWD_SCALARS(p, T);
    constexpr int MT = C::MT, SNT = C::SNT, DT = C::DT, KEY_TILE = Rows::size(BLOCK_N);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sdO = sQ + Rows::size(BLOCK_M);
    T* sK = sdO + Rows::size(BLOCK_M);   // two buffers
    T* sV = sK + 2 * KEY_TILE;           // two buffers

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int m_block = gridDim.x - 1 - blockIdx.x;   // heavy (late, causal) blocks first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    MODS_SETUP(T, T, MODE, p, b, gridDim.y);
    const auto& mask = mods.mask;
    const int q0 = m_block * BLOCK_M;
    const int q_rows = min(BLOCK_M, mask.nq - q0);
    if (q_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
    const int key_rows = mask.stop();   // rows past it are never read (key padding)

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<const T> dO = tensor<const T>(p.dout);
    const T* k_head = K.at(mods.tb, hk, mods.k_base);
    const T* v_head = V.at(mods.tb, hk, mods.k_base);

    load_tile_as<T, BLOCK_M, D, C::THREADS, Rows>(sQ, Q.at(mods.tb, h, mods.q_base + q0), Q.row, q_rows, d, vec);
    load_tile_as<T, BLOCK_M, D, C::THREADS, Rows>(sdO, dO.at(mods.tb, h, mods.q_base + q0), dO.row, q_rows, dim_v, vec);
    auto load_key_tile = [&](int j, int buf) {
        const int rows = min(BLOCK_N, key_rows - j * BLOCK_N);
        load_tile_as<T, BLOCK_N, D, C::THREADS, Rows>(sK + buf * KEY_TILE, k_head + (i64)j * BLOCK_N * K.row, K.row, rows, d, vec);
        load_tile_as<T, BLOCK_N, D, C::THREADS, Rows>(sV + buf * KEY_TILE, v_head + (i64)j * BLOCK_N * V.row, V.row, rows, dim_v, vec);
        cp_async_commit();
    };
    int j = mask.next_key_tile(tiles.x, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
    if (j < tiles.y) load_key_tile(j, 0);
    cp_async_commit();

    // The row workspaces of this thread's rows; padded, so rows past nq read lse2 = +inf
    // and give P = 0 (under varlen: the next sequence's rows, which the mask hides).
    const int warp_row0 = warp * MT * 16;
    const i64 at = row_workspace_offset(mods.tb, h, gridDim.y, nq_pad) + mods.q_base + q0 + warp_row0 + g;
    T row_lse[MT][2], row_delta[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            row_lse[mt][hh] = lse2[at + mt * 16 + hh * 8];
            row_delta[mt][hh] = delta[at + mt * 16 + hh * 8];
        }

    T acc[MT][DT][4];
    zero_frags(acc);

    for (int step = 0; j < tiles.y; ++step) {
        const int k0 = j * BLOCK_N;
        const int next = mask.next_key_tile(j + 1, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
        const T* sKj = sK + (step % 2) * KEY_TILE;
        const T* sVj = sV + (step % 2) * KEY_TILE;
        cp_async_wait<0>();   // Q, dO and tile j have landed
        __syncthreads();      // ... for every thread, and the previous tile's buffers are free
        if (next < tiles.y) load_key_tile(next, (step + 1) % 2);

        const bool needs_mask = mask.tile_needs_mask(q0, q0 + BLOCK_M, k0, k0 + BLOCK_N, h);
        #pragma unroll 1
        for (int k_s = 0; k_s < BLOCK_N; k_s += SLICE) {
            const T* sKs = sKj + Rows::block(k_s, 0);
            const T* sVs = sVj + Rows::block(k_s, 0);
            // S = Q K^T, then P = exp2(S scale log2 e - lse2[row]), 0 where hidden.
            T s[MT][SNT][4];
            T dtanh[MODE == MODE_EXT ? MT : 1][MODE == MODE_EXT ? SNT : 1][4];
            zero_frags(s);
            wide_mm_ABt<Rows, C::KSTEPS, C::CHAINS>(s, sQ, warp_row0, sKs);
            recompute_p<MODE, false>(s, dtanh, mods, mods.at_head(h), q0 + warp_row0, k0 + k_s,
                                     [&](int mt, int, int e) { return row_lse[mt][e / 2]; },
                                     scale_log2, needs_mask);

            // dP = dO V^T; dS = P o (dP - delta[row]) in place of P; dQ += dS K. (The
            // key-block kernel adds the bias gradient.)
            T dp[MT][SNT][4];
            zero_frags(dp);
            wide_mm_ABt<Rows, C::KSTEPS, C::CHAINS>(dp, sdO, warp_row0, sVs);
            grad_scores<MODE, false>(s, dp, dtanh, mods, mods.at_head(h), q0 + warp_row0, k0 + k_s,
                                     [&](int mt, int, int e) { return row_delta[mt][e / 2]; },
                                     nullptr, 0, 0, 0);
            wide_mm_AB<Rows>(acc, s, sKs);
        }
        j = next;
    }
    cp_async_wait<0>();   // with no key tile, the Q and dO copies may still be in flight

    const Strided<T> dQ = tensor<T>(p.dq);
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = warp_row0 + mt * 16 + g + hh * 8;
            if (r >= q_rows) continue;
            T* out = dQ.at(mods.tb, h, mods.q_base + q0 + r);
            #pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp)
                store_o_row(out + dp * 16, acc[mt][2 * dp], acc[mt][2 * dp + 1], hh, d - dp * 16, vec, scale);
        }
    }
}
