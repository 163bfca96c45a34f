// Which keys a query row sees, and which key tiles a query block must visit.
// Mirrors cupyflash/_masks.py; the masks issue extends these same functions.
//
// Causal is bottom-right aligned (flash-attn >= 2.1): row i sees key j iff
// j <= i + (nk - nq). Everything here is in absolute row/key indices.
#pragma once
#include "elem.cuh"

struct MaskInfo {
    int nq, nk;
    int causal;

    // One past the last key row `i` may see (before clipping to nk).
    __device__ __forceinline__ int key_limit(int i) const {
        return causal ? i + (nk - nq) + 1 : nk;
    }
    __device__ __forceinline__ bool visible(int i, int j) const {
        return j < nk && j < key_limit(i);
    }
    // Key tiles [0, stop) that the query rows [q0, q1) touch; tiles past it are skipped.
    __device__ __forceinline__ int key_tile_stop(int q0, int q1, int block_n) const {
        int last = causal ? min(nk, key_limit(q1 - 1)) : nk;
        return last <= 0 ? 0 : (last + block_n - 1) / block_n;
    }
    // A tile needs an elementwise mask only if some (row, key) in it is hidden: it
    // crosses the diagonal or runs past nk. All other tiles skip the predicate.
    __device__ __forceinline__ bool tile_needs_mask(int q0, int k0, int k1) const {
        return k1 > nk || (causal && k1 > key_limit(q0));
    }
    // Hide (-inf) what a row may not see in scores held as mma C fragments: element e of
    // n-tile nt of m-tile mt is row row0 + 16 mt + g + 8 (e / 2), key k0 + 8 nt + 2 t + e % 2
    // (g = lane / 4, t = lane % 4).
    template <int MT, int NT, typename Acc>
    __device__ __forceinline__ void apply(Acc (&s)[MT][NT][4], int row0, int k0) const {
        const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!visible(row0 + mt * 16 + g + (e / 2) * 8, k0 + nt * 8 + 2 * t + (e % 2)))
                        s[mt][nt][e] = -INFINITY;
    }
};
