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
//   producer (the last warpgroup; one warp works, and for fp32 in dense mode the other
//       three split Q into a second buffer a work tile ahead: QSplit below): loads each
//       work tile's Q (but QSplit's) and
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
// fp32 (T = float) runs on the 16-bit tensor cores at fp32 accuracy: split_f32.cu has
// written k and v (and q, but where the kernel splits q itself: QSplit), each chunk of 128
// rows scaled by its own power of two (QSplit's q: each consumer warpgroup's 64 rows), as fp16 high
// and low halves (halves.cuh), which TMA brings as two planes of every tile; a product is
// three fp16 products, a_h b_h + a_h b_l + a_l b_h (S = Q K^T over the planes of Q and K;
// P V from P split in registers, scaled by P_SCALE, over V's planes read N-major as in the
// 16-bit path). The consumers unscale S as it lands, by the exponents of Q's and the key
// tile's chunks (powers of two, exact). The tensor cores accumulate by truncation, so each
// key tile's P V is summed from zero, unscaled and added to O in the FPU, where rounding
// is to nearest; S, a few dozen k-steps, takes the truncation. precision="tf32"
// (MODE_TF32) keeps the high halves' one product each, S = Q K^T and O += P V, P rounded
// to fp16 as in the 16-bit path: 11 significant bits a factor, TF32's precision, at the
// 16-bit rate (tests/TOLERANCES.md); O accumulates in the scale of the largest V chunk so
// far and is unscaled in the epilogue.
// Varlen reads (1, H, total, d) tensors at the sequence's row offset: rows past a
// sequence's end belong to the next one (or are zero-filled past the tensor) and are
// masked or never stored. Tensors TMA cannot describe (rows not 16-byte aligned) run in
// fwd_sm80.cu.
#include "elem.cuh"
#include "copy.cuh"
#include "halves.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "tensor.cuh"
#include "tma.cuh"
#include "warp_mm.cuh"
#include "wgmma.cuh"

// The most dynamic shared memory a forward with a second Q buffer (QSplit) may take:
// sm_90's 227 KB a block less the option state's static shared memory (two Mods, 256
// bytes each at most; cupyflash/_kernels.py mirrors it).
#define SM90_FWD_Q_SPLIT_SMEM (232448 - 2 * 256)

// Barriers of the pipeline, after the tiles in shared memory, and the schedule: with
// the options the producer alone walks the key tiles (the mask's range, the block mask)
// and writes each stage's tile before its "full" arrival (release; the consumers' wait
// acquires): 4 tile, + 2 on the work tile's last, + 1 where it needs the element mask.
// Beside each Q buffer's "full" arrival the work word: 2 w, + 1 when the work tile visits
// no key tile, or END when no work is left. fp32: each stage's K and V exponents in one
// word (TileExponents), written once their copies are issued and announced by a second
// arrival on K's "full" barrier; and the bits of each consumer warpgroup's largest |q|
// (q_chunk), beside Q's work word: by the producer from the chunk words of the passes, or
// where the kernel splits Q itself by QSplit's warps (below), which then also choose the
// work tiles: the producer's loading warp takes each from its Q buffer's work word.
// The words are written and read with atomics: the barriers order them, and
// compute-sanitizer's racecheck, which does not follow mbarrier ordering, then sees no
// plain write racing the plain reads of a stage's previous round. (QSplit's own words,
// q_split_*, are plain: its named barriers order them.)
// fp32's words (none for 16-bit inputs: an empty base takes no bytes), first in
// Sm90FwdBarriers; the q_split words serve QSplit alone.
template <int STAGES, bool F32, int Q_BUFFERS>
struct Sm90FwdF32Words {
    u64 q_split_full[2], q_split_empty[2];   // QSplit's two slots of fp32 rows
    int q_chunk[Q_BUFFERS][4];
    int kv_exps[STAGES];
    int q_split_max[3][4];      // QSplit's warps' largest |q| a consumer warpgroup
    int q_split_tile[5];        // QSplit's work tile, from its first thread to all (QSplit::Tile)
};
template <int STAGES, int Q_BUFFERS>
struct Sm90FwdF32Words<STAGES, false, Q_BUFFERS> {};

template <int STAGES, bool F32, int Q_BUFFERS>
struct Sm90FwdBarriers : Sm90FwdF32Words<STAGES, F32, Q_BUFFERS> {
    static constexpr int END = -1;
    u64 q_full[Q_BUFFERS], q_empty[Q_BUFFERS];
    u64 k_full[STAGES], v_full[STAGES];
    u64 k_empty[STAGES], v_empty[STAGES];
    u64 bias_full[STAGES], bias_empty[STAGES];   // MODE_BIAS with the bias by TMA
    int tile[STAGES];
    int work[Q_BUFFERS];   // the work tile in the Q buffer (END: none left)
};

