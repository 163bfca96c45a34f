// Element types and conversions. The kernels include no CUDA header (cuda_fp16.h,
// cuda_bf16.h), so NVRTC needs no include path: 16-bit types are their bits, and the
// conversions are single PTX instructions.
#pragma once
#include "exp2_f64.cuh"

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

struct half_t { u16 bits; };
struct bfloat16_t { u16 bits; };

// Accumulation type: fp32 for 16-bit and fp32 inputs, fp64 for fp64 inputs.
template <typename T> struct Accum { typedef float type; };
template <> struct Accum<double> { typedef double type; };

__device__ __forceinline__ float to_float(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(bfloat16_t x) {
    return __uint_as_float(static_cast<u32>(x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ half_t from_float<half_t>(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
template <> __device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float f) {
    bfloat16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}

// Element <-> accumulation type for every input dtype.
__device__ __forceinline__ float to_acc(half_t x) { return to_float(x); }
__device__ __forceinline__ float to_acc(bfloat16_t x) { return to_float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(typename Accum<T>::type x) { return from_float<T>(x); }
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// Two floats rounded into one 32-bit register, `lo` in the low half: the layout mma.sync
// expects for a pair of neighbouring columns. (cvt's first source goes to the high half.)
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<half_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 pack2<bfloat16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four floats times `mul`, rounded into 8 bytes (pack2's layout): a 16-bit row's chunk
// of four elements from an fp32 accumulator.
template <typename T> __device__ __forceinline__ uint2 pack4(float4 a, float mul) {
    return make_uint2(pack2<T>(a.x * mul, a.y * mul), pack2<T>(a.z * mul, a.w * mul));
}

// Base-2 exponential on the SFU: the online softmax works in log2 units with log2(e)
// folded into the scale, so one FFMA and one MUFU.EX2 give each probability. fp64: a
// table and a short polynomial (exp2_f64.cuh), for x below 1024.
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ double exp2_fast(double x) { return exp2_f64(x); }
// log2 for the LSE, once per row: the SFU's for fp32, the accurate one for fp64.
__device__ __forceinline__ float log2_fast(float x) { return __log2f(x); }
__device__ __forceinline__ double log2_fast(double x) { return log2(x); }

#define LOG2E_F 1.4426950408889634f
#define LOG2E_D 1.4426950408889634
#define LN2_D 0.6931471805599453

// math.h is not included under NVRTC without headers; -inf as a bit pattern.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// An fp32 value rounded for a TF32 operand (the tensor cores read the top 19 bits of a
// .tf32 operand): x's bits plus half a TF32 ulp, so that the tensor core's truncation of
// it is x rounded to nearest TF32 (ties away; cvt.rna without its inf/NaN select; within
// 2^-12 relative of FLT_MAX it rounds to inf).
__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(__float_as_uint(x) + 0x1000u); }

// A template parameter's use that takes no part in deduction (std::type_identity).
template <typename X> struct NoDeduce { typedef X type; };

// Zero a warp's accumulator fragments ([m-tile][n-tile][4], any accumulation type).
template <int MT, int NT, typename Acc>
__device__ __forceinline__ void zero_frags(Acc (&c)[MT][NT][4]) {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) c[mt][nt][e] = Acc(0);
}
