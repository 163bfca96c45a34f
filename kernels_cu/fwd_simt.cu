// Forward attention on the CUDA cores for fp32 and fp64 inputs, computed at the
// inputs' own precision (no TF32), with the same O(N) memory as the tensor-core path.
//
// A CTA of 16 x 16 threads owns BLOCK_M query rows; thread (ty, tx) owns rows
// ty + 16 i and key columns tx + 16 j of each score tile, and output columns
// tx + 16 c. The 16 threads of a row group are one half-warp, so row reductions are
// four shuffles. K and V take turns in one shared buffer.
#include "elem.cuh"
#include "mask.cuh"
#include "tensor.cuh"

template <typename T, int D, int BLOCK>
struct SimtTile {
    static constexpr int THREADS = 256;
    static constexpr int R = BLOCK / 16;       // rows (and key columns) per thread
    static constexpr int DC = D / 16;          // output columns per thread
    static constexpr int LD = D + 1;           // odd strides keep column reads conflict-free
    static constexpr int LDP = BLOCK + 1;
    static constexpr int SMEM_ELEMS = 2 * BLOCK * LD + BLOCK * LDP;
};

template <typename T, int ROWS, int COLS, int LD, int THREADS>
__device__ __forceinline__ void load_rows(T* dst, const T* src, i64 ld, int rows, int cols) {
    for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
        const int r = i / COLS, c = i % COLS;
        dst[r * LD + c] = (r < rows && c < cols) ? src[r * ld + c] : T(0);
    }
}

template <typename Acc>
__device__ __forceinline__ Acc halfwarp_max(Acc x) {
    #pragma unroll
    for (int o = 1; o < 16; o *= 2) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
template <typename Acc>
__device__ __forceinline__ Acc halfwarp_sum(Acc x) {
    #pragma unroll
    for (int o = 1; o < 16; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <typename T, int D, int BLOCK>   // BLOCK rows and keys per tile
__global__ void __launch_bounds__(256)
flash_fwd_simt(TENSOR_ARG(const T, q), TENSOR_ARG(const T, k), TENSOR_ARG(const T, v),
               TENSOR_ARG(T, o), T* __restrict__ lse,
               int group, int nq, int nk, int d, int dv,
               T scale_log2, int causal)
{
    typedef SimtTile<T, D, BLOCK> C;
    constexpr int R = C::R, DC = C::DC;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sKV = sQ + BLOCK * C::LD;
    T* sP = sKV + BLOCK * C::LD;

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const int q0 = m_block * BLOCK;
    const int q_rows = min(BLOCK, nq - q0);
    const MaskInfo mask{nq, nk, causal};
    const int n_tiles = mask.key_tile_stop(q0, q0 + q_rows, BLOCK);

    const Strided<const T> Q = TENSOR(const T, q), K = TENSOR(const T, k), V = TENSOR(const T, v);
    const Strided<T> O = TENSOR(T, o);

    load_rows<T, BLOCK, D, C::LD, C::THREADS>(sQ, Q.at(b, h, q0), Q.row, q_rows, d);

    T acc[R][DC], row_max[R], row_sum[R];
    #pragma unroll
    for (int i = 0; i < R; ++i) {
        row_max[i] = -INFINITY;
        row_sum[i] = 0;
        #pragma unroll
        for (int c = 0; c < DC; ++c) acc[i][c] = 0;
    }

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * BLOCK;
        const int k_rows = min(BLOCK, nk - k0);
        __syncthreads();   // the previous V tile is no longer read
        load_rows<T, BLOCK, D, C::LD, C::THREADS>(sKV, K.at(b, hk, k0), K.row, k_rows, d);
        __syncthreads();

        T s[R][R];
        #pragma unroll
        for (int i = 0; i < R; ++i)
            #pragma unroll
            for (int jj = 0; jj < R; ++jj) s[i][jj] = 0;
        #pragma unroll 4
        for (int kk = 0; kk < D; ++kk) {
            T qv[R], kv[R];
            #pragma unroll
            for (int i = 0; i < R; ++i) { qv[i] = sQ[(ty + 16 * i) * C::LD + kk]; kv[i] = sKV[(tx + 16 * i) * C::LD + kk]; }
            #pragma unroll
            for (int i = 0; i < R; ++i)
                #pragma unroll
                for (int jj = 0; jj < R; ++jj) s[i][jj] = fma(qv[i], kv[jj], s[i][jj]);
        }

        const bool needs_mask = mask.tile_needs_mask(q0, k0, k0 + BLOCK);
        #pragma unroll
        for (int i = 0; i < R; ++i) {
            T tile_max = -INFINITY;
            #pragma unroll
            for (int jj = 0; jj < R; ++jj) {
                T x = s[i][jj] * scale_log2;
                if (needs_mask && !mask.visible(q0 + ty + 16 * i, k0 + tx + 16 * jj)) x = -INFINITY;
                s[i][jj] = x;
                tile_max = fmax(tile_max, x);
            }
            const T new_max = fmax(row_max[i], halfwarp_max(tile_max));
            const T base = new_max == -INFINITY ? T(0) : new_max;
            const T alpha = exp2_fast(row_max[i] - base);
            row_max[i] = new_max;
            T sum = 0;
            #pragma unroll
            for (int jj = 0; jj < R; ++jj) {
                const T p = exp2_fast(s[i][jj] - base);
                sP[(ty + 16 * i) * C::LDP + tx + 16 * jj] = p;
                sum += p;
            }
            row_sum[i] = row_sum[i] * alpha + sum;
            #pragma unroll
            for (int c = 0; c < DC; ++c) acc[i][c] *= alpha;
        }

        __syncthreads();   // K no longer read; P complete
        load_rows<T, BLOCK, D, C::LD, C::THREADS>(sKV, V.at(b, hk, k0), V.row, k_rows, dv);
        __syncthreads();

        #pragma unroll 4
        for (int kk = 0; kk < BLOCK; ++kk) {
            T pv[R], vv[DC];
            #pragma unroll
            for (int i = 0; i < R; ++i) pv[i] = sP[(ty + 16 * i) * C::LDP + kk];
            #pragma unroll
            for (int c = 0; c < DC; ++c) vv[c] = sKV[kk * C::LD + tx + 16 * c];
            #pragma unroll
            for (int i = 0; i < R; ++i)
                #pragma unroll
                for (int c = 0; c < DC; ++c) acc[i][c] = fma(pv[i], vv[c], acc[i][c]);
        }
    }

    #pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = ty + 16 * i;
        const T sum = halfwarp_sum(row_sum[i]);
        const T inv = sum > T(0) ? T(1) / sum : T(0);
        if (r < q_rows) {
            T* out = O.at(b, h, q0 + r);
            #pragma unroll
            for (int c = 0; c < DC; ++c)
                if (tx + 16 * c < dv) out[tx + 16 * c] = acc[i][c] * inv;
            if (tx == 0)
                lse[((i64)b * gridDim.y + h) * nq + q0 + r] =
                    sum > T(0) ? (row_max[i] + log2(sum)) * T(LN2_D) : T(-INFINITY);
        }
    }
}
