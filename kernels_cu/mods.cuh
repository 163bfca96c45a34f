// The attention options beyond causal (cupyflash/_mods.py has the semantics and the
// compact array shapes): sequence bounds (varlen, key padding), the mask of mask.cuh,
// the score modifiers (softcap, bias, ALiBi) and dropout, resolved once per CTA.
//
// Every kernel reads them from the ModsParams of its AttnParams (params.cuh) and builds
// its Mods<T, MODE> with MODS_SETUP; MODE selects how much of it is compiled:
//   MODE_DENSE    plain attention (causal only): the fast path; no option is read.
//   MODE_EXT      every option, each switched on at run time by its argument; in a
//                 family that keeps the bias apart (fwd_sm90.cu), every option but the
//                 bias, whose reads take registers its widest tiles do not have;
//   MODE_EXT | MODE_BIAS   that family's kernel with the bias too (other tiles);
//   MODE_BAND     the dense path with the options that only bound the keys a row sees
//                 (a window, key padding, varlen sequences, a place in a larger
//                 problem; mask.cuh's band) and a block mask of whole tiles, in
//                 bwd_sm90.cu: they hide keys and skip tiles and nothing else, so the
//                 dense pipeline serves them (persistent CTAs, the lean passes); the
//                 option kernel's one CTA per key block read 0.66-0.74x dense per visible
//                 pair at window 2048 (H200, session 25).
//   MODE_BAND | MODE_ALIBI   the same with ALiBi, the one score term whose gradient is
//                 dense mode's (it changes P; dS = P (dP - delta) stays): the lean passes
//                 add it to each score (bwd.cuh recomputed_p).
//   MODE_BAND | MODE_SOFTCAP   the same with softcap as the one score term: P and dS in
//                 one pass once both products are in (bwd.cuh capped_p_and_grad, as the
//                 option kernels), its derivative 1 - tanh^2 living only within the pass.
//   MODE_BAND | MODE_DROPOUT   the same with dropout and no score term: the keep bits drawn
//                 while the products run (the warps of a pair splitting each Philox call,
//                 as in the option kernels), dropped scores left out of dV and of dP.
// MODE_TF32 is not an option but the precision="tf32" policy of fp32 inputs in
// fwd_sm90.cu (one TF32 product per matrix product instead of three); it combines with
// the others and is no part of what Mods compiles.
#pragma once
#include "elem.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "philox.cuh"

enum { MODE_DENSE = 0, MODE_EXT = 1, MODE_BIAS = 2, MODE_TF32 = 4, MODE_BAND = 8, MODE_ALIBI = 16, MODE_SOFTCAP = 32,
       MODE_DROPOUT = 64 };

// Whether a mode's kernel runs the dense path: at most one of ALiBi, softcap or dropout,
// a band and a block mask of whole tiles (MODE_DENSE, MODE_BAND, MODE_ALIBI,
// MODE_SOFTCAP, MODE_DROPOUT; MODE_TF32 is no option either).
constexpr bool lean_mode(int mode) { return (mode & (MODE_EXT | MODE_BIAS)) == 0; }

// Declares `mods`, this CTA's Mods, from the contract's AttnParams `p` (params.cuh).
// The dense path keeps it in registers; the others in shared memory, written once: there
// the options' ~30 words would otherwise sit in registers for the whole main loop beside
// S, O and the fragments, and spill. (fwd_sm90.cu, whose persistent CTAs change batch
// entry between work tiles, keeps its own copies and fills them with set_bounds and
// set_terms.)
#define MODS_SETUP(T, Acc, MODE, p, b, heads)                                              \
    __shared__ Mods<T, Acc, MODE> mods_shared_;                                           \
    const Mods<T, Acc, MODE> mods_local_ = Mods<T, Acc, MODE>::make(p, b, heads);         \
    if constexpr (!lean_mode(MODE)) {                                                     \
        if (threadIdx.x == 0) mods_shared_ = mods_local_;                                 \
        __syncthreads();                                                                  \
    }                                                                                     \
    const Mods<T, Acc, MODE>& mods = lean_mode(MODE) ? mods_local_ : mods_shared_

