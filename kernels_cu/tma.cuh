// Hopper's tensor memory accelerator (TMA, sm_90): bulk tensor copies from global to
// shared memory that complete on an mbarrier, and the mbarrier operations a producer and
// its consumers synchronise with.
//
// A tensor map (CUtensorMap, 128 opaque bytes) describes one (B, H, N, d) tensor: its
// base, extents and byte strides, the box one copy moves and the shared-memory swizzle.
// The host encodes it (cupyflash/_tma.py, the driver's cuTensorMapEncodeTiled) and passes
// it by value as a __grid_constant__ kernel parameter, so the copy engine reads it from
// the parameter space. Elements outside the extents arrive as zeros: sequence tails and
// head-dim padding need no bounds code.
//
// mbarrier protocol (PTX ISA, "Parallel Synchronization and Communication Instructions:
// mbarrier"): a barrier completes a phase when its pending arrivals reach zero and its
// expected transaction bytes have all landed; waiters name the phase by its parity. A
// "full" barrier takes one arrival from the producer (which announces the bytes of the
// copies) plus the copies' bytes; an "empty" barrier takes one arrival per consumer warp
// that has finished reading the stage.
#pragma once
#include "elem.cuh"
#include "copy.cuh"
#include "params.cuh"   // TmaMap

__device__ __forceinline__ void mbar_init(u64* bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes the initialised barriers visible to the copy engine (and, after a CTA barrier,
// to the other threads).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n"
                 :: "r"(smem_addr(bar)) : "memory");
}
// A word another warp wrote into shared memory before arriving on an mbarrier that this
// warp has waited for (a work tile's or unit's number): lane 0 reads it with an atomic,
// which the compiler keeps after the wait, and every lane gets it.
__device__ __forceinline__ int read_published(int* word) {
    int x = 0;
    if (threadIdx.x % 32 == 0) x = atomicAdd(word, 0);
    return __shfl_sync(0xffffffffu, x, 0);
}
// The producer's arrival on a full barrier, announcing `bytes` of copies to wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Wait until the phase of parity `parity` has completed. A fresh barrier is in phase 0,
// so waiting for parity 1 returns at once: that is how a producer finds every stage
// empty on its first round.
// Debugging a hang: compiled with -DCUPYFLASH_WATCHDOG, a thread whose wait has spun for
// ~2^31 clocks records (block, thread, the barrier's shared address, the parity, the
// barrier's 64-bit state) once into the host-mapped words at mbar_watchdog_log (word 0
// counts the records), which the host reads while the kernel hangs; the host sets the
// pointer through the module's global (bench/hang_probe.py does both).
#ifdef CUPYFLASH_WATCHDOG
extern "C" __device__ unsigned* mbar_watchdog_log;
__device__ unsigned* mbar_watchdog_log;
#endif
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done;
#ifdef CUPYFLASH_WATCHDOG
    const long long start = clock64();
    bool logged = false;
#endif
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
#ifdef CUPYFLASH_WATCHDOG
        if (!done && !logged && mbar_watchdog_log != nullptr && clock64() - start > (1ll << 31)) {
            logged = true;
            const unsigned i = atomicAdd(mbar_watchdog_log, 1u);
            if (i < 4096) {
                unsigned* r = mbar_watchdog_log + 1 + 6 * i;
                r[0] = blockIdx.x;
                r[1] = threadIdx.x;
                r[2] = smem_addr(bar);
                r[3] = parity;
                const u64 state = *reinterpret_cast<volatile u64*>(bar);   // the barrier's opaque state
                r[4] = u32(state);
                r[5] = u32(state >> 32);
            }
            __threadfence_system();
        }
#endif
    } while (!done);
}

// One box of a 4-D tensor map at coordinates (c0 innermost: the head-dim column; c1 row;
// c2 head; c3 batch) into shared memory at `dst` (a shared-window address, 1024-byte aligned
// for the 128-byte swizzle), its bytes counted on `bar`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap& map, u64* bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                    "r"(smem_addr(bar))
                 : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaMap& map, u64* bar, int c0, int c1, int c2, int c3) {
    tma_load_4d(smem_addr(dst), map, bar, c0, c1, c2, c3);
}

