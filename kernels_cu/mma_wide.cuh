// Tensor-core building blocks for fp32 and fp64 inputs at their own precision (sm_80+):
// fp64 products on DMMA, fp32 products as three TF32 products (3xTF32).
//
// Every product is a sum of warp-wide 16x8x8 steps laid out as mma.m16n8k8 with .tf32 or
// .f64 operands (PTX ISA, "Matrix fragments for mma.m16n8k8"), g = lane / 4, t = lane % 4:
//   A (16x8, row-major)  a0: (g, t)   a1: (g+8, t)   a2: (g, t+4)   a3: (g+8, t+4)
//   B (8x8,  k x n)      b0: (k=t, n=g)   b1: (k=t+4, n=g)
//   C (16x8)             c0, c1: (g, 2t..2t+1)   c2, c3: (g+8, 2t..2t+1)
// sm_90 has that shape for fp64 (DMMA.16x8x8). sm_80 has only m8n8k4 (A 8x4 a0: (g, t);
// B 4x8 b0: (k=t, n=g); C 8x8 c0, c1: (g, 2t..2t+1)), so there a step is four of them:
// rows g from (a0, b0) then (a2, b1), rows g+8 from (a1, b0) then (a3, b1).
//
// The k index inside a step is only a label: permuting k in A's columns and B's rows
// alike leaves the product unchanged. Here logical k = t stands for physical column 2t
// of the 8-wide k slice and k = t+4 for column 2t+1. Two things follow:
//  - The C fragment of S = Q K^T is the A fragment of O = P V, in registers as it is:
//    keys 2t, 2t+1 of rows g, g+8 (c0, c1, c2, c3) are a0, a2, a1, a3, and V's B fragment
//    is read from key rows 2t and 2t+1. No shuffle, no trip through shared memory.
//  - Each thread's two k-neighbours of a row are adjacent in memory: one 8-byte (fp32)
//    or 16-byte (fp64) shared load per row instead of two.
// For B = V (k = key is V's row) the same pairing is applied to the n side, over two
// n-tiles at once: n-tile 2p + j reads physical column 16 p + 2 g + j, so a thread's
// row 2t gives (n-tile 2p, n-tile 2p+1) in one load. The output C fragments then hold,
// per row, the four consecutive columns 16 p + 4 t .. + 3 (see store_o_row).
//
// Shared-memory banks (no ldmatrix: it moves 16-bit pairs, which a 32/64-bit element
// does not split into usefully). An 8-byte load is served per half-warp and a 16-byte
// load per quarter-warp; one such phase reads, for
//   A rows and K (n-rows along k): 4 rows (fp32) / 2 rows (fp64), each 8 elements wide,
//     conflict-free when the row stride is D + 8 elements (D a multiple of 32);
//   V (k-rows 2t along n): rows 0, 2, 4, 6 of the step, each 8 fp32 / 4 fp64 wide,
//     conflict-free with the usual 16 bytes of padding (SmemTile) and a width that is a
//     multiple of 16.
// A tile read both ways (the backward's Q, dO, K: S^T reads them along k, dV, dK and dQ
// down k) meets the second pattern on the first's stride, where rows 0, 2, 4, 6 share
// banks (4-way for fp64, 2-way for fp32); for fp64, PairRowsStaggered shifts rows so
// that both ways are conflict-free (BothWaysRows says why fp32 keeps the 2-way).
#pragma once
#include "elem.cuh"
#include "copy.cuh"

// Layouts of shared tiles: at(row, col) is where an element lies, size(rows) the
// elements of a tile (rows a multiple of 8), and for R a multiple of 8, at(R + r, c) =
// block(R, 0) + at(r, c): the loaders below add a lane's part (r < 8, a value or two a
// thread, computed once) to a block's offset (an immediate, or a row register). A tile
// pointer moved by block(R, C) keeps the layout. PLAIN: at() is row * stride + col
// (copy.cuh RowMajor, the plain one), which element() below writes as one product.
//
// PairRows: tiles read along their rows only, as A operands or as K (pairs along k).
template <typename T, int COLS> struct PairRows : RowMajor<COLS + 8> {};