// tanh at the accuracy of the accumulation: the SFU's for 16-bit inputs (its ~2^-11
// relative error is below their rounding), the libdevice one for fp32 and fp64.
template <typename T> __device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
template <> __device__ __forceinline__ float tanh_acc<half_t>(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
template <> __device__ __forceinline__ float tanh_acc<bfloat16_t>(float x) { return tanh_acc<half_t>(x); }
template <typename T> __device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }

// Softcap's per-score arithmetic, for HeadMods of either path. Softcap of a raw product
// s, in log2 units: softcap log2 e tanh(scale s / softcap) = cap_log2() th for th =
// capped_tanh(s, tanh_arg(scale_log2)) (the scale's log2 e and softcap_in's ln 2 cancel
// inside). The scale thus rides in the tanh's one product and the cap in the one after
// it, which a pass can fold into its exp2's FMA (the forward's fold scale; the backward's
// P). `dtanh` receives softcap's derivative factor 1 - th^2.
template <typename T, typename Acc> struct SoftcapTerm {
    Acc softcap;         // 0: off
    Acc softcap_in;      // ln 2 / softcap: a log2-unit score times it is the tanh's argument

    __device__ __forceinline__ void set_softcap(Acc cap) {
        softcap = cap;
        softcap_in = cap > Acc(0) ? Acc(LN2_D) / cap : Acc(0);
    }
    __device__ __forceinline__ Acc tanh_arg(Acc scale_log2) const { return scale_log2 * softcap_in; }
    __device__ __forceinline__ Acc cap_log2() const { return softcap * Acc(LOG2E_D); }
    __device__ __forceinline__ Acc capped_tanh(Acc s, Acc to_tanh, Acc& dtanh) const {
        const Acc th = tanh_acc<T>(s * to_tanh);
        dtanh = Acc(1) - th * th;
        return th;
    }
};

static_assert(sizeof(ModsParams::rng_round_keys) == 2 * PHILOX_ROUNDS * sizeof(u32), "a key a round");

// Dropout's per-score draws, for HeadMods of either path: keep (row, key) iff its Philox
// draw >= threshold (0: off). Kept scores' scale: Mods::drop_scale in the forward, the
// row workspaces in the backward (bwd.cuh).
struct DropoutTerm {
    u64 seed, stream;
    u32 threshold;
    uint2 drop_base;     // the counters of the call's origin in its problem (Mods)

    __device__ __forceinline__ bool dropout() const { return threshold != 0; }
    __device__ __forceinline__ bool keep(int i, int j) const {
        return !dropout() || dropout_keep(seed, stream, i, j, threshold, drop_base);
    }
    // philox.cuh dropout_keep_bits of the m-tile at row r0, keys from c0. `key`: the seed,
    // or its schedule as the kernel's parameters hold it (RoundKeys of
    // ModsParams::rng_round_keys, read from the constant bank): the same bits.
    template <int NT, typename Key>
    __device__ __forceinline__ u64 keep_bits(int r0, int c0, Key key) const {
        return dropout_keep_bits<NT>(key, stream, r0, c0, threshold, drop_base);
    }
    // philox.cuh dropout_keep_bits_key_rows of the keys from k0 and queries from q0 (with
    // a WarpPair, the calls split with the warp of the keys k0 ^ 16); `key` as above.
    template <int NT, typename Key, typename WarpPair = SoloWarp>
    __device__ __forceinline__ u32 keep_bits_key_rows(int k0, int q0, Key key,
                                                      const WarpPair& pair = WarpPair()) const {
        return dropout_keep_bits_key_rows<NT>(key, stream, k0, q0, threshold, drop_base, pair);
    }
};

