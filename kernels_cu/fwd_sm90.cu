// Forward attention on Hopper (sm_90a, fp16/bf16): warp-specialised, the tiles moved by
// the tensor memory accelerator, the products on warpgroup MMA.
//
// A work tile is BLOCK_M = 64 CONSUMERS query rows of one (batch, head). A CTA takes
// work tiles one after another (persistent: one CTA per SM, the next tile's number from a
// counter; or one CTA per tile, params.cuh) and has CONSUMERS + 1 warpgroups:
//   consumers (warpgroups 0 .. CONSUMERS-1, 64 query rows each): for every key tile,
//       S = Q K^T (both operands by descriptor from shared memory), the mask and the
//       online softmax in registers, O += P V (P from registers, V read N-major); O and
//       the LSE go to global memory straight from the registers;
//   producer (the last warpgroup; one warp works): loads each work tile's Q and
//       streams the K and V tiles through STAGES shared-memory stages with TMA copies,
//       each stage guarded by a "full" mbarrier (the copy has landed) and an "empty" one
//       (every consumer warp has finished reading it). Q's buffer has the same pair: the
//       consumers give it back once the tile's last S has landed, so the next tile's Q
//       and first K/V tiles load while they finish the last P V and store O.
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
//     tiles are visited: the producer walks them (MaskInfo's range less the block mask's
//     empty blocks, from the diagonal down) and hands each stage's tile to the consumers
//     with a flag for the tiles that are not wholly visible, which alone run the element
//     mask;
//   - score terms (softcap, ALiBi) run in registers between S and the softmax, in the
//     softmax's units (HeadMods::fold_terms): the scale stays folded into the exp2, as in
//     dense mode, and ALiBi costs one FMA a score off the diagonal;
//   - the bias, in the MODE_EXT | MODE_BIAS instantiations only, streams through the
//     stages beside K and V by TMA where it has whole rows (else each thread loads its
//     scores' bias), with the heads of a query block side by side in the work order;
//   - dropout zeroes P after the row sums took it; its keep bits (16 scores per Philox
//     call) are drawn while S is on the tensor cores.
// fp32 (T = float) runs on TF32 wgmma at fp32 accuracy (3xTF32, elem.cuh tf32_low): a
// product of fp32 operands is a_lo b + a b_lo + a b, a's and b's high parts being the
// fp32 elements themselves, which the tensor cores read truncated to TF32. TF32 wgmma
// reads shared-memory operands K-major only, and a B operand needs its low parts in
// shared memory too, so three more warps of the producer warpgroup (the split warps)
// follow the stages: once K has landed they write its low parts below it in the same
// tile (S's first product is then one wgmma over the keys' high and low rows,
// [S_hh | S_hl] = Q [K; K_lo]^T, and the second adds Q_lo K^T from registers); once V has
// landed they write V^T and its low parts (keys in the order of P's registers, below).
// TF32 accumulates by truncation, so P V of each key tile is summed from zero on the
// tensor cores and added to O in the FPU, where rounding is to nearest (the same reason
// as mma_wide.cuh's slices). The consumers issue S, then P V, of each key tile in turn:
// the registers do not hold both tiles' products at once beside these sums.
// precision="tf32" (MODE_TF32) keeps one product each, S = Q K^T and O += P V, O
// accumulated on the tensor cores in the 16-bit inputs' pipeline. Q, P and V^T are
// rounded to TF32 to nearest (the consumers round their rows of Q in place and P in
// registers, the split warps V^T as they write it); K is read as it landed, truncated
// to TF32 by the tensor cores. Rounding K in place kept the consumers waiting for the
// split warps (a third of their stall samples, ncu, session 24); without it the
// forward ran 1.28-1.53x (H200, session 25), and truncation costs ~1.5x the error of
// rounding (6.5e-4 against 4.1e-4 relative, float64 simulation at d = 128), within
// the documented tolerance (tests/TOLERANCES.md).
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
// acquires): 4 tile, + 2 on the work tile's last, + 1 where it needs the element mask.
// Beside Q's "full" arrival it writes the work word: 2 w, + 1 when the work tile visits
// no key tile, or END when no work is left. The words are written and read with atomics:
// the barriers order them, and compute-sanitizer's racecheck, which does not follow
// mbarrier ordering, then sees no plain write racing the plain reads of a stage's
// previous round.
// fp32: the split warps' arrivals (k_split, v_split) follow k_full and v_full, and the
// consumers wait for them instead; v_full and v_landing_free guard V's landing buffers
// (Sm90FwdTile::LANDINGS), the latter completed by the split warps once they have read
// one. The producer writes the schedule word in every mode, and END there once no work is
// left, which stops the split warps.
template <int STAGES>
struct Sm90FwdBarriers {
    static constexpr int END = -1;
    u64 q_full, q_empty;
    u64 k_full[STAGES], v_full[STAGES];
    u64 k_empty[STAGES], v_empty[STAGES];
    u64 bias_full[STAGES], bias_empty[STAGES];   // MODE_BIAS with the bias by TMA
    u64 k_split[STAGES], v_split[STAGES];         // fp32: the split warps wrote the low parts
    u64 v_landing_free[STAGES];                   // fp32: ... and read V's landing buffer
    int tile[STAGES];
    int work;   // the work tile whose Q is in flight (END: none left)
};

// Work tiles (query block, head, batch entry) from their number w (params.cuh): the
// late, causally heavy query blocks of a head first, so that the last tiles handed out
// are light; the heads of one query block side by side with HEADS_FIRST (a bias
// broadcast over heads is then read from HBM once for all of them).
struct Sm90Work {
    int m_block, h, b;
    template <bool HEADS_FIRST>
    __device__ __forceinline__ static Sm90Work decode(int w, const AttnParams& p) {
        Sm90Work t;
        if (HEADS_FIRST) {
            t.h = w % p.grid_heads;
            w /= p.grid_heads;
            t.m_block = p.grid_m - 1 - w % p.grid_m;
            t.b = w / p.grid_m;
        } else {
            t.m_block = p.grid_m - 1 - w % p.grid_m;
            w /= p.grid_m;
            t.h = w % p.grid_heads;
            t.b = w / p.grid_heads;
        }
        return t;
    }
};

