// What every backward kernel shares: the per-row workspaces of the pre-pass, the query
// range of a key block, and conversions between element and accumulation types.
//
// Row workspaces. The pre-pass (bwd_prep.cu) turns the forward's LSE and the output into
// two (B, Hq, nq_pad) arrays in the accumulation type, nq_pad a multiple of BWD_ROW_PAD:
//   lse2[i]  = LSE_i * log2(e), so that P = exp2(S * scale * log2(e) - lse2) is one FFMA and
//              one exp2, and +inf where LSE = -inf (a row that sees no key), so that P = 0
//              there instead of exp2(-inf + inf) = NaN;
//   delta[i] = rowsum(dO_i * O_i), the softmax Jacobian's row term (D in the papers).
// Rows in [nq, nq_pad) hold lse2 = +inf and delta = 0: a query tile reads its rows without
// tail checks, and a padded row's P and dS are 0.
#pragma once
#include "elem.cuh"
#include "mask.cuh"

#define BWD_ROW_PAD 128
#define LOG2E_D 1.4426950408889634

// Gradients a backward kernel instantiation produces (its GRADS template argument).
enum { GRAD_DV = 1, GRAD_DK = 2, GRAD_DQ = 4 };

// The first query tile that sees any key of a block starting at key k0; every later
// tile sees some key of it (the last query row sees every key). Mirrors
// cupyflash/_masks.py query_block_range.
__device__ __forceinline__ int query_tile_start(const MaskInfo& mask, int k0, int block_m) {
    return mask.causal ? max(0, k0 - (mask.nk - mask.nq)) / block_m : 0;
}

__device__ __forceinline__ i64 row_workspace_offset(int b, int h, int hq, int nq_pad) {
    return ((i64)b * hq + h) * nq_pad;
}

// Element <-> accumulation type for every input dtype.
__device__ __forceinline__ float to_acc(half_t x) { return to_float(x); }
__device__ __forceinline__ float to_acc(bfloat16_t x) { return to_float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(typename Accum<T>::type x) { return from_float<T>(x); }
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }
