#include "cpu_reduce.h"

#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace xdev::kernels {
namespace {

// Storage types for the 16-bit floats: plain bit patterns, converted by hand
// so the kernels need neither torch nor compiler half-float support.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float to_float(BFloat16 v) {
  return bits_to_float(static_cast<uint32_t>(v.bits) << 16);
}
inline BFloat16 from_float_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((b >> 16) | 0x40)};
  b += 0x7fffu + ((b >> 16) & 1u);  // round to nearest even
  return BFloat16{static_cast<uint16_t>(b >> 16)};
}

// IEEE binary16 <-> binary32 with round-to-nearest-even, subnormals, inf, NaN.
inline float to_float(Half v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1fu;
  const uint32_t man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  // Subnormal or zero: value = man * 2^-24.
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
}
inline Half from_float_half(float f) {
  const uint32_t b = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t abs = b & 0x7fffffffu;
  if (abs > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u)};   // NaN
  if (abs >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (abs < 0x38800000u) {
    // Result is subnormal in half: round abs * 2^24 to an integer, ties to even.
    const float scaled = bits_to_float(abs) * 16777216.0f;
    auto q = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return Half{static_cast<uint16_t>(sign | q)};
  }
  uint32_t r = abs - (112u << 23);  // rebias exponent
  r += 0xfffu + ((r >> 13) & 1u);   // round to nearest even at bit 13
  return Half{static_cast<uint16_t>(sign | (r >> 13))};
}

template <typename T>
struct Accum {
  using type = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};
template <>
struct Accum<Half> {
  using type = float;
  static float load(Half v) { return to_float(v); }
  static Half store(float v) { return from_float_half(v); }
};
template <>
struct Accum<BFloat16> {
  using type = float;
  static float load(BFloat16 v) { return to_float(v); }
  static BFloat16 store(float v) { return from_float_bf16(v); }
};

// Integer add and multiply wrap: do them in the unsigned type of the same
// width, which C++ defines, and convert back.
template <typename A>
inline A wrap_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <typename A>
inline A wrap_mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    // Promote narrow types to unsigned int so the product cannot overflow int.
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

struct SumOp {
  template <typename A>
  static A apply(A a, A b) {
    return wrap_add(a, b);
  }
};
struct ProductOp {
  template <typename A>
  static A apply(A a, A b) {
    return wrap_mul(a, b);
  }
};
struct MinOp {
  template <typename A>
  static A apply(A a, A b) {
    return b < a ? b : a;
  }
};
struct MaxOp {
  template <typename A>
  static A apply(A a, A b) {
    return a < b ? b : a;
  }
};

// Elements per block: the accumulator block stays in L1 while every source
// streams through it once.
constexpr int64_t kBlock = 1024;

template <typename T, typename Op>
void reduce_typed(T* dst, const T* const* src, int n, int64_t count, int64_t divisor) {
  using A = typename Accum<T>::type;
  A acc[kBlock];
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t len = count - base < kBlock ? count - base : kBlock;
    const T* s0 = src[0] + base;
    for (int64_t i = 0; i < len; ++i) acc[i] = Accum<T>::load(s0[i]);
    for (int k = 1; k < n; ++k) {
      const T* sk = src[k] + base;
      for (int64_t i = 0; i < len; ++i) acc[i] = Op::apply(acc[i], Accum<T>::load(sk[i]));
    }
    if (divisor > 0) {
      if constexpr (std::is_integral_v<A>) {
        // Widen first: a narrow type cannot hold every world size.
        for (int64_t i = 0; i < len; ++i) {
          acc[i] = static_cast<A>(static_cast<int64_t>(acc[i]) / divisor);
        }
      } else {
        const A d = static_cast<A>(divisor);
        for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / d;
      }
    }
    T* out = dst + base;
    for (int64_t i = 0; i < len; ++i) out[i] = Accum<T>::store(acc[i]);
  }
}

template <typename T>
void reduce_dispatch_op(ReduceOp op, void* dst, const void* const* sources, int n, int64_t count,
                        int64_t divisor) {
  auto* d = static_cast<T*>(dst);
  auto* s = reinterpret_cast<const T* const*>(sources);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return reduce_typed<T, SumOp>(d, s, n, count, divisor);
    case ReduceOp::kProduct:
      return reduce_typed<T, ProductOp>(d, s, n, count, divisor);
    case ReduceOp::kMin:
      return reduce_typed<T, MinOp>(d, s, n, count, divisor);
    case ReduceOp::kMax:
      return reduce_typed<T, MaxOp>(d, s, n, count, divisor);
  }
  throw std::invalid_argument("reduce: unknown op");
}

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

void reduce(DType dtype, ReduceOp op, void* dst, const void* const* sources, int num_sources,
            int64_t count, int64_t divisor) {
  if (num_sources < 1) throw std::invalid_argument("reduce: needs at least one source");
  if (count <= 0) return;
  if (op != ReduceOp::kAvg) divisor = 0;
  switch (dtype) {
    case DType::kFloat32:
      return reduce_dispatch_op<float>(op, dst, sources, num_sources, count, divisor);
    case DType::kFloat64:
      return reduce_dispatch_op<double>(op, dst, sources, num_sources, count, divisor);
    case DType::kFloat16:
      return reduce_dispatch_op<Half>(op, dst, sources, num_sources, count, divisor);
    case DType::kBFloat16:
      return reduce_dispatch_op<BFloat16>(op, dst, sources, num_sources, count, divisor);
    case DType::kInt8:
      return reduce_dispatch_op<int8_t>(op, dst, sources, num_sources, count, divisor);
    case DType::kUInt8:
      return reduce_dispatch_op<uint8_t>(op, dst, sources, num_sources, count, divisor);
    case DType::kInt32:
      return reduce_dispatch_op<int32_t>(op, dst, sources, num_sources, count, divisor);
    case DType::kInt64:
      return reduce_dispatch_op<int64_t>(op, dst, sources, num_sources, count, divisor);
  }
  throw std::invalid_argument("reduce: unknown dtype");
}

void divide_inplace(DType dtype, void* data, int64_t count, int64_t divisor) {
  const void* src[1] = {data};
  reduce(dtype, ReduceOp::kAvg, data, src, 1, count, divisor);
}

}  // namespace xdev::kernels
