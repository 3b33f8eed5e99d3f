// CUDA reduction kernels as device functions, for kernels that reduce inline
// (the window program of transport/cuda_executor.cu) and for the standalone
// launches of cuda_reduce.cu. Include from .cu files only.
//
// Results match cpu_reduce.cc bit for bit: sources are combined in the
// listed order, one accumulator per element; fp16/bf16 accumulate in fp32 and
// round once (nearest even, the CPU's NaN encoding); float ops are the
// correctly rounded __fadd_rn/__fmul_rn/__fdiv_rn (never fused, never fast
// math), AVG divides (no reciprocal), integers wrap and AVG truncates toward
// zero after widening to int64; MIN/MAX are the same comparisons, so a NaN
// propagates only from srcs[0]. One exception: when SUM/AVG/PRODUCT produce a
// NaN its sign and payload differ (the GPU returns its canonical NaN, x86 the
// input's), it is a NaN on both.
//
// Speed: memory bound, so every thread keeps kUnroll 16-byte loads per source
// in flight, two sources at a time, with consecutive threads on consecutive
// vectors (coalesced). A calling kernel should say __launch_bounds__(threads,
// 1) when it runs one block per SM, or ptxas may trade those loads in flight
// for fewer registers. Sources are read with ld.global.cg, not __ldg: dst may
// be a source, and peers may have written the data earlier in the caller's
// kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "cpu_reduce.h"
#include "cuda_reduce.h"

namespace xdev::kernels::cuda {

template <DType D>
struct StorageOf;
template <>
struct StorageOf<DType::kFloat32> {
  using type = float;
};
template <>
struct StorageOf<DType::kFloat64> {
  using type = double;
};
template <>
struct StorageOf<DType::kFloat16> {
  using type = __half;
};
template <>
struct StorageOf<DType::kBFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct StorageOf<DType::kInt8> {
  using type = int8_t;
};
template <>
struct StorageOf<DType::kUInt8> {
  using type = uint8_t;
};
template <>
struct StorageOf<DType::kInt32> {
  using type = int32_t;
};
template <>
struct StorageOf<DType::kInt64> {
  using type = int64_t;
};

template <ReduceOp Op>
struct OpTag {
  static constexpr ReduceOp value = Op;
};
template <typename T>
struct TypeTag {
  using type = T;
};

namespace detail {

template <DType D, ReduceOp Op, typename F>
void call_with_tags(F& f) {
  f(TypeTag<typename StorageOf<D>::type>{}, OpTag<Op>{});
}

template <ReduceOp Op, typename F>
void dispatch_dtype(DType dtype, F& f) {
  switch (dtype) {
    case DType::kFloat32:
      return call_with_tags<DType::kFloat32, Op>(f);
    case DType::kFloat64:
      return call_with_tags<DType::kFloat64, Op>(f);
    case DType::kFloat16:
      return call_with_tags<DType::kFloat16, Op>(f);
    case DType::kBFloat16:
      return call_with_tags<DType::kBFloat16, Op>(f);
    case DType::kInt8:
      return call_with_tags<DType::kInt8, Op>(f);
    case DType::kUInt8:
      return call_with_tags<DType::kUInt8, Op>(f);
    case DType::kInt32:
      return call_with_tags<DType::kInt32, Op>(f);
    case DType::kInt64:
      return call_with_tags<DType::kInt64, Op>(f);
  }
  throw std::invalid_argument("xdev cuda kernels: unknown dtype");
}

}  // namespace detail

// Host side: calls f(TypeTag<T>{}, OpTag<Op>{}) for the runtime pair.
template <typename F>
void dispatch(DType dtype, ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::kSum:
      return detail::dispatch_dtype<ReduceOp::kSum>(dtype, f);
    case ReduceOp::kAvg:
      return detail::dispatch_dtype<ReduceOp::kAvg>(dtype, f);
    case ReduceOp::kMin:
      return detail::dispatch_dtype<ReduceOp::kMin>(dtype, f);
    case ReduceOp::kMax:
      return detail::dispatch_dtype<ReduceOp::kMax>(dtype, f);
    case ReduceOp::kProduct:
      return detail::dispatch_dtype<ReduceOp::kProduct>(dtype, f);
  }
  throw std::invalid_argument("xdev cuda kernels: unknown reduce op");
}

