"""How close the backward's element-wise passes are to what the GPU's memory gives: the
dQ conversion's shape (fp32 in, 16-bit out) and the pre-pass's zeroing, each as the
library runs it and in a few alternative forms, and plain copies beside them.

    python bench/pass_bandwidth_probe.py [--rows 16384] [--cols 2048]

Rows x cols is (B N, H d) of the grid's shapes: 16k x 2048, 128 MB of fp32. Prints
microseconds and TB/s (bytes read + written) per form, CUDA events over 20 launches.
"""

import argparse

import cupy as cp

SOURCE = r"""
#include <cuda_bf16.h>
// VEC float4s a thread, blockDim apart, all loads first.
template <int VEC>
__device__ void convert_vec(const float4* __restrict__ src, uint2* __restrict__ dst, long long n4, float scale) {
    long long i0 = (long long)blockIdx.x * blockDim.x * VEC + threadIdx.x;
    float4 v[VEC];
    #pragma unroll
    for (int k = 0; k < VEC; ++k) { long long i = i0 + (long long)k * blockDim.x; if (i < n4) v[k] = __ldcs(src + i); }
    #pragma unroll
    for (int k = 0; k < VEC; ++k) {
        long long i = i0 + (long long)k * blockDim.x;
        if (i >= n4) break;
        __nv_bfloat162 a = __floats2bfloat162_rn(v[k].x * scale, v[k].y * scale), b = __floats2bfloat162_rn(v[k].z * scale, v[k].w * scale);
        dst[i] = make_uint2(*reinterpret_cast<unsigned*>(&a), *reinterpret_cast<unsigned*>(&b));
    }
}
extern "C" {
// The library's conversion (bwd_prep.cu flash_bwd_dq_convert's vector path): 4 elements a thread.
__global__ void convert4(const float4* __restrict__ src, uint2* __restrict__ dst, long long n4, float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    float4 v = src[i];
    __nv_bfloat162 a = __floats2bfloat162_rn(v.x * scale, v.y * scale), b = __floats2bfloat162_rn(v.z * scale, v.w * scale);
    dst[i] = make_uint2(*reinterpret_cast<unsigned*>(&a), *reinterpret_cast<unsigned*>(&b));
}
__global__ void convert_vec2(const float4* s, uint2* d, long long n, float c) { convert_vec<2>(s, d, n, c); }
__global__ void convert_vec4(const float4* s, uint2* d, long long n, float c) { convert_vec<4>(s, d, n, c); }
__global__ void convert_vec8(const float4* s, uint2* d, long long n, float c) { convert_vec<8>(s, d, n, c); }
// Grid-stride, one float4 at a time, as many CTAs as fill the GPU.
__global__ void convert_stride(const float4* __restrict__ src, uint2* __restrict__ dst, long long n4, float scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = src[i];
        __nv_bfloat162 a = __floats2bfloat162_rn(v.x * scale, v.y * scale), b = __floats2bfloat162_rn(v.z * scale, v.w * scale);
        dst[i] = make_uint2(*reinterpret_cast<unsigned*>(&a), *reinterpret_cast<unsigned*>(&b));
    }
}
// Zeroing, 16 bytes a store, VEC a thread.
__global__ void zero4(uint4* dst, long long n16) {
    long long i0 = (long long)blockIdx.x * blockDim.x * 4 + threadIdx.x;
    #pragma unroll
    for (int k = 0; k < 4; ++k) { long long i = i0 + (long long)k * blockDim.x; if (i < n16) dst[i] = make_uint4(0, 0, 0, 0); }
}
__global__ void read_only(const float4* __restrict__ src, float* out, long long n4) {
    long long i0 = (long long)blockIdx.x * blockDim.x * 4 + threadIdx.x;
    float acc = 0;
    #pragma unroll
    for (int k = 0; k < 4; ++k) { long long i = i0 + (long long)k * blockDim.x; if (i < n4) { float4 v = src[i]; acc += v.x + v.y + v.z + v.w; } }
    if (acc == 12345.f) out[0] = acc;
}
}
"""

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, default=16384)
p.add_argument("--cols", type=int, default=2048)
a = p.parse_args()
mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
n = a.rows * a.cols
src = cp.random.standard_normal(n, dtype=cp.float32)
dst = cp.empty(n, dtype=cp.uint16)
n4 = n // 4
sms = cp.cuda.Device().attributes["MultiProcessorCount"]


def time_us(launch, reps=20):
    launch()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        launch()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / reps * 1e3


def report(name, us, nbytes):
    print(f"{name:34} {us:8.1f} us  {nbytes / us / 1e6:6.2f} TB/s", flush=True)


conv_bytes = n * 4 + n * 2
for name, vec in (("convert4 (the library's)", 1), ("convert_vec2", 2), ("convert_vec4", 4), ("convert_vec8", 8)):
    k = mod.get_function("convert4" if vec == 1 else f"convert_vec{vec}")
    grid = (-(-n4 // (256 * vec)),)
    report(name, time_us(lambda: k(grid, (256,), (src, dst, cp.int64(n4), cp.float32(0.125)))), conv_bytes)
k = mod.get_function("convert_stride")
for per_sm in (4, 8, 16):
    report(f"convert_stride {per_sm} CTAs/SM", time_us(lambda: k((sms * per_sm,), (256,), (src, dst, cp.int64(n4), cp.float32(0.125)))), conv_bytes)
# (The zeroing rows write over src: the conversions above have run.)
zero = mod.get_function("zero4")
report("zero4 (128 MB)", time_us(lambda: zero((-(-(n // 4) // 1024),), (256,), (src, cp.int64(n // 4)))), n * 4)
report("cupy memset (128 MB)", time_us(lambda: src.fill(0)), n * 4)
out = cp.zeros(1, cp.float32)
ro = mod.get_function("read_only")
report("read only (128 MB)", time_us(lambda: ro((-(-n4 // 1024),), (256,), (src, out, cp.int64(n4)))), n * 4)
big = cp.empty(n, dtype=cp.float32)
report("cupy copy fp32 (128 MB + 128 MB)", time_us(lambda: cp.copyto(big, src)), n * 8)
