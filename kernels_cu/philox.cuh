// Philox4x32-R (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
// Random123) and the dropout stream built on it. Mirrors cupyflash/_philox.py bit for bit:
// each function names its Python twin, and the module docstring there is the mapping.
//
// Counter-based: a word is a pure function of (counter, key), so a thread evaluates only
// the scores it holds and the backward pass regenerates the forward's mask from indices.
#pragma once
#include "elem.cuh"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u   // golden ratio
#define PHILOX_W1 0xBB67AE85u   // sqrt(3) - 1

// One round: two 32x32 -> 64-bit products, high halves XORed with the other words and key.
__device__ __forceinline__ uint4 philox_round(uint4 c, uint2 k) {
    const u32 hi0 = __umulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
    const u32 hi1 = __umulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
    uint4 r = {hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0};
    return r;
}

// _philox.philox4x32: counter words x..w are Random123's ctr[0..3], key x, y its key[0..1].
template <int ROUNDS = 10>
__device__ __forceinline__ uint4 philox4x32(uint4 counter, uint2 key) {
    counter = philox_round(counter, key);
#pragma unroll
    for (int r = 1; r < ROUNDS; ++r) {
        key.x += PHILOX_W0;
        key.y += PHILOX_W1;
        counter = philox_round(counter, key);
    }
    return counter;
}

// _philox.dropout_stream: the (batch, head) stream of a call whose RNG offset is `offset`;
// a call of B x H heads spans offset .. offset + B*H - 1. Computed once per CTA.
__device__ __forceinline__ u64 dropout_stream(u64 offset, u32 batch, u32 head, u32 heads) {
    return offset + static_cast<u64>(batch) * heads + head;
}

// _philox._dropout_words: the four words of row `row`, columns 4*group .. 4*group + 3.
__device__ __forceinline__ uint4 dropout_words(u64 seed, u64 stream, u32 row, u32 group) {
    const uint4 counter = {group, row, static_cast<u32>(stream), static_cast<u32>(stream >> 32)};
    const uint2 key = {static_cast<u32>(seed), static_cast<u32>(seed >> 32)};
    return philox4x32<10>(counter, key);
}

// Word j (= col & 3) of a group: the keep test reads one word per score.
__device__ __forceinline__ u32 philox_word(uint4 w, u32 j) {
    return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
}

// _philox.dropout_keep: does score (row, col) survive? `threshold` is
// _philox.dropout_threshold(p), computed on the host so no float rounding differs. A kernel
// holding several columns of one group calls dropout_words once and tests each word.
__device__ __forceinline__ bool dropout_keep(u64 seed, u64 stream, u32 row, u64 col, u32 threshold) {
    const uint4 w = dropout_words(seed, stream, row, static_cast<u32>(col >> 2));
    return philox_word(w, static_cast<u32>(col & 3)) >= threshold;
}