// PairRowsStaggered (fp64): PairRows' stride within groups of 8 rows, and row r of a
// group shifted right by (r >> 1) & 3 32-byte chunks (the groups spaced 12 elements
// apart to make room). A read down the rows (load_b_pair) touches rows 0, 2, 4, 6 of a
// group at the same columns, which PairRows' stride puts on one bank group (4-way
// conflicts); the shifts spread them over the four, and a read along the rows touches
// rows that share a shift, so it stays conflict-free. Being a shift rather than a
// permutation of chunks, it keeps column offsets additive (immediates).
template <typename T, int COLS> struct PairRowsStaggered {
    static_assert(sizeof(T) == 8, "fp64 elements");
    static constexpr int stride = COLS + 8;
    static constexpr bool PLAIN = false;
    static constexpr int GROUP = 8 * stride + 12;   // 8 rows, a multiple of 16 bytes
    __host__ __device__ static constexpr int size(int rows) { return rows / 8 * GROUP; }
    __device__ __forceinline__ static constexpr int at(int row, int col) {
        return (row >> 3) * GROUP + (row & 7) * stride + ((row & 7) >> 1) * 4 + col;
    }
    __device__ __forceinline__ static constexpr int block(int row, int col) { return (row >> 3) * GROUP + col; }
};

// Tiles read both ways (the backward's Q, dO, K): staggered for fp64. fp32 keeps
// PairRows: its stride gives 2-way conflicts down the rows, and the fp32 stagger (a
// 32-byte shift of rows 4-7 of each group) made the fp32 backward 0.93-0.95x as fast at
// d = 64 on an H100 (1.00x at d = 128), where fp64's made it 1.3-1.55x faster.
//
// PairRowsByBlock is PairRows addressed as the staggered rows are (a block's offset plus a
// lane's): the same addresses, but ptxas, at 255 registers, allocates the fp32 backward
// better from that form and the forward from the plain one (NVRTC 12.9 build check: each
// spilled in the other form).
template <typename T, int COLS> struct PairRowsByBlock : PairRows<T, COLS> { static constexpr bool PLAIN = false; };
template <typename T, int COLS> struct BothWaysRows { typedef PairRowsStaggered<T, COLS> type; };
template <int COLS> struct BothWaysRows<float, COLS> { typedef PairRowsByBlock<float, COLS> type; };

// Operand registers of one 16x8x8 step (N = 4 for A, 2 for B), filled element by element.
template <typename T, int N> struct Operand;

// ACCUMULATE_EXACT: the tensor cores round the accumulation to nearest (DMMA, IEEE fp64),
// so long sums may run in their accumulators. TF32 MMAs truncate instead (see fwd_wide.cu).
template <int N> struct Operand<double, N> {
    static constexpr bool ACCUMULATE_EXACT = true;
    double x[N];
    __device__ __forceinline__ void set(int i, double v) { x[i] = v; }
};

// 3xTF32: x = big + small, big = x rounded to TF32 (11 significant bits, to nearest with
// ties away, as cvt.rna.tf32.f32), small = x - big exactly (|small| <= 2^-11 |x|).
// The tensor cores read only the top 19 bits of a .tf32 operand (ptxas itself feeds
// cvt.rna's unmasked sum to the MMA, and CUTLASS's 3xTF32 relies on the same), so:
//  - big goes to the MMA as x's bits + 2^12 (half a TF32 ulp): the truncation that the
//    tensor core applies completes the rounding; only the subtraction needs it masked.
//    That is cvt.rna without its inf/NaN select (inf and NaN inputs give NaN either way);
//  - small goes with its low 13 bits in place, truncated by the tensor core, which costs
//    at most 2^-10 |small| <= 2^-21 |x|.
// With the dropped small*small term (<= 2^-22 |a b|) a product is exact to about 2^-21
// relative, far below the fp32 tolerance (tests/test_tf32_split.py emulates it).
// Finite inputs within 2^-12 relative of FLT_MAX round big to inf and give NaN.
template <int N> struct Operand<float, N> {
    static constexpr bool ACCUMULATE_EXACT = false;
    u32 big[N], small[N];
    __device__ __forceinline__ void set(int i, float v) {
        big[i] = __float_as_uint(tf32_round(v));   // elem.cuh
        small[i] = __float_as_uint(v - __uint_as_float(big[i] & 0xffffe000u));
    }
};

