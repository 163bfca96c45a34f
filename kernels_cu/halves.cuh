// fp32 operands as fp16 halves, for the tensor cores' 16-bit products (fwd_sm90.cu, bwd_sm90.cu).
//
// An fp32 tensor x is scaled by a power of two s (so that max |x s| lies in [2^14, 2^15),
// inside fp16's range) and split into a high half h = fp16(x s) and a low half
// l = fp16(x s - h): h carries 11 significant bits and l the next 11, so h + l holds x s
// to about 2^-22 relative, where TF32's three-product split holds 2^-21. A product of two
// such operands is then three fp16 products, a_h b_h + a_h b_l + a_l b_h (a_l b_l is
// ~2^-22 of it): on Hopper the 16-bit tensor-core rate is twice TF32's, and 16-bit wgmma
// reads shared-memory operands in either major order, so V needs no transposed copy.
// precision="tf32" keeps a_h b_h alone (11 significant bits a factor, TF32's precision).
// The backward's scale is one per tensor: an element far below the tensor's largest keeps
// its absolute error (about 2^-40 of the largest in the low half's subnormals), so the
// error norms the tests hold (tests/TOLERANCES.md) do not see it. Infinities and NaN are
// left out of the largest element and pass through the halves as themselves.
// split_f32.cu finds each tensor's largest finite |x| (as its bits: a non-negative float
// orders as its bits do, so atomicMax on them finds it) and writes the halves; the kernels
// that read them recompute s (or its exponent) from the same bits (halves_scale,
// halves_exponent), so the host never waits.
//
// The forward takes a scale per chunk of HALVES_CHUNK_ROWS rows (of a tensor, head and
// batch entry): one pass finds a chunk's largest |x|, writes its bits and the chunk's
// halves, 6 bytes an element (precision="tf32") where the two passes over the whole tensor
// move 10. Its tiles lie within chunks, so S is unscaled per key tile and V's scale is
// undone per key tile (fwd_sm90.cu). Under varlen a tile does not start at a chunk, and
// every chunk takes its tensor's scale (the two passes, the split writing every chunk's
// word). The dense forward kernels with room for a second Q buffer split q themselves
// (fwd_sm90.cu QSplit), a scale for each consumer warpgroup's 64 rows: the pass writes k
// and v alone.
#pragma once
#include "elem.cuh"
#include "params.cuh"

// The elements a kernel's tiles hold for inputs of type T: T, or fp16 halves for fp32.
template <typename T> struct HalvesOf { typedef T type; };
template <> struct HalvesOf<float> { typedef half_t type; };

// The largest finite magnitudes' bits of q, k, v (and the backward's dO), in
// AttnParams::halves_max.
enum { HALVES_Q = 0, HALVES_K = 1, HALVES_V = 2, HALVES_DO = 3, HALVES_TENSORS = 4 };

#define HALVES_CHUNK_ROWS 128

// The word of halves_chunk_max that holds the chunk of `row` of tensor `which` (HALVES_Q,
// _K, _V), head h (a kv head for k and v) and batch entry b of the halves arrays.
__device__ __forceinline__ u32* halves_chunk_word(const AttnParams& p, int which, int b, int h, i64 row) {
    return p.halves_chunk_max + (((i64)b * p.grid_heads + h) * HALVES_TENSORS + which) * p.halves_chunks +
           row / HALVES_CHUNK_ROWS;
}

// 2^e as a float for any int e: 0 below the subnormals, infinity above the range (from the
// exponent's bits where it is a normal float, a few instructions a key tile).
__device__ __forceinline__ float pow2(int e) {
    return e >= -126 && e <= 127 ? __uint_as_float(u32(e + 127) << 23) : ldexpf(1.f, e);
}

