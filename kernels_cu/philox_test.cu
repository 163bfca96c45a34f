// Test kernels for philox.cuh: tests/test_philox.py builds them for sm_80 and sm_90a and,
// on a GPU, compares what they return with cupyflash/_philox.py bit for bit.
#include "philox.cuh"

// out[i] = Philox4x32-ROUNDS(counters[i], keys[i]).
template <int ROUNDS>
__global__ void philox4x32_kernel(const uint4* counters, const uint2* keys, uint4* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = philox4x32<ROUNDS>(counters[i], keys[i]);
}

// keep[i] = dropout_keep(...) of score (row0 + rows[i], key0 + cols[i]) of one (batch,
// head), each thread evaluating its own element as an attention kernel's thread would,
// from its indices and the origin's counters.
__global__ void dropout_keep_kernel(u64 seed, u64 offset, u32 batch, u32 head, u32 heads,
                                    const u32* rows, const u64* cols, u32 row0, u32 key0, u32 threshold,
                                    unsigned char* keep, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const u64 stream = dropout_stream(offset, batch, head, heads);
        keep[i] = dropout_keep(seed, stream, rows[i], cols[i], threshold, dropout_counter_base(row0, key0));
    }
}

// keep[(row - r0) * NT * 8 + (key - c0)] of one m-tile, 16 rows from r0 (a multiple of 16)
// by NT n-tiles of keys from c0 (a multiple of 32), counted from the origin (row_origin,
// key_origin), from dropout_keep_bits as the forward's threads hold them (bit 4 nt + e of
// lane 4 g + t: row g + 8 (e / 2), key 8 nt + 2 t + e % 2). One warp. The key: `seed`, or
// with TABLE the host's table of its rounds' keys (_philox.round_keys) at `round_keys`, as
// the kernels take either.
template <int NT, bool TABLE>
__global__ void dropout_m_tile_kernel(u64 seed, const u32* round_keys, u64 stream, int r0, int c0, u32 row_origin,
                                      u32 key_origin, u32 threshold, unsigned char* keep) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const uint2 base = dropout_counter_base(row_origin, key_origin);
    u64 bits;
    if constexpr (TABLE) bits = dropout_keep_bits<NT>(RoundKeys{round_keys}, stream, r0, c0, threshold, base);
    else bits = dropout_keep_bits<NT>(seed, stream, r0, c0, threshold, base);
    for (int nt = 0; nt < NT; ++nt)
        for (int e = 0; e < 4; ++e)
            keep[(g + 8 * (e / 2)) * (NT * 8) + 8 * nt + 2 * t + e % 2] = (bits >> (4 * nt + e)) & 1u;
}

// keep[(key - key0) * nq_tile + (q - q0)] of the block's 16 keys a warp from key0 by NT * 8
// queries from q0, counted from the origin (row_origin, key_origin), from
// dropout_keep_bits_key_rows as the backward's threads hold them (bit 4 nt + e of lane 4 g +
// t: key g + 8 (e / 2), query 8 nt + 2 t + e % 2). One warp a block (SoloWarp), or with
// PAIRED two (keys key0 and key0 + 16, key0 a multiple of 32) splitting the calls through
// philox.cuh's SharedMemoryWarpPair, as bwd_sm90.cu's consumers do. The key as
// dropout_m_tile_kernel's.
template <int NT, bool PAIRED, bool TABLE>
__global__ void dropout_key_rows_kernel(u64 seed, const u32* round_keys, u64 stream, int key0, int q0,
                                        u32 row_origin, u32 key_origin, u32 threshold, unsigned char* keep) {
    __shared__ u32 slots[64];
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, warp_key0 = key0 + 16 * (threadIdx.x / 32);
    const uint2 base = dropout_counter_base(row_origin, key_origin);
    u32 bits;
    auto draw = [&](auto key) {
        if constexpr (PAIRED)
            return dropout_keep_bits_key_rows<NT>(key, stream, warp_key0, q0, threshold, base, SharedMemoryWarpPair{slots, 1});
        else return dropout_keep_bits_key_rows<NT>(key, stream, warp_key0, q0, threshold, base);
    };
    if constexpr (TABLE) bits = draw(RoundKeys{round_keys});
    else bits = draw(seed);
    for (int nt = 0; nt < NT; ++nt)
        for (int e = 0; e < 4; ++e)
            keep[(warp_key0 - key0 + g + 8 * (e / 2)) * (NT * 8) + 8 * nt + 2 * t + e % 2] = (bits >> (4 * nt + e)) & 1u;
}
