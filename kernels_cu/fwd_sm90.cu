// Forward attention on Hopper (sm_90a, fp16/bf16): warp-specialised, the tiles moved by
// the tensor memory accelerator, the products on warpgroup MMA.
//
// A CTA owns BLOCK_M = 64 CONSUMERS query rows of one (batch, head) and has
// CONSUMERS + 1 warpgroups:
//   consumers (warpgroups 0 .. CONSUMERS-1, 64 query rows each): for every key tile,
//       S = Q K^T (both operands by descriptor from shared memory), the mask and the
//       online softmax in registers, O += P V (P from registers, V read N-major);
//   producer (the last warpgroup; one thread works): loads Q once and streams the K and
//       V tiles through STAGES shared-memory stages with TMA copies, each stage guarded by
//       a "full" mbarrier (the copy has landed) and an "empty" one (every consumer warp
//       has finished reading it).
// The consumers never wait for each other inside the main loop (no CTA barrier per key
// tile) and issue no loads; the producer runs ahead by up to STAGES tiles. setmaxnreg
// moves registers from the producer to the consumers.
// Inside a consumer warpgroup S of the next key tile and P V of this one are issued back
// to back, and the softmax of the next tile runs while P V accumulates.
// Each warp holds one 16-row m-tile of S and O in the mma.sync fragment layout
// (wgmma.cuh), so masks, the options and the softmax are fwd_sm80's with MT = 1.
//
// MODE_EXT serves every option (mods.cuh) in the same pipeline, as policies:
//   - mask-only options (causal, window, seqlens_k, varlen, block mask) decide which key
//     tiles are visited: the producer walks them (MaskInfo's range, the block mask's
//     next_key_tile) and hands each stage's tile to the consumers with a flag for the
//     tiles that are not wholly visible, which alone run the element mask;
//   - score terms (softcap, ALiBi) run in registers between S and the softmax; without
//     one the scale stays folded into the exp2, as in dense mode;
//   - the bias, in the MODE_EXT | MODE_BIAS instantiations only (it needs registers the
//     128-key tiles spend on S and P at d = 128), is loaded while S is on the tensor
//     cores, with the heads of a query block side by side in the grid;
//   - dropout zeroes P after the row sums took it; its keep bits (16 scores per Philox
//     call) are drawn while S is on the tensor cores.
// Varlen reads (1, H, total, d) tensors at the sequence's row offset: rows past a
// sequence's end belong to the next one (or are zero-filled past the tensor) and are
// masked or never stored. Tensors TMA cannot describe (rows not 16-byte aligned) run in
// fwd_sm80.cu.
#include "elem.cuh"
#include "copy.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "tensor.cuh"
#include "tma.cuh"
#include "warp_mm.cuh"
#include "wgmma.cuh"

// Barriers of the pipeline, after the tiles in shared memory, and the schedule: with
// the options the producer alone walks the key tiles (the mask's range, the block mask)
// and writes each stage's tile before its "full" arrival (release; the consumers' wait
// acquires): 2 tile + 1 where it needs the element mask, END after the last. The word
// is written and read with atomics: the barriers order them, and compute-sanitizer's
// racecheck, which does not follow mbarrier ordering, then sees no plain write racing
// the plain reads of a stage's previous round.
template <int STAGES>
struct Sm90FwdBarriers {
    static constexpr int END = -1;
    u64 q_full;
    u64 k_full[STAGES], v_full[STAGES];
    u64 k_empty[STAGES], v_empty[STAGES];
    int tile[STAGES];
};

