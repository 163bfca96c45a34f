// Test kernel for exp2_f64.cuh: tests/test_exp2_f64.py builds it for sm_80 and sm_90a and,
// on a GPU, compares what it returns with the module's exact emulation bit for bit.
#include "exp2_f64.cuh"

__global__ void exp2_f64_kernel(const double* x, double* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = exp2_f64(x[i]);
}
