// The backward pass's small element-wise kernels, for every dtype:
//   flash_bwd_prep:       before the main kernels, the row workspaces lse2 and delta (bwd.cuh),
//                         and the dQ workspace zeroed.
//   flash_bwd_dq_convert: after a key-block kernel that added dq, dq = scale * the fp32 (fp64)
//                         accumulator (atomics, or bulk reductions in turns on Hopper).
#include "elem.cuh"
#include "bwd.cuh"
#include "tensor.cuh"

// CTAs of 32 rows and 128 threads, near cuDNN's pass's shape (128 threads; 16 rows at d = 64,
// 8 at d = 128): with CTAs of 128 rows and 256 threads (40 registers, six CTAs an SM) the
// 4096 CTAs of B N = 16k, H = 32, d = 64 ran 5.2 waves, the last a sixth full, and the pass
// trailed cuDNN's by 8-11 us (ncu, bench/NOTES.md session 38). 16 rows left d = 64 a CTA's
// two loads a thread, too few bytes in flight (77 us); 64 rows left d = 128 a tail (76 us);
// 32: 72 us at both.
#define PREP_ROWS 32       // rows a CTA (cupyflash/_kernels.py PREP_ROWS; BWD_ROW_PAD a multiple of it)
#define PREP_THREADS 128   // (cupyflash/_kernels.py PREP_THREADS)
static_assert(BWD_ROW_PAD % PREP_ROWS == 0, "a CTA's rows lie within one (batch, head)'s padded rows");
static_assert(PREP_ROWS % 16 == 0 && PREP_THREADS % 32 == 0, "a warp's 32 / lanes rows (at most 16) take the same turns");

// Where a thread's elements `stride` apart lie in a plane of rows `width` wide: row and
// column step from the first by a fixed amount and at most one carry (stride % width <
// width), so that the thread divides once. (A division an element made these passes
// issue-bound: the dQ conversion took 122 us for 34M elements on an H100, twice its
// memory time.)
template <typename Index>
struct PlaneCursor {
    Index row;
    int col;
    const int width, step_rows, step_cols;
    __device__ __forceinline__ PlaneCursor(Index first, int stride, int width_)
        : row(first / width_), col(int(first - row * width_)), width(width_), step_rows(stride / width_),
          step_cols(stride % width_) {}
    __device__ __forceinline__ void advance() {
        row += step_rows;
        col += step_cols;
        if (col >= width) {
            col -= width;
            ++row;
        }
    }
};