namespace detail {

constexpr int kVecBytes = 16;
constexpr int kCopyUnroll = 8;  // words in flight per thread in copy_bytes
// 16-byte vectors per source a thread has in flight at once. 1-byte types
// hold 16 accumulators per vector, so they take fewer to stay in registers.
template <typename T>
constexpr int kUnroll = sizeof(T) == 1 ? 2 : 4;

// How a storage type is read, accumulated and written: Raw is its bit
// pattern, Acc the accumulator. float, double and the integers are their own.
template <typename T>
struct Elem {
  using Raw = T;
  using Acc = T;
  template <bool kExactNaN>
  __device__ static T load(T r) {
    return r;
  }
  __device__ static T store(T a) { return a; }
};

template <>
struct Elem<__half> {
  using Raw = uint16_t;
  using Acc = float;
  // The hardware widening is exact. MIN/MAX hand NaNs through unchanged, so
  // for them (kExactNaN) a NaN is rebuilt with the CPU's sign and payload in
  // case the hardware canonicalises it; the other ops cannot keep them anyway.
  template <bool kExactNaN>
  __device__ static float load(uint16_t r) {
    float f = __half2float(__ushort_as_half(r));
    if (kExactNaN && (r & 0x7fffu) > 0x7c00u) {
      f = __uint_as_float(((r & 0x8000u) << 16) | 0x7f800000u | ((r & 0x3ffu) << 13));
    }
    return f;
  }
  // cvt.rn: round to nearest even with IEEE overflow and subnormals, as the
  // CPU's converter; NaN becomes sign | 0x7e00 as there.
  __device__ static uint16_t store(float a) {
    const uint32_t b = __float_as_uint(a);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7e00u);
    }
    return __half_as_ushort(__float2half_rn(a));
  }
};

template <>
struct Elem<__nv_bfloat16> {
  using Raw = uint16_t;
  using Acc = float;
  template <bool kExactNaN>
  __device__ static float load(uint16_t r) {
    return __uint_as_float(static_cast<uint32_t>(r) << 16);
  }
  // The CPU's integer rounding, step for step (cheaper than cvt + NaN fix):
  // NaN keeps its payload and is made quiet, the rest rounds to nearest even.
  __device__ static uint16_t store(float a) {
    uint32_t b = __float_as_uint(a);
    if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return static_cast<uint16_t>(b >> 16);
  }
};

// Integer add and multiply wrap: computed in the unsigned type of the same
// width (narrow ones in unsigned int), as the CPU does.
template <typename A>
__device__ __forceinline__ A add(A a, A b) {
  if constexpr (std::is_same_v<A, float>) {
    return __fadd_rn(a, b);
  } else if constexpr (std::is_same_v<A, double>) {
    return __dadd_rn(a, b);
  } else {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  }
}
template <typename A>
__device__ __forceinline__ A mul(A a, A b) {
  if constexpr (std::is_same_v<A, float>) {
    return __fmul_rn(a, b);
  } else if constexpr (std::is_same_v<A, double>) {
    return __dmul_rn(a, b);
  } else {
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  }
}

// acc = op(acc, x); MIN/MAX are the CPU's comparisons verbatim (not fminf,
// which treats NaN and signed zeros differently): a NaN from any rank wins.
template <ReduceOp Op, typename A>
__device__ __forceinline__ A combine(A acc, A x) {
  if constexpr (Op == ReduceOp::kMin) {
    return x != x ? x : (x < acc ? x : acc);
  } else if constexpr (Op == ReduceOp::kMax) {
    return x != x ? x : (acc < x ? x : acc);
  } else if constexpr (Op == ReduceOp::kProduct) {
    return mul(acc, x);
  } else {
    return add(acc, x);  // kSum and kAvg
  }
}

// AVG's final step. Floats divide (the CPU does not multiply by a
// reciprocal); integers widen to int64 and truncate toward zero.
template <typename A>
struct Divider {
  int64_t divisor;
  A d;
  __device__ explicit Divider(int64_t div) : divisor(div), d(static_cast<A>(div)) {}
  __device__ A operator()(A a) const {
    if constexpr (std::is_same_v<A, float>) {
      return __fdiv_rn(a, d);
    } else if constexpr (std::is_same_v<A, double>) {
      return __ddiv_rn(a, d);
    } else {
      return static_cast<A>(static_cast<int64_t>(a) / divisor);
    }
  }
};

