// What every backward kernel shares: the per-row workspaces of the pre-pass, the query
// range of a key block, and conversions between element and accumulation types.
//
// Row workspaces. The pre-pass (bwd_prep.cu) turns the forward's LSE and the output into
// two (B, Hq, nq_pad) arrays in the accumulation type, nq_pad a multiple of BWD_ROW_PAD:
//   lse2[i]  = LSE_i * log2(e), so that P = exp2(S * scale * log2(e) - lse2) is one FFMA and
//              one exp2, and +inf where LSE = -inf (a row that sees no key), so that P = 0
//              there instead of exp2(-inf + inf) = NaN;
//   delta[i] = rowsum(dO_i * O_i), the softmax Jacobian's row term (D in the papers).
// Under dropout (scale s = 1 / (1 - p) on kept scores) both rows carry s: lse2 - log2(s)
// and delta / s. Then exp2(...) is P' = s P, the P that multiplies dO into dV for a kept
// score as it is, and dS = P (s dP - delta) = P' (dP - delta / s) for a kept score,
// P' (0 - delta / s) for a dropped one: no product by s per score anywhere (the host
// scales a dlse by 1 / s likewise).
// Rows in [nq, nq_pad) hold lse2 = +inf and delta = 0: a query tile reads its rows without
// tail checks, and a padded row's P and dS are 0.
#pragma once
#include "elem.cuh"
#include "copy.cuh"
#include "mma.cuh"
#include "mods.cuh"

#define BWD_ROW_PAD 128

// Gradients a backward kernel instantiation produces (its GRADS template argument);
// GRAD_DQ_ORDERED with GRAD_DQ: the key blocks add into each dQ tile in a fixed order
// (DqTurns below), so that dQ is the same bits in every run.
enum { GRAD_DV = 1, GRAD_DK = 2, GRAD_DQ = 4, GRAD_DQ_ORDERED = 8 };

__device__ __forceinline__ i64 row_workspace_offset(int b, int h, int hq, int nq_pad) {
    return ((i64)b * hq + h) * nq_pad;
}

// The (query head, query tile) pairs a key-block CTA visits, head-major: every query head
// of its kv head's GQA group, times the query tiles that see some key of the block.
// Iteration `it` is pair number (it + rot) % count(): the walk may start part way along the
// list and wrap (rotate_start: the deterministic dQ's staggered starts, DqTurns), else at
// pair 0. next() skips the pairs the block mask leaves empty.
struct KeyBlockPairs {
    int hk, group, m_first, m_count, block_m, k0, k1;
    int rot = 0;

    template <bool EXT, bool BAND>
    __device__ __forceinline__ KeyBlockPairs(const MaskInfo<EXT, BAND>& mask, int hk_, int group_, int k0_,
                                             int block_n, int block_m_)
        : hk(hk_), group(group_), block_m(block_m_), k0(k0_), k1(k0_ + block_n) {
        const int2 tiles = mask.query_tile_range(k0, k1, block_m);
        m_first = tiles.x;
        m_count = tiles.y - tiles.x;
    }
    // Block x of `blocks` starts its walk x / blocks of the way along the list (the caller
    // keeps blocks * count() within an int).
    __device__ __forceinline__ void rotate_start(int x, int blocks) { rot = x * count() / blocks; }
    __device__ __forceinline__ int count() const { return group * m_count; }
    __device__ __forceinline__ int pair(int it) const { return it + rot < count() ? it + rot : it + rot - count(); }
    __device__ __forceinline__ int head(int it) const { return hk * group + pair(it) / m_count; }
    __device__ __forceinline__ int q0(int it) const { return (m_first + pair(it) % m_count) * block_m; }
    // The first pair from `it` on that the block mask leaves on.
    template <bool EXT, bool BAND>
    __device__ __forceinline__ int next(int it, const MaskInfo<EXT, BAND>& mask) const {
        if (MaskInfo<EXT, BAND>::BLOCKS && mask.blocks != nullptr)
            while (it < count() && mask.block_state(q0(it), q0(it) + block_m, k0, k1, head(it)) == 0) ++it;
        return it;
    }
    // The same, every lane of the warp calling it: the lanes test 32 pairs at once. One
    // pair after another the walk is a chain of dependent mask reads, which a sparse mask
    // makes long (bwd_sm90.cu's walker, which the consumers wait for; the sm80 kernels
    // keep next(): this one spills their d = 64 option kernel on sm_80, build check).
    template <bool EXT, bool BAND>
    __device__ __forceinline__ int next_in_warp(int it, const MaskInfo<EXT, BAND>& mask) const {
        if (!MaskInfo<EXT, BAND>::BLOCKS || mask.blocks == nullptr) return it;
        const int lane = threadIdx.x % 32;
        for (; it < count(); it += 32) {
            const int pair = it + lane;
            const bool on = pair < count() && mask.block_state(q0(pair), q0(pair) + block_m, k0, k1, head(pair)) != 0;
            const u32 found = __ballot_sync(0xffffffffu, on);
            if (found != 0) return it + __ffs(found) - 1;
        }
        return count();
    }
};