// The scale s = 2^(14 - e) of a tensor whose largest finite |x| is in [2^e, 2^(e + 1))
// (its bits `max_bits`); e at least -112 so that s stays a normal float (an all-zero or
// subnormal tensor), at most 127.
__device__ __forceinline__ int halves_exponent(u32 max_bits) { return max(int(max_bits >> 23) - 127, -112); }
__device__ __forceinline__ float halves_scale(u32 max_bits) {
    return __uint_as_float(u32(14 - halves_exponent(max_bits) + 127) << 23);
}

// A product over halves as PRODUCTS fp16 products (3, or 1: 16-bit inputs, the forward's
// precision="tf32"): f(a_plane, b_plane, first) for (high, high), then (high, low) and
// (low, high).
template <int PRODUCTS, typename F>
__device__ __forceinline__ void for_each_product(F&& f) {
    #pragma unroll
    for (int product = 0; product < PRODUCTS; ++product) f(int(product == 2), int(product == 1), product == 0);
}

// The smallest power of two at or above x >= 1 (a finite float): its exponent's, and the
// next where x has mantissa bits.
__device__ __forceinline__ float pow2_at_least(float x) {
    const u32 bits = __float_as_uint(x);
    return __uint_as_float(((bits >> 23) + ((bits & 0x7fffffu) != 0)) << 23);
}

// The elements of a row of halves for rows of `cols`: whole 16 bytes, which TMA needs of a
// row's stride (cupyflash/_cuda.py allocates them so).
__host__ __device__ constexpr int halves_row(int cols) { return (cols + 7) / 8 * 8; }

// x (already scaled) as its high half and the fp16 rounding of what the high half missed;
// an infinity or NaN as itself and a low half of 0 (inf - inf would make it NaN).
__device__ __forceinline__ void split_half(float x, half_t& hi, half_t& lo) {
    hi = from_float<half_t>(x);
    const float rest = x - to_float(hi);
    lo = from_float<half_t>(rest == rest ? rest : 0.f);
}

// Four consecutive elements times `scale` as split_half's high halves and low halves,
// each four in 8 bytes (the first element in the lowest bits).
__device__ __forceinline__ void split_run4(const float (&x)[4], float scale, uint2& hi, uint2& lo) {
    half_t h[4], l[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) split_half(x[i] * scale, h[i], l[i]);
    auto pack = [](const half_t (&e)[4]) {
        return make_uint2(u32(e[0].bits) | u32(e[1].bits) << 16, u32(e[2].bits) | u32(e[3].bits) << 16);
    };
    hi = pack(h);
    lo = pack(l);
}

// |x|'s bits, or 0 for an infinity or NaN (left out of the largest finite magnitude).
__device__ __forceinline__ u32 finite_magnitude_bits(float x) {
    const u32 m = __float_as_uint(x) & 0x7fffffffu;
    return m < 0x7f800000u ? m : 0u;
}

// Two scaled floats as pack2's pair of high halves and the pair of their low halves.
__device__ __forceinline__ void split_pack2(float a, float b, u32& hi, u32& lo) {
    hi = pack2<half_t>(a, b);
    const float ha = to_float(half_t{u16(hi & 0xffffu)}), hb = to_float(half_t{u16(hi >> 16)});
    lo = pack2<half_t>(a - ha, b - hb);
}

// warp_mm.cuh c_to_a_frag for a split operand: the C fragments of n-tiles 2 ks and 2 ks + 1
// times `mul`, as the A fragments of k-step ks in high and low halves; a score whose bit
// 4 nt + e of `kept` is clear as 0 (bwd.cuh kept_a_frag: dropout's dropped scores).
template <int MT, int KT>
__device__ __forceinline__ void c_to_split_a_frags(u32 (&hi)[4], u32 (&lo)[4], const float (&x)[MT][KT][4], int mt,
                                                   int ks, float mul, u32 kept = ~0u) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int nt = 2 * ks + i / 2, e0 = 2 * (i % 2);
        auto k = [&](int e) { return (kept >> (4 * nt + e)) & 1 ? x[mt][nt][e] * mul : 0.f; };
        split_pack2(k(e0), k(e0 + 1), hi[i], lo[i]);
    }
}
