// How many independent DMMA chains keep Hopper's fp64 tensor pipe busy (#16): each warp
// runs CHAINS accumulators through ITERS dependent mma.m16n8k8.f64 each, with WARPS warps
// per SM sub-partition (4 * WARPS a CTA, one CTA per SM). Prints cycles per DMMA per
// sub-partition (32 at the 67 TFLOP/s peak) and the latency of one chain's step.
// Build and run: nvcc -arch=sm_90a -o /tmp/dmma_chains bench/dmma_chains.cu && /tmp/dmma_chains
#include <cstdio>

constexpr int ITERS = 4096;

template <int CHAINS>
__global__ void chains(double* out, long long* cycles) {
    double a0 = threadIdx.x * 1e-3, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = 0.5, b1 = 0.25;
    double c[CHAINS][4];
    for (int i = 0; i < CHAINS; ++i)
        for (int e = 0; e < 4; ++e) c[i][e] = i + e;
    __syncthreads();
    const long long start = clock64();
    for (int it = 0; it < ITERS; ++it) {
        #pragma unroll
        for (int i = 0; i < CHAINS; ++i)
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                : "+d"(c[i][0]), "+d"(c[i][1]), "+d"(c[i][2]), "+d"(c[i][3])
                : "d"(a0), "d"(a1), "d"(a2), "d"(a3), "d"(b0), "d"(b1));
    }
    __syncthreads();
    const long long stop = clock64();
    double sum = 0;
    for (int i = 0; i < CHAINS; ++i) sum += c[i][0] + c[i][1] + c[i][2] + c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
    if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

template <int CHAINS>
void run(int warps_per_smsp, int sms, double* out, long long* cycles) {
    chains<CHAINS><<<sms, 128 * warps_per_smsp>>>(out, cycles);
    long long host[1024];
    cudaMemcpy(host, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
    double mean = 0;
    for (int i = 0; i < sms; ++i) mean += host[i];
    mean /= sms;
    const double dmma_per_smsp = double(ITERS) * CHAINS * warps_per_smsp;
    printf("chains %2d  warps/SMSP %d  cycles/DMMA/SMSP %6.1f  step latency (1 warp) %6.1f\n", CHAINS,
           warps_per_smsp, mean / dmma_per_smsp, mean / ITERS);
}

int main() {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    double* out;
    long long* cycles;
    cudaMalloc(&out, sms * 1024 * sizeof(double));
    cudaMalloc(&cycles, sms * sizeof(long long));
    for (int w = 1; w <= 4; w *= 2) {
        run<1>(w, sms, out, cycles);
        run<2>(w, sms, out, cycles);
        run<3>(w, sms, out, cycles);
        run<4>(w, sms, out, cycles);
        run<6>(w, sms, out, cycles);
        run<8>(w, sms, out, cycles);
    }
    printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
    return 0;
}