// Mods' per-score state of one query head, copied into registers for the scores of one
// tile: read from shared memory per score, the options would cost a load each.
template <typename T, typename Acc, bool EXT> struct HeadMods : SoftcapTerm<T, Acc>, DropoutTerm {
    // The dense path: ALiBi's slope (MODE_ALIBI) or 0, softcap (MODE_SOFTCAP) or 0,
    // dropout (MODE_DROPOUT) or off.
    Acc slope_log2;
};
template <typename T, typename Acc>
struct HeadMods<T, Acc, true> : SoftcapTerm<T, Acc>, DropoutTerm {
    using SoftcapTerm<T, Acc>::softcap;
    using SoftcapTerm<T, Acc>::tanh_arg;
    using SoftcapTerm<T, Acc>::cap_log2;
    using SoftcapTerm<T, Acc>::capped_tanh;
    // The mask (the CTA's, in shared memory). ALiBi's diagonal is read from it where a
    // distance is formed (MaskInfo::off), not copied here: a copy held a register across
    // a tile's products, which spilled bwd_sm90.cu's d = 128 tiles (build check).
    const MaskInfo<true>* mask;
    int h;
    const T* bias;       // this head's bias rows, or null
    i64 bias_sq, bias_sk;
    Acc slope_log2;      // ALiBi slope times log2(e); 0: off

    // Whether a term changes the scores (else a kernel may fold the scale into its exp2).
    __device__ __forceinline__ bool score_terms() const {
        return softcap > Acc(0) || bias != nullptr || slope_log2 != Acc(0);
    }

    // The score of (row i, key j) in log2 units from the raw product s = q_i . k_j:
    // scale (folded with log2 e), softcap, bias, ALiBi, and -inf where hidden (only
    // checked when `masked`). `dtanh` receives softcap's derivative factor 1 - tanh^2
    // (left alone without softcap).
    __device__ __forceinline__ Acc score_log2(Acc s, int i, int j, Acc scale_log2, bool masked, Acc& dtanh) const {
        Acc x = softcap > Acc(0) ? cap_log2() * capped_tanh(s, tanh_arg(scale_log2), dtanh) : s * scale_log2;
        if (bias != nullptr) x += biased(i, j);
        if (slope_log2 != Acc(0)) x -= alibi(i, j);
        return masked && !mask->visible(i, j, h) ? Acc(-INFINITY) : x;
    }

