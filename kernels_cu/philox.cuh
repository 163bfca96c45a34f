// Philox4x32-R (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
// Random123) and the dropout stream built on it. Mirrors cupyflash/_philox.py bit for bit:
// each function names its Python twin, and the module docstring there is the mapping.
//
// Counter-based: a word is a pure function of (counter, key), so a thread evaluates only
// the scores it holds and the backward pass regenerates the forward's mask from indices.
#pragma once
#include "copy.cuh"
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

#define PHILOX_ROUNDS 10

// _philox.philox4x32: counter words x..w are Random123's ctr[0..3], key x, y its key[0..1],
// which each round after the first bumps by (W0, W1).
template <int ROUNDS = PHILOX_ROUNDS>
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

// The same rounds with the key schedule read from the host's table (_philox.round_keys:
// round r's key at 2 r, 2 r + 1), the ModsParams::rng_round_keys of a kernel's
// parameters, which sit in the constant bank: a round's XOR takes its key as an operand
// instead of the two adds a round of each call above. Where the dropout draws below get
// a RoundKeys for their `key` they use it; a u64 key is the seed.
struct RoundKeys {
    const u32* words;
};
template <int ROUNDS = PHILOX_ROUNDS>
__device__ __forceinline__ uint4 philox4x32(uint4 counter, RoundKeys keys) {
    static_assert(ROUNDS <= PHILOX_ROUNDS, "the table holds PHILOX_ROUNDS keys");
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) counter = philox_round(counter, make_uint2(keys.words[2 * r], keys.words[2 * r + 1]));
    return counter;
}

// _philox.dropout_stream: the (batch, head) stream of a call whose RNG offset is `offset`;
// a call of B x H heads spans offset .. offset + B*H - 1. Computed once per CTA.
__device__ __forceinline__ u64 dropout_stream(u64 offset, u32 batch, u32 head, u32 heads) {
    return offset + static_cast<u64>(batch) * heads + head;
}

// The dropout draw (_philox's module docstring is the mapping): one Philox call gives 16
// bytes, one per score of a block of 2 rows x 8 columns laid out as an mma.sync C
// fragment holds them, so a thread of a forward kernel draws the 16 scores of 4 n-tiles
// of its m-tile with one call. Score (i, j) takes
//   counter (x, y) = ((j >> 5) * 4 + ((j >> 1) & 3), (i >> 4) * 8 + (i & 7)),
//   byte ((i >> 3) & 1) * 8 + ((j >> 3) & 3) * 2 + (j & 1) of the call's 16 (word byte / 4,
//   bits 8 (byte % 4) and up),
// and is kept iff that byte >= threshold (1 .. 255, _philox.dropout_threshold). (i, j)
// are the problem's row and key: a chunk pair of a streamed call counts from its origin
// and adds the origin's counters (dropout_counter_base), so it draws what the whole call
// would.

// _philox.counter_base: the counter words of an origin (row0, key0) in a larger problem,
// row0 a multiple of 16 and key0 of 32 (a chunk pair of a streamed call, params.cuh). The
// score (row0 + r, key0 + c) has the counter (x, y) of (r, c) plus these, and the same
// byte (the byte reads the row's bit 3 and the key's bits 0, 3 and 4, which the origin
// leaves alone): a kernel indexes its scores from its own row and key 0 as before and
// adds the base to its counters, once per Philox call.
__device__ __forceinline__ uint2 dropout_counter_base(u32 row0, u32 key0) {
    return make_uint2((key0 >> 5) * 4, (row0 >> 4) * 8);
}

// The Philox key of a dropout draw's `key`: the seed's two words, or the round keys as given.
__device__ __forceinline__ uint2 philox_key(u64 seed) {
    return make_uint2(static_cast<u32>(seed), static_cast<u32>(seed >> 32));
}
__device__ __forceinline__ RoundKeys philox_key(RoundKeys keys) { return keys; }

// _philox._dropout_words: the four words of counter (x, y) of one stream, under the seed
// or its round keys (the same words).
template <typename Key>
__device__ __forceinline__ uint4 dropout_words(Key key, u64 stream, u32 x, u32 y) {
    const uint4 counter = {x, y, static_cast<u32>(stream), static_cast<u32>(stream >> 32)};
    return philox4x32<PHILOX_ROUNDS>(counter, philox_key(key));
}

// Byte b (0 .. 15) of a call's words.
__device__ __forceinline__ u32 dropout_byte(uint4 w, u32 b) {
    const u32 word = (b >> 2) == 0 ? w.x : (b >> 2) == 1 ? w.y : (b >> 2) == 2 ? w.z : w.w;
    return (word >> (8 * (b & 3))) & 0xffu;
}

