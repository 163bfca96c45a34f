// Online-softmax row state for the tensor-core forwards (FlashAttention-2, §3.1), in the
// accumulation type: fp32 (16-bit and fp32 inputs) or fp64.
//
// A thread holds two rows of each 16-row m-tile (g and g + 8 in the mma C layout) and
// two columns of each 8-wide n-tile; the four threads of a quad share a row. Scores
// arrive unscaled (masked ones as -inf); the running max is kept in log2 units, so each
// probability is one FFMA and one EX2: exp2(s * scale * log2(e) - max). That needs
// scale_log2 > 0 (the host passes the smallest normal float, MIN_SCALE_LOG2, for scale =
// 0; a kernel that folds more into the scale keeps it there too).
// The running sum stays thread-local (one partial per quad member) and is reduced
// across the quad once, at the end: the rescale factor is the same for the whole quad.
#pragma once
#include "elem.cuh"

// The smallest scale_log2 the softmax takes: float's smallest normal (cupyflash/_cuda.py
// clamps the host's scale to it), so that a masked -inf score stays -inf.
constexpr float MIN_SCALE_LOG2 = 1.17549435e-38f;

template <typename Acc>
__device__ __forceinline__ Acc quad_max(Acc x) {
    x = fmax(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmax(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
template <typename Acc>
__device__ __forceinline__ Acc quad_sum(Acc x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int MT, typename Acc = float>
struct OnlineSoftmax {
    Acc row_max[MT][2];   // running max of the scaled scores, log2 units
    Acc row_sum[MT][2];   // this thread's part of the running sum of exp2(s - max)

    __device__ __forceinline__ void init() {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int h = 0; h < 2; ++h) { row_max[mt][h] = -INFINITY; row_sum[mt][h] = Acc(0); }
    }

    // The max is raised (and the output accumulator rescaled by exp2(old - new)) only
    // when some row of the warp would otherwise see a probability above 2^RESCALE_SLACK:
    // sum and accumulator always refer to the same max, so a stale max is exact, and
    // after the first tiles most tiles skip the rescale's multiplies (FlashAttention-4's
    // conditional rescaling). A row that has seen only masked keys keeps max = -inf;
    // subtracting 0 instead keeps its P at 0, not NaN.
    static constexpr float RESCALE_SLACK = 8.f;

    // Fold one tile of scores into the running max and sum: s becomes P = exp2(s *
    // scale_log2 - max). Where the max grows, on_grow(mt, h, alpha) is told the factor
    // exp2(old - new) by which the output accumulator's row must be multiplied before
    // this tile's P V is added to it. Returns whether the max grew.
    // SHIFTED: each score is s * scale_log2 + shift[mt][h] instead (a term per thread and
    // row, HeadMods::fold_terms).
    template <bool SHIFTED = false, int NT, typename OnGrow>
    __device__ __forceinline__ bool fold_with(Acc (&s)[MT][NT][4], Acc scale_log2, OnGrow&& on_grow,
                                              const Acc (*shift)[2] = nullptr) {
        Acc tile_max[MT][2];
        bool grow = false;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                Acc m = -INFINITY;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    m = fmax(m, fmax(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
                tile_max[mt][h] = SHIFTED ? quad_max(m * scale_log2 + shift[mt][h]) : quad_max(m) * scale_log2;
                grow |= tile_max[mt][h] > row_max[mt][h] + RESCALE_SLACK;
            }
        }
        const bool grew = __any_sync(0xffffffffu, grow);
        if (grew) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const Acc new_max = fmax(row_max[mt][h], tile_max[mt][h]);
                    const Acc alpha = exp2_fast(row_max[mt][h] - (new_max == -INFINITY ? Acc(0) : new_max));
                    row_max[mt][h] = new_max;
                    row_sum[mt][h] *= alpha;
                    on_grow(mt, h, alpha);
                }
            }
        }
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const Acc base = row_max[mt][h] == -INFINITY ? Acc(0) : row_max[mt][h];
                const Acc offset = SHIFTED ? shift[mt][h] - base : -base;
                Acc sum = 0;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const Acc p = exp2_fast(fma(s[mt][nt][2 * h + e], scale_log2, offset));
                        s[mt][nt][2 * h + e] = p;
                        sum += p;
                    }
                }
                row_sum[mt][h] += sum;
            }
        }
        return grew;
    }

    // Row h of m-tile mt of the output accumulator times alpha.
    template <int DT>
    __device__ __forceinline__ static void rescale_row(Acc (&acc)[MT][DT][4], int mt, int h, Acc alpha) {
        #pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            acc[mt][dt][2 * h] *= alpha;
            acc[mt][dt][2 * h + 1] *= alpha;
        }
    }

    // The tile's fold with the accumulator rescaled at once.
    template <int NT, int DT>
    __device__ __forceinline__ void update(Acc (&s)[MT][NT][4], Acc (&acc)[MT][DT][4], Acc scale_log2) {
        fold_with(s, scale_log2, [&](int mt, int h, Acc alpha) { rescale_row(acc, mt, h, alpha); });
    }

    // The fold with the rescale deferred (a pipelined kernel folds a tile while the
    // previous P V still accumulates): alpha is valid where it returns true, for rescale.
    template <int NT>
    __device__ __forceinline__ bool fold(Acc (&s)[MT][NT][4], Acc scale_log2, Acc (&alpha)[MT][2]) {
        return fold_with(s, scale_log2, [&](int mt, int h, Acc a) { alpha[mt][h] = a; });
    }
    template <int NT>
    __device__ __forceinline__ bool fold(Acc (&s)[MT][NT][4], Acc scale_log2, const Acc (&shift)[MT][2],
                                         Acc (&alpha)[MT][2]) {
        return fold_with<true>(s, scale_log2, [&](int mt, int h, Acc a) { alpha[mt][h] = a; }, shift);
    }

    template <int DT>
    __device__ __forceinline__ static void rescale(Acc (&acc)[MT][DT][4], const Acc (&alpha)[MT][2]) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int h = 0; h < 2; ++h) rescale_row(acc, mt, h, alpha[mt][h]);
    }

    // The single division by the row sum, and the natural-log LSE = ln2 * (max + log2 sum).
    // Rows with no visible key give output 0 and LSE -inf. `out_scale` multiplies the
    // output (dropout's 1 / (1 - p)), not the LSE.
    template <int DT>
    __device__ __forceinline__ void finalize(Acc (&acc)[MT][DT][4], Acc (&lse)[MT][2], Acc out_scale = Acc(1)) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const Acc sum = quad_sum(row_sum[mt][h]);
                const Acc inv = sum > Acc(0) ? out_scale / sum : Acc(0);
                lse[mt][h] = sum > Acc(0) ? (row_max[mt][h] + log2_fast(sum)) * Acc(LN2_D) : Acc(-INFINITY);
                #pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    acc[mt][dt][2 * h] *= inv;
                    acc[mt][dt][2 * h + 1] *= inv;
                }
            }
        }
    }
};
