// Tile movement between global and shared memory.
//
// A tile is ROWS x COLS elements in shared memory with a row stride of COLS + CHUNK
// elements: the 16 bytes of padding put the eight rows an ldmatrix phase reads into
// distinct banks. Global rows may be shorter than COLS (head dims that are not a tile
// size) and there may be fewer than ROWS of them (sequence tails): the missing elements
// are zero-filled, so padded rows and columns contribute nothing to the products.
#pragma once
#include "elem.cuh"

template <typename T> struct Chunk { static constexpr int elems = 16 / sizeof(T); };

template <typename T, int COLS>
struct SmemTile { static constexpr int stride = COLS + Chunk<T>::elems; };

// A shared tile's layout: where element (row, col) lies, and the elements of a tile of
// `rows` rows (mma_wide.cuh has others and says more). Rows STRIDE elements apart.
template <int STRIDE> struct RowMajor {
    static constexpr int stride = STRIDE;
    static constexpr bool PLAIN = true;   // at() is row * stride + col
    __device__ __forceinline__ static constexpr int at(int row, int col) { return row * STRIDE + col; }
    __device__ __forceinline__ static constexpr int block(int row, int col) { return at(row, col); }
    __host__ __device__ static constexpr int size(int rows) { return rows * STRIDE; }
};

// Shared-memory address of a generic pointer. The builtin (unlike a cvta in inline asm)
// lets the compiler fold constant tile offsets into the ldmatrix/cp.async immediates.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// One 16-byte shared-memory store. (A float4 store through a pointer may reach the code as
// four 4-byte stores where the compiler cannot prove the address 16-byte aligned.)
__device__ __forceinline__ void store_shared_16(float* p, float4 v) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "r"(smem_addr(p)), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w));
}
// 8 bytes at a shared-window address (smem_addr's).
__device__ __forceinline__ void store_shared_8(u32 addr, uint2 v) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" :: "r"(addr), "r"(v.x), "r"(v.y) : "memory");
}
// 16 bytes from a shared-window address, as floats.
__device__ __forceinline__ float4 load_shared_16(u32 addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}

// 16-byte asynchronous copy; bytes past `src_bytes` are zero-filled (0 reads nothing).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 4-byte asynchronous copy (through L1: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// A barrier among `threads` threads (whole warps) that use the same id (id 0 is
// __syncthreads'): the Hopper consumers without their producer, or a pair of warps.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
// The same, returning whether `pred` held in any of the threads.
__device__ __forceinline__ bool named_barrier_or(int id, int threads, bool pred) {
    u32 any;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}\n"
                 : "=r"(any) : "r"(u32(pred)), "r"(id), "r"(threads) : "memory");
    return any != 0;
}