// _philox.dropout_keep: does score (row, col) survive? One call per score: for kernels
// whose threads hold scores in another layout (the backward's transposed products).
// (row, col) count from the origin whose counters are `base` (dropout_counter_base).
__device__ __forceinline__ bool dropout_keep(u64 seed, u64 stream, u64 row, u64 col, u32 threshold, uint2 base) {
    const u32 x = base.x + static_cast<u32>((col >> 5) * 4 + ((col >> 1) & 3));
    const u32 y = base.y + static_cast<u32>((row >> 4) * 8 + (row & 7));
    const u32 b = static_cast<u32>(((row >> 3) & 1) * 8 + ((col >> 3) & 3) * 2 + (col & 1));
    return dropout_byte(dropout_words(seed, stream, x, y), b) >= threshold;
}

// Bits 0-3: whether bytes 0-3 of `word` are >= the threshold (1 .. 255), four compares in
// six integer instructions, where one per byte and the bits' assembly took about twelve:
// d = (word | 0x80..) - (the threshold's low 7 bits in each byte) borrows within no byte
// and has a byte's top bit set exactly when its low 7 bits are >= the threshold's. With
// the bytes' own top bits, a byte is >= the threshold iff its top bit is set and the
// threshold's is not, or both agree and d's verdict holds: (word & d) | ((word | d) &
// ~repeated), one LOP3, since `repeated` (the threshold in every byte,
// bytes_threshold) carries the threshold's top bit. One multiply then gathers the four
// top bits 7, 15, 23, 31 into bits 28 .. 31 (their cross products land elsewhere).
__device__ __forceinline__ u32 bytes_threshold(u32 threshold) { return threshold * 0x01010101u; }
// The verdicts as the bytes' top bits (7, 15, 23, 31), for a caller's own gather.
__device__ __forceinline__ u32 bytes_top_at_least(u32 word, u32 repeated) {
    constexpr u32 TOP = 0x80808080u;
    const u32 d = (word | TOP) - (repeated & ~TOP);
    return ((word & d) | ((word | d) & ~repeated)) & TOP;
}
__device__ __forceinline__ u32 bytes_at_least(u32 word, u32 repeated) {
    return (bytes_top_at_least(word, repeated) * 0x00204081u) >> 28;
}

// The keep bits of one 16-row m-tile of scores held as mma C fragments [NT][4]
// (for_each_score's layout) whose rows start at r0 (a multiple of 16) and columns at c0
// (a multiple of 32), counted from the origin of `base`: bit 4 nt + e for element e of
// n-tile nt, one Philox call per 4 n-tiles. They depend on indices alone, so a kernel
// draws them while the tensor cores compute the scores.
template <int NT, typename Key>
__device__ __forceinline__ u64 dropout_keep_bits(Key key, u64 stream, int r0, int c0, u32 threshold, uint2 base) {
    static_assert(NT % 4 == 0 && 4 * NT <= 64, "whole 32-column blocks, at most 64 scores");
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 y = base.y + static_cast<u32>((r0 >> 4) * 8 + g);
    const u32 repeated = bytes_threshold(threshold);
    u64 bits = 0;
    #pragma unroll
    for (int blk = 0; blk < NT / 4; ++blk) {
        const uint4 w = dropout_words(key, stream, base.x + static_cast<u32>(((c0 >> 5) + blk) * 4 + t), y);
        // Word 2 E + N holds the bytes of elements 2 E, 2 E + 1 of n-tiles 2 N, 2 N + 1 (byte
        // (nt % 2) * 2 + e % 2): their bits 4 nt + e are two pairs 4 apart from 8 N + 2 E. One
        // multiply puts the four top bits at 26, 27, 30 and 31 (bytes_at_least's way).
        #pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 word = q == 0 ? w.x : q == 1 ? w.y : q == 2 ? w.z : w.w;
            const u32 pairs = (bytes_top_at_least(word, repeated) * 0x00081081u) >> 26;
            bits |= u64(pairs) << (16 * blk + 8 * (q % 2) + 2 * (q / 2));
        }
    }
    return bits;
}