    // score_log2 over mma C fragments (for_each_score's layout), one pass per term that
    // is on: a uniform branch per term and tile instead of one per score. `dtanh` is
    // written where it has the fragments' shape (the backward keeps it). WITH_BIAS =
    // false leaves the bias term out of the code (a kernel that serves no bias).
    template <bool KEY_ROWS, bool WITH_BIAS = true, int MT, int NT, int MT2, int NT2>
    __device__ __forceinline__ void scores_log2(Acc (&s)[MT][NT][4], Acc (&dtanh)[MT2][NT2][4], int r0, int c0,
                                                Acc scale_log2, bool masked) const {
        constexpr bool KEEP_DTANH = MT2 == MT && NT2 == NT;
        if (softcap > Acc(0)) {
            const Acc to_tanh = tanh_arg(scale_log2), cap = cap_log2();
            for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int, int, int mt, int nt, int e) {
                Acc dt;
                x = cap * capped_tanh(x, to_tanh, dt);
                if constexpr (KEEP_DTANH) dtanh[mt][nt][e] = dt;
            });
        } else {
            for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int, int, int, int, int) { x *= scale_log2; });
            if constexpr (KEEP_DTANH)
                for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc&, int, int, int mt, int nt, int e) { dtanh[mt][nt][e] = Acc(1); });
        }
        if (WITH_BIAS && bias != nullptr) add_bias<KEY_ROWS>(s, r0, c0, Acc(LOG2E_D));
        if (slope_log2 != Acc(0)) {
            // Where the thread's fragments have registers to spare (QuerySlots::CACHED, the
            // Hopper forward's one m-tile), the distance i + off - j is its first one,
            // converted once, plus a compile-time offset: int-to-float conversions run at a
            // quarter of the FMA rate. (Elsewhere the one register it takes spills the
            // backward's dQ tile, build check.)
            if constexpr (QuerySlots<KEY_ROWS, MT, NT>::CACHED) {
                const int lane = threadIdx.x % 32, off = mask->off();
                const int first_i = KEY_ROWS ? c0 + 2 * (lane % 4) : r0 + lane / 4;
                const int first_j = KEY_ROWS ? r0 + lane / 4 : c0 + 2 * (lane % 4);
                const Acc first = Acc(first_i + off - first_j);
                for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int, int, int) {
                    x -= slope_log2 * fabs(first + Acc((i - first_i) - (j - first_j)));
                });
            } else {
                for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int, int, int) { x -= alibi(i, j); });
            }
        }
        if (masked) mask->template apply<KEY_ROWS>(s, r0, c0, h);
    }

    // The forward's form of scores_log2, for OnlineSoftmax::fold: s (raw products, C
    // fragments, rows from r0, keys from c0) becomes y with score_log2 = fs y + shift[mt][h]
    // for the returned fold scale fs and a shift per thread and fragment row, so that the
    // scale and the terms that do not vary along a row ride in the fold's exp2 FFMA rather
    // than in passes of their own:
    //   - softcap: y = tanh(scale s / softcap), fs = softcap log2 e (no multiply after it);
    //   - ALiBi where the warp's tile lies on one side of the diagonal (every tile the
    //     causal mask leaves whole): -slope |i + off - j| = sign slope (j - i - off), the
    //     key's part an FMA with its column in the tile (an immediate) and the rest in
    //     shift; on tiles across the diagonal, per score;
    //   - the bias: add_bias(weight) adds bias times `weight` to s where there is one
    //     (a kernel that brings its own bias tiles adds them; else HeadMods::add_bias);
    //   - the mask (-inf) where `masked`.
    // Without softcap fs = scale_log2, unless that is so small (scale = 0) that slope / fs
    // would overflow: then y is scaled here and fs = 1.
    template <int MT, int NT, typename AddBias>
    __device__ __forceinline__ Acc fold_terms(Acc (&s)[MT][NT][4], Acc (&shift)[MT][2], int r0, int c0,
                                              Acc scale_log2, bool masked, AddBias&& add_bias) const {
        Acc fs = scale_log2;
        if (softcap > Acc(0)) {
            const Acc to_tanh = tanh_arg(scale_log2);
            for_each_score<false>(s, r0, c0, [&](Acc& x, int, int, int, int, int) { x = tanh_acc<T>(x * to_tanh); });
            fs = cap_log2();
        } else if (slope_log2 != Acc(0) && scale_log2 < Acc(0x1p-60)) {
            for_each_score<false>(s, r0, c0, [&](Acc& x, int, int, int, int, int) { x *= scale_log2; });
            fs = Acc(1);
        }
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) shift[mt][0] = shift[mt][1] = Acc(0);
        if (bias != nullptr) add_bias(Acc(LOG2E_D) / fs);
        if (slope_log2 != Acc(0)) {
            const Acc per_key = slope_log2 / fs;
            const int off = mask->off();
            const int d_min = r0 + off - (c0 + 8 * NT - 1), d_max = r0 + 16 * MT - 1 + off - c0;
            if (d_min >= 0 || d_max <= 0) {
                const Acc sign = d_min >= 0 ? Acc(1) : Acc(-1), key_step = sign * per_key;
                const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
                for_each_score<false>(s, r0, c0, [&](Acc& x, int, int, int, int nt, int e) {
                    if (nt != 0 || e % 2 != 0) x = fma(Acc(8 * nt + e % 2), key_step, x);   // an immediate once unrolled
                });
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h)
                        shift[mt][h] = sign * slope_log2 * Acc(c0 + 2 * t4 - (r0 + 16 * mt + g + 8 * h) - off);
            } else {
                for_each_score<false>(s, r0, c0, [&](Acc& x, int i, int j, int, int, int) {
                    x = fma(-per_key, fabs(Acc(i + off - j)), x);
                });
            }
        }
        if (masked) mask->apply(s, r0, c0, h);
        return fs;
    }
    // s += weight * bias over C fragments (for_each_score's layout). One row pointer per
    // query the thread holds where they fit (null past the sequence: a tile's padding has
    // no bias), so that a score costs a load and an FMA.
    template <bool KEY_ROWS, int MT, int NT>
    __device__ __forceinline__ void add_bias(Acc (&s)[MT][NT][4], int r0, int c0, Acc weight) const {
        typedef QuerySlots<KEY_ROWS, MT, NT> Slots;
        if constexpr (Slots::CACHED) {
            const T* rows[Slots::COUNT];
            #pragma unroll
            for (int q = 0; q < Slots::COUNT; ++q) {
                const int i = Slots::query(q, r0, c0);
                rows[q] = i < mask->nq ? bias + i * bias_sq : nullptr;
            }
            const int nk = mask->nk;
            for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int, int j, int mt, int nt, int e) {
                const T* row = rows[Slots::of(mt, nt, e)];
                if (row != nullptr && j < nk) x = fma(to_acc(row[j * bias_sk]), weight, x);
            });
        } else {
            for_each_score<KEY_ROWS>(s, r0, c0, [&](Acc& x, int i, int j, int, int, int) {
                x += i < mask->nq && j < mask->nk ? to_acc(bias[i * bias_sq + j * bias_sk]) * weight : Acc(0);
            });
        }
    }

    // Rows and keys past the sequence (a tile's padding) read no bias: it has none there.
    __device__ __forceinline__ Acc biased(int i, int j) const {
        return i < mask->nq && j < mask->nk ? to_acc(bias[i * bias_sq + j * bias_sk]) * Acc(LOG2E_D) : Acc(0);
    }
    __device__ __forceinline__ Acc alibi(int i, int j) const {
        const int dist = i + mask->off() - j;
        return slope_log2 * Acc(dist < 0 ? -dist : dist);
    }
};

