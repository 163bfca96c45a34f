// Which keys a query row sees, and which tiles a block must visit.
// Mirrors cupyflash/_masks.py (the rules) and cupyflash/_mods.py (the options).
//
// Everything here is in coordinates relative to one batch entry (one sequence for
// varlen): rows 0 .. nq-1, keys 0 .. nk-1, and the band's diagonal key of row i is
// i + off(). A call that is its own problem is aligned at its bottom-right corner, off =
// nk - nq; a chunk pair of a streamed call (params.cuh ModsParams row0, key0, diag) takes
// its problem's diagonal, off = diag + row0 - key0 in its own coordinates, so that the
// band and ALiBi's distance (mods.cuh) are the problem's. A row's visible keys form the
// half-open span [key_lo(i), key_hi(i)) of the causal/window band, both bounds
// non-decreasing in i, so a tile range is read off the corner rows; the block-sparse mask
// then filters single tiles, and a tile is masked element by element only when it is not
// wholly visible.
//
// EXT = false is the dense fast path: causal and the sequence end only, or with BAND
// (mods.cuh MODE_BAND) the whole band: a window's extents, key padding, a varlen
// sequence's or a placed call's bounds, and a block mask whose blocks are whole tiles of
// the kernel (BLOCKS: it skips the tiles the mask leaves off, and masks no element by
// it; the host sends no other block mask there); EXT adds every block mask. The fields a
// kernel does not read the compiler drops.
#pragma once
#include "elem.cuh"

// f(x, row, key, mt, nt, e) for each score of mma C fragments [MT][NT][4] whose rows start
// at r0 and columns at c0: element e of n-tile nt of m-tile mt is row r0 + 16 mt + g + 8 (e / 2),
// column c0 + 8 nt + 2 t + e % 2 (g = lane / 4, t = lane % 4). With KEY_ROWS the fragment
// rows are keys and its columns queries (the backward's transposed products).
template <bool KEY_ROWS, int MT, int NT, typename Acc, typename F>
__device__ __forceinline__ void for_each_score(Acc (&s)[MT][NT][4], int r0, int c0, F&& f) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int fr = r0 + mt * 16 + g + (e / 2) * 8, fc = c0 + nt * 8 + 2 * t + (e % 2);
                f(s[mt][nt][e], KEY_ROWS ? fc : fr, KEY_ROWS ? fr : fc, mt, nt, e);
            }
}

// The queries a thread holds in for_each_score's layout, as slots: 2 per m-tile (its two
// fragment rows), or with KEY_ROWS 2 per n-tile (its two fragment columns). Per-query
// work (a band, a row pointer) is done once per slot rather than once per score.
template <bool KEY_ROWS, int MT, int NT>
struct QuerySlots {
    static constexpr int COUNT = KEY_ROWS ? 2 * NT : 2 * MT;
    // Whether per-query values are worth registers: for a thread's one m-tile (the Hopper
    // forward); with more queries they would take registers the kernels do not have
    // (build check), and the values are worked out per score instead.
    static constexpr bool CACHED = COUNT <= 2;
    // The slot of element e of n-tile nt of m-tile mt.
    __device__ __forceinline__ static int of(int mt, int nt, int e) {
        return KEY_ROWS ? 2 * nt + e % 2 : 2 * mt + e / 2;
    }
    // The query of slot q, for fragments whose rows start at r0 and columns at c0.
    __device__ __forceinline__ static int query(int q, int r0, int c0) {
        const int lane = threadIdx.x % 32;
        return KEY_ROWS ? c0 + (q / 2) * 8 + 2 * (lane % 4) + q % 2 : r0 + (q / 2) * 16 + lane / 4 + 8 * (q % 2);
    }
};

#define NO_LIMIT 0x3fffffff   // an unbounded window side, beyond any index

// A bit set of a thread's fragment columns: 32 bits where they fit, else 64.
template <bool FITS_32> struct ColumnBits { typedef u64 type; };
template <> struct ColumnBits<true> { typedef u32 type; };

template <bool EXT, bool BAND = EXT>
struct MaskInfo {
    static_assert(BAND || !EXT, "the options include the band");
    // Whether the block mask is read (to skip tiles; element by element only with EXT).
    static constexpr bool BLOCKS = BAND;
    int nq, nk;
    int causal;
    // BAND:
    int left, right;                    // window extents, -1 unbounded
    int key_stop;                       // keys >= key_stop are hidden (key padding)
    int diagonal;                       // off(), worked out once (Mods::set_bounds)
    // BLOCKS:
    const unsigned char* blocks;        // this batch entry's block mask, or null
    i64 blocks_head, blocks_row;        // its head and row strides (0 for a broadcast head)
    int block_q, block_k;

