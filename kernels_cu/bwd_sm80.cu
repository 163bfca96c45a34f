// Backward attention on the tensor cores (sm_80 and newer, fp16/bf16), by recomputation
// (FlashAttention-2): P = exp2(S * scale * log2 e - lse2) from the saved LSE, then
// dV += P^T dO, dP = dO V^T, dS = P o (dP - delta), dK += dS^T Q, dQ += dS K (bwd.cuh
// for lse2 and delta; scale is applied to dK and dQ once, at the end).
//
// Two kernels, each with warps that never reduce through shared memory:
//
// flash_bwd_dkdv_sm80: a CTA owns BLOCK_N keys of one kv head and splits them across its
//   warps; it walks every query head of the GQA group and every query tile that sees its
//   keys, with Q, dO and the row workspaces double-buffered by cp.async. It computes the
//   transposed products S^T = K Q^T and dP^T = V dO^T, whose C fragments are key-major,
//   so P^T and dS^T are directly the A operands of dV += P^T dO and dK += dS^T Q, the way
//   P feeds P V in the forward. dK and dV stay in registers for the whole key block.
//   With GRAD_DQ it also adds dQ = dS K into an fp32 workspace with atomics (the
//   non-deterministic mode): the warps write dS^T to shared memory, key-major as computed,
//   and read it back transposed (ldmatrix.trans) split over query rows instead.
//   GRADS selects dV, dK (+dQ). Where a warp's dK and dV do not fit its registers (d >=
//   192), HALVES = 2 warps share each 16-key m-tile, each holding half of their columns:
//   per query slice one computes S^T and the other dP^T, over all of d, and they trade
//   them through shared memory (bwd.cuh trade_products), as bwd_wide.cu's shares do.
//
// flash_bwd_dq_sm80 (the deterministic mode): a CTA owns BLOCK_M query rows of one head
//   and streams the key tiles that its rows see, like the forward; it recomputes S, P, dP
//   and dS per tile and keeps dQ in registers. No atomics: bitwise reproducible.
//
// Fragment layouts (mma.cuh): in the dK/dV kernel the rows of every C tile are keys and
// its columns queries; in the dQ kernel rows are queries and columns keys. Operands:
//   S^T  = K Q^T    A: K rows of the warp (sK, row-major)    B: Q^T  (sQ, query-major: load_bt_frags)
//   dV  += P^T dO   A: P^T from C fragments                  B: dO   (sdO, k = query rows: load_b_frags)
//   dP^T = V dO^T   A: V rows of the warp (sV)               B: dO^T (sdO, load_bt_frags)
//   dK  += dS^T Q   A: dS^T from C fragments                 B: Q    (sQ, load_b_frags)
//   dQ   = dS K     A: dS = (sdS, key-major)^T: load_at_frag B: K    (sK, k = key rows: load_b_frags)
#include "elem.cuh"
#include "copy.cuh"
#include "mma.cuh"
#include "warp_mm.cuh"
#include "mods.cuh"
#include "tensor.cuh"
#include "bwd.cuh"