template <typename T, ReduceOp Op>
struct Reducer {
  using E = Elem<T>;
  using Raw = typename E::Raw;
  using A = typename E::Acc;
  static constexpr int kV = kVecBytes / static_cast<int>(sizeof(Raw));  // elements per vector
  static constexpr bool kExactNaN = Op == ReduceOp::kMin || Op == ReduceOp::kMax;
  static_assert(sizeof(Raw) == sizeof(T), "storage and bit pattern differ in size");

  // One element i, for the unaligned head and tail (and the scalar fallback).
  __device__ static void scalar(T* dst, const T* const* srcs, int n, int64_t i, bool avg,
                                const Divider<A>& div) {
    A acc = E::template load<kExactNaN>(reinterpret_cast<const Raw*>(srcs[0])[i]);
    for (int k = 1; k < n; ++k) {
      acc = combine<Op>(acc, E::template load<kExactNaN>(reinterpret_cast<const Raw*>(srcs[k])[i]));
    }
    if (avg) acc = div(acc);
    reinterpret_cast<Raw*>(dst)[i] = E::store(acc);
  }

  // Loads vectors first, first + stride, ... (U of them) of a 16-byte aligned
  // array. ld.global.cg: a global load even though the pointer came through
  // a generic array (no address-space check), cached in L2 only, which is
  // where other SMs' and peers' writes are coherent, and streamed data is
  // never read twice anyway.
  template <int U>
  __device__ static void load(const T* src, int64_t first, int64_t stride, uint4 (&v)[U]) {
    const uint4* p = reinterpret_cast<const uint4*>(src) + first;
#pragma unroll
    for (int j = 0; j < U; ++j) v[j] = __ldcg(p + j * stride);
  }

  // acc = the vectors' elements (kFirst: srcs[0]), else acc = op(acc, them).
  template <int U, bool kFirst>
  __device__ static void accumulate(A (&acc)[U][kV], const uint4 (&v)[U]) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      Raw r[kV];
      memcpy(r, &v[j], sizeof r);
#pragma unroll
      for (int e = 0; e < kV; ++e) {
        const A x = E::template load<kExactNaN>(r[e]);
        if constexpr (kFirst) {
          acc[j][e] = x;
        } else {
          acc[j][e] = combine<Op>(acc[j][e], x);
        }
      }
    }
  }

  // U vectors at vector indices first + j * stride of the arrays starting at
  // element `head` (16-byte aligned there). Sources go two at a time so that
  // 2 * U loads are in flight before the first is needed.
  template <int U>
  __device__ static void vectors(T* dst, const T* const* srcs, int n, int64_t head, int64_t first,
                                 int64_t stride, bool avg, const Divider<A>& div) {
    A acc[U][kV];
    uint4 a[U];
    uint4 b[U];
    load<U>(srcs[0] + head, first, stride, a);
    if (n > 1) load<U>(srcs[1] + head, first, stride, b);
    accumulate<U, true>(acc, a);
    if (n > 1) accumulate<U, false>(acc, b);
    int k = 2;
    for (; k + 1 < n; k += 2) {
      load<U>(srcs[k] + head, first, stride, a);
      load<U>(srcs[k + 1] + head, first, stride, b);
      accumulate<U, false>(acc, a);
      accumulate<U, false>(acc, b);
    }
    if (k < n) {
      load<U>(srcs[k] + head, first, stride, a);
      accumulate<U, false>(acc, a);
    }
    uint4* out = reinterpret_cast<uint4*>(dst + head) + first;
#pragma unroll
    for (int j = 0; j < U; ++j) {
      Raw r[kV];
#pragma unroll
      for (int e = 0; e < kV; ++e) r[e] = E::store(avg ? div(acc[j][e]) : acc[j][e]);
      uint4 v;
      memcpy(&v, r, sizeof v);
      out[j * stride] = v;
    }
  }
};