// The mma asm statements are not volatile (they only touch registers), so the compiler
// may schedule them around the shared-memory loads.
__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b: the two small cross terms, then big * big.
__device__ __forceinline__ void mma_16x8x8(float (&c)[4], const Operand<float, 4>& a, const Operand<float, 2>& b) {
    mma_tf32(c, a.small, b.big[0], b.big[1]);
    mma_tf32(c, a.big, b.small[0], b.small[1]);
    mma_tf32(c, a.big, b.big[0], b.big[1]);
}

__device__ __forceinline__ void dmma_884(double& c0, double& c1, double a, double b) {
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
        : "+d"(c0), "+d"(c1) : "d"(a), "d"(b));
}

__device__ __forceinline__ void mma_16x8x8(double (&c)[4], const Operand<double, 4>& a, const Operand<double, 2>& b) {
#if __CUDA_ARCH__ >= 900
    asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a.x[0]), "d"(a.x[1]), "d"(a.x[2]), "d"(a.x[3]), "d"(b.x[0]), "d"(b.x[1]));
#else
    dmma_884(c[0], c[1], a.x[0], b.x[0]);
    dmma_884(c[2], c[3], a.x[1], b.x[0]);
    dmma_884(c[0], c[1], a.x[2], b.x[1]);
    dmma_884(c[2], c[3], a.x[3], b.x[1]);
#endif
}

// Two adjacent elements of a shared tile. Volatile like ldmatrix in mma.cuh: the loads
// keep their program order, so the compiler cannot hoist a whole unrolled loop's worth
// of them (and their TF32 splits) ahead of the MMAs and run out of registers; the MMAs
// still move freely around them.
__device__ __forceinline__ float2 load_pair(const float* p) {
    float2 r;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(r.x), "=f"(r.y) : "r"(smem_addr(p)));
    return r;
}
__device__ __forceinline__ double2 load_pair(const double* p) {
    double2 r;
    asm volatile("ld.shared.v2.f64 {%0,%1}, [%2];\n" : "=d"(r.x), "=d"(r.y) : "r"(smem_addr(p)));
    return r;
}

// Element (R + r, C + c) of a tile laid out as L, R a multiple of 8 and (r, c) a lane's
// part: plain rows as one product, the others as the block's offset plus the lane's
// (computed once a thread; see PairRowsByBlock).
template <typename L, typename T>
__device__ __forceinline__ const T* element(const T* tile, int R, int C, int r, int c) {
    if constexpr (L::PLAIN) return tile + L::at(R + r, C + c);
    else return tile + L::block(R, C) + L::at(r, c);
}

// A operand: the 16x8 block at (row0, k0) of a tile laid out as L.
template <typename L, typename T>
__device__ __forceinline__ void load_a(Operand<T, 4>& a, const T* tile, int row0, int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const auto top = load_pair(element<L>(tile, row0, k0, g, 2 * t));   // row0: a multiple of 8
    const auto bottom = load_pair(element<L>(tile, row0 + 8, k0, g, 2 * t));
    a.set(0, top.x);
    a.set(2, top.y);
    a.set(1, bottom.x);
    a.set(3, bottom.y);
}

// B operand of X^T for the n-tile n0..n0+7 and k slice k0..k0+7, X row-major with n as
// its row (K for S = Q K^T), laid out as L.
template <typename L, typename T>
__device__ __forceinline__ void load_bt(Operand<T, 2>& b, const T* tile, int n0, int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const auto p = load_pair(element<L>(tile, n0, k0, g, 2 * t));
    b.set(0, p.x);
    b.set(1, p.y);
}