// A bias pair (keys j and j + 1 of a row) in the N words a consumer keeps it in: one u32
// of two 16-bit halves, or two u32 of fp32 bits. load: the pair from one aligned load;
// set: its element e (0 or 1) into zeroed words; value: the e-th of the 4 scores a thread
// holds of an n-tile, from that n-tile's two pairs (rows g, g + 8), as a float.
template <typename T, int SIZE = sizeof(T)>
struct BiasWords {
    static constexpr int N = 1;
    __device__ static __forceinline__ void load(u32 (&v)[N], const T* pair) {
        v[0] = *reinterpret_cast<const u32*>(pair);
    }
    __device__ static __forceinline__ void set(u32 (&v)[N], int e, T x) { v[0] |= u32(x.bits) << (16 * e); }
    __device__ static __forceinline__ float value(const u32* words, int e) {
        T x;
        x.bits = u16(words[e / 2] >> (16 * (e % 2)));
        return to_acc(x);
    }
};
template <typename T>
struct BiasWords<T, 4> {
    static constexpr int N = 2;
    __device__ static __forceinline__ void load(u32 (&v)[N], const T* pair) {
        const float2 w = *reinterpret_cast<const float2*>(pair);
        v[0] = __float_as_uint(w.x);
        v[1] = __float_as_uint(w.y);
    }
    __device__ static __forceinline__ void set(u32 (&v)[N], int e, T x) { v[e] = __float_as_uint(x); }
    __device__ static __forceinline__ float value(const u32* words, int e) { return __uint_as_float(words[e]); }
};

template <typename T, int D_, int BLOCK_N_, int CONSUMERS, int STAGES_, int MODE>
struct Sm90FwdTile {
    static constexpr int D = D_, BLOCK_N = BLOCK_N_, STAGES = STAGES_;
    // Named barrier of the consumers alone (0 is __syncthreads').
    static constexpr int CONSUMER_BARRIER = 1;
    static constexpr int CONSUMER_THREADS = CONSUMERS * 128;
    static constexpr int THREADS = CONSUMER_THREADS + 128;   // + the producer warpgroup
    static constexpr int BLOCK_M = CONSUMERS * 64;
    static constexpr bool TF32 = sizeof(T) == 4;    // fp32 as 3xTF32 (above)
    static constexpr bool ONE_PRODUCT = TF32 && (MODE & MODE_TF32) != 0;   // precision="tf32"
    static constexpr bool SPLIT = TF32 && !ONE_PRODUCT;                     // low parts beside
    static constexpr int OPTIONS = MODE & ~MODE_TF32;   // the option policies (mods.cuh)
    static constexpr int NT = BLOCK_N / 8;          // n-tiles of S per warp
    static constexpr int DT = D / 8;                // n-tiles of O per warp
    static constexpr int KSTEPS = D / WgmmaK<T>::elems;         // k-steps of Q K^T
    static constexpr int PSTEPS = BLOCK_N / WgmmaK<T>::elems;   // k-steps of P V
    static constexpr int Q_ELEMS = BLOCK_M * D, KV_ELEMS = BLOCK_N * D;
    // A stage's K tile: K, and for fp32 its low parts as BLOCK_N more rows (K_ROWS rows in
    // all, so each panel holds both); its V tile: V as TMA lands it, or for fp32 V^T and
    // V^T's low parts (precision="tf32": V^T), which the split warps write from V's landing
    // buffer. One landing buffer serves every stage (the next V lands once the split warps
    // have read the last): the shared memory it frees bought precision="tf32" at d = 128
    // three consumer warpgroups or 64-key tiles (it fitted 32 keys and two: 1.14-1.25x).
    // A landing buffer a stage measured 0.95-0.99x for 3xTF32, two 0.94-1.02x (H200,
    // session 24: V's copies are not what the consumers wait for; bench/NOTES.md).
    static constexpr int K_ROWS = SPLIT ? 2 * BLOCK_N : BLOCK_N;
    static constexpr int K_TILE_ELEMS = K_ROWS * D, V_TILE_ELEMS = (SPLIT ? 2 : 1) * KV_ELEMS;
    static constexpr int LANDINGS = TF32 ? 1 : 0;
    static constexpr int SPLIT_WARPS = 3;           // fp32: the producer warpgroup's warps 1 .. 3
    // MODE_BIAS: a bias tile per stage (BLOCK_M rows, BLOCK_N / 64 panels of 64 keys);
    // none for fp32, whose bias the consumers load from global memory.
    static constexpr int BIAS_ELEMS = (MODE & MODE_BIAS) != 0 && !TF32 ? BLOCK_M * BLOCK_N : 0;
    static constexpr int PANEL = 128 / sizeof(T);   // columns per TMA box (128 bytes, the swizzle span)
    static constexpr u32 Q_BYTES = Q_ELEMS * sizeof(T), KV_BYTES = KV_ELEMS * sizeof(T);
    static constexpr u32 BIAS_BYTES = BIAS_ELEMS * sizeof(T);
    // Shared memory (cupyflash/_kernels.py mirrors it): Q, K x STAGES, V x STAGES, bias x
    // STAGES (MODE_BIAS), V's landing buffers (fp32), each 1024-byte aligned; then the
    // mbarriers and the schedule.
    static constexpr int ALIGN = 1024;
    static constexpr int TILE_BYTES =
        (Q_ELEMS + STAGES * (K_TILE_ELEMS + V_TILE_ELEMS + BIAS_ELEMS) + LANDINGS * KV_ELEMS) * sizeof(T);
    // The dynamic shared memory the host must give: the tiles, the slack to align them,
    // the barriers.
    static constexpr int SMEM_BYTES = TILE_BYTES + ALIGN + sizeof(Sm90FwdBarriers<STAGES>);
    // Register budgets after setmaxnreg: the producer keeps 24 a thread, 56 where it
    // walks the options' schedule (with less, its block-mask walk spills) or splits fp32
    // tiles, 72 where it does both or rounds them in place (build check); the consumers
    // share the rest of the launch's registers (tma.cuh WarpgroupRegs).
    static constexpr int PRODUCER_REGS = !TF32 ? (OPTIONS == MODE_DENSE ? 24 : 56)
                                               : (OPTIONS == MODE_DENSE && SPLIT ? 56 : 72);
    static constexpr int CONSUMER_REGS = WarpgroupRegs<THREADS, PRODUCER_REGS>::CONSUMER;
    static_assert(D % PANEL == 0 && BLOCK_N % PANEL == 0 && BLOCK_N <= 256 && D <= 256 && BLOCK_M <= 256,
                  "tile shape (TMA boxes take at most 256 rows)");
    static_assert(LANDINGS <= STAGES, "landing buffers share the stages' barrier arrays");