// Load a ROWS x COLS tile starting at `src` (row stride `ld` elements) into `dst`, laid
// out as L (rows a multiple of 16 bytes apart: other fragment reads than ldmatrix want
// other paddings, see mma_wide.cuh; a layout may shift rows by whole 16-byte chunks).
// `vec` says every row start is 16-byte aligned (base pointer and stride), which
// allows cp.async; otherwise elements are copied one by one, synchronously. Either
// way the data is visible after the caller's cp_async_wait + __syncthreads.
template <typename T, int ROWS, int COLS, int NTHREADS, typename L>
__device__ __forceinline__ void load_tile_as(T* dst, const T* src, i64 ld, int rows, int cols, bool vec) {
    constexpr int CE = Chunk<T>::elems;
    constexpr int CHUNKS_PER_ROW = COLS / CE;
    static_assert(L::stride % CE == 0 && L::stride >= COLS, "16-byte aligned rows");
    // Each thread moves the same column chunk of every ROW_STEP-th row (when the thread
    // count allows), so its addresses advance by a constant and cost few registers.
    constexpr bool FIXED_COL = NTHREADS % CHUNKS_PER_ROW == 0;
    constexpr int ROW_STEP = FIXED_COL ? NTHREADS / CHUNKS_PER_ROW : 1;
    constexpr int ITERS = FIXED_COL ? (ROWS + ROW_STEP - 1) / ROW_STEP
                                    : (ROWS * CHUNKS_PER_ROW + NTHREADS - 1) / NTHREADS;
    if (vec && FIXED_COL && rows >= ROWS && cols >= COLS) {
        // A whole tile (every tile but a sequence's last): no bounds, no zero-fill.
        const int r0 = threadIdx.x / CHUNKS_PER_ROW, col = (threadIdx.x % CHUNKS_PER_ROW) * CE;
        const T* s = src + r0 * ld + col;
        #pragma unroll
        for (int i = 0; i < ITERS; ++i)
            if (r0 + i * ROW_STEP < ROWS)
                cp_async_16(dst + L::at(r0 + i * ROW_STEP, col), s + i * ROW_STEP * ld, 16);
        return;
    }
    #pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int c = FIXED_COL ? threadIdx.x : threadIdx.x + i * NTHREADS;
        const int r = FIXED_COL ? threadIdx.x / CHUNKS_PER_ROW + i * ROW_STEP : c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * CE;
        if (r >= ROWS) break;
        T* d = dst + L::at(r, col);
        const int n = (r < rows) ? max(0, min(CE, cols - col)) : 0;
        const T* s = src + r * ld + col;
        if (vec) {
            cp_async_16(d, n > 0 ? s : src, n * (int)sizeof(T));  // never dereference past the tensor
        } else {
            #pragma unroll
            for (int e = 0; e < CE; ++e) {
                T x;
                if (e < n) x = s[e]; else x = T{};
                d[e] = x;
            }
        }
    }
}

// The same into rows LDS elements apart.
template <typename T, int ROWS, int COLS, int NTHREADS, int LDS = SmemTile<T, COLS>::stride>
__device__ __forceinline__ void load_tile(T* dst, const T* src, i64 ld, int rows, int cols, bool vec) {
    load_tile_as<T, ROWS, COLS, NTHREADS, RowMajor<LDS>>(dst, src, ld, rows, cols, vec);
}

// A ROWS x COLS fp32 tile in global memory (rows COLS floats apart; read through L2, which
// other CTAs' reductions wrote), times `mul`, into a padded shared tile of T.
template <typename T, int ROWS, int COLS, int NTHREADS>
__device__ __forceinline__ void stage_sums(T* dst, const float* src, float mul) {
    constexpr int CHUNKS_PER_ROW = COLS / 4, LDS = SmemTile<T, COLS>::stride;
    static_assert(COLS % 4 == 0, "rows of 16-byte chunks");
    #pragma unroll 4
    for (int c = threadIdx.x; c < ROWS * CHUNKS_PER_ROW; c += NTHREADS) {
        const int r = c / CHUNKS_PER_ROW, col = (c % CHUNKS_PER_ROW) * 4;
        *reinterpret_cast<uint2*>(dst + r * LDS + col) =
            pack4<T>(__ldcg(reinterpret_cast<const float4*>(src + r * COLS + col)), mul);
    }
}

// Store the first `rows` x `cols` of a shared-memory tile to global memory, by NTHREADS
// threads: `thread` is this one's index among them (default threadIdx.x).
template <typename T, int ROWS, int COLS, int NTHREADS>
__device__ __forceinline__ void store_tile(T* dst, i64 ld, const T* src, int rows, int cols, bool vec,
                                           int thread = -1) {
    constexpr int CE = Chunk<T>::elems;
    constexpr int CHUNKS_PER_ROW = COLS / CE;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    constexpr int LDS = SmemTile<T, COLS>::stride;
    #pragma unroll
    for (int c = thread < 0 ? int(threadIdx.x) : thread; c < CHUNKS; c += NTHREADS) {
        const int r = c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * CE;
        if (r >= rows || col >= cols) continue;
        const T* s = src + r * LDS + col;
        T* d = dst + r * ld + col;
        if (vec && col + CE <= cols) {
            *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
        } else {
            for (int e = 0; e < CE && col + e < cols; ++e) d[e] = s[e];
        }
    }
}
