// Backward attention on the CUDA cores for fp32 and fp64 inputs, at the inputs' own
// precision (no TF32): the fallback of the tensor-core bwd_wide.cu, for fp64 from d = 192
// (where one gradient of 16 keys per warp exceeds the registers) and for GPUs whose shared
// memory the tensor-core tiles do not fit (cupyflash/_cuda.py device_backward_plan), since
// it streams the head dim in chunks. The algorithm and the kernel split are those of bwd_sm80.cu (see
// there): flash_bwd_dkdv_simt owns a key block and walks the query tiles of its GQA
// group, optionally adding dQ into a workspace with atomics; flash_bwd_dq_simt owns a
// query block and walks its key tiles, for a deterministic dQ.
//
// Thread layout: a CTA of 16 x 16 threads, thread (ty, tx) owns rows
// ty + 16 i and columns tx + 16 j of each BLOCK x BLOCK tile (S^T, dP^T in the dK/dV
// kernel, with keys as rows; S, dP in the dQ kernel), and columns tx + 16 c of each
// head-dim accumulator. Shared memory never holds a whole BLOCK x D tile (fp64 at d = 256
// would not fit): the products over the head dim stream CH-column chunks of both
// operands; the products over a tile's rows keep P^T and dS^T in shared memory and stream
// CH-column chunks of the other operand, one chunk of the accumulator at a time.
#include "elem.cuh"
#include "mods.cuh"
#include "tensor.cuh"
#include "bwd.cuh"

template <typename T, int D, int BLOCK>
struct BwdSimtTile {
    static constexpr int THREADS = 256;
    static constexpr int R = BLOCK / 16;     // tile rows (and columns) per thread
    static constexpr int CH = 32;            // head-dim columns per chunk
    static constexpr int CHUNKS = D / CH;
    static constexpr int CC = CH / 16;       // chunk columns per thread
    static constexpr int DC = D / 16;        // accumulator columns per thread
    static constexpr int LDC = CH + 1;       // odd strides keep column reads conflict-free
    static constexpr int LDP = BLOCK + 1;
    // Four chunk buffers and two BLOCK x BLOCK tiles (cupyflash/_kernels.py mirrors the size).
    static constexpr int SMEM_ELEMS = 4 * BLOCK * LDC + 2 * BLOCK * LDP;
    static constexpr int SMEM_BYTES = SMEM_ELEMS * sizeof(T);
    static_assert(D % CH == 0 && BLOCK % 16 == 0, "tile shape");
    static_assert(BWD_ROW_PAD % BLOCK == 0, "query tiles read the padded row workspaces whole");
};

// ROWS x CH chunk of a row-major tensor into shared memory (stride LD), zero-filled past
// `rows` rows and `cols` columns (cols <= 0: all zero; src is then never read).
template <typename T, int ROWS, int CH, int LD>
__device__ __forceinline__ void load_chunk(T* dst, const T* src, i64 ld, int rows, int cols) {
    #pragma unroll 4
    for (int i = threadIdx.x; i < ROWS * CH; i += 256) {
        const int r = i / CH, c = i % CH;
        dst[r * LD + c] = (r < rows && c < cols) ? src[r * ld + c] : T(0);
    }
}

// c[i][j] += sum_kk A[ty + 16 i][kk] B[tx + 16 j][kk], over K columns of two row-major tiles.
template <typename T, int R, int K, int LD>
__device__ __forceinline__ void simt_mm_ABt(T (&c)[R][R], const T* sA, const T* sB) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    #pragma unroll 8
    for (int kk = 0; kk < K; ++kk) {
        T a[R], bb[R];
        #pragma unroll
        for (int i = 0; i < R; ++i) { a[i] = sA[(ty + 16 * i) * LD + kk]; bb[i] = sB[(tx + 16 * i) * LD + kk]; }
        #pragma unroll
        for (int i = 0; i < R; ++i)
            #pragma unroll
            for (int j = 0; j < R; ++j) c[i][j] = fma(a[i], bb[j], c[i][j]);
    }
}

// c[i][c0 + cc] += sum_kk A(ty + 16 i, kk) B[kk][tx + 16 cc] over K rows of B (a CC*16
// column chunk). A_T says A is stored transposed (A(r, kk) at sA[kk * LDA + r]).
// Callers unroll their chunk loop, so c0 is a constant and c stays in registers.
template <typename T, bool A_T, int R, int NC, int CC, int K, int LDA, int LDB>
__device__ __forceinline__ void simt_mm_AB(T (&c)[R][NC], int c0, const T* sA, const T* sB) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    #pragma unroll 8
    for (int kk = 0; kk < K; ++kk) {
        T a[R], bb[CC];
        #pragma unroll
        for (int i = 0; i < R; ++i) a[i] = A_T ? sA[kk * LDA + ty + 16 * i] : sA[(ty + 16 * i) * LDA + kk];
        #pragma unroll
        for (int cc = 0; cc < CC; ++cc) bb[cc] = sB[kk * LDB + tx + 16 * cc];
        #pragma unroll
        for (int i = 0; i < R; ++i)
            #pragma unroll
            for (int cc = 0; cc < CC; ++cc) c[i][c0 + cc] = fma(a[i], bb[cc], c[i][c0 + cc]);
    }
}

