// Host API of the CUDA reduction kernels: one standalone grid-stride kernel
// launch each for a reduction and for a byte copy. The device code itself is
// in cuda_reduce.cuh, so that other kernels can run it inline.
//
// Same contract as cpu_reduce.h: sources are combined in the listed order,
// fp16/bf16 accumulate in fp32 and round once, integers wrap, AVG divides by
// `divisor` at the end; for the same inputs the bits equal the CPU kernels'
// (NaN results of arithmetic ops excepted: the GPU returns its canonical NaN).
//
// Plain C++: compiles without the CUDA headers (the stream type is only
// forward-declared), so torch-free host code can call it.
#pragma once

#include <cstdint>

#include "cpu_reduce.h"

// The CUDA runtime's own declaration, repeated so this header needs no CUDA
// headers; a repeated typedef of the same type is legal C++.
typedef struct CUstream_st* cudaStream_t;

namespace xdev::kernels::cuda {

// Most sources one reduction takes (the kernel's parameter block holds them).
constexpr int kMaxSources = 16;

// dst[i] = op(srcs[0][i], ..., srcs[n-1][i]) for i in [0, count); for kAvg
// with divisor > 0 the result is then divided by divisor (other ops ignore
// divisor, as cpu_reduce.h does). srcs is a host array of n device pointers
// (1 <= n <= kMaxSources), which may point into peers' memory; dst may be
// one of the sources (in place). Enqueued on stream; throws
// std::invalid_argument for bad arguments and std::runtime_error when the
// launch fails.
void launch_reduce(DType dtype, ReduceOp op, void* dst, const void* const* srcs, int n,
                   int64_t count, int64_t divisor, cudaStream_t stream);

// Copies bytes from src to dst (device pointers, not overlapping) on stream.
void launch_copy(void* dst, const void* src, int64_t bytes, cudaStream_t stream);

}  // namespace xdev::kernels::cuda