// Deterministic dQ from a key-block kernel: the key blocks of a kv head add into a query
// tile's dQ rows one at a time, in an order fixed by the mask alone, each after the
// previous addition has completed; a counter per (batch entry, query head, query tile)
// says how many have. The order follows the walks: with a right edge to the band (causal,
// a window's right side) each key block walks up from its first visible query tile, so a
// higher key block reaches a tile first and the order is descending; without one every
// block starts at the first tile and it is ascending. A kernel numbers its key blocks by
// their place x in this order (of `blocks` a head) and takes them in increasing x, so
// that the blocks it waits for were taken before (bwd_sm90.cu Sm90BwdUnits says why the
// waits then cannot deadlock).
struct DqTurns {
    bool descending;
    int key_block;   // the key block in place x

    template <bool EXT, bool BAND>
    __device__ __forceinline__ DqTurns(const MaskInfo<EXT, BAND>& mask, bool ordered, int x, int blocks)
        : descending(ordered && mask.right_extent() != NO_LIMIT), key_block(descending ? blocks - 1 - x : x) {}

    // How many key blocks add into rows [q0, q0 + block_m) of head h before this one:
    // those of the band that the rows see (key_tile_range, the band the walkers' own
    // query_tile_range describes) that the block mask leaves on, ahead in the order.
    // Every lane of the warp calls it (they share the block mask's reads).
    template <bool EXT, bool BAND>
    __device__ __forceinline__ u32 ahead(const MaskInfo<EXT, BAND>& mask, int q0, int block_m, int block_n, int h,
                                         int lane) const {
        const int2 band = mask.key_tile_range(q0, q0 + block_m, block_n);
        const int lo = descending ? key_block + 1 : band.x, hi = descending ? band.y : key_block;
        if (!MaskInfo<EXT, BAND>::BLOCKS || mask.blocks == nullptr) return u32(max(0, hi - lo));
        u32 on = 0;
        for (int j = lo + lane; j < hi; j += 32)
            on += mask.block_state(q0, q0 + block_m, j * block_n, (j + 1) * block_n, h) != 0;
        return __reduce_add_sync(0xffffffffu, on);
    }

    // The same count where every block walks the whole pair list, block y of `blocks`
    // starting at pairs.rotate_start(y, blocks) and the turns going by the order in which
    // the walks reach a pair (ties to the lower block): the pair that this block reaches at
    // step `it` of its walk. A block's first turns are then not behind every lower block's
    // (with ascending turns on a common start, block x begins x reductions late), but it
    // waits for blocks of its head that start after it: the kernel runs this only where all
    // of a head's blocks run at once (bwd_sm90.cu says why that cannot deadlock).
    __device__ __forceinline__ u32 ahead_rotated(const KeyBlockPairs& pairs, int it, int blocks) const {
        // Block y starts at pair y * count / blocks (non-decreasing in y) and reaches this
        // pair at step (pair - its start) mod count: before this block exactly when its
        // start lies in (start, start + it] cyclically, or equals this block's and y is
        // lower. In closed form (a loop over the blocks held 4 bytes more of the dQ
        // writer's registers than it has; its Python transcription checked against the
        // walks in tests/test_dq_turns.py).
        const int count = pairs.count(), start = pairs.rot, end = start + it;
        auto starting_by = [&](int v) { return min(blocks, ((v + 1) * blocks + count - 1) / count); };   // starts <= v
        const int later = end < count ? starting_by(end) - starting_by(start)
                                      : blocks - starting_by(start) + starting_by(end - count);
        return u32(later + key_block - starting_by(start - 1));
    }
};