template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int GRADS, int HALVES>
struct BwdKVTile {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int KEY_WARPS = WARPS / HALVES;        // warps with distinct keys (warp / HALVES)
    static constexpr int ROWS_PER_WARP = BLOCK_N / KEY_WARPS;   // keys per warp
    static constexpr int MT = ROWS_PER_WARP / 16;           // key m-tiles per warp
    // Queries per slice of a query tile (see the main loop). Slices of 32 beside the dK
    // and dV accumulators spill (build check) past d = 128 or with two key m-tiles per warp.
    static constexpr int SLICE = (BLOCK_M < 32 || D > 128 || MT > 1) ? 16 : 32;
    static constexpr int SNT = SLICE / 8;                   // query n-tiles of a slice of S^T, dP^T
    static constexpr int COLS = D / HALVES;                 // columns of dK, dV per warp
    static constexpr int DT = COLS / 8;                     // their n-tiles
    static constexpr int KSTEPS = D / 16;
    static constexpr int QSTEPS = BLOCK_M / 16;             // query m-tiles of dQ
    static constexpr int LD = SmemTile<T, D>::stride;
    static constexpr int LDS = SmemTile<T, BLOCK_M>::stride;
    static constexpr bool DV = GRADS & GRAD_DV, DK = GRADS & GRAD_DK, DQ = GRADS & GRAD_DQ;
    static constexpr int DQ_COLS = 32;                      // dQ columns a warp sums at a time
    // Shared memory, in this order (cupyflash/_kernels.py mirrors the sizes):
    static constexpr int K_ELEMS = BLOCK_N * LD;
    static constexpr int V_ELEMS = DK ? BLOCK_N * LD : 0;   // dP needs V; dV alone does not
    static constexpr int QDO_ELEMS = 4 * BLOCK_M * LD;      // Q and dO, two buffers each
    static constexpr int DS_ELEMS = DQ ? BLOCK_N * LDS : 0;
    static constexpr int ROW_FLOATS = (DK ? 4 : 2) * BLOCK_M;   // lse2 (and delta), two buffers each
    static constexpr int TRADE_FLOATS = HALVES > 1 ? WARPS * MT * SNT * 4 * 32 : 0;   // a slice's product a warp
    static constexpr int SMEM_BYTES = (K_ELEMS + V_ELEMS + QDO_ELEMS + DS_ELEMS) * sizeof(T) +
                                      (ROW_FLOATS + TRADE_FLOATS) * sizeof(float);
    static_assert(ROWS_PER_WARP % 16 == 0 && BLOCK_M % SLICE == 0 && D % DQ_COLS == 0, "tile shape");
    static_assert(GRADS != 0 && (!DQ || DK), "dQ comes with dK (both need dS)");
    static_assert(HALVES == 1 || (HALVES == 2 && DV && DK && WARPS % 2 == 0), "the shares trade S^T for dP^T");
    // The shares' CTAs hold half the keys of the others, so they would add dQ with twice
    // the atomics a pair: the host leaves dQ to the query-block kernel there
    // (cupyflash/_kernels.py BWD_SM80_DQ_KERNEL_MIN_HEAD_DIM).
    static_assert(HALVES == 1 || !DQ, "the shares leave dQ to flash_bwd_dq_sm80");
    static_assert(HALVES == 1 || WARPS / 2 < 16, "a pair's named barrier id, 1 + warp / 2, is at most 15");
    static_assert(COLS % 16 == 0, "B fragments in pairs of n-tiles");
    static_assert(BWD_ROW_PAD % BLOCK_M == 0, "query tiles read the padded row workspaces whole");
};

