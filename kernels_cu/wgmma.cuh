// Hopper (sm_90a) warpgroup MMA: wgmma.mma_async on 16-bit operands (k-steps of 16) and
// on TF32 operands (fp32 tiles read as TF32, k-steps of 8), both with fp32 accumulators,
// and the 128-byte-swizzled shared-memory layout their descriptors read. A k-step is 32
// bytes of a row in either case, so the layout and the descriptors are the same in bytes.
//
// A warpgroup (4 consecutive warps, the first a multiple of 4) computes a 64 x n tile.
// Warp w of the group holds rows 16 w .. 16 w + 15 in the same C fragment layout as
// mma.sync m16n8k16 (mma.cuh), n / 8 fragments of 4 floats; and an A operand in
// registers has the m16n8k16 A layout. So the softmax, masks and C -> A conversion of the
// sm80 kernels serve these tiles unchanged, each warp seeing one 16-row m-tile.
//
// Ordering (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//   wgmma_fence()      before the first wgmma of a batch, after registers it reads
//                      (accumulator, A) were last written by other instructions;
//   wgmma_commit()     closes the batch; wgmma_wait<N>() waits until at most N batches
//                      are pending; the accumulators may be read only after that
//                      (reg_fence keeps the compiler from hoisting reads above the wait);
//   fence_async_smem() (tma.cuh) makes this thread's shared-memory writes (cp.async included)
//                      visible to the async proxy that wgmma reads through; a barrier
//                      after it publishes them to the whole CTA.
#pragma once
#include "elem.cuh"
#include "copy.cuh"
#include "wgmma_operands.cuh"

// ---------------------------------------------------------------- shared-memory layout
// A ROWS x COLS tile (COLS a multiple of 64 16-bit elements) as COLS / 64 panels of
// ROWS x 64: row r of a panel is 128 bytes at r * 128, and its 16-byte chunk c sits at
// position c ^ (r % 8) (the 128-byte swizzle: the 8 rows a tensor-core phase reads fall
// in distinct banks). The tile must start on a 1024-byte boundary, where the pattern of
// 8 rows starts.
template <typename T, int ROWS>
struct Swizzle128 {
    static constexpr int PANEL_COLS = 128 / sizeof(T);
    static constexpr int PANEL_ELEMS = ROWS * PANEL_COLS;
    static_assert(ROWS % 8 == 0, "whole swizzle atoms of 8 rows");
    // Element (r, col), col a multiple of the 16-byte chunk. Unsigned indices (I) spare
    // the divisions' sign fix-ups where the compiler cannot prove them nonnegative.
    template <typename I = int>
    __device__ static __forceinline__ T* at(T* tile, I r, I col) {
        const I chunk = (col % PANEL_COLS) / Chunk<T>::elems;
        return tile + (col / PANEL_COLS) * PANEL_ELEMS + r * PANEL_COLS + (chunk ^ (r % 8)) * Chunk<T>::elems;
    }
    // The same element's index from the tile's start (times sizeof(T): its byte offset, for
    // shared-window addresses). at() adds its terms to the pointer one by one, as the
    // kernels built on it were tuned and tested with.
    __device__ static __forceinline__ int index(int r, int col) {
        const int chunk = (col % PANEL_COLS) / Chunk<T>::elems;
        return (col / PANEL_COLS) * PANEL_ELEMS + r * PANEL_COLS + (chunk ^ (r % 8)) * Chunk<T>::elems;
    }
};

// copy.cuh's load_tile into a Swizzle128 tile: the same zero-fill of missing rows and
// columns, each 16-byte chunk at its swizzled place. (A separate loop rather than a
// layout parameter of load_tile: that changed the sm80 kernels' code and made two spill.)
template <typename T, int ROWS, int COLS, int NTHREADS>
__device__ __forceinline__ void load_tile_swizzled(T* dst, const T* src, i64 ld, int rows, int cols, bool vec) {
    constexpr int CE = Chunk<T>::elems, CHUNKS_PER_ROW = COLS / CE;
    // A whole tile where each thread can keep one chunk column and step by whole swizzle
    // atoms: one address computation, then constant offsets.
    constexpr int ROW_STEP = NTHREADS / CHUNKS_PER_ROW;
    if constexpr (NTHREADS % CHUNKS_PER_ROW == 0 && ROW_STEP % 8 == 0) {
        if (vec && rows >= ROWS && cols >= COLS) {
            const int r0 = threadIdx.x / CHUNKS_PER_ROW, col = (threadIdx.x % CHUNKS_PER_ROW) * CE;
            T* d = Swizzle128<T, ROWS>::at(dst, r0, col);
            const T* s = src + r0 * ld + col;
            #pragma unroll
            for (int i = 0; i < (ROWS + ROW_STEP - 1) / ROW_STEP; ++i)
                if (r0 + i * ROW_STEP < ROWS)
                    cp_async_16(d + i * ROW_STEP * Swizzle128<T, ROWS>::PANEL_COLS, s + i * ROW_STEP * ld, 16);
            return;
        }
    }
    #pragma unroll
    for (int c = threadIdx.x; c < ROWS * CHUNKS_PER_ROW; c += NTHREADS) {
        const int r = c / CHUNKS_PER_ROW, col = (c % CHUNKS_PER_ROW) * CE;
        T* d = Swizzle128<T, ROWS>::at(dst, r, col);
        const int n = (r < rows) ? max(0, min(CE, cols - col)) : 0;
        const T* s = src + r * ld + col;
        if (vec) {
            cp_async_16(d, n > 0 ? s : src, n * (int)sizeof(T));   // never dereference past the tensor
        } else {
            #pragma unroll
            for (int e = 0; e < CE; ++e) d[e] = e < n ? s[e] : T{};
        }
    }
}