template <typename T, int R>
__device__ __forceinline__ void zero(T (&c)[R][R]) {
    #pragma unroll
    for (int i = 0; i < R; ++i)
        #pragma unroll
        for (int j = 0; j < R; ++j) c[i][j] = T(0);
}

template <typename T, int D, int BLOCK, int GRADS, int MODE, int SMEM_BYTES>   // GRADS: GRAD_DV | GRAD_DK [| GRAD_DQ]
__global__ void __launch_bounds__(256)
flash_bwd_dkdv_simt(const __grid_constant__ AttnParams p)
{
    typedef BwdSimtTile<T, D, BLOCK> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    BWD_SCALARS(p, T);
    constexpr int R = C::R, CH = C::CH, CC = C::CC, DC = C::DC, LDC = C::LDC, LDP = C::LDP;
    constexpr bool DQ = GRADS & GRAD_DQ;
    static_assert((GRADS & (GRAD_DV | GRAD_DK)) == (GRAD_DV | GRAD_DK), "dK and dV together");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sKc = reinterpret_cast<T*>(smem_raw);   // chunks of K, Q, V, dO
    T* sQc = sKc + BLOCK * LDC;
    T* sVc = sQc + BLOCK * LDC;
    T* sdOc = sVc + BLOCK * LDC;
    T* sP = sdOc + BLOCK * LDC;                // P^T, key-major
    T* sdS = sP + BLOCK * LDP;                 // dS^T, key-major

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int hq = gridDim.y * group;
    MODS_SETUP(T, T, MODE, p, b, hq);
    const auto& mask = mods.mask;
    const int k0 = blockIdx.x * BLOCK;
    const int k_rows = min(BLOCK, mask.nk - k0);
    if (k_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const KeyBlockPairs pairs(mask, hk, group, k0, BLOCK, BLOCK);
    T* dbias_b = MODE != MODE_DENSE && dbias != nullptr ? dbias + b * dbias_sb : nullptr;

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<const T> dO = tensor<const T>(p.dout);
    const T* k_blk = K.at(mods.tb, hk, mods.k_base + k0);
    const T* v_blk = V.at(mods.tb, hk, mods.k_base + k0);

    T acc_dk[R][DC], acc_dv[R][DC];
    #pragma unroll
    for (int i = 0; i < R; ++i)
        #pragma unroll
        for (int c = 0; c < DC; ++c) { acc_dk[i][c] = T(0); acc_dv[i][c] = T(0); }

    for (int it = pairs.next(0, mask); it < pairs.count(); it = pairs.next(it + 1, mask)) {
        const int h = pairs.head(it), q0 = pairs.q0(it);
        const int q_rows = min(BLOCK, mask.nq - q0);
        const T* q_blk = Q.at(mods.tb, h, mods.q_base + q0);
        const T* do_blk = dO.at(mods.tb, h, mods.q_base + q0);
        // Padded: never a tail (under varlen the next sequence's rows, which the mask hides).
        const i64 at = row_workspace_offset(mods.tb, h, hq, nq_pad) + mods.q_base + q0;

        // S^T = K Q^T and dP^T = V dO^T, streamed over head-dim chunks.
        T s[R][R], dp[R][R];
        zero(s);
        zero(dp);
        for (int c0 = 0; c0 < D; c0 += CH) {
            __syncthreads();   // the previous chunk (or iteration) is no longer read
            load_chunk<T, BLOCK, CH, LDC>(sKc, k_blk + c0, K.row, k_rows, d - c0);
            load_chunk<T, BLOCK, CH, LDC>(sQc, q_blk + c0, Q.row, q_rows, d - c0);
            load_chunk<T, BLOCK, CH, LDC>(sVc, v_blk + c0, V.row, k_rows, dim_v - c0);
            load_chunk<T, BLOCK, CH, LDC>(sdOc, do_blk + c0, dO.row, q_rows, dim_v - c0);
            __syncthreads();
            simt_mm_ABt<T, R, CH, LDC>(s, sKc, sQc);
            simt_mm_ABt<T, R, CH, LDC>(dp, sVc, sdOc);
        }

        // P^T = exp2(S^T scale log2 e - lse2[query]), 0 where hidden; dS^T = P^T o (dP^T - delta[query]).
        const bool needs_mask = mask.tile_needs_mask(q0, q0 + BLOCK, k0, k0 + BLOCK, h);
        const auto hm = mods.at_head(h);
        #pragma unroll
        for (int j = 0; j < R; ++j) {
            const int qi = tx + 16 * j;
            const T l2 = lse2[at + qi], dl = delta[at + qi];
            #pragma unroll
            for (int i = 0; i < R; ++i) {
                const int kj = ty + 16 * i;
                T dtanh = T(1);
                const T p = recomputed_p<MODE>(mods, hm, s[i][j], q0 + qi, k0 + kj, l2, scale_log2, needs_mask, dtanh);
                T ds = score_grad<MODE>(hm, p, dp[i][j], dl);
                if constexpr (MODE != MODE_DENSE) {
                    if (dbias_b != nullptr && q0 + qi < mask.nq && k0 + kj < mask.nk)
                        atomicAdd(dbias_b + h * dbias_sh + (q0 + qi) * dbias_sq + (k0 + kj) * dbias_sk, ds);
                    ds *= dtanh;
                }
                sP[kj * LDP + qi] = MODE == MODE_DENSE || !mods.dropout() ? p : kept_p(p);
                sdS[kj * LDP + qi] = ds;
            }
        }

        // dV += P^T dO, dK += dS^T Q (and dQ = dS K), one head-dim chunk at a time.
        #pragma unroll
        for (int ch = 0; ch < C::CHUNKS; ++ch) {
            const int c0 = ch * CH;
            __syncthreads();   // P^T and dS^T written; the previous chunk is no longer read
            load_chunk<T, BLOCK, CH, LDC>(sQc, q_blk + c0, Q.row, q_rows, d - c0);
            load_chunk<T, BLOCK, CH, LDC>(sdOc, do_blk + c0, dO.row, q_rows, dim_v - c0);
            if (DQ) load_chunk<T, BLOCK, CH, LDC>(sKc, k_blk + c0, K.row, k_rows, d - c0);
            __syncthreads();
            simt_mm_AB<T, false, R, DC, CC, BLOCK, LDP, LDC>(acc_dv, ch * CC, sP, sdOc);
            simt_mm_AB<T, false, R, DC, CC, BLOCK, LDP, LDC>(acc_dk, ch * CC, sdS, sQc);
            if constexpr (DQ) {
                T dq[R][CC];
                #pragma unroll
                for (int i = 0; i < R; ++i)
                    #pragma unroll
                    for (int cc = 0; cc < CC; ++cc) dq[i][cc] = T(0);
                simt_mm_AB<T, true, R, CC, CC, BLOCK, LDP, LDC>(dq, 0, sdS, sKc);
                T* dq_tile = dq_accum + (((i64)mods.tb * hq + h) * nq + mods.q_base + q0) * dq_ld;
                #pragma unroll
                for (int i = 0; i < R; ++i)
                    #pragma unroll
                    for (int cc = 0; cc < CC; ++cc) {
                        const int row = ty + 16 * i, col = c0 + tx + 16 * cc;
                        if (row < q_rows && col < d) atomicAdd(dq_tile + (i64)row * dq_ld + col, dq[i][cc]);
                    }
            }
        }
    }

    const Strided<T> dK = tensor<T>(p.dk), dV = tensor<T>(p.dv);
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        if (r >= k_rows) continue;
        T* dk_row = dK.at(mods.tb, hk, mods.k_base + k0 + r);
        T* dv_row = dV.at(mods.tb, hk, mods.k_base + k0 + r);
        #pragma unroll
        for (int c = 0; c < DC; ++c) {
            const int col = (c / CC) * CH + tx + 16 * (c % CC);
            if (col < d) dk_row[col] = acc_dk[i][c] * scale;
            if (col < dim_v) dv_row[col] = acc_dv[i][c];
        }
    }
}

