// Warp-level tile products on the tensor cores, built from the fragments of mma.cuh.
//
// A warp owns MT 16-row m-tiles of its result and the whole width: the two products here
// are the only shapes attention needs, and each keeps the warp independent of the others.
//   warp_mm_ABt: C += A B^T, both operands row-major in shared memory (S = Q K^T and its
//                relatives: the contraction runs along the rows of both tiles).
//   warp_mm_AB:  C += A B, A in registers as fp32 C fragments of an earlier product (P, dS),
//                rounded to T on the fly, B row-major in shared memory with k as its row.
// C fragments use the layout of mma.cuh: c[mt][nt] is the 16x8 block (mt, nt).
#pragma once
#include "elem.cuh"
#include "copy.cuh"
#include "mma.cuh"

// C[MT][NT] += A B^T with B rows [0, 8 NT) of a padded shared tile, contracting over its
// first 16 KSTEPS columns; load_a(a, mt, ks) supplies A's fragment of m-tile mt, k-step ks
// (from shared memory below, or from registers kept across tiles, as the forward's Q).
template <typename T, int COLS, int MT, int NT, int KSTEPS, typename LoadA>
__device__ __forceinline__ void warp_mm_ABt_from(float (&c)[MT][NT][4], LoadA load_a, const T* sB) {
    static_assert(NT % 2 == 0, "B fragments come in pairs of n-tiles");
    #pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        u32 a[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a(a[mt], mt, ks);
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 b[4];
            load_bt_frags<T, COLS>(b, sB, np * 16, ks * 16);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                MmaOp<T>::run(c[mt][2 * np], a[mt], b[0], b[1]);
                MmaOp<T>::run(c[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// C[MT][NT] += A B^T: A is rows a_row0 + [0, 16 MT) of one padded shared tile, B is rows
// [0, 8 NT) of another; both contract over their first 16 KSTEPS columns.
template <typename T, int COLS, int MT, int NT, int KSTEPS>
__device__ __forceinline__ void warp_mm_ABt(float (&c)[MT][NT][4], const T* sA, int a_row0, const T* sB) {
    warp_mm_ABt_from<T, COLS, MT, NT, KSTEPS>(
        c, [&](u32 (&a)[4], int mt, int ks) { load_a_frag<T, COLS>(a, sA, a_row0 + mt * 16, ks * 16); }, sB);
}

// The A fragment of k-step ks (columns 16 ks .. 16 ks + 15) of a tile held as fp32 C
// fragments: the C layout of two neighbouring n-tiles is the A layout of one k-step.
template <typename T, int MT, int KT>
__device__ __forceinline__ void c_to_a_frag(u32 (&a)[4], const float (&x)[MT][KT][4], int mt, int ks) {
    a[0] = pack2<T>(x[mt][2 * ks][0], x[mt][2 * ks][1]);
    a[1] = pack2<T>(x[mt][2 * ks][2], x[mt][2 * ks][3]);
    a[2] = pack2<T>(x[mt][2 * ks + 1][0], x[mt][2 * ks + 1][1]);
    a[3] = pack2<T>(x[mt][2 * ks + 1][2], x[mt][2 * ks + 1][3]);
}

// C[MT][NT] += A B: A is MT x (8 KT) in registers (C fragments), B is rows [0, 8 KT) and
// columns [0, 8 NT) of a padded shared tile with k as its row.
template <typename T, int COLS, int MT, int KT, int NT>
__device__ __forceinline__ void warp_mm_AB(float (&c)[MT][NT][4], const float (&x)[MT][KT][4], const T* sB) {
    static_assert(KT % 2 == 0 && NT % 2 == 0, "k-steps of 16 and B fragments in pairs");
    #pragma unroll
    for (int ks = 0; ks < KT / 2; ++ks) {
        u32 a[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) c_to_a_frag<T>(a[mt], x, mt, ks);
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            u32 b[4];
            load_b_frags<T, COLS>(b, sB, ks * 16, np * 16);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                MmaOp<T>::run(c[mt][2 * np], a[mt], b[0], b[1]);
                MmaOp<T>::run(c[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Each pair of a warp's C fragments, (row, col) = (row0 + 16 mt + g (+ 8), 8 nt + 2 t) and
// the next column, to put(row, col, x, y).
template <int MT, int NT, typename Put>
__device__ __forceinline__ void for_each_c_pair(int row0, const float (&c)[MT][NT][4], Put&& put) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                put(row0 + mt * 16 + g + hh * 8, nt * 8 + 2 * t, c[mt][nt][2 * hh], c[mt][nt][2 * hh + 1]);
}

// A warp's C fragments as they are (fp32) into its rows row0 + [0, 16 MT) of a shared tile
// with rows `ld` floats apart.
template <int MT, int NT>
__device__ __forceinline__ void warp_store_c_f32(float* tile, int ld, int row0, const float (&c)[MT][NT][4]) {
    for_each_c_pair(row0, c, [&](int row, int col, float x, float y) {
        *reinterpret_cast<float2*>(tile + row * ld + col) = make_float2(x, y);
    });
}

// Round a warp's C fragments (times `mul`) into its rows row0 + [0, 16 MT) of a padded
// shared tile, for a CTA-wide coalesced store_tile afterwards.
template <typename T, int COLS, int MT, int NT>
__device__ __forceinline__ void warp_store_c(T* tile, int row0, const float (&c)[MT][NT][4], float mul) {
    for_each_c_pair(row0, c, [&](int row, int col, float x, float y) {
        *reinterpret_cast<u32*>(tile + row * SmemTile<T, COLS>::stride + col) = pack2<T>(x * mul, y * mul);
    });
}