// The backward kernels' scalars and workspaces from the contract's AttnParams `p`
// (params.cuh), under the names their bodies use, in the accumulation type Acc. dbias
// is the bias gradient's accumulator in the bias's compact shape (cupyflash/_mods.py),
// strides 0 on the axes it broadcasts over so that atomics sum them; null when no dbias
// is asked for (and in every launch but the one that has dS). Each kernel uses some.
#define BWD_SCALARS(p, Acc)                                                                          \
    [[maybe_unused]] const int group = (p).group, nq = (p).nq, d = (p).d, dim_v = (p).dim_v;        \
    [[maybe_unused]] const int nq_pad = (p).nq_pad, vec = (p).vec, dq_ld = (p).dq_ld;                \
    [[maybe_unused]] const Acc scale_log2 = Acc((p).scale_log2), scale = Acc((p).scale);             \
    [[maybe_unused]] Acc* const dq_accum = static_cast<Acc*>((p).dq_accum);                          \
    [[maybe_unused]] const Acc* const lse2 = static_cast<const Acc*>((p).lse2);                      \
    [[maybe_unused]] const Acc* const delta = static_cast<const Acc*>((p).delta);                    \
    [[maybe_unused]] Acc* const dbias = static_cast<Acc*>((p).dbias);                                \
    [[maybe_unused]] const i64 dbias_sb = (p).dbias_sb, dbias_sh = (p).dbias_sh,                     \
                               dbias_sq = (p).dbias_sq, dbias_sk = (p).dbias_sk

// P of one recomputed score s = q_i . k_j of head h: exp2(score - lse2), 0 where hidden
// (checked when `masked`). Under dropout a dropped score's P comes back negated: dV
// skips it, and dS still needs its P (a dropped score keeps its softmax gradient).
// `dtanh` receives softcap's derivative factor (mods.cuh score_log2).
template <int MODE, typename M, typename H, typename Acc>
__device__ __forceinline__ Acc recomputed_p(const M& mods, const H& hm, Acc s, int i, int j, Acc lse2,
                                            Acc scale_log2, bool masked, Acc& dtanh) {
    if constexpr (lean_mode(MODE)) {
        Acc x;
        if constexpr ((MODE & MODE_SOFTCAP) != 0) {   // the P alone (the dS pass: capped_p_and_grad)
            Acc unused;
            x = hm.cap_log2() * hm.capped_tanh(s, hm.tanh_arg(scale_log2), unused);
        } else {
            x = s * scale_log2;
        }
        if constexpr ((MODE & MODE_ALIBI) != 0) {   // HeadMods::alibi
            const int dist = i + mods.mask.off() - j;
            x -= hm.slope_log2 * Acc(dist < 0 ? -dist : dist);
        }
        const Acc p = exp2_fast(x - lse2);
        return masked && !mods.mask.visible(i, j) ? Acc(0) : p;
    } else {
        const Acc p = exp2_fast(hm.score_log2(s, i, j, scale_log2, masked, dtanh) - lse2);
        return hm.dropout() && !hm.keep(i, j) ? -p : p;
    }
}

// dS = P o (dP~ - delta) of one score from recomputed_p's P, dP = dO_i . v_j and the
// row's delta; dP~ is dP through the dropout mask (its scale is in the rows).
template <int MODE, typename H, typename Acc>
__device__ __forceinline__ Acc score_grad(const H& hm, Acc p, Acc dp, Acc delta) {
    if constexpr (lean_mode(MODE)) {
        return p * (dp - delta);
    } else {
        const Acc kept_dp = !hm.dropout() || p > Acc(0) ? dp : Acc(0);
        return (p < Acc(0) ? -p : p) * (kept_dp - delta);
    }
}