// Four 8x8 matrices of 16-bit elements from registers to shared memory (sm_90): lane l
// gives the row address of matrix l / 8, register j holds its pair (l / 4, 2 (l % 4)) of
// matrix j, as in ldmatrix (mma.cuh). An m16n8k16 A fragment a0..a3 is the four 8x8
// quarters (rows 0-7 / 8-15, columns 0-7 / 8-15 in that order): one instruction a
// fragment instead of four 4-byte stores.
__device__ __forceinline__ void stmatrix_x4(void* row_ptr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n"
                 :: "r"(smem_addr(row_ptr)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// ---------------------------------------------------------------- descriptors
// Lane 0's value in every lane. Of a warpgroup's index (or anything else derived from
// threadIdx that is the same across the warp) it is what the compiler can see is
// warp-uniform: a shuffle from lane 0. Descriptors
// built from it then stay in uniform registers, one uniform add per k-step; built from
// threadIdx / 128 as such, ptxas computed every descriptor in per-thread registers (two
// 64-bit adds, four moves to uniform registers: ~15 instructions a wgmma, a fifth of the
// Hopper backward's instructions, ncu at 7f8a6b4).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// Matrix descriptor of an operand in a Swizzle128 tile (PTX ISA, "Matrix Descriptor
// Format"): start address, leading and stride byte offsets (all >> 4), swizzle mode 1
// (128-byte). Base offset 0: every operand starts in a 1024-byte-aligned atom row 0, or
// at a 32-byte step along k inside one.
__device__ __forceinline__ u64 wgmma_desc(const void* start, u32 leading_bytes, u32 stride_bytes) {
    return static_cast<u64>((smem_addr(start) & 0x3FFFF) >> 4)
         | static_cast<u64>((leading_bytes >> 4) & 0x3FFF) << 16
         | static_cast<u64>((stride_bytes >> 4) & 0x3FFF) << 32
         | 1ull << 62;
}

// The operand descriptors below are the tile's descriptor plus the operand's byte offset
// in it (>> 4, into the start-address field: tiles are 16-byte aligned and the shared
// window is below 2^18 bytes, so the field cannot carry). Written so, the tile's
// descriptor is computed once and each k-step's is one add of a constant, where the
// address arithmetic inside wgmma_desc cost ~12 instructions per wgmma.

// Elements of one k-step: 32 bytes of a row (16 for 16-bit types, 8 for TF32).
template <typename T> struct WgmmaK { static constexpr int elems = 32 / sizeof(T); };

// K-major operand (rows of the tile along m or n, k contiguous: Q and K for S = Q K^T):
// k-step ks starts at panel ks / 4, byte 32 (ks % 4) of its rows; the 8-row groups are
// 1024 bytes apart (stride offset); the leading offset is unused.
template <typename T, int ROWS>
__device__ __forceinline__ u64 kmajor_desc(const T* tile, int row0, int ks) {
    typedef Swizzle128<T, ROWS> L;
    constexpr int KE = WgmmaK<T>::elems, KS_PER_PANEL = L::PANEL_COLS / KE;
    const u32 offset = ((ks / KS_PER_PANEL) * L::PANEL_ELEMS + row0 * L::PANEL_COLS + (ks % KS_PER_PANEL) * KE) * sizeof(T);
    return wgmma_desc(tile, 16, 1024) + (offset >> 4);
}

// MN-major operand (k along the tile's rows, m or n contiguous: V for O = P V, k = keys;
// the backward's dS^T as the A of dQ = dS K): k-step ks starts at row 16 ks; the operand
// starts at column col0 (a multiple of 64); 64-column panels are PANEL_ELEMS apart
// (leading offset), groups of 8 k-rows 1024 bytes apart (stride offset).
template <typename T, int ROWS>
__device__ __forceinline__ u64 mnmajor_desc(const T* tile, int ks, int col0 = 0) {
    typedef Swizzle128<T, ROWS> L;
    const u32 offset = ((col0 / L::PANEL_COLS) * L::PANEL_ELEMS + ks * 16 * L::PANEL_COLS) * sizeof(T);
    return wgmma_desc(tile, L::PANEL_ELEMS * sizeof(T), 1024) + (offset >> 4);
}

// ---------------------------------------------------------------- ordering
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// An empty volatile asm per register: reads of d after it cannot move above an earlier
// volatile asm (the wait), writes before it cannot sink below.
template <int NT>
__device__ __forceinline__ void reg_fence(float (&d)[NT][4]) {
    #pragma unroll
    for (int i = 0; i < NT; ++i)
        #pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e]) :: "memory");
}

// ---------------------------------------------------------------- the MMA
// Wgmma<T, N>::ss: D (+)= A B^T, A 64 x 16 and B N x 16 both K-major in shared memory.
// Wgmma<T, N>::ss_mn: D (+)= A B, A 64 x 16 and B 16 x N both MN-major in shared memory
// (the transpose bits of both operands set).
// Wgmma<T, N>::rs: D (+)= A B, A 64 x 16 in registers (the m16n8k16 A layout), B 16 x N
// MN-major in shared memory. ACCUMULATE = false overwrites D: its registers are then
// outputs only, so D's old value is not kept alive (nor copied between loop iterations:
// such moves would sit between a wgmma and its wait and make ptxas serialize the wgmmas).
template <typename T, int N> struct Wgmma;

#define WGMMA_ASM_K(TY, K, N, KIND, TAIL, CONSTRAINT, ...)                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " WG_N##N##_##KIND##_SCALE ", 0;\n"     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." TY "." TY " "          \
                 WG_N##N##_ACC ", " WG_N##N##_##KIND ", p, 1, 1" TAIL ";\n}\n"               \
                 : WG_N##N##_OPS(CONSTRAINT, d) : __VA_ARGS__, "r"(int(ACCUMULATE)) : "memory")
#define WGMMA_ASM(TY, N, KIND, TAIL, CONSTRAINT, ...) WGMMA_ASM_K(TY, 16, N, KIND, TAIL, CONSTRAINT, __VA_ARGS__)

#define WGMMA_DEFINE(TYPE, TY, N)                                                            \
template <> struct Wgmma<TYPE, N> {                                                          \
    template <bool ACCUMULATE>                                                               \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], u64 a, u64 b) {          \
        if constexpr (ACCUMULATE) WGMMA_ASM(TY, N, SS, ", 0, 0", "+f", "l"(a), "l"(b));       \
        else WGMMA_ASM(TY, N, SS, ", 0, 0", "=f", "l"(a), "l"(b));                            \
    }                                                                                        \
    template <bool ACCUMULATE>                                                               \
    static __device__ __forceinline__ void ss_mn(float (&d)[N / 8][4], u64 a, u64 b) {       \
        if constexpr (ACCUMULATE) WGMMA_ASM(TY, N, SS, ", 1, 1", "+f", "l"(a), "l"(b));       \
        else WGMMA_ASM(TY, N, SS, ", 1, 1", "=f", "l"(a), "l"(b));                            \
    }                                                                                        \
    template <bool ACCUMULATE>                                                               \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) { \
        if constexpr (ACCUMULATE)                                                            \
            WGMMA_ASM(TY, N, RS, ", 1", "+f", "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)); \
        else WGMMA_ASM(TY, N, RS, ", 1", "=f", "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)); \
    }                                                                                        \
};
WGMMA_DEFINE(half_t, "f16", 64)
WGMMA_DEFINE(half_t, "f16", 128)
WGMMA_DEFINE(half_t, "f16", 192)
WGMMA_DEFINE(half_t, "f16", 256)
WGMMA_DEFINE(bfloat16_t, "bf16", 64)
WGMMA_DEFINE(bfloat16_t, "bf16", 128)
WGMMA_DEFINE(bfloat16_t, "bf16", 192)
WGMMA_DEFINE(bfloat16_t, "bf16", 256)
#undef WGMMA_DEFINE