// fp32: a key tile's K and V halves' exponents (halves.cuh halves_exponent, -112 .. 127)
// as one word, a byte each.
struct TileExponents {
    int k, v;
    __device__ __forceinline__ static int pack(u32 k_chunk, u32 v_chunk) {
        return (halves_exponent(k_chunk) + 128) | (halves_exponent(v_chunk) + 128) << 8;
    }
    __device__ __forceinline__ explicit TileExponents(int word) : k((word & 255) - 128), v((word >> 8) - 128) {}
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
    // The number of the CTA's work tile after tile w (one thread claims it): the grid's
    // stride without a work counter, else the counter's next (a persistent CTA's first
    // tile is its blockIdx.x).
    __device__ __forceinline__ static int next(int w, const AttnParams& p) {
        return p.work_counter == nullptr ? w + int(gridDim.x) : int(gridDim.x) + atomicAdd(p.work_counter, 1);
    }
};

// fp32 in dense mode, where shared memory holds two Q buffers: Q split into fp16 halves by
// the producer warpgroup's three warps that issue no copies, a work tile ahead of the
// consumers, so that q comes from HBM once, as fp32 (its chunks a second time from L2),
// and split_f32.cu writes only K's and V's halves. These warps choose the work tiles (the
// loading warp streams each tile's K and V once its Q buffer's work word is out). For
// each tile, into Q buffer k % 2: each consumer warpgroup's largest finite |q| over its 64
// rows; then, once the buffer is given back (by the consumers, and by the loading warp
// once it has read the words), the rows again, scaled by 2^(14 - e) (halves.cuh) and
// written as PLANES fp16 planes in the 128-byte swizzle TMA writes (wgmma.cuh
// Swizzle128); then the work word (2 w, + 1 without key tiles, or END) and each
// warpgroup's bits (q_chunk), and each warp's arrival on the buffer's "full" barrier. The fp32 rows come CHUNK_ROWS at a time
// by TMA (q_map describes q itself, 32 columns a box in the 128-byte swizzle; rows past q's
// and columns past d arrive as zeros) through two slots, the next chunk in flight while
// the warps read one: the producer warpgroup keeps 32 registers a thread (40 with the low
// halves), too few for loads of their own in flight.
template <int D, int BLOCK_M, int BLOCK_N, int PLANES>
struct QSplit {
    static constexpr int WARPS = 3, THREADS = 32 * WARPS;
    static constexpr int GROUPS = BLOCK_M / 64;   // consumer warpgroups
    static constexpr int CHUNK_ROWS = D <= 64 ? 64 : D <= 128 ? 32 : 16;
    static constexpr int CHUNKS = BLOCK_M / CHUNK_ROWS, GROUP_CHUNKS = 64 / CHUNK_ROWS;
    typedef Swizzle128<float, CHUNK_ROWS> ChunkLayout;   // a chunk in its slot, a TMA box a panel
    static constexpr int BOX_COLS = ChunkLayout::PANEL_COLS;   // fp32 columns a box (the swizzle's 128 bytes)
    static constexpr int CHUNK_BYTES = CHUNK_ROWS * D * 4;
    static constexpr int RING_BYTES = 2 * CHUNK_BYTES;   // shared memory (cupyflash/_kernels.py mirrors it)
    // A thread's runs of 4 columns: one column c, every ROW_STEP-th row.
    static constexpr int ROW_RUNS = D / 4, ROW_STEP = THREADS / ROW_RUNS;
    static constexpr int BARRIER = 2;             // named barrier of the three warps (1: the consumers')
    static_assert(D % BOX_COLS == 0 && 64 % CHUNK_ROWS == 0, "whole boxes, chunks within a warpgroup");
    static_assert(WARPS == 3 && GROUPS <= 4, "Sm90FwdF32Words' q_split_max and q_chunk");
    static constexpr bool SERVES = THREADS % ROW_RUNS == 0;   // whole rows at a time (not d = 256)

    // The work tile's words in shared memory (the first thread's, read where needed: in
    // registers they outlived the loops, which then spilled).
    enum Tile { NUMBER, WORD, ROW, HEAD, BATCH };