// The P that multiplies dO into dV: recomputed_p's, dropped ones 0 (kept ones carry the
// scale through the rows).
template <typename Acc>
__device__ __forceinline__ Acc kept_p(Acc p) { return p > Acc(0) ? p : Acc(0); }

template <int MT, int NT>
__device__ __forceinline__ void dropped_p(float (&kept)[MT][NT][4], const float (&p)[MT][NT][4]) {
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) kept[mt][nt][e] = kept_p(p[mt][nt][e]);
}

// recomputed_p over mma C fragments (mask.cuh for_each_score: fragment rows start at r0,
// columns at c0, KEY_ROWS for the key-major products); lse2_at(mt, nt, e) gives the
// element's row workspace. The options' terms go one pass per term (HeadMods scores_log2).
template <int MODE, bool KEY_ROWS, int MT, int NT, int MT2, int NT2, typename Acc, typename M, typename H, typename L>
__device__ __forceinline__ void recompute_p(Acc (&s)[MT][NT][4], Acc (&dtanh)[MT2][NT2][4], const M& mods,
                                            const H& hm, int r0, int c0, L&& lse2_at, Acc scale_log2, bool masked) {
    if constexpr (lean_mode(MODE)) {
        for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int mt, int nt, int e) {
            Acc unused;
            x = recomputed_p<MODE>(mods, hm, x, i, j, lse2_at(mt, nt, e), scale_log2, masked, unused);
        });
    } else {
        hm.template scores_log2<KEY_ROWS>(s, dtanh, r0, c0, scale_log2, masked);
        for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int, int, int mt, int nt, int e) {
            x = exp2_fast(x - lse2_at(mt, nt, e));
        });
        if (hm.dropout())
            for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& p, int i, int j, int, int, int) {
                if (!hm.keep(i, j)) p = -p;
            });
    }
}

// dS over C fragments, in place of P: score_grad, then the bias gradient (the dS of the
// biased score, added into dbias_b, this batch entry's accumulator, where not null) and
// softcap's derivative. delta_at(mt, nt, e) as lse2_at above. Acc is taken from the
// fragments alone (NoDeduce), so callers without a bias gradient pass a plain nullptr.
template <int MODE, bool KEY_ROWS, int MT, int NT, int MT2, int NT2, typename Acc, typename M, typename H, typename L>
__device__ __forceinline__ void grad_scores(Acc (&s)[MT][NT][4], const Acc (&dp)[MT][NT][4],
                                            const Acc (&dtanh)[MT2][NT2][4], const M& mods, const H& hm,
                                            int r0, int c0, L&& delta_at, typename NoDeduce<Acc>::type* dbias_b,
                                            i64 dbias_sh, i64 dbias_sq, i64 dbias_sk) {
    for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int mt, int nt, int e) {
        x = score_grad<MODE>(hm, x, dp[mt][nt][e], delta_at(mt, nt, e));
        if constexpr (!lean_mode(MODE)) {
            if (dbias_b != nullptr && i < mods.mask.nq && j < mods.mask.nk)
                atomicAdd(dbias_b + hm.h * dbias_sh + i * dbias_sq + j * dbias_sk, x);
        }
        if constexpr (MODE == MODE_EXT) x *= dtanh[mt][nt][e];
    });
}

// The bias gradient on bwd_sm90.cu's consumers: the dS of the biased score (query i, key j)
// added into `head`, the (batch entry, head)'s rows of the accumulator (null: not asked
// for), at the scores inside the (nq, nk) problem (grad_scores' atomics). The rows are
// whole (the kernel's bias has whole rows): key j at j.
struct DbiasAdder {
    static constexpr bool ON = true;
    float* head;
    int sq, nq, nk;   // the row stride, the problem
    __device__ __forceinline__ void operator()(int i, int j, float ds) const {
        if (head != nullptr && i < nq && j < nk) atomicAdd(head + i64(i) * sq + j, ds);   // (nq nk may pass 2^31)
    }
};
struct NoDbias {
    static constexpr bool ON = false;
    __device__ __forceinline__ void operator()(int, int, float) const {}
};