// B operands of X for the two n-tiles of columns n0..n0+15 and k slice k0..k0+7, X
// row-major with k as its row (V for O = P V), laid out as L: b[j] is n-tile j of the pair.
template <typename L, typename T>
__device__ __forceinline__ void load_b_pair(Operand<T, 2> (&b)[2], const T* tile, int k0, int n0) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const auto even = load_pair(element<L>(tile, k0, n0, 2 * t, 2 * g));   // k0: a multiple of 8
    const auto odd = load_pair(element<L>(tile, k0, n0, 2 * t + 1, 2 * g));
    b[0].set(0, even.x);
    b[0].set(1, odd.x);
    b[1].set(0, even.y);
    b[1].set(1, odd.y);
}

__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
    float4 v;
    v.x = a; v.y = b; v.z = c; v.w = d;
    *reinterpret_cast<float4*>(p) = v;
}
__device__ __forceinline__ void store4(double* p, double a, double b, double c, double d) {
    double2 lo, hi;
    lo.x = a; lo.y = b; hi.x = c; hi.y = d;
    reinterpret_cast<double2*>(p)[0] = lo;
    reinterpret_cast<double2*>(p)[1] = hi;
}

// One row of an n-tile pair's C fragments (c of n-tile 2p, d of n-tile 2p + 1, half hh:
// row g + 8 hh): this thread's four consecutive columns 16 p + 4 t .. + 3, times mul.
template <typename T>
__device__ __forceinline__ void paired_row(T (&x)[4], const T (&c)[4], const T (&d)[4], int hh, T mul) {
    x[0] = c[2 * hh] * mul;
    x[1] = d[2 * hh] * mul;
    x[2] = c[2 * hh + 1] * mul;
    x[3] = d[2 * hh + 1] * mul;
}

// paired_row into global memory at `row` (which points at column 16 p), of which the first
// `cols` columns exist. `vec`: 16-byte aligned rows.
template <typename T>
__device__ __forceinline__ void store_o_row(T* row, const T (&c)[4], const T (&d)[4], int hh, int cols, bool vec,
                                            T mul = T(1)) {
    const int col = 4 * (threadIdx.x % 4);
    T x[4];
    paired_row(x, c, d, hh, mul);
    if (vec && col + 4 <= cols) {
        store4(row + col, x[0], x[1], x[2], x[3]);
    } else {
        #pragma unroll
        for (int i = 0; i < 4; ++i)
            if (col + i < cols) row[col + i] = x[i];
    }
}

// ---------------------------------------------------------------- warp-level products
// The two shapes of attention's products, for one warp that owns MT 16-row m-tiles of
// the result and its whole width (the fp32/fp64 counterparts of warp_mm.cuh):
//   wide_mm_ABt_from: C += A B^T, B row-major in shared memory with its n index as the
//                     row (S = Q K^T and its relatives), A supplied by a callback;
//   wide_mm_AB_from:  C += A B, B row-major with k as its row (P V, dS K), the result in
//                     the paired column layout of load_b_pair (store_o_row writes it).

// C[MT][NT] += A B^T over 8 KSTEPS columns, B rows [0, 8 NT) of a tile laid out as LB;
// load_a(a, mt, ks) fills A's operand of m-tile mt, k-step ks. CHAINS > 1: the k-steps
// rotate through enough accumulators (added at the end) that the warp keeps that many
// independent chains of MMAs in flight with few (m-tile, n-tile) products. fp32 is where
// it matters: each product is three TF32 MMAs into one accumulator. For fp64, a DMMA's
// result is ready ~50 cycles after its issue and a scheduler's pipe takes one every 32
// cycles (bench/dmma_chains.cu): two warps of one product each already keep it full.
// The tile structs choose CHAINS from measurements (the extra accumulators cost
// registers that some tiles do not have).
constexpr int accumulator_sets(int products, int ksteps, int chains) {
    int sets = 1;
    while (products * sets < chains && ksteps % (2 * sets) == 0) sets *= 2;
    return sets;
}
template <typename LB, int KSTEPS, int CHAINS = 1, typename T, int MT, int NT, typename LoadA>
__device__ __forceinline__ void wide_mm_ABt_from(T (&c)[MT][NT][4], LoadA&& load_a, const T* sB) {
    constexpr int SETS = accumulator_sets(MT * NT, KSTEPS, CHAINS);
    T extra[SETS][MT][NT][4];   // set 0 is c itself
    #pragma unroll
    for (int set = 1; set < SETS; ++set) zero_frags(extra[set]);
    #pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        Operand<T, 4> a[MT];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a(a[mt], mt, ks);
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            Operand<T, 2> b;
            load_bt<LB>(b, sB, nt * 8, ks * 8);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_16x8x8(ks % SETS == 0 ? c[mt][nt] : extra[ks % SETS][mt][nt], a[mt], b);
        }
    }
    #pragma unroll
    for (int set = 1; set < SETS; ++set)
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e) c[mt][nt][e] += extra[set][mt][nt][e];
}