// Minimum one CTA per SM: without it ptxas aims at more resident CTAs than shared memory
// allows and spills (as in fwd_wide.cu).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int GRADS, int HALVES, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_bwd_dkdv_sm80(const __grid_constant__ AttnParams p)
{
    typedef BwdKVTile<T, D, BLOCK_M, BLOCK_N, WARPS, GRADS, HALVES> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    BWD_SCALARS(p, float);
    constexpr int MT = C::MT, SNT = C::SNT, DT = C::DT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + C::K_ELEMS;
    T* sQ = sV + C::V_ELEMS;                     // two buffers
    T* sdO = sQ + 2 * BLOCK_M * C::LD;           // two buffers
    T* sdS = sdO + 2 * BLOCK_M * C::LD;
    float* sLse = reinterpret_cast<float*>(sdS + C::DS_ELEMS);   // two buffers
    float* sDelta = sLse + 2 * BLOCK_M;                           // two buffers (DK only)
    float* sTrade = sLse + C::ROW_FLOATS;                         // the shares' slots

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int hq = gridDim.y * group;
    MODS_SETUP(T, float, MODE, p, b, hq);
    const auto& mask = mods.mask;
    const int k0 = blockIdx.x * BLOCK_N;
    const int k_rows = min(BLOCK_N, mask.nk - k0);
    if (k_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const KeyBlockPairs pairs(mask, hk, group, k0, BLOCK_N, BLOCK_M);
    const int n_iter = pairs.count();
    // The shares compute the same dS: one of them adds the bias gradient and writes dS.
    const int share = warp % HALVES;
    float* dbias_b = MODE != MODE_DENSE && dbias != nullptr && share == 0 ? dbias + b * dbias_sb : nullptr;

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<const T> dO = tensor<const T>(p.dout);

    load_tile<T, BLOCK_N, D, C::THREADS>(sK, K.at(mods.tb, hk, mods.k_base + k0), K.row, k_rows, d, vec);
    if constexpr (C::DK) load_tile<T, BLOCK_N, D, C::THREADS>(sV, V.at(mods.tb, hk, mods.k_base + k0), V.row, k_rows, dim_v, vec);

    // Q, dO, lse2 (and delta) of iteration `it` into buffer `buf`. The row workspaces are
    // padded (never a tail); under varlen a sequence may start anywhere in them, so the
    // 16-byte copies need its start aligned.
    const bool rows_vec = mods.q_base % 4 == 0;
    auto load_query_tile = [&](int it, int buf) {
        const int h = pairs.head(it), q0 = pairs.q0(it);
        const int rows = min(BLOCK_M, mask.nq - q0);
        load_tile<T, BLOCK_M, D, C::THREADS>(sQ + buf * BLOCK_M * C::LD, Q.at(mods.tb, h, mods.q_base + q0), Q.row, rows, d, vec);
        load_tile<T, BLOCK_M, D, C::THREADS>(sdO + buf * BLOCK_M * C::LD, dO.at(mods.tb, h, mods.q_base + q0), dO.row, rows, dim_v, vec);
        const i64 at = row_workspace_offset(mods.tb, h, hq, nq_pad) + mods.q_base + q0;
        load_tile<float, 1, BLOCK_M, C::THREADS>(sLse + buf * BLOCK_M, lse2 + at, 0, 1, BLOCK_M, rows_vec);
        if constexpr (C::DK) load_tile<float, 1, BLOCK_M, C::THREADS>(sDelta + buf * BLOCK_M, delta + at, 0, 1, BLOCK_M, rows_vec);
        cp_async_commit();
    };
    int it = pairs.next(0, mask);
    if (it < n_iter) load_query_tile(it, 0);
    cp_async_commit();

    const int warp_row0 = warp / HALVES * C::ROWS_PER_WARP;
    const int col0 = share * C::COLS;   // this warp's columns of dK and dV
    float acc_dv[C::DV ? MT : 1][C::DV ? DT : 1][4];
    float acc_dk[C::DK ? MT : 1][C::DK ? DT : 1][4];
    zero_frags(acc_dv);
    zero_frags(acc_dk);

    for (int step = 0; it < n_iter; ++step) {
        const int h = pairs.head(it), q0 = pairs.q0(it);
        const int next = pairs.next(it + 1, mask);
        const int buf = step % 2;
        const T* sQb = sQ + buf * BLOCK_M * C::LD;
        const T* sdOb = sdO + buf * BLOCK_M * C::LD;
        const float* sLseb = sLse + buf * BLOCK_M;
        const float* sDeltab = sDelta + buf * BLOCK_M;
        cp_async_wait<0>();   // this iteration's tiles (and K, V) have landed
        __syncthreads();      // ... for every thread, and iteration it-1 no longer reads the other buffer or sdS
        if (next < n_iter) load_query_tile(next, (step + 1) % 2);

        // The tile in slices of SLICE queries: only a slice of S^T and dP^T is live beside
        // the dK and dV accumulators, whatever BLOCK_M.
        const bool needs_mask = mask.tile_needs_mask(q0, q0 + BLOCK_M, k0, k0 + BLOCK_N, h);
        #pragma unroll 1
        for (int q_s = 0; q_s < BLOCK_M; q_s += C::SLICE) {
            const T* sQs = sQb + q_s * C::LD;
            const T* sdOs = sdOb + q_s * C::LD;
            // S^T = K Q^T, then P^T = exp2(S^T scale log2 e - lse2[query]), 0 where hidden.
            // (With shares: S^T and dP^T, one each, traded.)
            float s[MT][SNT][4];
            float dp[MT][SNT][4];
            float dtanh[MODE == MODE_EXT ? MT : 1][MODE == MODE_EXT ? SNT : 1][4];
            zero_frags(s);
            zero_frags(dp);
            if constexpr (HALVES == 2) {
                if (share == 0) warp_mm_ABt<T, D, MT, SNT, C::KSTEPS>(s, sK, warp_row0, sQs);
                else warp_mm_ABt<T, D, MT, SNT, C::KSTEPS>(dp, sV, warp_row0, sdOs);
                trade_products<false, HALVES>(s, dp, sTrade, warp, share);
            } else {
                warp_mm_ABt<T, D, MT, SNT, C::KSTEPS>(s, sK, warp_row0, sQs);
            }
            recompute_p<MODE, true>(s, dtanh, mods, mods.at_head(h), k0 + warp_row0, q0 + q_s,
                                    [&](int, int nt, int e) { return sLseb[q_s + nt * 8 + 2 * t + (e % 2)]; },
                                    scale_log2, needs_mask);

            if constexpr (C::DV) {
                if (MODE != MODE_DENSE && mods.dropout()) {
                    float kept[MT][SNT][4];
                    dropped_p(kept, s);
                    warp_mm_AB<T, D, MT, SNT, DT>(acc_dv, kept, sdOs + col0);
                } else {
                    warp_mm_AB<T, D, MT, SNT, DT>(acc_dv, s, sdOs + col0);
                }
            }

            if constexpr (C::DK) {
                // dP^T = V dO^T; dS^T = P^T o (dP^T - delta[query]), in place of P^T.
                if constexpr (HALVES == 1) warp_mm_ABt<T, D, MT, SNT, C::KSTEPS>(dp, sV, warp_row0, sdOs);
                grad_scores<MODE, true>(s, dp, dtanh, mods, mods.at_head(h), k0 + warp_row0, q0 + q_s,
                                        [&](int, int nt, int e) { return sDeltab[q_s + nt * 8 + 2 * t + (e % 2)]; },
                                        dbias_b, dbias_sh, dbias_sq, dbias_sk);
                warp_mm_AB<T, D, MT, SNT, DT>(acc_dk, s, sQs + col0);
            }

            if constexpr (C::DQ) {
                // dS^T into shared memory, each warp its own key rows...
                for_each_c_pair(warp_row0, s, [&](int row, int col, float x, float y) {
                    *reinterpret_cast<u32*>(sdS + row * C::LDS + q_s + col) = pack2<T>(x, y);
                });
            }
        }

        if constexpr (C::DQ) {
            __syncthreads();
            // ... then dQ = dS K over all BLOCK_N keys, the warps taking (query m-tile,
            // DQ_COLS columns) jobs: each job is a complete sum, added once per element.
            constexpr int JOBS = C::QSTEPS * (D / C::DQ_COLS);
            float* dq_head = dq_accum + (((i64)mods.tb * hq + h) * nq + mods.q_base) * (i64)dq_ld;
            for (int job = warp; job < JOBS; job += WARPS) {
                const int mq = job % C::QSTEPS, col0 = (job / C::QSTEPS) * C::DQ_COLS;
                if (col0 >= d) continue;   // padding columns: dQ is 0 there
                float acc[1][C::DQ_COLS / 8][4];
                zero_frags(acc);
                #pragma unroll
                for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
                    u32 a[4];
                    load_at_frag<T, BLOCK_M>(a, sdS, mq * 16, ks * 16);
                    #pragma unroll
                    for (int np = 0; np < C::DQ_COLS / 16; ++np) {
                        u32 bk[4];
                        load_b_frags<T, D>(bk, sK, ks * 16, col0 + np * 16);
                        MmaOp<T>::run(acc[0][2 * np], a, bk[0], bk[1]);
                        MmaOp<T>::run(acc[0][2 * np + 1], a, bk[2], bk[3]);
                    }
                }
                #pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = q0 + mq * 16 + g + hh * 8;
                    if (row >= mask.nq) continue;
                    #pragma unroll
                    for (int nt = 0; nt < C::DQ_COLS / 8; ++nt) {
                        const int col = col0 + nt * 8 + 2 * t;
                        if (col < d) atomicAdd(dq_head + (i64)row * dq_ld + col, acc[0][nt][2 * hh]);
                        if (col + 1 < d) atomicAdd(dq_head + (i64)row * dq_ld + col + 1, acc[0][nt][2 * hh + 1]);
                    }
                }
            }
        }
        it = next;
    }

    // Epilogue: each gradient goes through sK (no warp reads it any more), each warp
    // writing its own key rows, then out with wide stores.
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (C::DV) {
        const Strided<T> dV = tensor<T>(p.dv);
        warp_store_c<T, D>(sK + col0, warp_row0, acc_dv, 1.f);
        __syncthreads();
        store_tile<T, BLOCK_N, D, C::THREADS>(dV.at(mods.tb, hk, mods.k_base + k0), dV.row, sK, k_rows, dim_v, vec);
    }
    if constexpr (C::DK) {
        const Strided<T> dK = tensor<T>(p.dk);
        if constexpr (C::DV) __syncthreads();
        warp_store_c<T, D>(sK + col0, warp_row0, acc_dk, scale);
        __syncthreads();
        store_tile<T, BLOCK_N, D, C::THREADS>(dK.at(mods.tb, hk, mods.k_base + k0), dK.row, sK, k_rows, d, vec);
    }
}