// dbias over the dS of grad_pass (below), in a pass of its own.
template <bool KEY_ROWS, int NT>
__device__ __forceinline__ void add_dbias(float (&ds)[1][NT][4], int r0, int c0, const DbiasAdder& dbias) {
    for_each_score<KEY_ROWS>(ds, r0, c0, [&](float& x, int i, int j, int, int, int) { dbias(i, j, x); });
}

// The bias term of p_pass and capped_p_and_grad below (bwd_sm90.cu's softcap pass, and
// fp32's passes; otherwise the bias rides in S^T's accumulator): `at(nt, e)` is the bias of
// element e of n-tile nt, added in log2 units after softcap and before ALiBi
// (HeadMods::score_log2's order).
// NoBias leaves the term out of the code. KeyRowBias reads it, for the key-row layout of
// bwd_sm90.cu's consumers, from a shared-memory stage that TMA filled as the bias lies in
// memory: ROWS queries, panels of 64 keys with the 128-byte swizzle (wgmma.cuh
// Swizzle128). ldmatrix.trans hands each lane exactly its pairs: matrix m of an x4 is
// keys key0 + 8 (m % 2) .. of n-tile 2 np + m / 2, and a lane receives (key g, queries
// 2 t and 2 t + 1) of each. One x4 per pair of n-tiles, issued as a pass reaches the pair
// (element 0 of an even n-tile: the passes walk the scores in for_each_score's order), so
// only its 4 words are live.
struct NoBias {
    static constexpr bool ON = false;
    __device__ __forceinline__ float at(int, int) { return 0.f; }
};

template <typename T, int ROWS>
struct KeyRowBias {
    static constexpr bool ON = true;
    static constexpr int PANEL = 64;   // keys per 128-byte swizzled row
    const T* lane_row;                 // this lane's ldmatrix row for n-tiles 0 and 1
    u32 words[4];

    // stage: the stage's first element (1024-byte aligned); key0: the warp's first key of
    // the block (a multiple of 16).
    __device__ __forceinline__ KeyRowBias(const T* stage, int key0) {
        const int lane = threadIdx.x % 32, m = lane / 8, q = (m / 2) * 8 + lane % 8;
        const int key = key0 + (m % 2) * 8;
        lane_row = stage + (key / PANEL) * (ROWS * PANEL) + q * PANEL + (((key % PANEL) / 8) ^ (q % 8)) * 8;
    }
    __device__ __forceinline__ float at(int nt, int e) {
        if (nt % 2 == 0 && e == 0) ldmatrix_x4_trans(words, lane_row + (nt / 2) * 16 * PANEL);
        T x;
        x.bits = u16(words[(nt % 2) * 2 + e / 2] >> (16 * (e % 2)));
        return to_float(x);
    }
};

// KeyRowBias of an fp32 bias: panels of 32 keys (128 bytes) with the 128-byte swizzle (16-byte
// chunk c of row q at c ^ (q % 8)), each element by its own load (no ldmatrix for 32-bit
// elements; the key-row layout wants no two of a lane's scores side by side in a row). A
// warp's 32 loads of one (nt, e) read 8 chunks whose banks are all distinct: conflict-free.
template <int ROWS>
struct KeyRowBias<float, ROWS> {
    static constexpr bool ON = true;
    static constexpr int PANEL = 32;   // keys per 128-byte swizzled row
    const float* lane_at[4];           // element e of n-tile 0 (n-tile nt: 8 nt rows further)

    __device__ __forceinline__ KeyRowBias(const float* stage, int key0) {
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int q = 2 * t + e % 2, key = key0 + g + 8 * (e / 2);
            lane_at[e] = stage + (key / PANEL) * (ROWS * PANEL) + q * PANEL + (((key % PANEL) / 4) ^ (q % 8)) * 4 + key % 4;
        }
    }
    __device__ __forceinline__ float at(int nt, int e) { return lane_at[e][nt * 8 * PANEL]; }
};