template <typename T, int D, int BLOCK, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(256)
flash_bwd_dq_simt(const __grid_constant__ AttnParams p)
{
    typedef BwdSimtTile<T, D, BLOCK> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    BWD_SCALARS(p, T);
    constexpr int R = C::R, CH = C::CH, CC = C::CC, DC = C::DC, LDC = C::LDC, LDP = C::LDP;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQc = reinterpret_cast<T*>(smem_raw);   // chunks of Q, K, dO, V
    T* sKc = sQc + BLOCK * LDC;
    T* sdOc = sKc + BLOCK * LDC;
    T* sVc = sdOc + BLOCK * LDC;
    T* sdS = sVc + BLOCK * LDC;                // dS, query-major

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m_block = gridDim.x - 1 - blockIdx.x;   // heavy (late, causal) blocks first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    MODS_SETUP(T, T, MODE, p, b, gridDim.y);
    const auto& mask = mods.mask;
    const int q0 = m_block * BLOCK;
    const int q_rows = min(BLOCK, mask.nq - q0);
    if (q_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK);

    const Strided<const T> Q = tensor<const T>(p.q), K = tensor<const T>(p.k), V = tensor<const T>(p.v);
    const Strided<const T> dO = tensor<const T>(p.dout);
    const T* q_blk = Q.at(mods.tb, h, mods.q_base + q0);
    const T* do_blk = dO.at(mods.tb, h, mods.q_base + q0);

    // This thread's rows' workspaces; padded, so rows past nq read lse2 = +inf (P = 0;
    // under varlen the next sequence's rows, which the mask hides).
    const i64 at = row_workspace_offset(mods.tb, h, gridDim.y, nq_pad) + mods.q_base + q0;
    T row_lse[R], row_delta[R];
    #pragma unroll
    for (int i = 0; i < R; ++i) { row_lse[i] = lse2[at + ty + 16 * i]; row_delta[i] = delta[at + ty + 16 * i]; }

    T acc[R][DC];
    #pragma unroll
    for (int i = 0; i < R; ++i)
        #pragma unroll
        for (int c = 0; c < DC; ++c) acc[i][c] = T(0);

    for (int j = mask.next_key_tile(tiles.x, tiles.y, q0, q0 + q_rows, BLOCK, h); j < tiles.y;
         j = mask.next_key_tile(j + 1, tiles.y, q0, q0 + q_rows, BLOCK, h)) {
        const int k0 = j * BLOCK;
        const int k_rows = min(BLOCK, mask.stop() - k0);   // keys past the stop are never read
        const T* k_blk = K.at(mods.tb, hk, mods.k_base + k0);
        const T* v_blk = V.at(mods.tb, hk, mods.k_base + k0);

        // S = Q K^T and dP = dO V^T, streamed over head-dim chunks.
        T s[R][R], dp[R][R];
        zero(s);
        zero(dp);
        for (int c0 = 0; c0 < D; c0 += CH) {
            __syncthreads();
            load_chunk<T, BLOCK, CH, LDC>(sQc, q_blk + c0, Q.row, q_rows, d - c0);
            load_chunk<T, BLOCK, CH, LDC>(sKc, k_blk + c0, K.row, k_rows, d - c0);
            load_chunk<T, BLOCK, CH, LDC>(sdOc, do_blk + c0, dO.row, q_rows, dim_v - c0);
            load_chunk<T, BLOCK, CH, LDC>(sVc, v_blk + c0, V.row, k_rows, dim_v - c0);
            __syncthreads();
            simt_mm_ABt<T, R, CH, LDC>(s, sQc, sKc);
            simt_mm_ABt<T, R, CH, LDC>(dp, sdOc, sVc);
        }

        // dS = P o (dP - delta[row]), P = exp2(S scale log2 e - lse2[row]), 0 where hidden.
        const bool needs_mask = mask.tile_needs_mask(q0, q0 + BLOCK, k0, k0 + BLOCK, h);
        const auto hm = mods.at_head(h);
        #pragma unroll
        for (int i = 0; i < R; ++i)
            #pragma unroll
            for (int jj = 0; jj < R; ++jj) {
                T dtanh = T(1);
                const T p = recomputed_p<MODE>(mods, hm, s[i][jj], q0 + ty + 16 * i, k0 + tx + 16 * jj,
                                               row_lse[i], scale_log2, needs_mask, dtanh);
                sdS[(ty + 16 * i) * LDP + tx + 16 * jj] = score_grad<MODE>(hm, p, dp[i][jj], row_delta[i]) * dtanh;
            }

        // dQ += dS K, one head-dim chunk at a time.
        #pragma unroll
        for (int ch = 0; ch < C::CHUNKS; ++ch) {
            __syncthreads();   // dS written; the previous chunk is no longer read
            load_chunk<T, BLOCK, CH, LDC>(sKc, k_blk + ch * CH, K.row, k_rows, d - ch * CH);
            __syncthreads();
            simt_mm_AB<T, false, R, DC, CC, BLOCK, LDP, LDC>(acc, ch * CC, sdS, sKc);
        }
    }

    const Strided<T> dQ = tensor<T>(p.dq);
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        if (r >= q_rows) continue;
        T* dq_row = dQ.at(mods.tb, h, mods.q_base + q0 + r);
        #pragma unroll
        for (int c = 0; c < DC; ++c) {
            const int col = (c / CC) * CH + tx + 16 * (c % CC);
            if (col < d) dq_row[col] = acc[i][c] * scale;
        }
    }
}
