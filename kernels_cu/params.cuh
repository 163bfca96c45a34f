// The one contract between the host and every kernel: each kernel takes a single
// AttnParams by value as a __grid_constant__ parameter (it lives in the parameter space;
// a TMA copy reads its tensor maps from there).
//
// cupyflash/_params.py mirrors this layout field by field, and tests/test_params.py
// compiles static_asserts generated from that mirror (offset and size of every field)
// with NVRTC, so the two sides cannot drift apart without the CPU tier failing.
// Fields a kernel does not use are zero (null pointers for options that are off).
#pragma once
#include "elem.cuh"

// A CUtensorMap: 128 opaque bytes that the driver encodes (cupyflash/_tma.py).
struct __align__(64) TmaMap { u64 opaque[16]; };

// A (batch, head, row, col) tensor: its base and the element strides of the first three
// axes (64-bit, so B*H*N*d may pass 2^31); the last axis is contiguous.
struct TensorParams {
    const void* ptr;
    i64 batch, head, row;
};

// The options beyond causal (mods.cuh reads them; cupyflash/_mods.py has the semantics).
// Pointers are null where an option is off; strides are in elements, 0 on the axes an
// option array broadcasts over.
struct ModsParams {
    const int* cu_q;                    // varlen: (S + 1,) sequence starts of q and k
    const int* cu_k;
    const int* seqlens_k;               // key padding: (B,) keys per batch entry
    const unsigned char* bmask;         // block mask (Bm, Hm, Nq / block_q, Nk / block_k)
    i64 bmask_sb, bmask_sh, bmask_sq;
    const void* bias;                   // additive bias (Bb, Hb, Nqb, Nkb), input dtype
    i64 bias_sb, bias_sh, bias_sq, bias_sk;
    const void* alibi;                  // ALiBi slopes (Ba, Hq), accumulation dtype
    i64 alibi_sb;
    u64 rng_seed, rng_offset;           // dropout's Philox key and first stream
    double softcap;                     // 0: off
    double drop_scale;                  // 1 / (1 - p) of the drawn keep probability
    int win_left, win_right;            // window sides, -1 unbounded
    int block_q, block_k;               // the block mask's block size
    u32 drop_threshold;                 // philox.cuh: 0 = no dropout, else the byte threshold
    int bias_tma;                       // 1: AttnParams::bias_map describes the bias (whole rows)
    // Where the call lies in its problem (mask.cuh MaskInfo::off, mods.cuh Mods::drop_base):
    // a chunk pair of a streamed call (cupyflash/streaming.py) is a call of its own, but
    // its band, ALiBi and dropout are the whole problem's. row0 and key0 are the problem's
    // coordinates of the call's query row 0 and key 0, multiples of 32 (dropout is drawn
    // in whole Philox blocks of 16 rows x 32 keys, philox.cuh: rows need only 16; the
    // host asks 32 of both, cupyflash/_mods.py ORIGIN_ALIGN); diag is the problem's
    // Nk - Nq. A call that is its own problem has 0, 0 and its own nk - nq. Varlen
    // sequences are their own problems: each takes its own corner and these are 0. Only
    // the MODE_EXT kernels read them; the host gives a placed call no dense kernel.
    int row0, key0;
    int diag;
    // Dropout's Philox key schedule (philox.cuh RoundKeys, _philox.round_keys): round r's
    // key at 2 r, 2 r + 1, for the 10 rounds (PHILOX_ROUNDS, mods.cuh checks), from
    // rng_seed; written only where dropout is on. The Hopper backward's keep bits at
    // d <= 64 read it (a round's key a constant-bank operand, not two adds a call); the
    // other kernels draw from rng_seed.
    u32 rng_round_keys[20];
};