    // Where the t-th key tile's V lands (TMA's layout; `v_tiles`: the stages' V tiles,
    // `landings`: fp32's buffers) and the index and round of its landing barriers.
    __device__ static __forceinline__ int landing(int t) { return TF32 ? t % LANDINGS : t % STAGES; }
    __device__ static __forceinline__ u32 landing_parity(int t) { return (t / (TF32 ? LANDINGS : STAGES)) & 1; }
    template <typename E>
    __device__ static __forceinline__ E* landed_v(E* v_tiles, E* landings, int t) {
        return TF32 ? landings + landing(t) * KV_ELEMS : v_tiles + landing(t) * V_TILE_ELEMS;
    }
};

// The split warps of an fp32 tile (C::TF32): for each stage the producer fills, in the
// producer's order, once K has landed its low parts into the K tile's rows BLOCK_N ..
// (the same swizzle phase: BLOCK_N is a multiple of 8), and once V has landed in its
// landing buffer the stage's V^T and its low parts (rows: head-dim columns; columns:
// keys, each 8-key group's keys in the order 0 2 4 6 1 3 5 7, so that the C fragment of
// S, keys 2t and 2t + 1 of a thread's rows, is P V's A fragment as it is: a0 a1 a2 a3 =
// c0 c2 c1 c3, k-slots t and t + 4). With one product (precision="tf32") they write V^T
// rounded to TF32 only (K is read as it landed). Each write is fenced for the wgmmas
// (async proxy) before the warp's arrival, and the landing buffer goes back to the
// producer beside V^T's arrival. They stop at a schedule word END.
template <typename C, typename Bars, typename ReadWord, typename ReleaseBar>
__device__ __forceinline__ void split_stages(float* sK, float* sV, float* sLanding, Bars& bars, ReadWord&& read_word,
                                             ReleaseBar&& release_bar) {
    constexpr int BLOCK_N = C::BLOCK_N, D = C::D, STAGES = C::STAGES;
    constexpr int SPLIT_THREADS = C::SPLIT_WARPS * 32;
    // Indices are unsigned: with signed ones Swizzle128's divisions took ~10 integer
    // instructions an element, and the split warps, busy 86% of the time, kept the
    // consumers waiting for K (a third of their stall samples; ncu, precision="tf32", d =
    // 128, H200, session 24).
    const unsigned tid = threadIdx.x - C::CONSUMER_THREADS - 32;
    typedef Swizzle128<float, BLOCK_N> VLayout;   // V as TMA lays it out: rows are keys
    typedef Swizzle128<float, D> VtLayout;        // V^T: rows are head-dim columns
    for (int t = 0;; ++t) {
        const int s = t % STAGES;
        const u32 parity = (t / STAGES) & 1;
        mbar_wait(&bars.k_full[s], parity);
        if (read_word(&bars.tile[s]) == Bars::END) return;
        // K's 16-byte chunks, panel by panel: rows 0 .. BLOCK_N - 1 of a K_ROWS-row panel;
        // their low parts BLOCK_N rows below. (precision="tf32" reads K as it landed.)
        if constexpr (C::SPLIT) {
            float* k_tile = sK + s * C::K_TILE_ELEMS;
            constexpr unsigned CHUNKS = BLOCK_N * 8;   // per panel: 8 chunks of 4 floats a row
            #pragma unroll 4
            for (unsigned c = tid; c < (D / 32) * CHUNKS; c += SPLIT_THREADS) {
                float* chunk = k_tile + (c / CHUNKS) * (C::K_ROWS * 32) + (c % CHUNKS) * 4;
                store_shared_16(chunk + BLOCK_N * 32, tf32_low(*reinterpret_cast<const float4*>(chunk)));
            }
            fence_async_smem();
            release_bar(&bars.k_split[s]);
        }

        mbar_wait(&bars.v_full[C::landing(t)], C::landing_parity(t));
        float* v_tile = C::landed_v(sV, sLanding, t);
        float* vt = sV + s * C::V_TILE_ELEMS;
        float* vt_low = vt + C::KV_ELEMS;
        // A thread takes one head-dim column d of an 8-key group: a warp reads 32
        // neighbouring columns of a key row (128 bytes) and writes 16-byte chunks of 8
        // neighbouring V^T rows at distinct swizzle positions, so neither side conflicts.
        #pragma unroll 2
        for (unsigned u = tid; u < (BLOCK_N / 8) * D; u += SPLIT_THREADS) {
            const unsigned d = u % D, key0 = (u / D) * 8;
            float x[8];
            #pragma unroll
            for (unsigned i = 0; i < 8; ++i) x[i] = VLayout::at(v_tile, key0 + i, d & ~3u)[d & 3];
            const float4 even = make_float4(x[0], x[2], x[4], x[6]), odd = make_float4(x[1], x[3], x[5], x[7]);
            if constexpr (C::SPLIT) {
                store_shared_16(VtLayout::at(vt, d, key0), even);
                store_shared_16(VtLayout::at(vt, d, key0 + 4), odd);
                store_shared_16(VtLayout::at(vt_low, d, key0), tf32_low(even));
                store_shared_16(VtLayout::at(vt_low, d, key0 + 4), tf32_low(odd));
            } else {
                store_shared_16(VtLayout::at(vt, d, key0), tf32_round(even));
                store_shared_16(VtLayout::at(vt, d, key0 + 4), tf32_round(odd));
            }
        }
        fence_async_smem();
        release_bar(&bars.v_landing_free[C::landing(t)]);
        release_bar(&bars.v_split[s]);
    }
}

