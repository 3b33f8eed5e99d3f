// CPU reduction kernels: dst = op(src[0], src[1], ..., src[n-1]) elementwise.
//
// Sources are combined in the listed order with one accumulator per element,
// so the same inputs give the same bits every time. fp16 and bf16 accumulate
// in fp32 and round once at the end; integers wrap like torch's integer ops.
#pragma once

#include <cstddef>
#include <cstdint>

namespace xdev::kernels {

enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16, kInt8, kUInt8, kInt32, kInt64 };
enum class ReduceOp { kSum, kAvg, kMin, kMax, kProduct };

size_t element_size(DType t);
const char* to_string(DType t);
const char* to_string(ReduceOp op);

// Where dst's cache lines are when a reduction starts.
enum class DstLines {
  kLocal,  // private to this core or in memory
  // In another core's cache, and dst is one of the sources: the kernel fetches
  // that source for ownership a block ahead, so each line comes over once
  // instead of being read shared and then invalidated in the other cache.
  kPeerCache,
};

// Reduces num_sources arrays of count elements into dst, and into dst2 too
// when it is not null. dst and dst2 may each be one of the sources exactly
// (same address: an in-place reduction) but must not partly overlap a source
// or each other. divisor > 0 divides the result by it (AVG's final step;
// integers truncate toward zero).
void reduce(DType dtype, ReduceOp op, void* dst, const void* const* sources, int num_sources,
            int64_t count, int64_t divisor, void* dst2 = nullptr,
            DstLines dst_lines = DstLines::kLocal);

// memcpy that leaves src's cache lines owned by this core: for a source that
// another core wrote and this core writes next, which then needs no second
// trip to the other cache. dst and src must not overlap.
void copy_taking_source(void* dst, const void* src, size_t bytes);

}  // namespace xdev::kernels
