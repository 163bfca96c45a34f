// fp32 q, k and v (and for the backward dO) as fp16 halves for the Hopper kernels (halves.cuh),
// in two passes before them:
//   f32_halves_max:   each tensor's largest finite |x|, as bits, by atomicMax into
//                     AttnParams::halves_max (zeroed by the host);
//   f32_halves<PLANES>: each tensor scaled by its power of two and split into its high
//                     half (and with PLANES = 2 its low half), written to halves_q, halves_k,
//                     halves_v (halves_do) as contiguous (B, PLANES, H, N, halves_row(d))
//                     arrays: the planes of a batch entry are its heads H .. 2H - 1, so a
//                     tensor map of the (B, PLANES H, N, d) view reads a low tile at head h + H.
// Grid (ceil(max(nq, nk) / HALVES_ROWS), Hq, 3 B, or 4 B with dO): blockIdx.z = tensor * B
// + batch entry, the launch's nq and nk the arrays' rows (under varlen the packed total)
// and grid_batch their batch; CTAs past a tensor's heads or rows return at once.
#include "halves.cuh"
#include "params.cuh"
#include "tensor.cuh"

#define HALVES_ROWS 64       // rows a CTA (cupyflash/_kernels.py HALVES_ROWS)
#define HALVES_THREADS 256

// The CTA's tensor and rows: the view, its extents and its row range.
struct HalvesSlice {
    Strided<const float> x;
    int which, b, h, heads, rows, cols, row0, row_end;

    __device__ __forceinline__ explicit HalvesSlice(const AttnParams& p) {
        which = blockIdx.z / p.grid_batch;
        b = blockIdx.z % p.grid_batch;
        h = blockIdx.y;
        const bool query_rows = which == HALVES_Q || which == HALVES_DO;
        const TensorParams& t = which == HALVES_Q ? p.q : which == HALVES_K ? p.k : which == HALVES_V ? p.v : p.dout;
        x = tensor<const float>(t);
        heads = query_rows ? p.grid_heads : p.grid_heads / p.group;
        rows = query_rows ? p.nq : p.nk;
        cols = which == HALVES_V || which == HALVES_DO ? p.dim_v : p.d;
        row0 = blockIdx.x * HALVES_ROWS;
        row_end = min(row0 + HALVES_ROWS, rows);
    }
    __device__ __forceinline__ bool empty() const { return h >= heads || row0 >= rows; }
    // Calls f(row, col, count) for the CTA's elements in runs of 4 (count 4: a 16-byte
    // aligned float4 of one row) or 1, the threads' runs neighbouring in each row. A
    // thread's runs are HALVES_THREADS apart: their rows and columns follow from the
    // first's by a fixed step and a carry (no division a run), and four at a time are
    // unrolled so that their loads are in flight together (1.01-1.08x the division's form,
    // H200: the passes run near HBM's bandwidth either way).
    template <typename F>
    __device__ __forceinline__ void for_each(bool vec, F&& f) const {
        const int run = vec && cols % 4 == 0 ? 4 : 1, per_row = cols / run;
        const int step_rows = HALVES_THREADS / per_row, step_runs = HALVES_THREADS % per_row;
        int row = row0 + int(threadIdx.x) / per_row, r = int(threadIdx.x) % per_row;
        #pragma unroll 4
        for (; row < row_end; row += step_rows) {
            f(row, r * run, run);
            r += step_runs;
            if (r >= per_row) {
                r -= per_row;
                ++row;
            }
        }
    }
};

// |x|'s bits, or 0 for an infinity or NaN (left out of the largest finite magnitude).
__device__ __forceinline__ u32 finite_magnitude_bits(float x) {
    const u32 m = __float_as_uint(x) & 0x7fffffffu;
    return m < 0x7f800000u ? m : 0u;
}

__global__ void __launch_bounds__(HALVES_THREADS)
f32_halves_max(const __grid_constant__ AttnParams p)
{
    const HalvesSlice s(p);
    if (s.empty()) return;
    u32 largest = 0;
    s.for_each(p.vec, [&](int row, int col, int run) {
        const float* at = s.x.at(s.b, s.h, row) + col;
        if (run == 4) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(at));
            largest = max(largest, max(max(finite_magnitude_bits(v.x), finite_magnitude_bits(v.y)),
                                       max(finite_magnitude_bits(v.z), finite_magnitude_bits(v.w))));
        } else {
            largest = max(largest, finite_magnitude_bits(__ldg(at)));
        }
    });
    // One atomic a CTA: the whole grid adds into three words.
    __shared__ u32 warp_largest[HALVES_THREADS / 32];
    largest = __reduce_max_sync(0xffffffffu, largest);
    if (threadIdx.x % 32 == 0) warp_largest[threadIdx.x / 32] = largest;
    __syncthreads();
    if (threadIdx.x < 32) {
        largest = threadIdx.x < HALVES_THREADS / 32 ? warp_largest[threadIdx.x] : 0u;
        largest = __reduce_max_sync(0xffffffffu, largest);
        if (threadIdx.x == 0) atomicMax(&p.halves_max[s.which], largest);
    }
}

template <int PLANES>
__global__ void __launch_bounds__(HALVES_THREADS)
f32_halves(const __grid_constant__ AttnParams p)
{
    const HalvesSlice s(p);
    if (s.empty()) return;
    const float scale = halves_scale(p.halves_max[s.which]);
    half_t* const out = static_cast<half_t*>(s.which == HALVES_Q   ? p.halves_q
                                             : s.which == HALVES_K ? p.halves_k
                                             : s.which == HALVES_V ? p.halves_v
                                                                   : p.halves_do);
    // Element (b, plane, h, row, col) of the (B, PLANES, H, N, halves_row(cols)) halves.
    const int row_elems = halves_row(s.cols);
    const i64 plane_elems = (i64)s.heads * s.rows * row_elems;
    half_t* const high = out + ((i64)s.b * PLANES * s.heads + s.h) * s.rows * row_elems;
    s.for_each(p.vec, [&](int row, int col, int run) {
        const float* at = s.x.at(s.b, s.h, row) + col;
        float v[4] = {};
        if (run == 4) {
            const float4 w = __ldg(reinterpret_cast<const float4*>(at));
            v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
        } else {
            v[0] = __ldg(at);
        }
        half_t hi[4], lo[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) split_half(v[i] * scale, hi[i], lo[i]);
        half_t* const dst = high + (i64)row * row_elems + col;
        auto pair = [](const half_t* x, int i) { return u32(x[i].bits) | u32(x[i + 1].bits) << 16; };
        if (run == 4) {   // 8-byte stores: cols % 4 == 0 keeps them aligned
            *reinterpret_cast<uint2*>(dst) = make_uint2(pair(hi, 0), pair(hi, 2));
            if (PLANES == 2) *reinterpret_cast<uint2*>(dst + plane_elems) = make_uint2(pair(lo, 0), pair(lo, 2));
        } else {
            dst[0] = hi[0];
            if (PLANES == 2) dst[plane_elems] = lo[0];
        }
    });
}