    template <int FIRST_THREAD, bool HEADS_FIRST, typename Bars>
    __device__ __forceinline__ static void run(const AttnParams& p, Bars& bars, half_t* sQ, u32 ring) {
        static_assert(SERVES, "whole rows at a time");
        const int tid = int(threadIdx.x) - FIRST_THREAD, lane = tid % 32;
        int (&tile)[5] = bars.q_split_tile;
        int t = 0;   // chunks through the slots so far: slot t % 2
        for (int k = 0;; ++k) {
            if (tid == 0) {   // the next work tile: its number, work word, first row, head and batch entry
                const int w = k == 0 ? int(blockIdx.x) : Sm90Work::next(tile[NUMBER], p);
                const bool end = w >= p.grid_m * p.grid_heads * p.grid_batch;
                const Sm90Work work = Sm90Work::decode<HEADS_FIRST>(end ? 0 : w, p);
                Mods<float, float, MODE_DENSE> mods;
                mods.set_bounds(p, work.b);
                // + 1 where the loading warp's walk visits no key tile (dense mode: the range)
                const int q0 = work.m_block * BLOCK_M, q_rows = min(BLOCK_M, mods.mask.nq - q0);
                const int2 tiles = mods.mask.key_tile_range(q0, q0 + q_rows, BLOCK_N);
                tile[NUMBER] = w;
                tile[WORD] = end ? Bars::END : 2 * w + (tiles.y <= tiles.x);
                tile[ROW] = q0;
                tile[HEAD] = work.h;
                tile[BATCH] = work.b;
            }
            named_barrier(BARRIER, THREADS);
            const bool end = tile[WORD] == Bars::END;
            // The tile's chunks, twice (the maxima, then the split): chunk i's rows come into
            // slot t % 2 (the first thread issues chunk i + 1 before the warps read chunk i),
            // and f(i % CHUNKS, r, c, x) takes each of the thread's runs of it: row r of the
            // tile, the 4 columns x from c.
            auto issue = [&](int i, int slot_t) {
                const int s = slot_t % 2;
                mbar_wait(&bars.q_split_empty[s], ((slot_t / 2) & 1) ^ 1);
                mbar_arrive_expect_tx(&bars.q_split_full[s], CHUNK_BYTES);
                #pragma unroll
                for (int box = 0; box < D / BOX_COLS; ++box)
                    tma_load_4d(ring_at(ring, s) + box * ChunkLayout::PANEL_ELEMS * 4, p.q_map, &bars.q_split_full[s],
                                box * BOX_COLS, tile[ROW] + i % CHUNKS * CHUNK_ROWS, tile[HEAD], tile[BATCH]);
            };
            auto for_each_run = [&](int i, auto&& f) {
                if (tid == 0 && i + 1 < 2 * CHUNKS) issue(i + 1, t + 1);
                const int s = t % 2;
                mbar_wait(&bars.q_split_full[s], (t / 2) & 1);
                const int c = tid % ROW_RUNS * 4;
                #pragma unroll 1
                for (int r = tid / ROW_RUNS; r < CHUNK_ROWS; r += ROW_STEP) {
                    const float4 v = load_shared_16(ring_at(ring, s) + ChunkLayout::index(r, c) * 4);
                    const float x[4] = {v.x, v.y, v.z, v.w};
                    f(i % CHUNKS * CHUNK_ROWS + r, c, x);
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&bars.q_split_empty[s]);
                ++t;
            };
            if (!end && tid == 0) issue(0, t);
            // (one set of slots serves every tile: the next tile's writes follow its first
            // barrier, which every thread meets after its last read of these)
            int (&slots)[WARPS][4] = bars.q_split_max;
            #pragma unroll 1
            for (int g = 0; g < GROUPS; ++g) {
                u32 largest = 0;
                if (!end)
                    #pragma unroll 1
                    for (int i = g * GROUP_CHUNKS; i < (g + 1) * GROUP_CHUNKS; ++i)
                        for_each_run(i, [&](int, int, const float (&x)[4]) {
                            #pragma unroll
                            for (int e = 0; e < 4; ++e) largest = max(largest, finite_magnitude_bits(x[e]));
                        });
                largest = __reduce_max_sync(0xffffffffu, largest);
                if (lane == 0) slots[tid / 32][g] = int(largest);
            }
            named_barrier(BARRIER, THREADS);   // (and every thread has read the tile's words)
            auto group_largest = [&](int g) {
                u32 m = 0;
                #pragma unroll
                for (int v = 0; v < WARPS; ++v) m = max(m, u32(slots[v][g]));
                return m;
            };
            const int qb = k % 2;
            // the buffer's last tile done with: by the consumers, and its words read by the loading warp
            mbar_wait(&bars.q_empty[qb], ((k / 2) & 1) ^ 1);
            const u32 buffer = smem_addr(sQ) + qb * PLANES * BLOCK_M * D * 2;
            #pragma unroll 1
            for (int g = 0; g < GROUPS; ++g) {
                const float scale = halves_scale(group_largest(g));
                if (!end)
                    #pragma unroll 1
                    for (int i = CHUNKS + g * GROUP_CHUNKS; i < CHUNKS + (g + 1) * GROUP_CHUNKS; ++i)
                        for_each_run(i, [&](int r, int c, const float (&x)[4]) {
                            uint2 hi, lo;
                            split_run4(x, scale, hi, lo);
                            const u32 at = buffer + (Swizzle128<half_t, BLOCK_M>::index(r, c & ~7) + c % 8) * 2;
                            store_shared_8(at, hi);
                            if (PLANES == 2) store_shared_8(at + BLOCK_M * D * 2, lo);
                        });
            }
            fence_async_smem();   // the halves, to wgmma's reads
            if (tid == 0) {
                atomicExch(&bars.work[qb], tile[WORD]);
                #pragma unroll
                for (int g = 0; g < GROUPS; ++g) atomicExch(&bars.q_chunk[qb][g], int(group_largest(g)));
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&bars.q_full[qb]);
            if (end) return;
        }
    }