// Each row's o . dO by a group of `lanes` lanes of a warp; grid (nq_pad / PREP_ROWS, Hq, B).
// 16-bit rows of 8-element groups (2 to 32 of them): one 16-byte load of each row a lane,
// lanes the groups' count rounded up to a power of two, so that at d = 64 a warp's loads
// cover four rows. (One warp a row of 8-byte loads and CTAs of 8 rows took 108 us for
// B N = 16k, H = 32, d = 64 on an H200, four times its memory time.) Otherwise 32 lanes a
// row, element by element.
template <typename T>
__global__ void __launch_bounds__(PREP_THREADS)
flash_bwd_prep(const __grid_constant__ AttnParams p)
{
    typedef typename Accum<T>::type Acc;
    const int nq = p.nq, dim_v = p.dim_v, nq_pad = p.nq_pad;
    Acc* const lse2 = static_cast<Acc*>(p.lse2);
    Acc* const delta = static_cast<Acc*>(p.delta);
    const int h = blockIdx.y, b = blockIdx.z;
    const int groups = dim_v / 8;
    const bool by_eight = sizeof(T) == 2 && p.vec && dim_v % 8 == 0 && groups >= 2 && groups <= 32;
    int lanes = 32;
    while (by_eight && lanes / 2 >= groups) lanes /= 2;
    const int sub = threadIdx.x % lanes;   // the lane's place in its row's group
    const Strided<const T> O = tensor<const T>(p.o), dO = tensor<const T>(p.dout);
    // The CTA's rows of the dQ workspace zeroed, where the call has one, for the key-block
    // kernels to add into (beside the loads: this pass waits on their latency, and a memset
    // of its own cost 34 us at B N = 16k, H = 32, d = 64 on an H200). Only each row's d
    // columns: the Hopper kernels' rows are padded (dq_ld = D + 8, their bulk reductions
    // add whole padded rows), but the conversion reads the d columns alone, so the padding
    // may hold anything (12% of the bytes at d = 64). By 16-byte chunks where the rows
    // allow (the base is the allocator's, 256-byte aligned), else by words.
    if (p.dq_accum != nullptr) {
        const int row0 = blockIdx.x * PREP_ROWS, rows = min(PREP_ROWS, nq - row0);
        const i64 row_bytes = (i64)p.dq_ld * sizeof(Acc);
        char* const base = static_cast<char*>(p.dq_accum) + (((i64)b * gridDim.y + h) * nq + row0) * row_bytes;
        const bool by_chunks = row_bytes % 16 == 0 && p.d * sizeof(Acc) % 16 == 0;
        const int unit = by_chunks ? 16 : 4;
        const int units = int(p.d * sizeof(Acc)) / unit;   // a row's units in use
        for (PlaneCursor<int> at(threadIdx.x, PREP_THREADS, units); at.row < rows; at.advance()) {
            char* const unit_at = base + at.row * row_bytes + at.col * unit;
            if (by_chunks) *reinterpret_cast<uint4*>(unit_at) = uint4{0, 0, 0, 0};
            else *reinterpret_cast<u32*>(unit_at) = 0u;
        }
    }
    // Every lane of a warp takes the same number of turns (a warp's 32 / lanes rows lie in
    // one aligned group, and PREP_ROWS is a multiple of the group), so that the shuffles
    // below see whole warps; at d = 16 in 16 bits (two lanes a row) warps 2 and 3 have no
    // row. Unrolled, with read-only loads that the compiler may move past the row stores,
    // so that a thread has several rows' loads in flight.
    #pragma unroll 4
    for (int r = threadIdx.x / lanes; r < PREP_ROWS; r += PREP_THREADS / lanes) {
        const int row = blockIdx.x * PREP_ROWS + r;
        Acc sum = 0;
        if (row < nq) {
            const T* o_row = O.at(b, h, row);
            const T* do_row = dO.at(b, h, row);
            if constexpr (sizeof(T) == 2) {
                if (by_eight && sub < groups) {
                    T o8[8], do8[8];
                    *reinterpret_cast<uint4*>(o8) = __ldg(reinterpret_cast<const uint4*>(o_row + 8 * sub));
                    *reinterpret_cast<uint4*>(do8) = __ldg(reinterpret_cast<const uint4*>(do_row + 8 * sub));
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) sum += to_acc(o8[i]) * to_acc(do8[i]);
                }
            }
            for (int c = sub; !by_eight && c < dim_v; c += 32) sum += to_acc(o_row[c]) * to_acc(do_row[c]);
        }
        for (int off = lanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (sub != 0) continue;
        const i64 at = row_workspace_offset(b, h, gridDim.y, nq_pad) + row;
        if (row >= nq) {   // the padding rows (bwd.cuh)
            lse2[at] = Acc(INFINITY);
            delta[at] = Acc(0);
            continue;
        }
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
// A thread's elements are 256 apart in the (nq, d) plane (PlaneCursor).
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
            *reinterpret_cast<uint2*>(DQ.at(b, h, row) + col) =
                pack4<T>(*reinterpret_cast<const float4*>(src + row * p.dq_ld + col), scale);
            return;
        }
    }
    PlaneCursor<i64> at((i64)blockIdx.x * CONVERT_PER_THREAD * blockDim.x + threadIdx.x, int(blockDim.x), d);
    #pragma unroll
    for (int i = 0; i < CONVERT_PER_THREAD; ++i, at.advance())
        if (at.row * d + at.col < plane) DQ.at(b, h, at.row)[at.col] = from_acc<T>(src[at.row * p.dq_ld + at.col] * scale);
}
