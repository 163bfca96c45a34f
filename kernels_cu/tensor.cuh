// Strided (batch, head, row, col) tensors as the kernels receive them. The last axis
// is contiguous (checked on the host); the other strides are in elements and 64-bit,
// so B*H*N*d may pass 2^31. The host passes each tensor as four kernel arguments,
// which TENSOR_ARG declares and TENSOR rebuilds.
#pragma once
#include "elem.cuh"

template <typename T>
struct Strided {
    T* ptr;
    i64 batch, head, row;
    __device__ __forceinline__ T* at(int b, int h, i64 r) const {
        return ptr + b * batch + h * head + r * row;
    }
};

#define TENSOR_ARG(T, name) T* __restrict__ name##_ptr, i64 name##_sb, i64 name##_sh, i64 name##_sn
#define TENSOR(T, name) Strided<T>{name##_ptr, name##_sb, name##_sh, name##_sn}