    // The dense path is always its own problem (the host gives it no coordinates).
    __device__ __forceinline__ int off() const { return BAND ? diagonal : nk - nq; }
    __device__ __forceinline__ int stop() const { return BAND ? key_stop : nk; }
    // Right extent of the band relative to the diagonal i + off (causal: 0).
    __device__ __forceinline__ int right_extent() const {
        return causal ? 0 : (BAND && right >= 0 ? right : NO_LIMIT);
    }
    // First key row `i` may see, and one past the last (before clipping to [0, stop)).
    __device__ __forceinline__ int key_lo(int i) const {
        return BAND && left >= 0 ? i + off() - left : 0;
    }
    __device__ __forceinline__ int key_hi(int i) const {
        const int r = right_extent();
        return r == NO_LIMIT ? stop() : min(stop(), i + off() + r + 1);
    }
    // Block-sparse and head-dependent: the functions below take the query head h. Rows
    // and keys past the sequence are left to the band (they have no mask entry).
    __device__ __forceinline__ bool block_visible(int i, int j, int h) const {
        return !EXT || blocks == nullptr || i >= nq || j >= nk ||
               blocks[h * blocks_head + (i / block_q) * blocks_row + j / block_k] != 0;
    }
    __device__ __forceinline__ bool visible(int i, int j, int h = 0) const {
        if constexpr (!BAND) return j < nk && (!causal || j <= i + off());   // the diagonal tiles' test
        return i < nq && j >= key_lo(i) && j < key_hi(i) && block_visible(i, j, h);
    }

    // Tiles of the block mask over rows [q0, q1) x keys [k0, k1) (clipped to the
    // sequence): 0 = no mask block set (skip the tile), 1 = all set, 2 = mixed.
    __device__ __forceinline__ int block_state(int q0, int q1, int k0, int k1, int h) const {
        if (!BLOCKS || blocks == nullptr) return 1;
        if constexpr (!EXT) {   // blocks of whole tiles (the host's contract, above): the tile's one block
            return q0 < nq && k0 < nk && blocks[h * blocks_head + (q0 / block_q) * blocks_row + k0 / block_k] != 0;
        }
        q1 = min(q1, nq);
        k1 = min(k1, nk);
        if (q0 >= q1 || k0 >= k1) return 0;
        bool any = false, all = true;
        for (int bi = q0 / block_q; bi <= (q1 - 1) / block_q; ++bi)
            for (int bj = k0 / block_k; bj <= (k1 - 1) / block_k; ++bj) {
                const bool set = blocks[h * blocks_head + bi * blocks_row + bj] != 0;
                any |= set;
                all &= set;
            }
        return any ? (all ? 1 : 2) : 0;
    }

    // Key tiles [first, stop) that the rows [q0, q1) touch; tiles outside are skipped.
    __device__ __forceinline__ int2 key_tile_range(int q0, int q1, int block_n) const {
        const int last_row = min(q1, nq) - 1;
        const int lo = max(0, key_lo(q0));
        const int hi = min(stop(), key_hi(last_row));
        const int first = lo / block_n;
        return make_int2(first, hi <= lo ? first : (hi + block_n - 1) / block_n);
    }
    // Query tiles [first, stop) that see some key of [k0, k1). Mirrors
    // cupyflash/_masks.py query_block_range.
    __device__ __forceinline__ int2 query_tile_range(int k0, int k1, int block_m) const {
        const int last_key = min(k1, stop()) - 1;
        if (last_key < k0) return make_int2(0, 0);
        const int r = right_extent();
        const int lo = r == NO_LIMIT ? 0 : max(0, k0 - off() - r);
        const int hi = BAND && left >= 0 ? min(nq, last_key - off() + left + 1) : nq;
        const int first = lo / block_m;
        return make_int2(first, hi <= lo ? first : (hi + block_m - 1) / block_m);
    }
    // The first key tile at or after j (before `stop`) that the block mask leaves on.
    __device__ __forceinline__ int next_key_tile(int j, int stop, int q0, int q1, int block_n, int h = 0) const {
        if (BLOCKS && blocks != nullptr)
            while (j < stop && block_state(q0, q1, j * block_n, (j + 1) * block_n, h) == 0) ++j;
        return j;
    }
    __device__ __forceinline__ int next_query_tile(int m, int stop, int k0, int k1, int block_m, int h = 0) const {
        if (BLOCKS && blocks != nullptr)
            while (m < stop && block_state(m * block_m, (m + 1) * block_m, k0, k1, h) == 0) ++m;
        return m;
    }

    // A tile needs the elementwise mask unless every existing (row, key) in it is
    // visible: it crosses the band's edges, runs past the keys (or, BAND, the rows:
    // the backward's padded row workspaces belong to the next sequence under varlen),
    // or holds a partial block-mask pattern. All other tiles skip the predicate. (The
    // dense path's rows past nq read +inf rows: their P is 0 without the mask.)
    __device__ __forceinline__ bool tile_needs_mask(int q0, int q1, int k0, int k1, int h = 0) const {
        return band_needs_mask(q0, q1, k0, k1) || (EXT && block_state(q0, q1, k0, k1, h) != 1);
    }
    // The same test without the block mask (for a walker that has its block_state).
    __device__ __forceinline__ bool band_needs_mask(int q0, int q1, int k0, int k1) const {
        if (k1 > stop() || k1 > key_hi(q0)) return true;
        return BAND && (q1 > nq || k0 < key_lo(min(q1, nq) - 1));
    }