// The keep bits of the transposed products' fragments (bwd_sm90.cu: C fragments whose rows
// are keys, for_each_score's KEY_ROWS layout): a warp's 16 keys from key0 (a multiple of
// 16), NT n-tiles of queries from q0 (a multiple of 16); bit 4 nt + e for element e of
// n-tile nt. A thread's keys g and g + 8 share a counter (the same j >> 5 and (j >> 1) & 3),
// and so do its queries 16 m + 2 t + u and 16 m + 8 + 2 t + u; so do the keys of lane
// 4 (g ^ 1) + t, which differ in key bit 0 alone. So the two lanes split the calls: each
// draws the counters of one u for both lanes' keys and hands the other lane its bits by
// one shuffle. One call gives 8 of the pair's scores (the forward's layout gets 16): 4
// calls for a thread's 32 scores instead of 32. The other 8 bytes are the scores of the
// keys 16 apart (key bit 4), which the next warp of a warpgroup holds: with a WarpPair
// (below) the two warps split the calls too, each drawing every other m for both and
// handing the other warp its bits through the pair's exchange, so that one call gives 16
// scores as in the forward (2 calls for 32). Keys and queries count from the origin of
// `base`.
struct SoloWarp {   // no exchange: the warp draws all its calls
    static constexpr bool PAIRED = false;
};
// A WarpPair (PAIRED = true) is called by both warps of a pair (keys key0 and key0 ^ 16,
// the same lane layout and q0): it passes `theirs` to the same lane of the other warp and
// returns what that lane passed. This one goes through shared memory, for warps w and
// w ^ 1 of a block (threads t and t ^ 32): each writes the other's word of `slots` (a
// word a thread, by threadIdx.x), then both meet at the named barrier `barrier` (64
// threads). A caller that exchanges again before another barrier of the pair passes
// other slots (bwd_sm90.cu alternates two).
struct SharedMemoryWarpPair {
    static constexpr bool PAIRED = true;
    u32* slots;
    int barrier;
    __device__ __forceinline__ u32 operator()(u32 theirs) const {
        slots[threadIdx.x ^ 32] = theirs;
        named_barrier(barrier, 64);
        return slots[threadIdx.x];
    }
};
template <int NT, typename Key, typename WarpPair = SoloWarp>
__device__ __forceinline__ u32 dropout_keep_bits_key_rows(Key key, u64 stream, int key0, int q0, u32 threshold,
                                                          uint2 base, const WarpPair& pair = WarpPair()) {
    constexpr bool PAIRED = WarpPair::PAIRED;
    static_assert(NT % (PAIRED ? 4 : 2) == 0 && 4 * NT <= 32, "pairs (a warp pair: quads) of query n-tiles, at most 32 scores");
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int j = key0 + g;
    const int u = g & 1;   // the query this lane draws for: its own key bit 0
    const u32 x = base.x + static_cast<u32>((j >> 5) * 4 + ((j >> 1) & 3));
    // The keys' bytes: from byte ((j >> 3) & 3) * 2 of each 8-byte half, key bit 0 and then
    // key g + 8 (2 more). key0 is a multiple of 16, so that is byte 0 or 4 (the warp's: key
    // bit 4), and a half's four bytes are one word of the call's, in the bits' order.
    const int high_word = (j >> 4) & 1;
    const u32 repeated = bytes_threshold(threshold);
    // Bit 4 nt + 2 kh + b of `drawn`: query u's score of the key with bit 0 = b, i.e. this
    // lane's bits where b = u, and where b != u the partner's, which it moves to its u.
    // Paired, the calls of m = 2 i + high_word, placed at m = 2 i and moved up at the end;
    // `theirs`: the other warp's bits of the same calls.
    u32 drawn = 0, theirs = 0;
    #pragma unroll
    for (int i = 0; i < NT / 2 / (PAIRED ? 2 : 1); ++i) {
        const int m = PAIRED ? 2 * i + high_word : i;
        const uint4 w = dropout_words(key, stream, x, base.y + static_cast<u32>(((q0 >> 4) + m) * 8 + 2 * t + u));
        #pragma unroll
        for (int half = 0; half < 2; ++half) {          // n-tile 2 m + half: query bit 3
            const u32 key_bit4_clear = half ? w.z : w.x, key_bit4_set = half ? w.w : w.y;
            const int at = 4 * (2 * (PAIRED ? 2 * i : i) + half);
            drawn |= bytes_at_least(high_word ? key_bit4_set : key_bit4_clear, repeated) << at;
            if constexpr (PAIRED) theirs |= bytes_at_least(high_word ? key_bit4_clear : key_bit4_set, repeated) << at;
        }
    }
    if constexpr (PAIRED) drawn = (drawn << (8 * high_word)) | pair(theirs << (8 * high_word));
    const u32 own = u ? 0xaaaaaaaau : 0x55555555u;   // the bits of this lane's key parity
    const u32 partners = __shfl_xor_sync(0xffffffffu, drawn, 4) & own;   // their query, these keys
    return (drawn & own) | (u ? partners >> 1 : partners << 1);
}
