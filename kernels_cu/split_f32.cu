// fp32 q, k and v (and for the backward dO; for a forward that splits q itself, k and v
// alone) as fp16 halves for the Hopper kernels (halves.cuh), in passes before them:
//   f32_halves_max:   each tensor's largest finite |x|, as bits, by atomicMax into
//                     AttnParams::halves_max (zeroed by the host);
//   f32_halves<PLANES, CHUNKED>: each tensor scaled by a power of two and split into its
//                     high half (and with PLANES = 2 its low half), written to halves_q,
//                     halves_k, halves_v (halves_do) as contiguous (B, PLANES, H, N,
//                     halves_row(d)) arrays: the planes of a batch entry are its heads H ..
//                     2H - 1, so a tensor map of the (B, PLANES H, N, d) view reads a low
//                     tile at head h + H. CHUNKED (the forward, one pass): the scale is the
//                     CTA's chunk's, from its own largest |x|, whose bits it writes to
//                     halves_chunk_max; else the tensor's, after f32_halves_max, and where
//                     halves_chunk_max is given (the forward under varlen) every chunk's
//                     word is the tensor's.
// Grid (ceil(rows / HALVES_ROWS), Hq, T B): T tensors from halves_first on (k and v for a
// forward kernel that splits q itself, else q, k, v and the backward's dO; rows the longest's),
// blockIdx.z = (tensor - halves_first) B + batch entry, the launch's nq and nk the arrays'
// rows (under varlen the packed total) and grid_batch their batch; CTAs past a tensor's
// heads or rows return at once. A CTA's rows are one chunk (HALVES_CHUNK_ROWS).
#include "copy.cuh"
#include "halves.cuh"
#include "params.cuh"
#include "tensor.cuh"

#define HALVES_ROWS 128       // rows a CTA (cupyflash/_kernels.py HALVES_ROWS): a chunk
#define HALVES_THREADS 512
#define HALVES_MAX_COLS 256   // the widest rows taken as halves (cupyflash/_kernels.py HALVES_MAX_COLS)
// The one-pass split (CHUNKED) stages rows of at most HALVES_STAGED_COLS elements in 16-byte
// runs in shared memory from the chunk's largest |x| to the split (cp.async: no registers
// held while the loads are in flight), so HBM reads them once; wider or unaligned rows are
// read again, from L2 mostly. Held in registers instead, the CTA's loads and its stores
// took turns, two CTAs an SM: 2.7 TB/s on an H200.
#define HALVES_STAGED_COLS 128
#define HALVES_STAGED_BYTES (HALVES_ROWS * HALVES_STAGED_COLS * 4)   // cupyflash/_kernels.py mirrors it
// Three CTAs an SM (the staging allows three): at most 40 registers a thread.
#define HALVES_CTAS_PER_SM 3
static_assert(HALVES_ROWS == HALVES_CHUNK_ROWS, "a CTA scales one chunk");

// The CTA's tensor and rows: the view, its extents and its row range.
struct HalvesSlice {
    Strided<const float> x;
    int which, b, h, heads, rows, cols, row0, row_end;