// Copies bytes with words of W where dst and src can both be aligned to W.
template <typename W>
__device__ void copy_words(char* dst, const char* src, int64_t bytes, int64_t tid,
                           int64_t nthreads) {
  constexpr int64_t kW = sizeof(W);
  const auto mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % kW);
  const int64_t head = (kW - mis) % kW < bytes ? (kW - mis) % kW : bytes;
  const int64_t words = (bytes - head) / kW;
  for (int64_t i = tid; i < head; i += nthreads) dst[i] = src[i];
  W* d = reinterpret_cast<W*>(dst + head);
  const W* s = reinterpret_cast<const W*>(src + head);
  int64_t w = tid;
  for (; w + (kCopyUnroll - 1) * nthreads < words; w += kCopyUnroll * nthreads) {
    W x[kCopyUnroll];
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) x[j] = __ldcg(s + w + j * nthreads);  // as in load()
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) d[w + j * nthreads] = x[j];
  }
  for (; w < words; w += nthreads) d[w] = __ldcg(s + w);
  for (int64_t i = head + words * kW + tid; i < bytes; i += nthreads) dst[i] = src[i];
}

}  // namespace detail

// dst[i] = op(srcs[0][i], ..., srcs[n-1][i]) for i in [0, count); for kAvg
// with divisor > 0 the result is then divided by divisor (other ops ignore
// it, as the CPU kernels do). The calling thread does its grid-stride share:
// thread tid of nthreads, all of which must call with the same arguments.
// Sources in the listed order, 1 <= n; srcs may be a local array of the
// caller and may point into peer GPUs' memory; dst may be one of the sources
// (in place: each element is read from every source, then written, by one
// thread), but must not overlap one at another offset.
// 16-byte vectors when dst and every source sit at the same offset within 16
// bytes (a scalar head reaches the boundary); element by element otherwise.
template <typename T, ReduceOp Op>
__device__ void reduce_elements(T* dst, const T* const* srcs, int n, int64_t count, int64_t divisor,
                                int64_t tid, int64_t nthreads) {
  using R = detail::Reducer<T, Op>;
  constexpr int64_t kV = R::kV;
  constexpr int kU = detail::kUnroll<T>;
  if (count <= 0 || n < 1) return;
  const bool avg = Op == ReduceOp::kAvg && divisor > 0;
  const detail::Divider<typename R::A> div(avg ? divisor : 1);

  const auto mis = static_cast<unsigned>(reinterpret_cast<uintptr_t>(dst) % detail::kVecBytes);
  bool vec = mis % sizeof(T) == 0;
  for (int k = 0; vec && k < n; ++k) {
    vec = reinterpret_cast<uintptr_t>(srcs[k]) % detail::kVecBytes == mis;
  }
  int64_t head = count;  // scalar elements before the first vector
  int64_t nvec = 0;
  if (vec) {
    const int64_t to_boundary = (detail::kVecBytes - mis) % detail::kVecBytes / sizeof(T);
    head = to_boundary < count ? to_boundary : count;
    nvec = (count - head) / kV;
  }

  for (int64_t i = tid; i < head; i += nthreads) R::scalar(dst, srcs, n, i, avg, div);
  int64_t v = tid;
  for (; v + (kU - 1) * nthreads < nvec; v += kU * nthreads) {
    R::template vectors<kU>(dst, srcs, n, head, v, nthreads, avg, div);
  }
  for (; v < nvec; v += nthreads) R::template vectors<1>(dst, srcs, n, head, v, nthreads, avg, div);
  for (int64_t i = head + nvec * kV + tid; i < count; i += nthreads) {
    R::scalar(dst, srcs, n, i, avg, div);
  }
}

// Copies bytes from src to dst (not overlapping, or equal), the calling
// thread doing its grid-stride share. Uses the widest word (16, 8, 4, 2
// bytes) that dst and src can both be aligned to after a short byte head.
__device__ inline void copy_bytes(char* dst, const char* src, int64_t bytes, int64_t tid,
                                  int64_t nthreads) {
  if (bytes <= 0) return;
  const uintptr_t diff = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if (diff % 16 == 0) {
    detail::copy_words<uint4>(dst, src, bytes, tid, nthreads);
  } else if (diff % 8 == 0) {
    detail::copy_words<uint2>(dst, src, bytes, tid, nthreads);
  } else if (diff % 4 == 0) {
    detail::copy_words<uint32_t>(dst, src, bytes, tid, nthreads);
  } else if (diff % 2 == 0) {
    detail::copy_words<uint16_t>(dst, src, bytes, tid, nthreads);
  } else {
    detail::copy_words<uint8_t>(dst, src, bytes, tid, nthreads);
  }
}

}  // namespace xdev::kernels::cuda