template <typename T, int D, int BLOCK_N, int CONSUMERS, int STAGES>
struct Sm90FwdTile {
    // Named barrier of the consumers alone (0 is __syncthreads').
    static constexpr int EPILOGUE_BARRIER = 1;
    static constexpr int CONSUMER_THREADS = CONSUMERS * 128;
    static constexpr int THREADS = CONSUMER_THREADS + 128;   // + the producer warpgroup
    static constexpr int BLOCK_M = CONSUMERS * 64;
    static constexpr int NT = BLOCK_N / 8;          // n-tiles of S per warp
    static constexpr int DT = D / 8;                // n-tiles of O per warp
    static constexpr int KSTEPS = D / 16;           // k-steps of Q K^T
    static constexpr int PSTEPS = BLOCK_N / 16;     // k-steps of P V
    static constexpr int Q_ELEMS = BLOCK_M * D, KV_ELEMS = BLOCK_N * D;
    static constexpr int PANEL = 64;                // columns per TMA box (128 bytes, the swizzle span)
    static constexpr u32 Q_BYTES = Q_ELEMS * sizeof(T), KV_BYTES = KV_ELEMS * sizeof(T);
    // Shared memory (cupyflash/_cuda.py mirrors it): Q, K x STAGES, V x STAGES, each
    // 1024-byte aligned; then the mbarriers. The epilogue stages O over Q and K with
    // padded rows.
    static constexpr int ALIGN = 1024;
    static constexpr int TILE_BYTES = (Q_ELEMS + 2 * STAGES * KV_ELEMS) * sizeof(T);
    // The dynamic shared memory the host must give: the tiles, the slack to align them,
    // the barriers.
    static constexpr int SMEM_BYTES = TILE_BYTES + ALIGN + sizeof(Sm90FwdBarriers<STAGES>);
    // Register budgets after setmaxnreg: the producer keeps 24 a thread; the consumers
    // share the rest of the 64K register file (a multiple of 8, at most 240).
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS_FREE = (65536 - 128 * PRODUCER_REGS) / CONSUMER_THREADS / 8 * 8;
    static constexpr int CONSUMER_REGS = CONSUMER_REGS_FREE < 240 ? CONSUMER_REGS_FREE : 240;
    static_assert(D % PANEL == 0 && BLOCK_N % 64 == 0 && BLOCK_N <= 256 && D <= 256 && BLOCK_M <= 256,
                  "tile shape (TMA boxes take at most 256 rows)");
    static_assert(Q_ELEMS + 2 * STAGES * KV_ELEMS >= BLOCK_M * SmemTile<T, D>::stride, "epilogue staging");
};