    // Slot s of the ring (1024-byte aligned, as the swizzle needs).
    __device__ __forceinline__ static u32 ring_at(u32 ring, int s) { return ring + s * CHUNK_BYTES; }
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
    // fp32 (above): the tiles hold fp16 halves, PLANES of them (high, and low beside for
    // full accuracy), and a product is PRODUCTS fp16 products.
    static constexpr bool F32 = sizeof(T) == 4;
    static constexpr bool ONE_PRODUCT = F32 && (MODE & MODE_TF32) != 0;   // precision="tf32"
    static constexpr bool SPLIT = F32 && !ONE_PRODUCT;                     // low halves beside
    static constexpr int PLANES = SPLIT ? 2 : 1, PRODUCTS = SPLIT ? 3 : 1;
    // Whether each key tile's S and P V run in turn rather than overlapped (below): fp32
    // at d = 128 with the options, where the registers do not hold the next tile's S
    // beside O, the tile's P V and the option state (the overlapped loop spilled 268-708
    // bytes there; build check).
    static constexpr bool SERIAL = SPLIT && D >= 128 && (MODE & ~MODE_TF32) != MODE_DENSE;
    typedef typename HalvesOf<T>::type E;   // the tiles' elements
    // fp32: P's scale before it is split. The online softmax's stale max lets P reach
    // 2^RESCALE_SLACK = 2^8 (softmax.cuh), so 2^6 keeps it below 2^14, inside fp16's
    // range; the low halves stay normal fp16 down to P = 2^-9 (the row's largest P is at
    // least 1) and round to ~2^-31 absolute below.
    static constexpr float P_SCALE = SPLIT ? 64.f : 1.f;
    static_assert(OnlineSoftmax<1>::RESCALE_SLACK == 8.f, "P_SCALE keeps P * P_SCALE below 2^14");
    static constexpr int OPTIONS = MODE & ~MODE_TF32;   // the option policies (mods.cuh)
    static constexpr int NT = BLOCK_N / 8;          // n-tiles of S per warp
    static constexpr int DT = D / 8;                // n-tiles of O per warp
    static constexpr int KSTEPS = D / WgmmaK<E>::elems;         // k-steps of Q K^T
    static constexpr int PSTEPS = BLOCK_N / WgmmaK<E>::elems;   // k-steps of P V
    // A plane of the Q tile and of a stage's K and V tiles; the planes of a tile follow
    // one another.
    static constexpr int Q_ELEMS = BLOCK_M * D, KV_ELEMS = BLOCK_N * D;
    // MODE_BIAS: a bias tile per stage (BLOCK_M rows, BLOCK_N / 64 panels of 64 keys);
    // none for fp32, whose bias the consumers load from global memory.
    static constexpr int BIAS_ELEMS = (MODE & MODE_BIAS) != 0 && !F32 ? BLOCK_M * BLOCK_N : 0;
    static constexpr int PANEL = 128 / sizeof(E);   // columns per TMA box (128 bytes, the swizzle span)
    static constexpr u32 Q_BYTES = Q_ELEMS * sizeof(E), KV_BYTES = KV_ELEMS * sizeof(E);   // a plane's
    static constexpr u32 BIAS_BYTES = BIAS_ELEMS * sizeof(E);
    // Shared memory (cupyflash/_kernels.py mirrors it): Q x Q_BUFFERS, K x STAGES, V x
    // STAGES (each PLANES planes), bias x STAGES (MODE_BIAS), each 1024-byte aligned, and
    // with QSplit its ring; then the mbarriers and the schedule. The dynamic shared memory
    // the host must give: the tiles, the slack to align them, the barriers.
    static constexpr int ALIGN = 1024;
    // fp32 in dense mode: Q split by the kernel itself (QSplit: a second Q buffer and its
    // ring of loads) where shared memory holds them; else by split_f32.cu's passes,
    // through one buffer.
    template <bool Q_SPLIT>
    static constexpr int tile_bytes() {
        return (PLANES * ((1 + Q_SPLIT) * Q_ELEMS + 2 * STAGES * KV_ELEMS) + STAGES * BIAS_ELEMS) * sizeof(E) +
               (Q_SPLIT ? QSplit<D, BLOCK_M, BLOCK_N, PLANES>::RING_BYTES : 0);
    }
    template <bool Q_SPLIT>
    static constexpr int smem_bytes() {
        return tile_bytes<Q_SPLIT>() + ALIGN + sizeof(Sm90FwdBarriers<STAGES, F32, 1 + Q_SPLIT>);
    }
    static constexpr bool Q_SPLIT = F32 && OPTIONS == MODE_DENSE && QSplit<D, BLOCK_M, BLOCK_N, PLANES>::SERVES &&
                                    smem_bytes<true>() <= SM90_FWD_Q_SPLIT_SMEM;
    static constexpr int Q_BUFFERS = Q_SPLIT ? 2 : 1;
    static constexpr int TILE_BYTES = tile_bytes<Q_SPLIT>();
    static constexpr int SMEM_BYTES = smem_bytes<Q_SPLIT>();
    // Register budgets after setmaxnreg: the producer keeps 24 a thread, 32 for QSplit (40
    // with the low halves), 56 where it walks the options' schedule (with less, its
    // block-mask walk spills; build check); the consumers share the rest of the launch's
    // registers (tma.cuh WarpgroupRegs).
    static constexpr int PRODUCER_REGS = OPTIONS != MODE_DENSE ? 56 : Q_SPLIT ? (PLANES == 2 ? 40 : 32) : 24;
    static constexpr int CONSUMER_REGS = WarpgroupRegs<THREADS, PRODUCER_REGS>::CONSUMER;
    static_assert(D % PANEL == 0 && BLOCK_N % PANEL == 0 && BLOCK_N <= 256 && D <= 256 && BLOCK_M <= 256,
                  "tile shape (TMA boxes take at most 256 rows)");
    static_assert(!F32 || (HALVES_CHUNK_ROWS % 64 == 0 && HALVES_CHUNK_ROWS % BLOCK_N == 0),
                  "fp32: a key tile and a warpgroup's query rows lie within one chunk of the halves' scales");
};

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
    typedef typename C::E E;
    constexpr int PLANES = C::PLANES, Q_TILE = PLANES * C::Q_ELEMS, KV_TILE = PLANES * C::KV_ELEMS;
    E* sQ = reinterpret_cast<E*>(smem_raw + (C::ALIGN - smem_addr(smem_raw) % C::ALIGN) % C::ALIGN);
    E* sK = sQ + C::Q_BUFFERS * Q_TILE;   // STAGES K tiles
    E* sV = sK + STAGES * KV_TILE;        // STAGES V tiles
    E* sBias = sV + STAGES * KV_TILE;     // STAGES buffers (MODE_BIAS)
    const u32 sRing = smem_addr(sBias + STAGES * C::BIAS_ELEMS);   // QSplit's slots of fp32 rows
    typedef Sm90FwdBarriers<STAGES, C::F32, C::Q_BUFFERS> Bars;
    auto& bars = *reinterpret_cast<Bars*>(reinterpret_cast<unsigned char*>(sQ) + C::TILE_BYTES);
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
    const bool bias_in_smem = (MODE & MODE_BIAS) != 0 && !C::F32 && p.mods.bias_tma;
    const int work_tiles = p.grid_m * p.grid_heads * p.grid_batch;
    // fp32: a second arrival on Q's and K's "full" barriers (the words of their scales),
    // or with QSplit each of its warps' on Q's.
    typedef QSplit<D, BLOCK_M, BLOCK_N, PLANES> QSplitT;
    constexpr int Q_FULL_ARRIVALS = C::Q_SPLIT ? QSplitT::WARPS : C::F32 ? 2 : 1, K_FULL_ARRIVALS = C::F32 ? 2 : 1;
    if (threadIdx.x == 0) {
        #pragma unroll
        for (int b = 0; b < C::Q_BUFFERS; ++b) {
            mbar_init(&bars.q_full[b], Q_FULL_ARRIVALS);
            mbar_init(&bars.q_empty[b], CONSUMERS * 4 + C::Q_SPLIT);   // QSplit: and the loading warp's
        }
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&bars.k_full[s], K_FULL_ARRIVALS);
            mbar_init(&bars.v_full[s], 1);
            mbar_init(&bars.k_empty[s], CONSUMERS * 4);
            mbar_init(&bars.v_empty[s], CONSUMERS * 4);
            mbar_init(&bars.bias_full[s], 1);
            mbar_init(&bars.bias_empty[s], CONSUMERS * 4);
        }
        if constexpr (C::Q_SPLIT)
            for (int s = 0; s < 2; ++s) {
                mbar_init(&bars.q_split_full[s], 1);
                mbar_init(&bars.q_split_empty[s], QSplitT::WARPS);
            }
        mbar_init_fence();
    }
    __syncthreads();

    // ------------------------------------------------------------------ producer
    // For each work tile: Q (once the consumers have issued the previous tile's last
    // S; with QSplit, its warps' work and their choice of the tile), then the key tiles
    // through the stages. With a work counter the CTA is persistent and the next work
    // tile's loads overlap this one's last products and its epilogue. The producer
    // warpgroup's first warp runs it: lane 0 issues the copies and the barrier and
    // schedule operations, the 32 lanes walk a block mask together.
    if (warp >= CONSUMERS * 4) {
        warpgroup_release_regs<C::PRODUCER_REGS>();
        if (warp == CONSUMERS * 4) {
            const bool leader = lane == 0;
            const ModsT& mods = producer_mods;
            // A tile of `rows` rows (the box's) from row0 on, in the tensor maps' coordinates
            // (under varlen the sequence's offset), with its planes (fp32's halves).
            auto load_tile = [&](E* dst, const TmaMap& map, u64* bar, int rows, i64 row0, int head, int heads) {
                tma_load_planes<PLANES, D, C::PANEL>(dst, map, bar, rows, int(row0), head, heads, mods.tb);
            };
            auto next_work = [&](int w) {
                if (p.work_counter == nullptr) return w + int(gridDim.x);
                int next = 0;
                if (leader) next = Sm90Work::next(w, p);
                return warp_uniform(next);
            };
            int t = 0;   // key tiles loaded so far, over every work tile: stage t % STAGES
            for (int w = blockIdx.x, k = 0;; ++k) {
                Sm90Work work;
                int q0 = 0, q_rows = 0;
                // The next work tile: with QSplit its choice, once its Q buffer's work word is
                // out (QSplit runs a work tile ahead); else the next with query rows (varlen:
                // the grid covers the longest sequence), once Q's buffer is free again.
                auto take = [&]() {
                    work = Sm90Work::decode<HEADS_FIRST>(w, p);
                    __syncwarp();   // every lane is past its reads of the previous state
                    if (leader) producer_mods.set_bounds(p, work.b);
                    __syncwarp();
                    q0 = work.m_block * BLOCK_M;
                    q_rows = min(BLOCK_M, mods.mask.nq - q0);
                };
                if constexpr (C::Q_SPLIT) {
                    mbar_wait(&bars.q_full[k % 2], (k / 2) & 1);
                    const int word = read_word(&bars.work[k % 2]);
                    // The buffer's words read: QSplit may fill it again once the consumers are
                    // done with it too (a tile without key tiles gives it back at once).
                    if (leader) mbar_arrive(&bars.q_empty[k % 2]);
                    if (word == bars.END) break;
                    w = word >> 1;
                    take();
                } else {
                    mbar_wait(&bars.q_empty[0], (k & 1) ^ 1);
                    for (w = k == 0 ? w : next_work(w); w < work_tiles; w = next_work(w)) {
                        take();
                        if (q_rows > 0) break;
                    }
                    if (w >= work_tiles) {   // plain arrivals complete the phase
                        if (leader) {
                            atomicExch(&bars.work[0], bars.END);
                            for (int i = 0; i < Q_FULL_ARRIVALS; ++i) mbar_arrive(&bars.q_full[0]);
                        }
                        break;
                    }
                }
                const int h = work.h, hk = h / p.group, kv_heads = p.grid_heads / p.group;
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
                if (!C::Q_SPLIT && leader) {
                    // The work word: 2 w, + 1 when no key tile is visited.
                    atomicExch(&bars.work[0], 2 * w + (k_pos >= walk_length));
                    mbar_arrive_expect_tx(&bars.q_full[0], PLANES * C::Q_BYTES);
                    load_tile(sQ, p.q_map, &bars.q_full[0], BLOCK_M, mods.q_base + q0, h, p.grid_heads);
                    if constexpr (C::F32) {
                        for (int wg = 0; wg < CONSUMERS; ++wg) {   // (a warpgroup past the rows: 0)
                            const int r = q0 + 64 * wg;
                            const u32 word = r < mods.mask.nq ? *halves_chunk_word(p, HALVES_Q, mods.tb, h, mods.q_base + r) : 0;
                            atomicExch(&bars.q_chunk[0][wg], int(word));
                        }
                        mbar_arrive(&bars.q_full[0]);
                    }
                }
                for (; k_pos < walk_length; ++t) {
                    const int s = t % STAGES, j = tile_at(k_pos);
                    const u32 parity = ((t / STAGES) & 1) ^ 1;   // the consumers' release of the round before
                    // fp32: the tile's chunk words, loaded before the wait for its stage
                    u32 k_chunk = 0, v_chunk = 0;
                    if (C::F32 && leader) {
                        const u32* word = halves_chunk_word(p, HALVES_K, mods.tb, hk, mods.k_base + (i64)j * BLOCK_N);
                        k_chunk = word[0];
                        v_chunk = word[p.halves_chunks];   // HALVES_V's, the next tensor's
                    }
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
                        }
                        mbar_arrive_expect_tx(&bars.k_full[s], PLANES * C::KV_BYTES);
                        load_tile(sK + s * KV_TILE, p.k_map, &bars.k_full[s], BLOCK_N, mods.k_base + (i64)j * BLOCK_N, hk,
                                  kv_heads);
                        if constexpr (C::F32) {
                            atomicExch(&bars.kv_exps[s], TileExponents::pack(k_chunk, v_chunk));
                            mbar_arrive(&bars.k_full[s]);
                        }
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
                    mbar_wait(&bars.v_empty[s], parity);
                    if (leader) {
                        mbar_arrive_expect_tx(&bars.v_full[s], PLANES * C::KV_BYTES);
                        load_tile(sV + s * KV_TILE, p.v_map, &bars.v_full[s], BLOCK_N, mods.k_base + (i64)j * BLOCK_N, hk,
                                  kv_heads);
                    }
                    k_pos = next;
                    state = next_state;
                }
            }
        } else if constexpr (C::Q_SPLIT) {
            QSplitT::template run<C::CONSUMER_THREADS + 32, HEADS_FIRST>(p, bars, sQ, sRing);
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
    auto release = [&](u64* empty, int t) { release_bar(&empty[t % STAGES]); };
    const float scale_log2 = float(p.scale_log2);
    // fp32: the exponents e of the halves' chunk scales 2^(14 - e) (halves.cuh), all powers
    // of two, so unscaling is exact. Q's is the work tile's; with each key tile's S, the
    // tile's K and V exponents are read from its stage's words (S is unscaled as it lands
    // by 2^(e_q + e_k - 28)); v_exp_next is V's of the tile whose P is formed next, for its
    // P V: fp32's per-tile sum is unscaled as it is added (pv_unscale), while with one
    // product P V accumulates across tiles, in the scale of V's largest exponent so far
    // (o_exp: the accumulator is rescaled where a tile raises it, and a tile below it takes
    // P times 2^(e_v - o_exp)).
    constexpr int NO_PV = -(1 << 20);   // o_exp before a work tile's first P V
    int q_exp = 0, v_exp_next = 0, o_exp = NO_PV;
    float pv_unscale = 1.f;

    for (int k = 0;; ++k) {
        // The work tile's Q buffer (two with QSplit, in turn).
        const int qb = k % C::Q_BUFFERS;
        const E* const sQk = sQ + qb * Q_TILE;
        mbar_wait(&bars.q_full[qb], (k / C::Q_BUFFERS) & 1);
        const int work_word = read_word(&bars.work[qb]);
        if (work_word == bars.END) break;
        const Sm90Work work = Sm90Work::decode<HEADS_FIRST>(work_word >> 1, p);
        const int h = work.h;
        if constexpr (C::F32) {
            q_exp = halves_exponent(u32(read_word(&bars.q_chunk[qb][warp / 4])));
            o_exp = NO_PV;   // no P V yet
        }
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
        float acc[1][DT][4];
        zero_frags(acc);
        OnlineSoftmax<1> softmax;
        softmax.init();
        float s[1][NT][4];
        u32 p_frag[C::PSTEPS][4];   // P of the tile whose P V is next, as A fragments
        float alpha[1][2];
        // fp32 with the low halves: P's low halves, and one key tile's P V, summed into acc
        // in the FPU.
        constexpr bool F32 = C::F32, SPLIT = C::SPLIT;
        u32 p_low[SPLIT ? C::PSTEPS : 1][4];
        float o_tile[1][SPLIT ? DT : 1][4];

        // S = Q K^T of the t-th key tile (this warpgroup's 64 rows), one batch: the
        // products of planes (0, 0), then fp32's (0, 1) and (1, 0).
        auto issue_s = [&](int t) {
            const E* sKb = sK + (t % STAGES) * KV_TILE;
            wgmma_fence();
            for_each_product<C::PRODUCTS>([&](int pa, int pb, bool first) {
                const E* q = sQk + pa * C::Q_ELEMS;
                const E* k = sKb + pb * C::KV_ELEMS;
                #pragma unroll
                for (int ks = 0; ks < C::KSTEPS; ++ks) {
                    const u64 a = kmajor_desc<E, BLOCK_M>(q, wg_row0, ks), b = kmajor_desc<E, BLOCK_N>(k, 0, ks);
                    if (first && ks == 0)
                        Wgmma<E, BLOCK_N>::template ss<false>(s[0], a, b);
                    else
                        Wgmma<E, BLOCK_N>::template ss<true>(s[0], a, b);
                }
            });
            wgmma_commit();
        };
        // fp32: the t-th key tile's S unscale and V exponent, read from its stage's words
        // while its S is computed (the stage goes back once S has landed).
        float s_unscale = 1.f;
        auto read_tile_scales = [&](int t) {
            if constexpr (F32) {
                const TileExponents e(read_word(&bars.kv_exps[t % STAGES]));
                s_unscale = pow2(q_exp + e.k - 28);
                v_exp_next = e.v;
            }
        };
        auto scale_s = [&](float x) {
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e) s[0][nt][e] *= x;
        };
        // S once its product has landed (fp32: unscaled; in dense mode the unscale folds
        // into the softmax's scale, dense_scale_log2: no product a score).
        float dense_scale_log2 = scale_log2;
        auto land_s = [&]() {
            reg_fence(s[0]);
            if constexpr (F32) {
                if constexpr (C::OPTIONS == MODE_DENSE) {
                    dense_scale_log2 = fmaxf(scale_log2 * s_unscale, MIN_SCALE_LOG2);
                } else {
                    scale_s(s_unscale);
                }
            }
        };
        // O += P V of the t-th key tile, one batch, V read N-major. fp32 with the low
        // halves: o_tile = P_h V_h + P_h V_l + P_l V_h, added to acc once landed (land_pv).
        auto issue_pv = [&](int t) {
            const E* sVb = sV + (t % STAGES) * KV_TILE;
            wgmma_fence();
            if constexpr (SPLIT) {
                for_each_product<C::PRODUCTS>([&](int pa, int pb, bool first) {
                    const E* v = sVb + pb * C::KV_ELEMS;
                    #pragma unroll
                    for (int ks = 0; ks < C::PSTEPS; ++ks) {
                        const u32 (&a)[4] = pa ? p_low[ks] : p_frag[ks];
                        if (first && ks == 0)
                            Wgmma<E, D>::template rs<false>(o_tile[0], a, mnmajor_desc<E, BLOCK_N>(v, ks));
                        else
                            Wgmma<E, D>::template rs<true>(o_tile[0], a, mnmajor_desc<E, BLOCK_N>(v, ks));
                    }
                });
            } else {
                #pragma unroll
                for (int ks = 0; ks < C::PSTEPS; ++ks)
                    Wgmma<E, D>::template rs<true>(acc[0], p_frag[ks], mnmajor_desc<E, BLOCK_N>(sVb, ks));
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
                    // (The key schedule added up from the seed: read from the parameters'
                    // table, philox.cuh RoundKeys, the causal forward ran 0.98x, H200.)
                    return head_mods.template keep_bits<NT>(q0 + warp_row0, jt * BLOCK_N, head_mods.seed);
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
                if constexpr (!F32) {
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
                grew = softmax.fold(s, dense_scale_log2, alpha);
            }
            return grew;
        };
        auto land_pv = [&]() {
            if constexpr (SPLIT) {
                reg_fence(o_tile[0]);
                #pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) acc[0][dt][e] = fma(o_tile[0][dt][e], pv_unscale, acc[0][dt][e]);
            } else {
                reg_fence(acc[0]);
            }
        };
        // P into A fragments; p_frag must not change while a P V that reads it is in flight
        // (and fp32's scale of its P V: any earlier one has landed). fp32 with the low
        // halves: P times P_SCALE in high and low halves.
        auto round_p = [&]() {
            if constexpr (SPLIT) pv_unscale = pow2(v_exp_next - 14) / C::P_SCALE;
            if constexpr (C::ONE_PRODUCT) {
                if (v_exp_next > o_exp) {
                    if (o_exp != NO_PV) {
                        float raise[1][2];
                        raise[0][0] = raise[0][1] = pow2(o_exp - v_exp_next);
                        softmax.rescale(acc, raise);
                    }
                    o_exp = v_exp_next;
                } else if (v_exp_next < o_exp) {
                    scale_s(pow2(v_exp_next - o_exp));
                }
            }
            #pragma unroll
            for (int ks = 0; ks < C::PSTEPS; ++ks) {
                if constexpr (SPLIT)
                    c_to_split_a_frags(p_frag[ks], p_low[ks], s, 0, ks, C::P_SCALE);
                else
                    c_to_a_frag<E>(p_frag[ks], s, 0, ks);
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
                wait_full(bars.k_full, t);
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
        // C::SERIAL (fp32 at d = 128 with the options): each key tile's S, then its P V,
        // in turn; Q goes back once the last S has landed.
        if constexpr (C::SERIAL) {
            for (bool last = (work_word & 1) != 0; !last; ++t) {
                int jt;
                bool masked;
                visited(t, jt, masked, last);
                wait_full(bars.k_full, t);
                issue_s(t);
                read_tile_scales(t);
                const u64 keep = keep_bits(jt);
                wgmma_wait<0>();
                land_s();
                if (last) release_bar(&bars.q_empty[qb]);
                release(bars.k_empty, t);
                BiasPairs bias;
                bias_tile(t, jt, bias);
                const bool grew = softmax_tile(jt, masked, keep, bias);
                round_p();
                wait_full(bars.v_full, t);
                issue_pv(t);
                if (grew) softmax.rescale(acc, alpha);
                wgmma_wait<0>();
                land_pv();
                release(bars.v_empty, t);
            }
            if (work_word & 1) release_bar(&bars.q_empty[qb]);
        } else if ((work_word & 1) == 0) {
            int jt;
            bool masked, last;
            visited(t, jt, masked, last);
            wait_full(bars.k_full, t);
            issue_s(t);
            read_tile_scales(t);
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
                wait_full(bars.k_full, t + 1);
                wait_full(bars.v_full, t);
                issue_s(t + 1);
                issue_pv(t);
                read_tile_scales(t + 1);
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
            release_bar(&bars.q_empty[qb]);
            wait_full(bars.v_full, t);
            issue_pv(t);
            wgmma_wait<0>();
            land_pv();
            release(bars.v_empty, t);
            ++t;
        } else {
            release_bar(&bars.q_empty[qb]);
        }

        float row_lse[1][2];
        // fp32 with one product: O in V's scale of o_exp (no P V at all: O is 0).
        const float o_unscale = C::ONE_PRODUCT && o_exp != NO_PV ? pow2(o_exp - 14) : 1.f;
        softmax.finalize(acc, row_lse, (mods.dropout() ? mods.drop_scale : 1.f) * o_unscale);

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
                        if constexpr (F32)
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