template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS>
struct BwdQTile {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int ROWS_PER_WARP = BLOCK_M / WARPS;
    static constexpr int MT = ROWS_PER_WARP / 16;   // query m-tiles per warp
    // Keys per slice of a key tile (see the main loop); past d = 128, slices of 32 beside
    // the dQ accumulator spill (build check).
    static constexpr int SLICE = (BLOCK_N < 32 || D > 128) ? 16 : 32;
    static constexpr int SNT = SLICE / 8;           // key n-tiles of a slice of S, dP
    static constexpr int DT = D / 8;                // n-tiles of dQ
    static constexpr int KSTEPS = D / 16;
    static constexpr int LD = SmemTile<T, D>::stride;
    // Shared memory: Q, dO, then K and V with two buffers each (cupyflash/_kernels.py mirrors it).
    static constexpr int SMEM_BYTES = (2 * BLOCK_M + 4 * BLOCK_N) * LD * sizeof(T);
    static_assert(ROWS_PER_WARP % 16 == 0 && BLOCK_N % SLICE == 0 && SLICE % 16 == 0, "tile shape");
    static_assert(BWD_ROW_PAD % BLOCK_M == 0, "query blocks read the padded row workspaces whole");
};

// Minimum one CTA per SM: without it ptxas aims at more resident CTAs than shared memory
// allows and spills (as in fwd_wide.cu).
template <typename T, int D, int BLOCK_M, int BLOCK_N, int WARPS, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32, 1)
flash_bwd_dq_sm80(const __grid_constant__ AttnParams p)
{
    typedef BwdQTile<T, D, BLOCK_M, BLOCK_N, WARPS> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    BWD_SCALARS(p, float);
    constexpr int MT = C::MT, SNT = C::SNT, DT = C::DT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sdO = sQ + BLOCK_M * C::LD;
    T* sK = sdO + BLOCK_M * C::LD;          // two buffers
    T* sV = sK + 2 * BLOCK_N * C::LD;       // two buffers

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int m_block = gridDim.x - 1 - blockIdx.x;   // heavy (late, causal) blocks first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    MODS_SETUP(T, float, MODE, p, b, gridDim.y);
    const auto& mask = mods.mask;
    const int q0 = m_block * BLOCK_M;
    const int q_rows = min(BLOCK_M, mask.nq - q0);
    if (q_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
    const int key_rows = mask.stop();   // rows past it are never read (key padding)

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<const T> dO = tensor<const T>(p.dout);
    const Strided<T> dQ = tensor<T>(p.dq);
    const T* k_head = K.at(mods.tb, hk, mods.k_base);
    const T* v_head = V.at(mods.tb, hk, mods.k_base);

    load_tile<T, BLOCK_M, D, C::THREADS>(sQ, Q.at(mods.tb, h, mods.q_base + q0), Q.row, q_rows, d, vec);
    load_tile<T, BLOCK_M, D, C::THREADS>(sdO, dO.at(mods.tb, h, mods.q_base + q0), dO.row, q_rows, dim_v, vec);
    auto load_key_tile = [&](int j, int buf) {
        const int rows = min(BLOCK_N, key_rows - j * BLOCK_N);
        load_tile<T, BLOCK_N, D, C::THREADS>(sK + buf * BLOCK_N * C::LD, k_head + (i64)j * BLOCK_N * K.row, K.row, rows, d, vec);
        load_tile<T, BLOCK_N, D, C::THREADS>(sV + buf * BLOCK_N * C::LD, v_head + (i64)j * BLOCK_N * V.row, V.row, rows, dim_v, vec);
        cp_async_commit();
    };
    int j = mask.next_key_tile(tiles.x, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
    if (j < tiles.y) load_key_tile(j, 0);
    cp_async_commit();

    // The row workspaces of this thread's rows (g and g + 8 of each m-tile); padded, so
    // rows past nq read lse2 = +inf and give P = 0 (under varlen: the next sequence's
    // rows, which the mask hides).
    const int warp_row0 = warp * C::ROWS_PER_WARP;
    const i64 at = row_workspace_offset(mods.tb, h, gridDim.y, nq_pad) + mods.q_base + q0 + warp_row0 + g;
    float row_lse[MT][2], row_delta[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            row_lse[mt][hh] = lse2[at + mt * 16 + hh * 8];
            row_delta[mt][hh] = delta[at + mt * 16 + hh * 8];
        }

    float acc[MT][DT][4];
    zero_frags(acc);

    for (int step = 0; j < tiles.y; ++step) {
        const int k0 = j * BLOCK_N;
        const int next = mask.next_key_tile(j + 1, tiles.y, q0, q0 + q_rows, BLOCK_N, h);
        const T* sKj = sK + (step % 2) * BLOCK_N * C::LD;
        const T* sVj = sV + (step % 2) * BLOCK_N * C::LD;
        cp_async_wait<0>();   // Q, dO and tile j have landed
        __syncthreads();      // ... for every thread, and the previous tile's buffers are free
        if (next < tiles.y) load_key_tile(next, (step + 1) % 2);

        // The tile in slices of SLICE keys (as in the dK/dV kernel).
        const bool needs_mask = mask.tile_needs_mask(q0, q0 + BLOCK_M, k0, k0 + BLOCK_N, h);
        #pragma unroll 1
        for (int k_s = 0; k_s < BLOCK_N; k_s += C::SLICE) {
            const T* sKs = sKj + k_s * C::LD;
            const T* sVs = sVj + k_s * C::LD;
            // S = Q K^T, then P = exp2(S scale log2 e - lse2[row]), 0 where hidden.
            float s[MT][SNT][4];
            float dtanh[MODE == MODE_EXT ? MT : 1][MODE == MODE_EXT ? SNT : 1][4];
            zero_frags(s);
            warp_mm_ABt<T, D, MT, SNT, C::KSTEPS>(s, sQ, warp_row0, sKs);
            recompute_p<MODE, false>(s, dtanh, mods, mods.at_head(h), q0 + warp_row0, k0 + k_s,
                                     [&](int mt, int, int e) { return row_lse[mt][e / 2]; },
                                     scale_log2, needs_mask);

            // dP = dO V^T; dS = P o (dP - delta[row]) in place of P; dQ += dS K. (The
            // key-block kernel adds the bias gradient.)
            float dp[MT][SNT][4];
            zero_frags(dp);
            warp_mm_ABt<T, D, MT, SNT, C::KSTEPS>(dp, sdO, warp_row0, sVs);
            grad_scores<MODE, false>(s, dp, dtanh, mods, mods.at_head(h), q0 + warp_row0, k0 + k_s,
                                     [&](int mt, int, int e) { return row_delta[mt][e / 2]; },
                                     nullptr, 0, 0, 0);
            warp_mm_AB<T, D, MT, SNT, DT>(acc, s, sKs);
        }
        j = next;
    }

    // Epilogue: each warp rounds its rows into its own rows of sQ (no other warp reads
    // them), then the CTA writes the tile with wide stores.
    cp_async_wait<0>();   // with no key tile, the Q and dO copies may still be in flight
    __syncthreads();
    warp_store_c<T, D>(sQ, warp_row0, acc, scale);
    __syncthreads();
    store_tile<T, BLOCK_M, D, C::THREADS>(dQ.at(mods.tb, h, mods.q_base + q0), dQ.row, sQ, q_rows, d, vec);
}