    // The band of keys a row sees, clipped to the sequence (none past the rows: under
    // varlen a tile's padded rows belong to the next sequence).
    __device__ __forceinline__ int band_lo(int i) const { return i < nq ? max(key_lo(i), 0) : 0; }
    __device__ __forceinline__ int band_hi(int i) const { return i < nq ? key_hi(i) : 0; }
    // The block mask at fragment row fr (a query, or with KEY_ROWS a key) over the 2 NT
    // fragment columns of a thread from c0: bit c for column c0 + 8 (c / 2) + 2 t + c % 2.
    // In a loop that is not unrolled: unrolled, its loads and divisions would take
    // registers and code the main loops need.
    template <bool KEY_ROWS, int NT>
    __device__ __forceinline__ typename ColumnBits<(2 * NT <= 32)>::type block_row_bits(int fr, int c0, int h) const {
        static_assert(2 * NT <= 64, "a bit per fragment column");
        typedef typename ColumnBits<(2 * NT <= 32)>::type Bits;
        const int t = threadIdx.x % 4;
        Bits bits = 0;
        #pragma unroll 1
        for (int c = 0; c < 2 * NT; ++c) {
            const int fc = c0 + (c / 2) * 8 + 2 * t + c % 2;
            bits |= Bits(block_visible(KEY_ROWS ? fc : fr, KEY_ROWS ? fr : fc, h)) << c;
        }
        return bits;
    }

    // apply's verdict as bits for one m-tile of fragments (bit 4 nt + e; with the band):
    // for a kernel that works them out while its products run and masks in the pass that
    // needs them (bwd_sm90.cu), where a -inf pass over the scores would cost registers.
    // Without EXT the block mask's blocks are whole tiles, which the walker skips.
    template <bool KEY_ROWS, int NT>
    __device__ __forceinline__ u32 visible_bits(int r0, int c0, int h) const {
        static_assert(BAND && 4 * NT <= 32, "a bit per score of the m-tile");
        const int g = threadIdx.x % 32 / 4;
        float indices_only[1][NT][4];   // for for_each_score's (i, j) walk; never read
        u32 bits = 0;
        for_each_score<KEY_ROWS>(indices_only, r0, c0, [&](float&, int i, int j, int, int nt, int e) {
            bits |= u32(j >= band_lo(i) && j < band_hi(i)) << (4 * nt + e);
        });
        if (!EXT || blocks == nullptr) return bits;
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
            const auto row = block_row_bits<KEY_ROWS, NT>(r0 + g + 8 * half, c0, h);
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int odd = 0; odd < 2; ++odd)
                    if (!((row >> (2 * nt + odd)) & 1)) bits &= ~(1u << (4 * nt + 2 * half + odd));
        }
        return bits;
    }

    // Hide (-inf) what a row of head h may not see in scores held as mma C fragments
    // (for_each_score's layout; KEY_ROWS for the backward's key-major products). With
    // the options, the band of keys is worked out per query (once per query the thread
    // holds where it has registers for it), so a score costs two compares, and a partial
    // block mask is gathered into bits: not visible()'s divisions and branches per score,
    // which made the masked tiles slow and the code too large for the instruction cache.
    template <bool KEY_ROWS = false, int MT, int NT, typename Acc>
    __device__ __forceinline__ void apply(Acc (&s)[MT][NT][4], int r0, int c0, int h = 0) const {
        if constexpr (!EXT) {
            for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int, int, int) {
                if (!visible(i, j)) x = Acc(-INFINITY);
            });
        } else {
            typedef QuerySlots<KEY_ROWS, MT, NT> Slots;
            if constexpr (Slots::CACHED) {
                int lo[Slots::COUNT], hi[Slots::COUNT];
                #pragma unroll
                for (int q = 0; q < Slots::COUNT; ++q) {
                    lo[q] = band_lo(Slots::query(q, r0, c0));
                    hi[q] = band_hi(Slots::query(q, r0, c0));
                }
                for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int, int j, int mt, int nt, int e) {
                    const int q = Slots::of(mt, nt, e);
                    if (j < lo[q] || j >= hi[q]) x = Acc(-INFINITY);
                });
            } else {
                for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int, int, int) {
                    if (j < band_lo(i) || j >= band_hi(i)) x = Acc(-INFINITY);
                });
            }
            // The block mask, on tiles with a partial block pattern.
            if (blocks == nullptr) return;
            const int g = threadIdx.x % 32 / 4;
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const auto bits = block_row_bits<KEY_ROWS, NT>(r0 + mt * 16 + g + 8 * half, c0, h);
                    #pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        #pragma unroll
                        for (int odd = 0; odd < 2; ++odd)
                            if (!((bits >> (2 * nt + odd)) & 1)) s[mt][nt][2 * half + odd] = Acc(-INFINITY);
                }
        }
    }
};