// The same with A rows a_row0 + [0, 16 MT) of a tile laid out as L, as B is.
template <typename L, int KSTEPS, int CHAINS = 1, typename T, int MT, int NT>
__device__ __forceinline__ void wide_mm_ABt(T (&c)[MT][NT][4], const T* sA, int a_row0, const T* sB) {
    wide_mm_ABt_from<L, KSTEPS, CHAINS>(
        c, [&](Operand<T, 4>& a, int mt, int ks) { load_a<L>(a, sA, a_row0 + mt * 16, ks * 8); }, sB);
}

// C[MT][NT] += A B over 8 KT rows of B (laid out as LB), columns [0, 8 NT), 16 at a time;
// load_a(a, mt, kt) fills A's operand of m-tile mt, k-step kt. For fp32 every 16-column
// pair is summed from zero in the tensor cores and added into C in the FPU: TF32 MMAs
// truncate as they accumulate, and over a long sequence of calls that bias would grow
// (fwd_wide.cu, tests/test_tf32_split.py). DMMA rounds to nearest and accumulates into C.
template <typename LB, int KT, typename T, int MT, int NT, typename LoadA>
__device__ __forceinline__ void wide_mm_AB_from(T (&c)[MT][NT][4], LoadA&& load_a, const T* sB) {
    constexpr bool FRESH = !Operand<T, 4>::ACCUMULATE_EXACT;
    static_assert(NT % 2 == 0, "B operands come in pairs of n-tiles");
    #pragma unroll
    for (int dp = 0; dp < NT / 2; ++dp) {
        T part[FRESH ? MT : 1][2][4];
        if constexpr (FRESH) zero_frags(part);
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            Operand<T, 2> b[2];
            load_b_pair<LB>(b, sB, kt * 8, dp * 16);
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Operand<T, 4> a;
                load_a(a, mt, kt);
                #pragma unroll
                for (int i = 0; i < 2; ++i)
                    mma_16x8x8(FRESH ? part[FRESH ? mt : 0][i] : c[mt][2 * dp + i], a, b[i]);
            }
        }
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int i = 0; i < 2; ++i)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (FRESH) c[mt][2 * dp + i][e] += part[FRESH ? mt : 0][i][e];
    }
}

// C += f(X) B with X in registers as the C fragments of an earlier product (P, dS^T):
// the fragment of n-tile kt is, as it stands, A's operand of k-step kt (see the top of
// this file); each element goes through f (the backward's dropout on P) and is converted
// (split, for fp32) once for all column pairs.
struct Identity { template <typename X> __device__ __forceinline__ X operator()(X x) const { return x; } };

template <typename LB, typename T, int MT, int KT, int NT, typename F = Identity>
__device__ __forceinline__ void wide_mm_AB(T (&c)[MT][NT][4], const T (&x)[MT][KT][4], const T* sB, F f = F()) {
    Operand<T, 4> ops[MT][KT];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            ops[mt][kt].set(0, f(x[mt][kt][0]));
            ops[mt][kt].set(2, f(x[mt][kt][1]));
            ops[mt][kt].set(1, f(x[mt][kt][2]));
            ops[mt][kt].set(3, f(x[mt][kt][3]));
        }
    wide_mm_AB_from<LB, KT>(c, [&](Operand<T, 4>& a, int mt, int kt) { a = ops[mt][kt]; }, sB);
}