template <typename T, int D, int BLOCK_N, int CONSUMERS, int STAGES, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(Sm90FwdTile<T, D, BLOCK_N, CONSUMERS, STAGES>::THREADS, 1)
flash_fwd_sm90(const __grid_constant__ AttnParams p)
{
    typedef Sm90FwdTile<T, D, BLOCK_N, CONSUMERS, STAGES> C;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_cuda.py)");
    constexpr int BLOCK_M = C::BLOCK_M, NT = C::NT, DT = C::DT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw + (C::ALIGN - smem_addr(smem_raw) % C::ALIGN) % C::ALIGN);
    T* sK = sQ + C::Q_ELEMS;                  // STAGES buffers
    T* sV = sK + STAGES * C::KV_ELEMS;        // STAGES buffers
    auto& bars = *reinterpret_cast<Sm90FwdBarriers<STAGES>*>(reinterpret_cast<unsigned char*>(sQ) + C::TILE_BYTES);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Heavy (late, causal) query blocks first so the tail of the grid is short.
    // With a bias the grid is (heads, query blocks, batch): the heads of one query block
    // run together and read the same bias rows (a bias broadcast over heads is read from
    // HBM once, not once per head). Otherwise (query blocks, heads, batch).
    constexpr bool HEADS_FIRST = (MODE & MODE_BIAS) != 0;
    const int heads = HEADS_FIRST ? gridDim.x : gridDim.y;
    const int m_block = HEADS_FIRST ? gridDim.y - 1 - blockIdx.y : gridDim.x - 1 - blockIdx.x;
    const int h = HEADS_FIRST ? blockIdx.x : blockIdx.y, b = blockIdx.z, hk = h / p.group;
    MODS_SETUP_IN(T, float, MODE, p, b, heads, true);
    const auto& mask = mods.mask;
    const int q0 = m_block * BLOCK_M;
    const int q_rows = min(BLOCK_M, mask.nq - q0);
    if (q_rows <= 0) return;   // varlen: the grid covers the longest sequence
    const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
    // The key tiles visited, in order: every tile of the range, less those the block
    // mask leaves out (the dense path visits the whole range).
    auto next_tile = [&](int j) { return mask.next_key_tile(j, tiles.y, q0, q0 + q_rows, BLOCK_N, h); };

    if (threadIdx.x == 0) {
        mbar_init(&bars.q_full, 1);
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&bars.k_full[s], 1);
            mbar_init(&bars.v_full[s], 1);
            mbar_init(&bars.k_empty[s], CONSUMERS * 4);
            mbar_init(&bars.v_empty[s], CONSUMERS * 4);
        }
        mbar_init_fence();
    }
    __syncthreads();

    // ------------------------------------------------------------------ producer
    if (warp >= CONSUMERS * 4) {
        warpgroup_release_regs<C::PRODUCER_REGS>();
        if (threadIdx.x == C::CONSUMER_THREADS) {
            // Rows in the tensor maps' coordinates: under varlen the sequence's offset.
            auto load_panels = [&](T* dst, const TmaMap& map, u64* bar, int rows, i64 row0, int head) {
                #pragma unroll
                for (int panel = 0; panel < D / C::PANEL; ++panel)
                    tma_load_4d(dst + panel * rows * C::PANEL, map, bar, panel * C::PANEL, int(row0), head, mods.tb);
            };
            mbar_arrive_expect_tx(&bars.q_full, C::Q_BYTES);
            load_panels(sQ, p.q_map, &bars.q_full, BLOCK_M, mods.q_base + q0, h);
            for (int j = next_tile(tiles.x), t = 0;; j = next_tile(j + 1), ++t) {
                const int s = t % STAGES;
                const u32 parity = ((t / STAGES) & 1) ^ 1;   // the consumers' release of the round before
                const i64 row0 = mods.k_base + (i64)j * BLOCK_N;
                if (MODE == MODE_DENSE && j >= tiles.y) break;
                mbar_wait(&bars.k_empty[s], parity);
                if constexpr (MODE != MODE_DENSE) {
                    if (j >= tiles.y) {   // the end mark: a plain arrival completes the phase
                        atomicExch(&bars.tile[s], bars.END);
                        mbar_arrive(&bars.k_full[s]);
                        break;
                    }
                    atomicExch(&bars.tile[s], 2 * j + mask.tile_needs_mask(q0, q0 + q_rows, j * BLOCK_N,
                                                                           (j + 1) * BLOCK_N, h));
                }
                mbar_arrive_expect_tx(&bars.k_full[s], C::KV_BYTES);
                load_panels(sK + s * C::KV_ELEMS, p.k_map, &bars.k_full[s], BLOCK_N, row0, hk);
                mbar_wait(&bars.v_empty[s], parity);
                mbar_arrive_expect_tx(&bars.v_full[s], C::KV_BYTES);
                load_panels(sV + s * C::KV_ELEMS, p.v_map, &bars.v_full[s], BLOCK_N, row0, hk);
            }
        }
        return;
    }

    // ------------------------------------------------------------------ consumers
    warpgroup_claim_regs<C::CONSUMER_REGS>();
    const int g = lane / 4, t4 = lane % 4;
    const int wg_row0 = (warp / 4) * 64;   // this warpgroup's rows of the query tile
    const int warp_row0 = warp * 16;       // this warp's m-tile
    // Stage and phase of the t-th key tile visited.
    auto wait_full = [&](u64* full, int t) { mbar_wait(&full[t % STAGES], (t / STAGES) & 1); };
    auto release = [&](u64* empty, int t) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[t % STAGES]);
    };

    float acc[1][DT][4];
    zero_frags(acc);
    OnlineSoftmax<1> softmax;
    softmax.init();
    float s[1][NT][4];
    u32 p_frag[C::PSTEPS][4];   // P of the tile whose P V is next, as A fragments
    float alpha[1][2];

    // S = Q K^T of the key tile in stage `st` (this warpgroup's 64 rows), one batch.
    auto issue_s = [&](int st) {
        const T* sKb = sK + st * C::KV_ELEMS;
        wgmma_fence();
        Wgmma<T, BLOCK_N>::template ss<false>(s[0], kmajor_desc<T, BLOCK_M>(sQ, wg_row0, 0), kmajor_desc<T, BLOCK_N>(sKb, 0, 0));
        #pragma unroll
        for (int ks = 1; ks < C::KSTEPS; ++ks)
            Wgmma<T, BLOCK_N>::template ss<true>(s[0], kmajor_desc<T, BLOCK_M>(sQ, wg_row0, ks), kmajor_desc<T, BLOCK_N>(sKb, 0, ks));
        wgmma_commit();
    };
    // O += P V of the tile in stage `st`, one batch.
    auto issue_pv = [&](int st) {
        wgmma_fence();
        #pragma unroll
        for (int ks = 0; ks < C::PSTEPS; ++ks)
            Wgmma<T, D>::template rs<true>(acc[0], p_frag[ks], mnmajor_desc<T, BLOCK_N>(sV + st * C::KV_ELEMS, ks));
        wgmma_commit();
    };
    const float scale_log2 = float(p.scale_log2);
    // The options' per-score state of this head (nothing in dense mode).
    const auto head_mods = mods.at_head(h);
    // Dropout's keep bits of key tile jt's scores (bit 4 nt + e), drawn while its S is
    // being computed (they depend on indices alone), and their use on P.
    auto keep_bits = [&](int jt) {
        if constexpr (MODE != MODE_DENSE)
            if (head_mods.dropout())
                return dropout_keep_bits<NT>(head_mods.seed, head_mods.stream, q0 + warp_row0, jt * BLOCK_N,
                                             head_mods.threshold);
        return ~0ull;
    };
    auto drop = [&](u64 keep) {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!((keep >> (4 * nt + e)) & 1)) s[0][nt][e] = 0.f;
    };
    // The bias of key tile jt's scores (MODE_BIAS), loaded while its S is being computed:
    // pairs of neighbouring keys as one 32-bit load where the rows allow (keys contiguous,
    // rows 4-byte aligned), zeros past the sequence. Added after the other score terms
    // (scores_log2 leaves it out): the sum is the same, the loads are off the critical path.
    typedef u32 BiasPairs[NT][2];
    auto load_bias = [&](int jt, BiasPairs& pairs) {
        if constexpr ((MODE & MODE_BIAS) != 0) {
            const int k0 = jt * BLOCK_N + 2 * t4;
            const bool wide = head_mods.bias_sk == 1 && head_mods.bias_sq % 2 == 0 &&
                              reinterpret_cast<u64>(head_mods.bias) % 4 == 0;
            #pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = q0 + warp_row0 + g + 8 * half;
                const T* row = head_mods.bias + (i64)min(i, mask.nq - 1) * head_mods.bias_sq;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int j = k0 + nt * 8;
                    u32 v = 0;
                    if (i < mask.nq && j + 1 < mask.nk && wide) {
                        v = *reinterpret_cast<const u32*>(row + j);
                    } else if (i < mask.nq && j < mask.nk) {
                        v = row[j * head_mods.bias_sk].bits;
                        if (j + 1 < mask.nk) v |= u32(row[(j + 1) * head_mods.bias_sk].bits) << 16;
                    }
                    pairs[nt][half] = v;
                }
            }
        }
    };
    auto add_bias = [&](const BiasPairs& pairs) {
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                T x;
                x.bits = u16(pairs[nt][e / 2] >> (16 * (e % 2)));
                s[0][nt][e] += to_acc(x) * float(LOG2E_D);
            }
    };
    // The mask and the score terms on the scores of key tile jt (masked: not wholly
    // visible), folded into the softmax state: s becomes P (dropped where `keep` says:
    // the row sums took it first, so the LSE is that of the undropped softmax). Returns
    // whether acc must be rescaled by alpha before this tile's P V is added. Without a
    // score term the scale stays folded into the softmax's exp2, as in dense mode.
    auto softmax_tile = [&](int jt, bool masked, u64 keep, const BiasPairs& bias) {
        const int k0 = jt * BLOCK_N;
        const int r0 = q0 + warp_row0;
        bool grew;
        if constexpr (MODE != MODE_DENSE) {
            if (head_mods.score_terms()) {
                float no_dtanh[1][1][4];
                head_mods.template scores_log2<false, false>(s, no_dtanh, r0, k0, scale_log2, masked);
                if constexpr ((MODE & MODE_BIAS) != 0) add_bias(bias);
                grew = softmax.fold(s, 1.f, alpha);
            } else {
                if (masked) mask.apply(s, r0, k0, h);
                grew = softmax.fold(s, scale_log2, alpha);
            }
            if (head_mods.dropout()) drop(keep);
        } else {
            if (masked) mask.apply(s, r0, k0, h);
            grew = softmax.fold(s, scale_log2, alpha);
        }
        return grew;
    };
    // P into A fragments; p_frag must not change while a P V that reads it is in flight.
    auto round_p = [&]() {
        #pragma unroll
        for (int ks = 0; ks < C::PSTEPS; ++ks) c_to_a_frag<T>(p_frag[ks], s, 0, ks);
    };

    // Pipeline over the visited key tiles (the t-th in stage t % STAGES): before the loop,
    // S and P of the first tile; while there is a next tile, an iteration issues S of the
    // next tile and P V of this one back to back, and runs the softmax of the next tile
    // while the tensor cores still accumulate P V; acc is rescaled only once that product
    // has landed. The last P V follows the loop. A stage goes back to the producer as soon
    // as the product that reads it has landed. (The issue order is unconditional inside
    // the loop: a wgmma batch issued on one path only would leave register copies between
    // the wgmmas and their wait.)
    mbar_wait(&bars.q_full, 0);   // also when no key is visible: no copy may outlive the CTA
    // The t-th visited tile: its index and whether it needs the element mask. The dense
    // path visits the range in order (one induction variable: a second costs the d = 64
    // tile a spill); with the options the producer's schedule says (END: no more).
    // Dense: the tiles from the one holding the block's first hidden key on need the
    // mask (tile_needs_mask's test, worked out once: no shared-memory reads per tile).
    const int dense_masked_from = mask.key_hi(q0) / BLOCK_N;
    auto visited = [&](int t, int& jt, bool& masked) {
        if constexpr (MODE == MODE_DENSE) {
            jt = tiles.x + t;
            masked = jt >= dense_masked_from;
            return jt < tiles.y;
        } else {
            wait_full(bars.k_full, t);
            int code = 0;
            if (lane == 0) code = atomicAdd(&bars.tile[t % STAGES], 0);
            code = __shfl_sync(0xffffffffu, code, 0);
            jt = code >> 1;
            masked = code & 1;
            return code != bars.END;
        }
    };
    int t = 0, jt;
    bool masked;
    if (visited(0, jt, masked)) {
        wait_full(bars.k_full, 0);
        issue_s(0);
        const u64 keep = keep_bits(jt);
        BiasPairs bias;
        load_bias(jt, bias);
        wgmma_wait<0>();
        reg_fence(s[0]);
        release(bars.k_empty, 0);
        softmax_tile(jt, masked, keep, bias);   // acc is still 0: nothing to rescale
        round_p();
        for (; visited(t + 1, jt, masked); ++t) {
            wait_full(bars.k_full, t + 1);
            wait_full(bars.v_full, t);
            issue_s((t + 1) % STAGES);
            issue_pv(t % STAGES);
            const u64 keep = keep_bits(jt);
            BiasPairs bias;
            load_bias(jt, bias);
            wgmma_wait<1>();   // S of the next tile (P V may still run)
            reg_fence(s[0]);
            release(bars.k_empty, t + 1);
            const bool grew = softmax_tile(jt, masked, keep, bias);
            wgmma_wait<0>();
            reg_fence(acc[0]);
            release(bars.v_empty, t);
            if (grew) softmax.rescale(acc, alpha);
            round_p();
        }
        wait_full(bars.v_full, t);
        issue_pv(t % STAGES);
        wgmma_wait<0>();
        reg_fence(acc[0]);
        release(bars.v_empty, t);
    }

    float row_lse[1][2];
    softmax.finalize(acc, row_lse, mods.dropout() ? mods.drop_scale : 1.f);

    // Epilogue as in fwd_sm80.cu, the output staged with padded rows over Q and K once
    // every consumer warpgroup is past its last product (the producer has nothing in
    // flight: every copy it issued has been waited for).
    named_barrier(C::EPILOGUE_BARRIER, C::CONSUMER_THREADS);
    warp_store_c<T, D>(sQ, warp_row0, acc, 1.f);
    #pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = warp_row0 + g + hh * 8;
        if (t4 == 0 && r < q_rows)
            static_cast<float*>(p.lse)[((i64)mods.tb * heads + h) * p.nq + mods.q_base + q0 + r] = row_lse[0][hh];
    }
    named_barrier(C::EPILOGUE_BARRIER, C::CONSUMER_THREADS);
    const Strided<T> O = tensor<T>(p.o);
    store_tile<T, BLOCK_M, D, C::CONSUMER_THREADS>(O.at(mods.tb, h, mods.q_base + q0), O.row, sQ, q_rows, p.dim_v, p.vec);
}
