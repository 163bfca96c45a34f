// Strided (batch, head, row, col) tensors as the kernels read them. The last axis
// is contiguous (checked on the host); the other strides are in elements and 64-bit,
// so B*H*N*d may pass 2^31. Every tensor reaches a kernel as a TensorParams of the
// contract (params.cuh); tensor<T>() gives its typed view.
#pragma once
#include "elem.cuh"
#include "params.cuh"

template <typename T>
struct Strided {
    T* ptr;
    i64 batch, head, row;
    __device__ __forceinline__ T* at(int b, int h, i64 r) const {
        return ptr + b * batch + h * head + r * row;
    }
};

template <typename T>
__device__ __forceinline__ Strided<T> tensor(const TensorParams& t) {
    return {static_cast<T*>(const_cast<void*>(t.ptr)), t.batch, t.head, t.row};
}