template <typename T, int D, int BLOCK_N, int CONSUMERS, int STAGES, int MODE, int SMEM_BYTES>
__global__ void __launch_bounds__(Sm90FwdTile<T, D, BLOCK_N, CONSUMERS, STAGES, MODE>::THREADS, 1)
flash_fwd_sm90(const __grid_constant__ AttnParams p)
{
    typedef Sm90FwdTile<T, D, BLOCK_N, CONSUMERS, STAGES, MODE> C;
    typedef Mods<T, float, C::OPTIONS> ModsT;
    static_assert(SMEM_BYTES == C::SMEM_BYTES, "the host's shared-memory size (cupyflash/_kernels.py)");
    constexpr int BLOCK_M = C::BLOCK_M, NT = C::NT, DT = C::DT;
    constexpr bool HEADS_FIRST = (MODE & MODE_BIAS) != 0;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw + (C::ALIGN - smem_addr(smem_raw) % C::ALIGN) % C::ALIGN);
    T* sK = sQ + C::Q_ELEMS;                    // STAGES K tiles
    T* sV = sK + STAGES * C::K_TILE_ELEMS;      // STAGES V tiles
    T* sBias = sV + STAGES * C::V_TILE_ELEMS;   // STAGES buffers (MODE_BIAS)
    T* sLanding = sBias + STAGES * C::BIAS_ELEMS;   // LANDINGS buffers (fp32)
    auto& bars = *reinterpret_cast<Sm90FwdBarriers<STAGES>*>(reinterpret_cast<unsigned char*>(sQ) + C::TILE_BYTES);
    // The option state of the current work tile (mods.cuh), one copy for the producer
    // thread and one for the consumers, each written and read by its own side (the
    // producer runs a work tile ahead). In registers it would sit beside S, O and the
    // fragments for the whole main loop and spill.
    __shared__ ModsT producer_mods, consumer_mods;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    auto release_bar = [&](u64* bar) {   // one arrival per warp, once all its lanes are done
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };
    // A shared word the producer wrote before the barrier just waited for.
    auto read_word = [](int* word) { return read_published(word); };
    // MODE_BIAS: the bias tiles come by TMA beside K and V where the bias has whole rows
    // (a tensor map describes it), else each thread loads its scores' bias (bias_tile).
    const bool bias_in_smem = (MODE & MODE_BIAS) != 0 && !C::TF32 && p.mods.bias_tma;
    const int work_tiles = p.grid_m * p.grid_heads * p.grid_batch;
    if (threadIdx.x == 0) {
        mbar_init(&bars.q_full, 1);
        mbar_init(&bars.q_empty, CONSUMERS * 4);
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&bars.k_full[s], 1);
            mbar_init(&bars.v_full[s], 1);
            mbar_init(&bars.k_empty[s], CONSUMERS * 4);
            mbar_init(&bars.v_empty[s], CONSUMERS * 4);
            mbar_init(&bars.bias_full[s], 1);
            mbar_init(&bars.bias_empty[s], CONSUMERS * 4);
            mbar_init(&bars.k_split[s], C::SPLIT_WARPS);
            mbar_init(&bars.v_split[s], C::SPLIT_WARPS);
            mbar_init(&bars.v_landing_free[s], C::SPLIT_WARPS);
        }
        mbar_init_fence();
    }
    __syncthreads();

    // ------------------------------------------------------------------ producer
    // For each work tile: Q (once the consumers have issued the previous tile's last
    // S), then the key tiles through the stages. With a work counter the CTA is
    // persistent and the next work tile's loads overlap this one's last products and
    // its epilogue. The producer warpgroup's first warp runs it: lane 0 issues the copies
    // and the barrier and schedule operations, the 32 lanes walk a block mask together.
    if (warp >= CONSUMERS * 4) {
        warpgroup_release_regs<C::PRODUCER_REGS>();
        if (warp == CONSUMERS * 4) {
            const bool leader = lane == 0;
            const ModsT& mods = producer_mods;
            // Rows in the tensor maps' coordinates: under varlen the sequence's offset. The
            // panels of dst have panel_rows rows (the box's, or an fp32 K tile's K_ROWS).
            auto load_panels = [&](T* dst, const TmaMap& map, u64* bar, int panel_rows, i64 row0, int head) {
                #pragma unroll
                for (int panel = 0; panel < D / C::PANEL; ++panel)
                    tma_load_4d(dst + panel * panel_rows * C::PANEL, map, bar, panel * C::PANEL, int(row0), head, mods.tb);
            };
            auto next_work = [&](int w) {
                if (p.work_counter == nullptr) return w + int(gridDim.x);
                int next = 0;
                if (leader) next = int(gridDim.x) + atomicAdd(p.work_counter, 1);
                return warp_uniform(next);
            };
            int t = 0;   // key tiles loaded so far, over every work tile: stage t % STAGES
            for (int w = blockIdx.x, k = 0;; w = next_work(w), ++k) {
                mbar_wait(&bars.q_empty, (k & 1) ^ 1);
                // The next work tile with query rows (varlen: the grid covers the longest
                // sequence).
                Sm90Work work;
                int q0 = 0, q_rows = 0;
                for (; w < work_tiles; w = next_work(w)) {
                    work = Sm90Work::decode<HEADS_FIRST>(w, p);
                    __syncwarp();   // every lane is past its reads of the previous state
                    if (leader) producer_mods.set_bounds(p, work.b);
                    __syncwarp();
                    q0 = work.m_block * BLOCK_M;
                    q_rows = min(BLOCK_M, mods.mask.nq - q0);
                    if (q_rows > 0) break;
                }
                if (w >= work_tiles) {   // a plain arrival completes the phase
                    if (leader) {
                        atomicExch(&bars.work, bars.END);
                        mbar_arrive(&bars.q_full);
                    }
                    if constexpr (C::TF32) {   // and stops the split warps at the next stage
                        mbar_wait(&bars.k_empty[t % STAGES], ((t / STAGES) & 1) ^ 1);
                        if (leader) {
                            atomicExch(&bars.tile[t % STAGES], bars.END);
                            mbar_arrive(&bars.k_full[t % STAGES]);
                        }
                    }
                    break;
                }
                const int h = work.h, hk = h / p.group;
                const int2 tiles = mods.mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
                // The key tiles visited, in order: every tile of the range, less those the
                // block mask leaves out. The dense path visits the range upwards (its
                // consumers count the tiles themselves); with the options the walk starts
                // at the range's last tile, nearest the diagonal, so that with ALiBi the
                // first tile holds the row's largest scores and the later ones seldom
                // raise the max (each rise rescales the output accumulator). Position
                // k_pos of the walk is tile tile_at(k_pos). `state`: the tile's
                // block_state (2: the block mask covers it partly). A block mask is read
                // 32 positions at a time, one per lane, so that a sparse mask costs one
                // round of loads per 32 tiles rather than one per tile skipped.
                const int walk_length = tiles.y - tiles.x;
                auto tile_at = [&](int k_pos) { return C::OPTIONS == MODE_DENSE ? tiles.x + k_pos : tiles.y - 1 - k_pos; };
                int window = -32;      // first position of the window the lanes have read (none yet)
                int lane_state = 0;    // block_state of the tile at position window + lane
                u32 window_hits = 0;   // the window's tiles the block mask leaves on
                auto next_visited = [&](int k_pos, int& state) {
                    state = 1;
                    if (C::OPTIONS == MODE_DENSE || mods.mask.blocks == nullptr) return k_pos;
                    for (; k_pos < walk_length; k_pos = window + 32) {
                        if (k_pos < window || k_pos >= window + 32) {
                            window = k_pos;
                            const int mine = tile_at(k_pos + lane);
                            lane_state = k_pos + lane < walk_length
                                             ? mods.mask.block_state(q0, q0 + q_rows, mine * BLOCK_N, (mine + 1) * BLOCK_N, h)
                                             : 0;
                            window_hits = __ballot_sync(0xffffffffu, lane_state != 0);
                        }
                        const u32 ahead = window_hits >> (k_pos - window);
                        if (ahead != 0) {
                            const int found = k_pos + __ffs(ahead) - 1;
                            state = __shfl_sync(0xffffffffu, lane_state, found - window);
                            return found;
                        }
                    }
                    return walk_length;
                };
                int state;
                int k_pos = next_visited(0, state);
                if (leader) {
                    // The work word: 2 w, + 1 when no key tile is visited.
                    atomicExch(&bars.work, 2 * w + (k_pos >= walk_length));
                    mbar_arrive_expect_tx(&bars.q_full, C::Q_BYTES);
                    load_panels(sQ, p.q_map, &bars.q_full, BLOCK_M, mods.q_base + q0, h);
                }
                for (; k_pos < walk_length; ++t) {
                    const int s = t % STAGES, j = tile_at(k_pos);
                    const u32 parity = ((t / STAGES) & 1) ^ 1;   // the consumers' release of the round before
                    mbar_wait(&bars.k_empty[s], parity);
                    int next_state;
                    const int next = next_visited(k_pos + 1, next_state);
                    if (leader) {
                        if constexpr (C::OPTIONS != MODE_DENSE) {
                            // The schedule word: 4 j, + 2 on the last tile, + 1 where it needs
                            // the element mask.
                            const bool masked = state == 2 || mods.mask.band_needs_mask(q0, q0 + q_rows, j * BLOCK_N,
                                                                                        (j + 1) * BLOCK_N);
                            atomicExch(&bars.tile[s], 4 * j + 2 * (next >= walk_length) + masked);
                        } else if constexpr (C::TF32) {
                            atomicExch(&bars.tile[s], 4 * j);   // not END: the split warps go on
                        }
                        mbar_arrive_expect_tx(&bars.k_full[s], C::KV_BYTES);
                        load_panels(sK + s * C::K_TILE_ELEMS, p.k_map, &bars.k_full[s], C::K_ROWS,
                                    mods.k_base + (i64)j * BLOCK_N, hk);
                    }
                    if (bias_in_smem) {
                        mbar_wait(&bars.bias_empty[s], parity);
                        if (leader) {
                            // Axes the bias broadcasts over (stride 0) are read at 0.
                            mbar_arrive_expect_tx(&bars.bias_full[s], C::BIAS_BYTES);
                            #pragma unroll
                            for (int panel = 0; panel < BLOCK_N / C::PANEL; ++panel)
                                tma_load_4d(sBias + s * C::BIAS_ELEMS + panel * BLOCK_M * C::PANEL, p.bias_map,
                                            &bars.bias_full[s], j * BLOCK_N + panel * C::PANEL, q0,
                                            p.mods.bias_sh != 0 ? h : 0, p.mods.bias_sb != 0 ? work.b : 0);
                        }
                    }
                    // fp32: V lands apart and the split warps write the stage's V^T from it,
                    // after this wait on the stage (so the consumers are done with it).
                    mbar_wait(&bars.v_empty[s], parity);
                    if constexpr (C::TF32)
                        mbar_wait(&bars.v_landing_free[C::landing(t)], C::landing_parity(t) ^ 1);
                    if (leader) {
                        u64* landed = &bars.v_full[C::landing(t)];
                        mbar_arrive_expect_tx(landed, C::KV_BYTES);
                        load_panels(C::landed_v(sV, sLanding, t), p.v_map, landed, BLOCK_N,
                                    mods.k_base + (i64)j * BLOCK_N, hk);
                    }
                    k_pos = next;
                    state = next_state;
                }
            }
        } else if constexpr (C::TF32) {
            split_stages<C>(sK, sV, sLanding, bars, read_word, release_bar);
        }
        return;
    }

    // ------------------------------------------------------------------ consumers
    warpgroup_claim_regs<C::CONSUMER_REGS>();
    const ModsT& mods = consumer_mods;
    const int g = lane / 4, t4 = lane % 4;
    const int wg_row0 = warp_uniform(warp / 4) * 64;   // this warpgroup's rows of the query tile (wgmma.cuh)
    const int warp_row0 = warp * 16;       // this warp's m-tile
    // Key tiles are counted over every work tile of the CTA, as the producer counts
    // them: the t-th is in stage t % STAGES.
    int t = 0;
    auto wait_full = [&](u64* full, int t) { mbar_wait(&full[t % STAGES], (t / STAGES) & 1); };
    // Where the consumers learn that a stage's K or V is ready: fp32 once the split warps
    // have written its low parts (V^T: or rounded it); precision="tf32" takes K as it lands.
    u64* const k_ready = C::SPLIT ? bars.k_split : bars.k_full;
    u64* const v_ready = C::TF32 ? bars.v_split : bars.v_full;
    auto release = [&](u64* empty, int t) { release_bar(&empty[t % STAGES]); };
    const float scale_log2 = float(p.scale_log2);

    for (int k = 0;; ++k) {
        mbar_wait(&bars.q_full, k & 1);
        const int work_word = read_word(&bars.work);
        if (work_word == bars.END) break;
        const Sm90Work work = Sm90Work::decode<HEADS_FIRST>(work_word >> 1, p);
        const int h = work.h;
        // Every consumer thread is past the previous work tile (its reads of the state).
        named_barrier(C::CONSUMER_BARRIER, C::CONSUMER_THREADS);
        if (threadIdx.x == 0) {
            consumer_mods.set_bounds(p, work.b);
            consumer_mods.set_terms(p, work.b, p.grid_heads);
        }
        named_barrier(C::CONSUMER_BARRIER, C::CONSUMER_THREADS);
        const auto& mask = mods.mask;
        const int q0 = work.m_block * BLOCK_M;
        const int q_rows = min(BLOCK_M, mask.nq - q0);
        const int2 tiles = mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
        // precision="tf32": this warpgroup's rows of Q rounded to TF32 in place, fenced for
        // the wgmmas and published to the warpgroup (named barrier 2 + its index).
        if constexpr (C::ONE_PRODUCT) {
            constexpr int CHUNKS = 64 * 8;   // per panel: the warpgroup's 64 rows of 8 chunks
            #pragma unroll 4
            for (int c = threadIdx.x % 128; c < (D / 32) * CHUNKS; c += 128) {
                float4* chunk = reinterpret_cast<float4*>(sQ + (c / CHUNKS) * (BLOCK_M * 32) + wg_row0 * 32 + (c % CHUNKS) * 4);
                *chunk = tf32_round(*chunk);
            }
            fence_async_smem();
            named_barrier(2 + warp / 4, 128);
        }

        float acc[1][DT][4];
        zero_frags(acc);
        OnlineSoftmax<1> softmax;
        softmax.init();
        float s[1][NT][4];
        u32 p_frag[C::PSTEPS][4];   // P of the tile whose P V is next, as A fragments
        float alpha[1][2];
        // fp32 (3xTF32): S's products [S_hh | S_hl] (the second half then added to the
        // first), P's low parts, and one key tile's P V, summed into acc in the FPU.
        constexpr bool TF32 = C::TF32, SPLIT = C::SPLIT;
        float s2[1][SPLIT ? 2 * NT : 1][4];
        u32 p_low[SPLIT ? C::PSTEPS : 1][4];
        float o_tile[1][SPLIT ? DT : 1][4];

        // S = Q K^T of the t-th key tile (this warpgroup's 64 rows), one batch. fp32: into
        // s2, Q [K; K_lo]^T, then Q_lo K^T (Q_lo from Q's shared tile, in the m16n8k8 A
        // layout) onto its first half.
        auto issue_s = [&](int t) {
            const T* sKb = sK + (t % STAGES) * C::K_TILE_ELEMS;
            u32 q_low[SPLIT ? C::KSTEPS : 1][4];
            if constexpr (SPLIT) {
                #pragma unroll
                for (int ks = 0; ks < C::KSTEPS; ++ks)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = warp_row0 + g + 8 * (e % 2), col = 8 * ks + t4 + 4 * (e / 2);
                        q_low[ks][e] = __float_as_uint(tf32_low(Swizzle128<float, BLOCK_M>::at(sQ, row, col & ~3)[col & 3]));
                    }
            }
            wgmma_fence();
            if constexpr (SPLIT) {
                auto& s_hh = *reinterpret_cast<float (*)[NT][4]>(&s2[0][0][0]);
                Wgmma<float, 2 * BLOCK_N>::template ss<false>(s2[0], kmajor_desc<float, BLOCK_M>(sQ, wg_row0, 0),
                                                              kmajor_desc<float, C::K_ROWS>(sKb, 0, 0));
                #pragma unroll
                for (int ks = 1; ks < C::KSTEPS; ++ks)
                    Wgmma<float, 2 * BLOCK_N>::template ss<true>(s2[0], kmajor_desc<float, BLOCK_M>(sQ, wg_row0, ks),
                                                                 kmajor_desc<float, C::K_ROWS>(sKb, 0, ks));
                #pragma unroll
                for (int ks = 0; ks < C::KSTEPS; ++ks)
                    Wgmma<float, BLOCK_N>::template rs<true>(s_hh, q_low[ks], kmajor_desc<float, C::K_ROWS>(sKb, 0, ks));
            } else {
                Wgmma<T, BLOCK_N>::template ss<false>(s[0], kmajor_desc<T, BLOCK_M>(sQ, wg_row0, 0), kmajor_desc<T, BLOCK_N>(sKb, 0, 0));
                #pragma unroll
                for (int ks = 1; ks < C::KSTEPS; ++ks)
                    Wgmma<T, BLOCK_N>::template ss<true>(s[0], kmajor_desc<T, BLOCK_M>(sQ, wg_row0, ks), kmajor_desc<T, BLOCK_N>(sKb, 0, ks));
            }
            wgmma_commit();
        };
        // S once its product has landed (3xTF32: the sum of s2's halves).
        auto land_s = [&]() {
            if constexpr (SPLIT) {
                reg_fence(s2[0]);
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) s[0][nt][e] = s2[0][nt][e] + s2[0][NT + nt][e];
            } else {
                reg_fence(s[0]);
            }
        };
        // O += P V of the t-th key tile, one batch. 3xTF32: o_tile = P_lo V + P V_lo + P V
        // from V^T's tiles (split_stages), added to acc once landed (land_pv); one TF32
        // product: P V^T into acc.
        auto issue_pv = [&](int t) {
            const T* sVb = sV + (t % STAGES) * C::V_TILE_ELEMS;
            wgmma_fence();
            if constexpr (TF32 && !SPLIT) {
                #pragma unroll
                for (int ks = 0; ks < C::PSTEPS; ++ks)
                    Wgmma<float, D>::template rs<true>(acc[0], p_frag[ks], kmajor_desc<float, D>(sVb, 0, ks));
            } else if constexpr (SPLIT) {
                const float* vt = sVb;
                const float* vt_low = vt + C::KV_ELEMS;
                Wgmma<float, D>::template rs<false>(o_tile[0], p_low[0], kmajor_desc<float, D>(vt, 0, 0));
                #pragma unroll
                for (int ks = 1; ks < C::PSTEPS; ++ks)
                    Wgmma<float, D>::template rs<true>(o_tile[0], p_low[ks], kmajor_desc<float, D>(vt, 0, ks));
                #pragma unroll
                for (int ks = 0; ks < C::PSTEPS; ++ks)
                    Wgmma<float, D>::template rs<true>(o_tile[0], p_frag[ks], kmajor_desc<float, D>(vt_low, 0, ks));
                #pragma unroll
                for (int ks = 0; ks < C::PSTEPS; ++ks)
                    Wgmma<float, D>::template rs<true>(o_tile[0], p_frag[ks], kmajor_desc<float, D>(vt, 0, ks));
            } else {
                #pragma unroll
                for (int ks = 0; ks < C::PSTEPS; ++ks)
                    Wgmma<T, D>::template rs<true>(acc[0], p_frag[ks], mnmajor_desc<T, BLOCK_N>(sVb, ks));
            }
            wgmma_commit();
        };
        // The options' per-score state of this head (nothing in dense mode).
        const auto head_mods = mods.at_head(h);
        // Dropout's keep bits of key tile jt's scores (bit 4 nt + e), drawn while its S is
        // being computed (they depend on indices alone), and their use on P.
        auto keep_bits = [&](int jt) {
            if constexpr (C::OPTIONS != MODE_DENSE)
                if (head_mods.dropout())
                    return head_mods.template keep_bits<NT>(q0 + warp_row0, jt * BLOCK_N);
            return ~0ull;
        };
        auto drop = [&](u64 keep) {
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!((keep >> (4 * nt + e)) & 1)) s[0][nt][e] = 0.f;
        };
        // The bias of the t-th key tile (index jt; MODE_BIAS) as pairs of neighbouring keys
        // in the fragments' layout, once its S has landed; added after the other score terms
        // (fold_terms leaves it out: the sum is the same). From the tile's stage where TMA
        // brought it (128-byte swizzle: the 16-byte chunk c of row r at chunk c ^ (r % 8))
        // by ldmatrix: matrix m of an x4 is rows 8 (m % 2) .. of the warp's 16 and n-tile
        // nt + m / 2, so each lane receives exactly its pairs. Else from global memory, a
        // pair as one 32-bit load where the rows allow (keys contiguous, rows 4-byte
        // aligned; one 8-byte load for fp32), zeros past the sequence. fp32 biases come
        // from global memory only (BiasWords: a pair is one word, or two for fp32).
        typedef BiasWords<T> Words;
        typedef u32 BiasPairs[NT][2 * Words::N];
        auto bias_tile = [&](int t, int jt, BiasPairs& pairs) {
            if constexpr ((MODE & MODE_BIAS) != 0) {
                if constexpr (!TF32) {
                    if (bias_in_smem) {
                        wait_full(bars.bias_full, t);
                        const T* stage = sBias + (t % STAGES) * C::BIAS_ELEMS;
                        const int m = lane / 8, row = warp_row0 + (m % 2) * 8 + lane % 8;
                        #pragma unroll
                        for (int nt = 0; nt < NT; nt += 2) {
                            const int chunk = nt + m / 2;   // 8 keys
                            u32 r[4];
                            ldmatrix_x4(r, stage + (chunk / 8) * (BLOCK_M * C::PANEL) + row * C::PANEL +
                                               ((chunk % 8) ^ (row % 8)) * 8);
                            pairs[nt][0] = r[0];
                            pairs[nt][1] = r[1];
                            pairs[nt + 1][0] = r[2];
                            pairs[nt + 1][1] = r[3];
                        }
                        return;
                    }
                }
                const int k0 = jt * BLOCK_N + 2 * t4;
                const bool wide = head_mods.bias_sk == 1 && head_mods.bias_sq % 2 == 0 &&
                                  reinterpret_cast<u64>(head_mods.bias) % (2 * sizeof(T)) == 0;
                #pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int i = q0 + warp_row0 + g + 8 * half;
                    const T* row = head_mods.bias + (i64)min(i, mask.nq - 1) * head_mods.bias_sq;
                    #pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const int j = k0 + nt * 8;
                        u32 v[Words::N] = {};
                        if (i < mask.nq && j + 1 < mask.nk && wide) {
                            Words::load(v, row + j);
                        } else if (i < mask.nq && j < mask.nk) {
                            Words::set(v, 0, row[j * head_mods.bias_sk]);
                            if (j + 1 < mask.nk) Words::set(v, 1, row[(j + 1) * head_mods.bias_sk]);
                        }
                        #pragma unroll
                        for (int w = 0; w < Words::N; ++w) pairs[nt][Words::N * half + w] = v[w];
                    }
                }
            }
        };
        // The stage goes back once the pairs were used (the loads have completed).
        auto release_bias_tile = [&](int t) {
            if (bias_in_smem) release(bars.bias_empty, t);
        };
        auto add_bias = [&](const BiasPairs& pairs, float weight) {
            if constexpr ((MODE & MODE_BIAS) != 0) {
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) s[0][nt][e] = fma(Words::value(pairs[nt], e), weight, s[0][nt][e]);
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
            if constexpr (C::OPTIONS != MODE_DENSE) {
                if (head_mods.score_terms()) {
                    float shift[1][2];
                    const float fs = head_mods.fold_terms(s, shift, r0, k0, scale_log2, masked, [&](float weight) {
                        if constexpr ((MODE & MODE_BIAS) != 0) add_bias(bias, weight);
                    });
                    grew = softmax.fold(s, fs, shift, alpha);
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
        auto land_pv = [&]() {
            if constexpr (SPLIT) {
                reg_fence(o_tile[0]);
                #pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) acc[0][dt][e] += o_tile[0][dt][e];
            } else {
                reg_fence(acc[0]);
            }
        };
        // P into A fragments; p_frag must not change while a P V that reads it is in flight.
        // fp32: n-tile ks of S is k-step ks, its keys 2t, 2t + 1 in k-slots t, t + 4
        // (split_stages' order of V^T), and the low parts beside (3xTF32) or P rounded
        // to TF32 (one product).
        auto round_p = [&]() {
            #pragma unroll
            for (int ks = 0; ks < C::PSTEPS; ++ks) {
                if constexpr (TF32) {
                    constexpr int SLOT[4] = {0, 2, 1, 3};
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float x = s[0][ks][SLOT[i]];
                        if constexpr (SPLIT) {
                            p_frag[ks][i] = __float_as_uint(x);
                            p_low[ks][i] = __float_as_uint(tf32_low(x));
                        } else {
                            p_frag[ks][i] = __float_as_uint(tf32_round(x));
                        }
                    }
                } else {
                    c_to_a_frag<T>(p_frag[ks], s, 0, ks);
                }
            }
        };

        // The t-th key tile (counted over the CTA's work tiles): its index, whether it
        // needs the element mask and whether it is this work tile's last. The dense path
        // visits the range in order from the current t, and the tiles from the one
        // holding the block's first hidden key on need the mask (tile_needs_mask's test,
        // worked out once: no shared-memory reads per tile); with the options the
        // producer's schedule word says.
        const int dense_masked_from = mask.key_hi(q0) / BLOCK_N;
        const int dense_first = tiles.x - t;
        auto visited = [&](int t, int& jt, bool& masked, bool& last) {
            if constexpr (C::OPTIONS == MODE_DENSE) {
                jt = dense_first + t;
                masked = jt >= dense_masked_from;
                last = jt + 1 >= tiles.y;
            } else {
                wait_full(k_ready, t);
                const int code = read_word(&bars.tile[t % STAGES]);
                jt = code >> 2;
                last = code & 2;
                masked = code & 1;
            }
        };

        // Pipeline over the visited key tiles: before the loop, S and P of the first
        // tile; while there is a next tile, an iteration issues S of the next tile and
        // P V of this one back to back, and runs the softmax of the next tile while the
        // tensor cores still accumulate P V; acc is rescaled only once that product has
        // landed. Once every S has landed, Q's buffer goes back to the producer (the
        // next work tile's Q), then the last P V. A stage goes back to the producer as
        // soon as the product that reads it has landed. (The issue order is
        // unconditional inside the loop: a wgmma batch issued on one path only would
        // leave register copies between the wgmmas and their wait.)
        // fp32 as 3xTF32: each key tile's S, then its P V, in turn (see the top); Q goes
        // back once the last S has landed.
        if constexpr (SPLIT) {
            for (bool last = (work_word & 1) != 0; !last; ++t) {
                int jt;
                bool masked;
                visited(t, jt, masked, last);
                wait_full(k_ready, t);
                issue_s(t);
                const u64 keep = keep_bits(jt);
                wgmma_wait<0>();
                land_s();
                if (last) release_bar(&bars.q_empty);
                release(bars.k_empty, t);
                BiasPairs bias;
                bias_tile(t, jt, bias);
                const bool grew = softmax_tile(jt, masked, keep, bias);
                round_p();
                wait_full(v_ready, t);
                issue_pv(t);
                if (grew) softmax.rescale(acc, alpha);
                wgmma_wait<0>();
                land_pv();
                release(bars.v_empty, t);
            }
            if (work_word & 1) release_bar(&bars.q_empty);
        } else if ((work_word & 1) == 0) {
            int jt;
            bool masked, last;
            visited(t, jt, masked, last);
            wait_full(k_ready, t);
            issue_s(t);
            const u64 keep = keep_bits(jt);
            wgmma_wait<0>();
            land_s();
            release(bars.k_empty, t);
            BiasPairs bias;
            bias_tile(t, jt, bias);
            softmax_tile(jt, masked, keep, bias);   // acc is still 0: nothing to rescale
            release_bias_tile(t);
            round_p();
            for (; !last; ++t) {
                visited(t + 1, jt, masked, last);
                wait_full(k_ready, t + 1);
                wait_full(v_ready, t);
                issue_s(t + 1);
                issue_pv(t);
                const u64 keep = keep_bits(jt);
                wgmma_wait<1>();   // S of the next tile (P V may still run)
                land_s();
                release(bars.k_empty, t + 1);
                BiasPairs bias;
                bias_tile(t + 1, jt, bias);
                const bool grew = softmax_tile(jt, masked, keep, bias);
                release_bias_tile(t + 1);
                wgmma_wait<0>();
                land_pv();
                release(bars.v_empty, t);
                if (grew) softmax.rescale(acc, alpha);
                round_p();
            }
            release_bar(&bars.q_empty);
            wait_full(v_ready, t);
            issue_pv(t);
            wgmma_wait<0>();
            land_pv();
            release(bars.v_empty, t);
            ++t;
        } else {
            release_bar(&bars.q_empty);
        }

        float row_lse[1][2];
        softmax.finalize(acc, row_lse, mods.dropout() ? mods.drop_scale : 1.f);

        // Epilogue: O straight from the accumulators, a thread's two neighbouring columns
        // per store (nothing staged in shared memory: the producer may already be loading
        // the next work tile's Q), and the row's LSE. Rows past the sequence are not stored.
        const Strided<T> O = tensor<T>(p.o);
        #pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = warp_row0 + g + hh * 8;
            if (r >= q_rows) continue;
            const i64 row = mods.q_base + q0 + r;
            if (t4 == 0)
                static_cast<float*>(p.lse)[((i64)mods.tb * p.grid_heads + h) * p.nq + row] = row_lse[0][hh];
            T* o_row = O.at(mods.tb, h, row) + 2 * t4;
            if (p.vec && p.dim_v % 2 == 0) {   // pairs aligned, whole or wholly outside
                #pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    if (dt * 8 + 2 * t4 < p.dim_v) {
                        if constexpr (TF32)
                            *reinterpret_cast<float2*>(o_row + dt * 8) = make_float2(acc[0][dt][2 * hh], acc[0][dt][2 * hh + 1]);
                        else
                            *reinterpret_cast<u32*>(o_row + dt * 8) = pack2<T>(acc[0][dt][2 * hh], acc[0][dt][2 * hh + 1]);
                    }
            } else {
                #pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    #pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (dt * 8 + 2 * t4 + e < p.dim_v) o_row[dt * 8 + e] = from_acc<T>(acc[0][dt][2 * hh + e]);
            }
        }
    }
}