template <typename T, typename Acc, int MODE>
struct Mods {
    static constexpr bool EXT = !lean_mode(MODE);
    static constexpr bool BAND = EXT || (MODE & MODE_BAND) != 0;   // the mask's band (mask.cuh)
    static constexpr bool ALIBI = EXT || (MODE & MODE_ALIBI) != 0;   // the ALiBi slopes
    static constexpr bool SOFTCAP = EXT || (MODE & MODE_SOFTCAP) != 0;
    static constexpr bool DROPOUT = EXT || (MODE & MODE_DROPOUT) != 0;
    // Where this batch entry's rows live in the (B, H, N, d) arrays: batch index `tb`
    // and first row; under varlen the arrays are (1, H, total, d) and a sequence starts
    // at cu_seqlens.
    int tb;
    i64 q_base, k_base;
    MaskInfo<EXT, BAND> mask;
    // Score modifiers, this batch entry's slices; the query head h is an argument (the
    // backward's key-block CTAs walk every query head of a GQA group).
    const T* bias;
    i64 bias_sh, bias_sq, bias_sk;
    const Acc* alibi;    // this batch entry's slopes, one per query head; null: off
    Acc softcap;         // 0: off
    // Dropout: keep (row, key) iff its Philox draw >= threshold; scale drop_scale.
    u64 seed, stream0;   // stream0: the stream of head 0 of this batch entry
    u32 threshold;
    Acc drop_scale;
    // The Philox counters of the call's row 0 and key 0 in its problem (params.cuh
    // ModsParams row0, key0; philox.cuh dropout_counter_base): a chunk pair of a streamed
    // call draws the whole call's bits. Folded into the counters rather than added to the
    // indices: the indices keep their known low bits (tile origins are multiples of the
    // tiles), which the per-score draws' arithmetic relies on to stay cheap.
    uint2 drop_base;