// The options on bwd_sm90.cu's consumers (MODE_EXT, with MODE_BIAS its bias), whose scores come one
// m-tile of C fragments at a time (bit 4 nt + e of `visible` and `kept` for element e of
// n-tile nt: which scores the mask shows and dropout keeps, worked out while the products
// ran; masking the scores at the peak of the registers spilled). The terms are
// compile-time flags of each pass, chosen once per tile (a branch per term and score
// would leave the scheduler one score's dependent chain at a time), and so is BITS:
// false where every score is shown and kept (no dropout, an unmasked tile), which saves
// the selects. Dropout's scale is in the rows (above): P comes out of p_pass scaled.
//
// Without softcap, the dense kernels' two steps: p_pass turns S into P (0 where hidden)
// while dP's product still runs, kept_a_frag packs the P that multiplies dO (dropped
// scores 0), and grad_pass turns P into dS once dP is in.
template <bool ALIBI, bool BITS, bool KEY_ROWS, int NT, typename Acc, typename H, typename L, typename Bias>
__device__ __forceinline__ void p_pass(Acc (&s)[1][NT][4], const H& hm, int r0, int c0, L&& lse2_at, u32 visible,
                                       Acc scale_log2, Bias& bias) {
    for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int mt, int nt, int e) {
        Acc score = x * scale_log2;
        if constexpr (Bias::ON) score = fma(bias.at(nt, e), Acc(LOG2E_D), score);
        if constexpr (ALIBI) score -= hm.alibi(i, j);
        const Acc p = exp2_fast(score - lse2_at(mt, nt, e));
        x = !BITS || (visible >> (4 * nt + e)) & 1 ? p : Acc(0);
    });
}

template <typename T, bool BITS, int NT>
__device__ __forceinline__ void kept_a_frag(u32 (&a)[4], const float (&p)[1][NT][4], int ks, u32 kept) {
    auto k = [&](int nt, int e) { return !BITS || (kept >> (4 * nt + e)) & 1 ? p[0][nt][e] : 0.f; };
    a[0] = pack2<T>(k(2 * ks, 0), k(2 * ks, 1));
    a[1] = pack2<T>(k(2 * ks, 2), k(2 * ks, 3));
    a[2] = pack2<T>(k(2 * ks + 1, 0), k(2 * ks + 1, 1));
    a[3] = pack2<T>(k(2 * ks + 1, 2), k(2 * ks + 1, 3));
}

template <bool BITS, bool KEY_ROWS, int NT, typename Acc, typename Dl>
__device__ __forceinline__ void grad_pass(Acc (&s)[1][NT][4], const Acc (&dp)[1][NT][4], int r0, int c0,
                                          Dl&& delta_at, u32 kept) {
    for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int, int, int mt, int nt, int e) {
        const Acc kept_dp = !BITS || (kept >> (4 * nt + e)) & 1 ? dp[mt][nt][e] : Acc(0);
        x *= kept_dp - delta_at(mt, nt, e);
    });
}

// With softcap, one pass once both products are in: there are no registers for the
// derivative 1 - tanh^2 to wait in between, so per score it lives only between its two
// uses. s becomes the P that multiplies dO (kept_a_frag's values) and dp becomes dS;
// `dbias` takes the dS of the biased score, before softcap's derivative.
template <bool ALIBI, bool BITS, bool KEY_ROWS, int NT, typename Acc, typename H, typename L, typename Dl,
          typename Bias, typename Dbias = NoDbias>