struct AttnParams {
    TmaMap q_map, k_map, v_map;         // the Hopper kernels' tensor maps (fwd_sm90.cu, bwd_sm90.cu)
    TmaMap bias_map;                    // the bias, where mods.bias_tma (Hopper kernels)
    TmaMap dout_map;                    // the backward's dO
    TmaMap rows_map;                    // the backward's lse2 and delta rows, one (2, B, Hq, nq_pad) array (bwd_sm90.cu)
    TensorParams q, k, v, o;            // (B, H, N, d) views; o is written by the forward
    TensorParams dout, dq, dk, dv;      // the backward's gradient views
    void* lse;                          // (B, Hq, Nq) log-sum-exp, accumulation dtype
    void* lse2;                         // the backward's padded row workspaces (bwd.cuh)
    void* delta;
    void* dq_accum;                     // dQ accumulator (B, Hq, nq, dq_ld) of the key-block kernels that add dQ,
                                        // zeroed by the pre-pass (bwd_prep.cu); or null
    u32* dq_order;                      // deterministic dQ on Hopper: a turn counter per (batch, query head,
                                        // query tile), zeroed (bwd.cuh DqTurns), or null
    void* dbias;                        // dbias accumulator (compact bias shape), or null
    i64 dbias_sb, dbias_sh, dbias_sq, dbias_sk;
    int* work_counter;                  // the Hopper kernels' work scheduler (below), or null; the
                                        // Hopper backward's split units' piece counters follow it
    void* kv_partial;                   // the Hopper backward's split units' fp32 dK and dV sums, zeroed, or null
    // fp32 on the Hopper kernels (fwd_sm90.cu, bwd_sm90.cu): q, k, v (and the backward's dO)
    // as fp16 halves (halves.cuh), each a contiguous (B, PLANES, H, N, d) array written by
    // split_f32.cu, and the bits of each tensor's largest finite |x| (HALVES_Q, _K, _V,
    // _DO; zeroed by the host), which give the halves' scales, where the passes find them
    // (the backward, varlen); null elsewhere. The forward scales each chunk of
    // HALVES_CHUNK_ROWS rows on its own: halves_chunk_max holds the bits of each chunk's
    // largest finite |x| (halves.cuh halves_chunk_word: halves_chunks words a tensor, head
    // and batch entry), or null (the backward). A forward kernel that splits q itself
    // (fwd_sm90.cu QSplit; the host's Variant.splits_q) has its passes write k and v alone,
    // and halves_q null.
    void* halves_q;
    void* halves_k;
    void* halves_v;
    void* halves_do;
    u32* halves_max;
    u32* halves_chunk_max;
    double scale;                       // softmax scale
    double scale_log2;                  // scale * log2(e), > 0 (the host clamps it)
    int group;                          // query heads per kv head
    int nq, nk;                         // rows of q and k (the longest sequence under varlen)
    int d, dim_v;                       // head dims of q/k and of v
    int nq_pad;                         // rows of the backward's workspaces per head
    int dq_ld;                          // row stride of dq_accum (d, or a Hopper kernel's padded rows)
    int causal;
    int vec;                            // every row 16-byte aligned: wide copies
    int halves_chunks;                  // chunks of HALVES_CHUNK_ROWS rows of the longest fp32 halves array
    int halves_first;                   // the first tensor split_f32.cu's passes write (HALVES_Q, or HALVES_K
                                        // for a forward kernel that splits q itself)
    // A launch's query tiles, (query tile, head, batch entry): the Hopper forward's work
    // tiles, numbered in the order fwd_sm90.cu decodes: CTA i starts at tile i and, with a
    // (zeroed) work_counter, takes tile gridDim.x + atomicAdd(work_counter, 1) next
    // (persistent CTAs); without one, tile i + gridDim.x. The Hopper backward's dq_order
    // counters, one per tile (under varlen grid_m covers the longest sequence).
    int grid_m, grid_heads, grid_batch;
    // The Hopper backward's key blocks a head: its units are (key block, kv head, batch
    // entry) of grid_n x grid_heads / group x grid_batch, taken from work_counter
    // (bwd_sm90.cu Sm90BwdUnits).
    int grid_n;
    // Its units from whole_units on come in unit_pieces pieces each (1: none split).
    int whole_units, unit_pieces;
    ModsParams mods;
};

