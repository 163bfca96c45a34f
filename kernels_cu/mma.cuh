// Tensor-core building blocks for sm_80+: ldmatrix fragment loads and the
// m16n8k16 mma.sync with fp32 accumulators.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), g = lane / 4,
// t = lane % 4:
//   A (16x16, row-major)  a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16x8,  k x n)      b0: (k=2t..2t+1, n=g)  b1: (k=2t+8.., n=g)
//   C (16x8,  fp32)       c0,c1: (g, 2t..2t+1)   c2,c3: (g+8, 2t..2t+1)
// so a C fragment of S = Q K^T, rounded to 16 bits, is directly an A fragment of P V.
#pragma once
#include "elem.cuh"
#include "copy.cuh"

// Four 8x8 matrices of 16-bit elements; lane l supplies the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row_ptr)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* row_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row_ptr)));
}

// The mma asm is not volatile: it only reads and writes registers, so the compiler may
// schedule it around the (volatile, shared-memory reading) ldmatrix loads.
template <typename T> struct MmaOp;
template <> struct MmaOp<half_t> {
    static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct MmaOp<bfloat16_t> {
    static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Row-major 16x16 A fragment at (row0, col0) of a padded shared tile.
template <typename T, int COLS>
__device__ __forceinline__ void load_a_frag(u32 (&a)[4], const T* tile, int row0, int col0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4(a, tile + (row0 + lane % 16) * SmemTile<T, COLS>::stride + col0 + (lane / 16) * 8);
}

// B fragments of X^T for two 8-wide n-tiles, X stored row-major with n as its row
// (K for S = Q K^T): r[0], r[1] serve n-tile n0..n0+7, r[2], r[3] serve n0+8..n0+15.
template <typename T, int COLS>
__device__ __forceinline__ void load_bt_frags(u32 (&r)[4], const T* tile, int n0, int k0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4(r, tile + (n0 + lane % 8 + (lane / 16) * 8) * SmemTile<T, COLS>::stride + k0 + ((lane / 8) % 2) * 8);
}

// B fragments of X for two n-tiles, X stored row-major with k as its row (V for
// O = P V): the transposing load puts two consecutive k of one column in a register.
template <typename T, int COLS>
__device__ __forceinline__ void load_b_frags(u32 (&r)[4], const T* tile, int k0, int n0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4_trans(r, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * SmemTile<T, COLS>::stride + n0 + (lane / 16) * 8);
}

// A fragment of X^T, 16x16 at (row0, col0) of X^T, for X stored row-major (dS^T stored
// key-major, read as dS for dQ = dS K). Each 8x8 block of X^T is the transposing load of
// the 8x8 block of X at (col0 + .., row0 + ..): a0 from X rows col0..+7, cols row0..+7;
// a1 rows col0.., cols row0+8..; a2 rows col0+8.., cols row0..; a3 rows col0+8.., cols row0+8...
template <typename T, int COLS>
__device__ __forceinline__ void load_at_frag(u32 (&a)[4], const T* tile, int row0, int col0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4_trans(a, tile + (col0 + lane % 8 + (lane / 16) * 8) * SmemTile<T, COLS>::stride + row0 + ((lane / 8) % 2) * 8);
}