    __device__ __forceinline__ static Mods make(const AttnParams& p, int b, int heads) {
        Mods m;
        m.set_bounds(p, b);
        m.set_terms(p, b, heads);
        return m;
    }
    // The state of batch entry b in two parts, each written field by field where it
    // lives (a whole Mods built in registers and then copied to shared memory holds ~40
    // registers at once): where its rows are and which keys they see (all that a loader
    // needs), then the score terms and dropout.
    __device__ __forceinline__ void set_bounds(const AttnParams& p, int b) {
        tb = b;
        q_base = k_base = 0;
        mask.nq = p.nq;
        mask.nk = p.nk;
        mask.causal = p.causal;
        [[maybe_unused]] const ModsParams& o = p.mods;
        if constexpr (BAND) {
            mask.diagonal = o.diag + o.row0 - o.key0;   // the problem's diagonal, in this call's keys
            if (o.cu_q != nullptr) {
                tb = 0;
                q_base = o.cu_q[b];
                k_base = o.cu_k[b];
                mask.nq = o.cu_q[b + 1] - o.cu_q[b];
                mask.nk = o.cu_k[b + 1] - o.cu_k[b];
                mask.diagonal = mask.nk - mask.nq;   // each sequence at its own corner
            }
            mask.key_stop = o.seqlens_k != nullptr ? min(o.seqlens_k[b], mask.nk) : mask.nk;
            mask.left = o.win_left;
            mask.right = o.win_right;
            mask.blocks = o.bmask != nullptr ? o.bmask + b * o.bmask_sb : nullptr;
            mask.blocks_head = o.bmask_sh;
            mask.blocks_row = o.bmask_sq;
            mask.block_q = o.block_q;
            mask.block_k = o.block_k;
        }
    }
    __device__ __forceinline__ void set_terms(const AttnParams& p, int b, int heads) {
        [[maybe_unused]] const ModsParams& o = p.mods;
        if constexpr (ALIBI) alibi = o.alibi != nullptr ? static_cast<const Acc*>(o.alibi) + b * o.alibi_sb : nullptr;
        if constexpr (EXT) {
            bias = o.bias != nullptr ? static_cast<const T*>(o.bias) + b * o.bias_sb : nullptr;
            bias_sh = o.bias_sh;
            bias_sq = o.bias_sq;
            bias_sk = o.bias_sk;
        }
        if constexpr (SOFTCAP) softcap = Acc(o.softcap);
        if constexpr (DROPOUT) {
            seed = o.rng_seed;
            stream0 = dropout_stream(o.rng_offset, b, 0, heads);
            threshold = o.drop_threshold;
            drop_scale = Acc(o.drop_scale);
            drop_base = dropout_counter_base(o.row0, o.key0);
        }
    }

    __device__ __forceinline__ bool dropout() const { return DROPOUT && threshold != 0; }

    // The per-score state of head h, for the scores of one tile (below).
    __device__ __forceinline__ HeadMods<T, Acc, EXT> at_head(int h) const {
        HeadMods<T, Acc, EXT> m;
        if constexpr (EXT) {
            m.mask = &mask;
            m.h = h;
        }
        m.set_softcap(SOFTCAP ? softcap : Acc(0));
        if constexpr (EXT) {
            m.bias = bias != nullptr ? bias + h * bias_sh : nullptr;
            m.bias_sq = bias_sq;
            m.bias_sk = bias_sk;
        }
        m.slope_log2 = ALIBI && alibi != nullptr ? alibi[h] * Acc(LOG2E_D) : Acc(0);
        if constexpr (DROPOUT) {
            m.seed = seed;
            m.stream = stream0 + h;
        }
        m.threshold = DROPOUT ? threshold : 0u;
        if constexpr (DROPOUT) m.drop_base = drop_base;
        return m;
    }
};