__device__ __forceinline__ void capped_p_and_grad(Acc (&s)[1][NT][4], Acc (&dp)[1][NT][4], const H& hm, int r0, int c0,
                                                  L&& lse2_at, Dl&& delta_at, Bias& bias, u32 visible, u32 kept,
                                                  Acc scale_log2, const Dbias& dbias = Dbias()) {
    const Acc to_tanh = hm.tanh_arg(scale_log2), cap = hm.cap_log2();
    for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int mt, int nt, int e) {
        Acc dtanh;
        const Acc th = hm.capped_tanh(x, to_tanh, dtanh);
        // The exponent's terms beside the cap, which then rides in the exp2's FMA.
        Acc rest = -lse2_at(mt, nt, e);
        if constexpr (Bias::ON) rest = fma(bias.at(nt, e), Acc(LOG2E_D), rest);
        if constexpr (ALIBI) rest -= hm.alibi(i, j);
        const Acc p = exp2_fast(fma(th, cap, rest));
        if constexpr (BITS) {
            const bool shown = (visible >> (4 * nt + e)) & 1, keep = (kept >> (4 * nt + e)) & 1;
            const Acc ds = p * ((keep ? dp[mt][nt][e] : Acc(0)) - delta_at(mt, nt, e));
            if constexpr (Dbias::ON) {
                if (shown) dbias(i, j, ds);
            }
            dp[mt][nt][e] = shown ? ds * dtanh : Acc(0);
            x = shown && keep ? p : Acc(0);
        } else {
            const Acc ds = p * (dp[mt][nt][e] - delta_at(mt, nt, e));
            if constexpr (Dbias::ON) dbias(i, j, ds);
            dp[mt][nt][e] = ds * dtanh;
            x = p;
        }
    });
}

// Shares of a key m-tile (bwd_wide.cu, bwd_sm80.cu: the HALVES warps that each hold a
// share of its dK and dV columns) trade their products of a slice: share 0
// computed S^T into s, share 1 dP^T into dp (with more shares, shares 2 j and 2 j + 1 the
// same products over part j of d), and each gets what it lacks through the group's slots
// of `trade` (a warp's slot lane-major: conflict-free). Every share leaves with the same
// s and dp, bit for bit (with more than two, each product is the sum of its parts, added
// in the same order by every share).
// CTA_DONE: end with a barrier of the whole CTA (the slots share a buffer that is
// written next) instead of the group's.
template <bool CTA_DONE, int HALVES, typename T, int MT, int NT>
__device__ __forceinline__ void trade_products(T (&s)[MT][NT][4], T (&dp)[MT][NT][4], T* trade, int warp,
                                               int share) {
    constexpr int PER_WARP = MT * NT * 4 * 32;
    const int lane = threadIdx.x % 32;
    const int barrier = 1 + warp / HALVES;   // named barrier of the group (0 is __syncthreads')
    T* mine = trade + warp * PER_WARP + lane;
    const T* group = trade + (warp - share) * PER_WARP + lane;   // share j's slot at j PER_WARP
    // Fully unrolled, each branch naming its own array: a select between s and dp would
    // index registers at run time (local memory).
    #pragma unroll
    for (int i = 0; i < MT * NT * 4; ++i) {
        if (share % 2 == 0) mine[i * 32] = s[i / (NT * 4)][i / 4 % NT][i % 4];
        else mine[i * 32] = dp[i / (NT * 4)][i / 4 % NT][i % 4];
    }
    named_barrier(barrier, 32 * HALVES);
    #pragma unroll
    for (int i = 0; i < MT * NT * 4; ++i) {
        T& si = s[i / (NT * 4)][i / 4 % NT][i % 4];
        T& di = dp[i / (NT * 4)][i / 4 % NT][i % 4];
        if constexpr (HALVES == 2) {   // the partner's product
            if (share == 0) di = group[PER_WARP + i * 32];
            else si = group[i * 32];
        } else {   // each product's parts, in share order
            si = group[i * 32];
            di = group[PER_WARP + i * 32];
            #pragma unroll
            for (int part = 1; part < HALVES / 2; ++part) {
                si += group[2 * part * PER_WARP + i * 32];
                di += group[(2 * part + 1) * PER_WARP + i * 32];
            }
        }
    }
    if constexpr (CTA_DONE) __syncthreads();
    else named_barrier(barrier, 32 * HALVES);   // the group has read these slots before the next slice refills them
}
