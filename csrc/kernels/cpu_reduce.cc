#include "cpu_reduce.h"

#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace xdev::kernels {
namespace {

namespace baseline {
#include "cpu_reduce_loops.inc"
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__)
#define XDEV_HAVE_AVX2_KERNELS 1
#pragma GCC push_options
// prfchw: prefetchw, which asks for a line in exclusive state (a no-op on
// CPUs without it). f16c: fp16 <-> fp32 conversions (every AVX2 CPU has them).
#pragma GCC target("avx2,f16c,prfchw")
#include <immintrin.h>
#define XDEV_REDUCE_F16C 1
namespace avx2 {
#include "cpu_reduce_loops.inc"
}  // namespace avx2
#undef XDEV_REDUCE_F16C
#pragma GCC pop_options
#endif

}  // namespace

size_t element_size(DType t) {
  switch (t) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
      return 1;
  }
  return 0;
}

const char* to_string(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "SUM";
    case ReduceOp::kAvg:
      return "AVG";
    case ReduceOp::kMin:
      return "MIN";
    case ReduceOp::kMax:
      return "MAX";
    case ReduceOp::kProduct:
      return "PRODUCT";
  }
  return "unknown";
}

namespace {

#if defined(XDEV_HAVE_AVX2_KERNELS)
// The CPU's features do not change while we run: decide once.
bool use_avx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}
#endif

}  // namespace

void reduce(DType dtype, ReduceOp op, void* dst, const void* const* sources, int num_sources,
            int64_t count, int64_t divisor, void* dst2, DstLines dst_lines) {
  if (num_sources < 1) throw std::invalid_argument("reduce: needs at least one source");
  if (count <= 0) return;
  if (op != ReduceOp::kAvg) divisor = 0;
#if defined(XDEV_HAVE_AVX2_KERNELS)
  if (use_avx2()) {
    return avx2::reduce_any(dtype, op, dst, dst2, sources, num_sources, count, divisor, dst_lines);
  }
#endif
  baseline::reduce_any(dtype, op, dst, dst2, sources, num_sources, count, divisor, dst_lines);
}

void copy_taking_source(void* dst, const void* src, size_t bytes) {
#if defined(XDEV_HAVE_AVX2_KERNELS)
  if (use_avx2()) return avx2::copy_taking_source_lines(dst, src, bytes);
#endif
  baseline::copy_taking_source_lines(dst, src, bytes);
}

}  // namespace xdev::kernels