// A tile of `rows` rows of D columns from row0 on (the map's coordinates) into `dst`, in
// boxes of PANEL columns, panel after panel, each PLANES times: plane p of head `head` is
// head head + p heads of the map (fp32's fp16 halves, split_f32.cu: the low plane after the
// high one), and lands after plane p - 1's panels.
template <int PLANES, int D, int PANEL, typename E>
__device__ __forceinline__ void tma_load_planes(E* dst, const TmaMap& map, u64* bar, int rows, int row0, int head,
                                                int heads, int batch) {
    #pragma unroll
    for (int plane = 0; plane < PLANES; ++plane)
        #pragma unroll
        for (int panel = 0; panel < D / PANEL; ++panel)
            tma_load_4d(dst + (plane * D / PANEL + panel) * rows * PANEL, map, bar, panel * PANEL, row0,
                        head + plane * heads, batch);
}

// Register budgets of warp-specialised kernels (sm_90a): the producer warpgroup gives
// registers back, the consumers take them. Both need the kernel's launch bound with one
// CTA per SM (__launch_bounds__(threads, 1)), and every warp of a warpgroup executes them.
template <int REGS> __device__ __forceinline__ void warpgroup_release_regs() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
template <int REGS> __device__ __forceinline__ void warpgroup_claim_regs() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
// What the consumers may claim (a multiple of 8, at most 240) once one producer warpgroup
// keeps PRODUCER_REGS: the registers the CTA was launched with, not the whole 64K file.
// setmaxnreg only moves registers between the CTA's warps; a claim beyond what the
// others released waits forever (at 384 threads the launch holds 168 a thread, 64512).
template <int THREADS, int PRODUCER_REGS>
struct WarpgroupRegs {
    static constexpr int LAUNCH = 65536 / THREADS / 8 * 8;
    static constexpr int FREE = (LAUNCH * THREADS - 128 * PRODUCER_REGS) / (THREADS - 128) / 8 * 8;
    static constexpr int CONSUMER = FREE < 240 ? FREE : 240;
    static_assert(PRODUCER_REGS <= LAUNCH && CONSUMER >= LAUNCH, "a producer that gives registers back");
};

// This thread's shared-memory writes (cp.async included) made visible to the async proxy:
// to wgmma's operand reads and to bulk copies (after a barrier for other threads' reads).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Bulk reductions from shared to global memory (sm_90): one thread adds `bytes` (a
// multiple of 16; both addresses 16-byte aligned) of floats or doubles at `src` into
// `dst`, in L2, without the SM waiting. The copy engine reads the source asynchronously:
// the writers of `src` make their writes visible to it first (fence_async_smem, then a
// barrier), and the issuing thread waits for the reads (bulk_wait_read) before `src` is
// written again.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_reduce_add(double* dst, const double* src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f64 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
// Closes this thread's bulk operations issued so far into one group.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's groups still read their shared-memory sources.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// Until at most N of this thread's groups are incomplete (their writes performed).
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}

// Turn-taking between CTAs around bulk reductions (bwd.cuh DqTurns). A CTA waits until
// `*turn` reaches `ahead`, then issues its reduction; once that has completed, it passes
// the turn on. The proxy fences order the bulk copies (the async proxy) with the counter's
// generic accesses on either side.
__device__ __forceinline__ u32 load_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// A bounded spin (seconds): an accounting that ever disagreed with the walks traps
// instead of hanging the GPU.
__device__ __forceinline__ void wait_turn(const u32* turn, u32 ahead) {
    for (u32 spins = 0; load_acquire_gpu(turn) != ahead; ++spins) {
        if (spins == (1u << 26)) __trap();
        __nanosleep(64);
    }
    fence_proxy_async_global();
}
// After this thread's bulk groups have completed (bulk_wait<0>).
__device__ __forceinline__ void pass_turn(u32* turn) {
    fence_proxy_async_global();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" :: "l"(turn) : "memory");
}
// Without turns: counts this thread's completed reductions (after bulk_wait<0>) into
// `*done` and returns how many had been counted before, so that the one that completes a
// sum may read it back (acquire: each other reduction was counted after it completed,
// with release).
__device__ __forceinline__ u32 count_completed(u32* done) {
    fence_proxy_async_global();
    u32 before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(before) : "l"(done) : "memory");
    return before;
}