    __device__ __forceinline__ explicit HalvesSlice(const AttnParams& p) {
        which = p.halves_first + int(blockIdx.z) / p.grid_batch;
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
    // Calls f(slot, row, col) for the thread's runs of RUN elements of the CTA's rows (RUN
    // 4: a 16-byte aligned float4 of one row; or 1), slot its run's place among them (below
    // SLOTS, enough for rows of SLOTS RUN HALVES_THREADS / HALVES_ROWS elements), the
    // threads' runs neighbouring in each row. A thread's runs are HALVES_THREADS apart:
    // their rows and columns follow from the first's by a fixed step and a carry (no
    // division a run), unrolled UNROLL times so that the loads are in flight together
    // (wholly for the staging's copies; in part where the rows are read in place, else
    // the compiler keeps every run's address from one loop to the next, and spills).
    template <int RUN, int SLOTS, int UNROLL, typename F>
    __device__ __forceinline__ void for_each_run(F&& f) const {
        const int per_row = cols / RUN;
        const int step_rows = HALVES_THREADS / per_row, step_runs = HALVES_THREADS % per_row;
        int row = row0 + int(threadIdx.x) / per_row, r = int(threadIdx.x) % per_row;
        #pragma unroll UNROLL
        for (int slot = 0; slot < SLOTS; ++slot) {
            if (row < row_end) f(slot, row, r * RUN);
            row += step_rows;
            r += step_runs;
            if (r >= per_row) {
                r -= per_row;
                ++row;
            }
        }
    }
    // The RUN elements of a run from global memory.
    template <int RUN>
    __device__ __forceinline__ void read(float (&v)[RUN], int row, int col) const {
        const float* at = x.at(b, h, row) + col;
        if constexpr (RUN == 4) {
            const float4 w = __ldg(reinterpret_cast<const float4*>(at));
            v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
        } else {
            v[0] = __ldg(at);
        }
    }
};

// How a CTA reads its elements: in runs of RUN, staged in shared memory or read where used.
template <int RUN_, bool STAGED_>
struct HalvesReads {
    static constexpr int RUN = RUN_;
    static constexpr bool STAGED = STAGED_;
    static constexpr int SLOTS = (STAGED ? HALVES_STAGED_COLS : HALVES_MAX_COLS) * HALVES_ROWS / (HALVES_THREADS * RUN);
    static constexpr int UNROLL = STAGED ? SLOTS : 4;
    static_assert(!STAGED || RUN == 4, "staged runs are 16 bytes");
};

// Calls body(Reads()) with the reads the CTA's rows allow, staged where STAGE asks (a pass
// that reads its elements twice, with HALVES_STAGED_BYTES of dynamic shared memory) and
// the rows allow.
template <bool STAGE, typename F>
__device__ __forceinline__ void with_reads(const AttnParams& p, const HalvesSlice& s, F&& body) {
    if (p.vec && s.cols % 4 == 0) {
        if (STAGE && s.cols <= HALVES_STAGED_COLS) body(HalvesReads<4, true>());
        else body(HalvesReads<4, false>());
    } else {
        body(HalvesReads<1, false>());
    }
}

// The CTA's largest of each thread's `bits`, in every thread.
__device__ __forceinline__ u32 cta_max(u32 bits) {
    __shared__ u32 warp_largest[HALVES_THREADS / 32];
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (threadIdx.x % 32 == 0) warp_largest[threadIdx.x / 32] = bits;
    __syncthreads();
    #pragma unroll
    for (int w = 0; w < HALVES_THREADS / 32; ++w) bits = max(bits, warp_largest[w]);
    return bits;
}

// The thread's run `slot` in the CTA's staging: slot-major, so that a warp's 16-byte runs
// are neighbours (no bank conflicts); each thread reads back only what it staged.
__device__ __forceinline__ float4* staged_run(float4* staged, int slot) {
    return staged + slot * HALVES_THREADS + threadIdx.x;
}

// The elements of a run, from the staging or from global memory.
template <typename R>
__device__ __forceinline__ void read_run(const HalvesSlice& s, float4* staged, float (&v)[R::RUN], int slot, int row,
                                         int col) {
    if constexpr (R::STAGED) {
        const float4 w = *staged_run(staged, slot);
        v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
    } else {
        s.read(v, row, col);
    }
}

// The CTA's largest finite |x| as bits, in every thread; with staged reads, the thread's
// runs are left in `staged`.
template <typename R>
__device__ __forceinline__ u32 largest_of(const HalvesSlice& s, float4* staged) {
    if constexpr (R::STAGED) {
        s.for_each_run<4, R::SLOTS, R::SLOTS>([&](int slot, int row, int col) {
            cp_async_16(staged_run(staged, slot), s.x.at(s.b, s.h, row) + col, 16);
        });
        cp_async_commit();
        cp_async_wait<0>();
    }
    u32 largest = 0;
    s.for_each_run<R::RUN, R::SLOTS, R::UNROLL>([&](int slot, int row, int col) {
        float v[R::RUN];
        read_run<R>(s, staged, v, slot, row, col);
        #pragma unroll
        for (int i = 0; i < R::RUN; ++i) largest = max(largest, finite_magnitude_bits(v[i]));
    });
    return cta_max(largest);
}

__global__ void __launch_bounds__(HALVES_THREADS, HALVES_CTAS_PER_SM)
f32_halves_max(const __grid_constant__ AttnParams p)
{
    const HalvesSlice s(p);
    if (s.empty()) return;
    with_reads<false>(p, s, [&](auto reads) {
        const u32 largest = largest_of<decltype(reads)>(s, nullptr);
        // One atomic a CTA: the whole grid adds into three or four words.
        if (threadIdx.x == 0) atomicMax(&p.halves_max[s.which], largest);
    });
}

// The CTA's chunk scaled and split (R: how it reads its elements).
template <int PLANES, bool CHUNKED, typename R>
__device__ __forceinline__ void split_slice(const AttnParams& p, const HalvesSlice& s, float4* staged) {
    u32 largest;
    if constexpr (CHUNKED) largest = largest_of<R>(s, staged);
    else largest = p.halves_max[s.which];
    if (p.halves_chunk_max != nullptr && threadIdx.x == 0) *halves_chunk_word(p, s.which, s.b, s.h, s.row0) = largest;
    const float scale = halves_scale(largest);
    half_t* const out = static_cast<half_t*>(s.which == HALVES_Q   ? p.halves_q
                                             : s.which == HALVES_K ? p.halves_k
                                             : s.which == HALVES_V ? p.halves_v
                                                                   : p.halves_do);
    // Element (b, plane, h, row, col) of the (B, PLANES, H, N, halves_row(cols)) halves.
    const int row_elems = halves_row(s.cols);
    const i64 plane_elems = (i64)s.heads * s.rows * row_elems;
    half_t* const high = out + ((i64)s.b * PLANES * s.heads + s.h) * s.rows * row_elems;
    s.for_each_run<R::RUN, R::SLOTS, R::UNROLL>([&](int slot, int row, int col) {
        float v[R::RUN];
        read_run<R>(s, staged, v, slot, row, col);
        half_t* const dst = high + (i64)row * row_elems + col;
        if constexpr (R::RUN == 4) {   // 8-byte stores: cols % 4 == 0 keeps them aligned
            uint2 hi, lo;
            split_run4(v, scale, hi, lo);
            *reinterpret_cast<uint2*>(dst) = hi;
            if (PLANES == 2) *reinterpret_cast<uint2*>(dst + plane_elems) = lo;
        } else {
            half_t hi, lo;
            split_half(v[0] * scale, hi, lo);
            dst[0] = hi;
            if (PLANES == 2) dst[plane_elems] = lo;
        }
    });
}

template <int PLANES, bool CHUNKED>
__global__ void __launch_bounds__(HALVES_THREADS, HALVES_CTAS_PER_SM)
f32_halves(const __grid_constant__ AttnParams p)
{
    extern __shared__ float4 staged[];   // CHUNKED: HALVES_STAGED_BYTES
    const HalvesSlice s(p);
    if (s.empty()) return;
    with_reads<CHUNKED>(p, s, [&](auto reads) { split_slice<PLANES, CHUNKED, decltype(reads)>(p, s, staged); });
}
