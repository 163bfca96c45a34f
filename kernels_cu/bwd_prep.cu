// The backward pass's small element-wise kernels, for every dtype:
//   flash_bwd_prep:       before the main kernels, the row workspaces lse2 and delta (bwd.cuh).
//   flash_bwd_dq_convert: after a key-block kernel that added dq, dq = scale * the fp32 (fp64)
//                         accumulator (atomics, or bulk reductions in turns on Hopper).
#include "elem.cuh"
#include "bwd.cuh"
#include "tensor.cuh"

#define PREP_WARPS 8

// One warp per query row; grid (nq_pad / PREP_WARPS, Hq, B).
template <typename T>
__global__ void __launch_bounds__(PREP_WARPS * 32)
flash_bwd_prep(const __grid_constant__ AttnParams p)
{
    typedef typename Accum<T>::type Acc;
    const int nq = p.nq, dim_v = p.dim_v, nq_pad = p.nq_pad;
    Acc* const lse2 = static_cast<Acc*>(p.lse2);
    Acc* const delta = static_cast<Acc*>(p.delta);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * PREP_WARPS + warp;
    const int h = blockIdx.y, b = blockIdx.z;
    const i64 at = row_workspace_offset(b, h, gridDim.y, nq_pad) + row;
    if (row >= nq) {   // the padding rows (bwd.cuh); whole warps leave together
        if (lane == 0) { lse2[at] = Acc(INFINITY); delta[at] = Acc(0); }
        return;
    }
    const Strided<const T> O = tensor<const T>(p.o), dO = tensor<const T>(p.dout);
    const T* o_row = O.at(b, h, row);
    const T* do_row = dO.at(b, h, row);
    Acc sum = 0;
    // 16-bit rows of 4-element groups: four elements (8 bytes) of each row per lane and
    // load (the scalar loop issued four times the loads for the same bytes).
    const bool by_four = sizeof(T) == 2 && p.vec && dim_v % 4 == 0;
    if constexpr (sizeof(T) == 2) {
        for (int c = 4 * lane; by_four && c < dim_v; c += 4 * 32) {
            T o4[4], do4[4];
            *reinterpret_cast<uint2*>(o4) = *reinterpret_cast<const uint2*>(o_row + c);
            *reinterpret_cast<uint2*>(do4) = *reinterpret_cast<const uint2*>(do_row + c);
            #pragma unroll
            for (int i = 0; i < 4; ++i) sum += to_acc(o4[i]) * to_acc(do4[i]);
        }
    }
    for (int c = lane; !by_four && c < dim_v; c += 32) sum += to_acc(o_row[c]) * to_acc(do_row[c]);
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
        const Acc l = static_cast<const Acc*>(p.lse)[((i64)b * gridDim.y + h) * nq + row];   // (B, Hq, nq)
        // Under dropout the rows carry its scale s (bwd.cuh): lse2 - log2 s, delta / s.
        const bool dropout = p.mods.drop_threshold != 0;
        const Acc drop_log2 = dropout ? Acc(log2(p.mods.drop_scale)) : Acc(0);
        const Acc keep_prob = dropout ? Acc(1.0 / p.mods.drop_scale) : Acc(1);
        lse2[at] = l == Acc(-INFINITY) ? Acc(INFINITY) : l * Acc(LOG2E_D) - drop_log2;
        delta[at] = sum * keep_prob;
    }
}

#define CONVERT_PER_THREAD 4

// dq (B, Hq, nq, d) from the accumulator (B, Hq, nq, dq_ld), contiguous, whose rows may
// be padded past d (bwd_sm90.cu's); grid (ceil(nq * d / (256 * CONVERT_PER_THREAD)), Hq, B).
// A thread's elements are 256 apart in the (nq, d) plane: their row and column follow
// from the first one's by a fixed step and a carry, so that a thread divides once (64-bit
// divisions per element made this kernel compute-bound: 122 us for 34M elements on an
// H100, about twice its memory time).
template <typename T>
__global__ void __launch_bounds__(256)
flash_bwd_dq_convert(const __grid_constant__ AttnParams p)
{
    typedef typename Accum<T>::type Acc;
    const int h = blockIdx.y, b = blockIdx.z, d = p.d;
    const Acc scale = Acc(p.scale);
    const Strided<T> DQ = tensor<T>(p.dq);
    const i64 plane = (i64)p.nq * d;
    const Acc* src = static_cast<const Acc*>(p.dq_accum) + ((i64)b * gridDim.y + h) * p.nq * (i64)p.dq_ld;
    if constexpr (sizeof(T) == 2) {
        // 16-bit dq with rows of 4-element groups: each thread converts CONVERT_PER_THREAD
        // consecutive elements, one 16-byte load and one 8-byte store (the scalar loop
        // below made this memory-bound kernel issue-bound).
        if (p.vec && d % CONVERT_PER_THREAD == 0 && p.dq_ld % CONVERT_PER_THREAD == 0) {
            const i64 e = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * CONVERT_PER_THREAD;
            if (e >= plane) return;
            const i64 row = e / d;
            const int col = int(e - row * d);
            const float4 a = *reinterpret_cast<const float4*>(src + row * p.dq_ld + col);
            *reinterpret_cast<uint2*>(DQ.at(b, h, row) + col) =
                make_uint2(pack2<T>(a.x * scale, a.y * scale), pack2<T>(a.z * scale, a.w * scale));
            return;
        }
    }
    const i64 e0 = (i64)blockIdx.x * CONVERT_PER_THREAD * blockDim.x + threadIdx.x;
    i64 row = e0 / d;
    int col = int(e0 - row * d);
    const int step_rows = int(blockDim.x) / d, step_cols = int(blockDim.x) % d;   // d <= 256: step_cols < d
    #pragma unroll
    for (int i = 0; i < CONVERT_PER_THREAD; ++i) {
        if (row * d + col < plane) DQ.at(b, h, row)[col] = from_acc<T>(src[row * p.dq_ld + col] * scale);
        row += step_rows;
        col += step_cols;
        if (col >= d) {
            col -= d;
            ++row;
        }
    }
}