// TF32 (fp32 tiles; the tensor cores read the top 19 bits of each element, mma_wide.cuh):
// k-steps of 8, both shared-memory operands K-major (TF32 has no transpose bits, so a
// B whose k runs along its rows, as V's keys do, must be transposed in shared memory),
// A in registers in the m16n8k8 A layout (a0: (g, t), a1: (g + 8, t), a2: (g, t + 4),
// a3: (g + 8, t + 4)).
#define WGMMA_DEFINE_TF32(N)                                                                 \
template <> struct Wgmma<float, N> {                                                         \
    template <bool ACCUMULATE>                                                               \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], u64 a, u64 b) {          \
        if constexpr (ACCUMULATE) WGMMA_ASM_K("tf32", 8, N, SS, "", "+f", "l"(a), "l"(b));    \
        else WGMMA_ASM_K("tf32", 8, N, SS, "", "=f", "l"(a), "l"(b));                         \
    }                                                                                        \
    template <bool ACCUMULATE>                                                               \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) { \
        if constexpr (ACCUMULATE)                                                            \
            WGMMA_ASM_K("tf32", 8, N, RS, "", "+f", "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)); \
        else WGMMA_ASM_K("tf32", 8, N, RS, "", "=f", "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)); \
    }                                                                                        \
};
WGMMA_DEFINE_TF32(32)
WGMMA_DEFINE_TF32(64)
WGMMA_DEFINE_TF32(128)
#undef WGMMA_DEFINE_TF32
#undef WGMMA_ASM
#undef WGMMA_ASM_K
