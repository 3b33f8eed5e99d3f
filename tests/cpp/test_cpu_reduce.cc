// Tests of the CPU reduction kernels (csrc/kernels/cpu_reduce.h) against a scalar reference
// written here from the header's contract: sources fold left to right in the listed order with
// one accumulator per element; fp16 and bf16 accumulate in fp32 and round once (to nearest, ties
// to even); integers wrap; AVG's divisor divides the result, integers truncating toward zero.
// Results must match the reference bit for bit, for every dtype and op, over lengths that end in
// the vector body, in its tail and across the kernels' 1024-element blocks, 1 to 8 sources (the
// kernels fold up to four per pass), with and without a second destination, in place, and at
// pointers that are not vector-aligned.
//
// The 16-bit conversions below come from the formats' definitions (value = significand * 2^e),
// not from the kernels' bit manipulation, so a rounding slip in either shows up as a mismatch.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu_reduce.h"
#include "test_harness.h"

namespace {

using xdev::kernels::DstLines;
using xdev::kernels::DType;
using xdev::kernels::ReduceOp;

// ---- 16-bit floats from their definitions ----------------------------------------------------

// A binary format with man_bits stored significand bits, an exponent bias and a smallest normal
// exponent min_exp: binary16 (10, 15, -14) or bfloat16 (7, 127, -126).
struct Format16 {
  int man_bits;
  int bias;
  int min_exp;
};
constexpr Format16 kHalf{10, 15, -14};
constexpr Format16 kBf16{7, 127, -126};

double decode16(Format16 f, uint16_t bits) {
  const int exp_field = (bits >> f.man_bits) & ((0x8000 >> f.man_bits) - 1);
  const int man = bits & ((1 << f.man_bits) - 1);
  const int max_field = (0x8000 >> f.man_bits) - 1;
  double mag;
  if (exp_field == max_field) {
    mag = INFINITY;  // the tests make no NaN
  } else if (exp_field == 0) {
    mag = std::ldexp(man, f.min_exp - f.man_bits);
  } else {
    mag = std::ldexp((1 << f.man_bits) + man, exp_field - f.bias - f.man_bits);
  }
  return (bits & 0x8000) ? -mag : mag;
}

// Rounds x (not NaN) to the nearest value of the format, ties to even: count x in quanta of its
// binade (the smallest normal binade for subnormals) and round that count with nearbyint, which
// rounds half to even in the default floating-point environment.
uint16_t encode16(Format16 f, double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  const int inf_bits = 0x7fff & ~((1 << f.man_bits) - 1);
  if (a == 0) return sign;
  if (std::isinf(a)) return static_cast<uint16_t>(sign | inf_bits);
  int e = 0;
  std::frexp(a, &e);                           // a in [2^(e-1), 2^e)
  const int exp = std::max(e - 1, f.min_exp);  // binade of a, or the subnormal one
  const double q = std::nearbyint(std::ldexp(a, f.man_bits - exp));  // quanta of 2^(exp - man_bits)
  // Normal: q in [2^man_bits, 2^(man_bits+1)], the leading bit landing in the exponent field; a
  // count rounded up to 2^(man_bits+1) carries into the next binade by the same sum. Subnormal
  // (exp == min_exp, q < 2^man_bits): the sum is q itself.
  const long bits =
      (static_cast<long>(exp + f.bias) << f.man_bits) + static_cast<long>(q) - (1L << f.man_bits);
  return static_cast<uint16_t>(sign | (bits >= inf_bits ? inf_bits : bits));
}

TEST(reference_16bit_conversions_are_right) {
  // Known points of both formats.
  CHECK_EQ(encode16(kHalf, 1.0), 0x3c00);
  CHECK_EQ(encode16(kHalf, 65504.0), 0x7bff);                     // largest finite
  CHECK_EQ(encode16(kHalf, 65519.0), 0x7bff);                     // below the midpoint to 65536
  CHECK_EQ(encode16(kHalf, 65520.0), 0x7c00);                     // the midpoint ties to even: inf
  CHECK_EQ(encode16(kHalf, std::ldexp(1.0, -24)), 0x0001);        // smallest subnormal
  CHECK_EQ(encode16(kHalf, std::ldexp(1.0, -25)), 0x0000);        // tie to even: zero
  CHECK_EQ(encode16(kHalf, std::ldexp(3.0, -25)), 0x0002);        // tie to even: up
  CHECK_EQ(encode16(kHalf, -std::ldexp(1023.5, -24)), 0x8400);    // rounds into the normals
  CHECK_EQ(encode16(kHalf, 1.0 + std::ldexp(1.0, -11)), 0x3c00);  // tie, even stays
  CHECK_EQ(encode16(kHalf, 1.0 + std::ldexp(3.0, -11)), 0x3c02);  // tie, odd goes up
  CHECK_EQ(encode16(kBf16, 1.0), 0x3f80);
  CHECK_EQ(encode16(kBf16, -2.0), 0xc000);
  CHECK_EQ(encode16(kBf16, 1.0 + std::ldexp(1.0, -8)), 0x3f80);
  CHECK_EQ(encode16(kBf16, 1.0 + std::ldexp(3.0, -8)), 0x3f82);
  CHECK_EQ(encode16(kBf16, 3.4e38), 0x7f80);  // past the largest finite bfloat16: inf
  // Every non-NaN pattern decodes and encodes back to itself.
  for (const Format16 f : {kHalf, kBf16}) {
    const int max_field = (0x8000 >> f.man_bits) - 1;
    int bad = 0;
    for (uint32_t b = 0; b <= 0xffff; ++b) {
      const auto bits = static_cast<uint16_t>(b);
      const bool nan =
          ((bits >> f.man_bits) & max_field) == max_field && (bits & ((1 << f.man_bits) - 1)) != 0;
      if (!nan && encode16(f, decode16(f, bits)) != bits) ++bad;
    }
    CHECK_EQ(bad, 0);
  }
}

// ---- the reference reduction -----------------------------------------------------------------

template <typename T>
T load_as(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename T>
void store_as(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename A>
A combine(ReduceOp op, A a, A b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return a + b;
    case ReduceOp::kProduct:
      return a * b;
    case ReduceOp::kMin:
      return b < a ? b : a;
    case ReduceOp::kMax:
      return a < b ? b : a;
  }
  return a;
}

// Floating point, accumulating in A (the element type, or float for the 16-bit formats).
template <typename A, typename Load, typename Store>
void reference_float(ReduceOp op, int64_t divisor, const std::vector<const unsigned char*>& src,
                     unsigned char* dst, int64_t count, size_t es, Load load, Store store) {
  for (int64_t i = 0; i < count; ++i) {
    A v = load(src[0] + i * es);
    for (size_t k = 1; k < src.size(); ++k) v = combine(op, v, load(src[k] + i * es));
    if (op == ReduceOp::kAvg && divisor > 0) v = v / static_cast<A>(divisor);
    store(dst + i * es, v);
  }
}

// Integers: sums and products mod 2^64 agree with the width's wrapping arithmetic mod 2^bits.
template <typename T>
void reference_int(ReduceOp op, int64_t divisor, const std::vector<const unsigned char*>& src,
                   unsigned char* dst, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    T v = load_as<T>(src[0] + i * sizeof(T));
    for (size_t k = 1; k < src.size(); ++k) {
      const T x = load_as<T>(src[k] + i * sizeof(T));
      const auto uv = static_cast<uint64_t>(v), ux = static_cast<uint64_t>(x);
      if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
        v = static_cast<T>(uv + ux);
      } else if (op == ReduceOp::kProduct) {
        v = static_cast<T>(uv * ux);
      } else {
        v = combine(op, v, x);
      }
    }
    if (op == ReduceOp::kAvg && divisor > 0) v = static_cast<T>(static_cast<int64_t>(v) / divisor);
    store_as<T>(dst + i * sizeof(T), v);
  }
}

void reference(DType t, ReduceOp op, int64_t divisor, const std::vector<const unsigned char*>& src,
               unsigned char* dst, int64_t count) {
  const auto f16 = [](Format16 f) {
    return std::make_pair(
        [f](const unsigned char* p) {
          return static_cast<float>(decode16(f, load_as<uint16_t>(p)));
        },
        [f](unsigned char* p, float v) { store_as<uint16_t>(p, encode16(f, v)); });
  };
  switch (t) {
    case DType::kFloat32:
      return reference_float<float>(op, divisor, src, dst, count, 4, load_as<float>,
                                    store_as<float>);
    case DType::kFloat64:
      return reference_float<double>(op, divisor, src, dst, count, 8, load_as<double>,
                                     store_as<double>);
    case DType::kFloat16: {
      const auto [load, store] = f16(kHalf);
      return reference_float<float>(op, divisor, src, dst, count, 2, load, store);
    }
    case DType::kBFloat16: {
      const auto [load, store] = f16(kBf16);
      return reference_float<float>(op, divisor, src, dst, count, 2, load, store);
    }
    case DType::kInt8:
      return reference_int<int8_t>(op, divisor, src, dst, count);
    case DType::kUInt8:
      return reference_int<uint8_t>(op, divisor, src, dst, count);
    case DType::kInt32:
      return reference_int<int32_t>(op, divisor, src, dst, count);
    case DType::kInt64:
      return reference_int<int64_t>(op, divisor, src, dst, count);
  }
}

// ---- inputs ---------------------------------------------------------------------------------

// Random finite values: floats over a spread of binades (so sums round), 16-bit floats from
// subnormals up to a few hundred (so products overflow to inf now and then, which rounding once
// must give), integers over every bit pattern (so sums and products wrap).
void fill(DType t, std::mt19937_64& rng, unsigned char* p, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t r = rng();
    const bool neg = (r >> 63) != 0;
    switch (t) {
      case DType::kFloat32: {
        const double m = 1.0 + static_cast<double>(r & 0xffffff) / 16777216.0;
        const auto v = static_cast<float>(std::ldexp(m, static_cast<int>((r >> 24) % 21) - 10));
        store_as<float>(p + i * 4, neg ? -v : v);
        break;
      }
      case DType::kFloat64: {
        const double m = 1.0 + static_cast<double>(r & 0xffffffffffull) / 1099511627776.0;
        const double v = std::ldexp(m, static_cast<int>((r >> 40) % 61) - 30);
        store_as<double>(p + i * 8, neg ? -v : v);
        break;
      }
      case DType::kFloat16: {
        const auto exp = static_cast<uint16_t>((r >> 10) % 23);  // 0 (subnormal) to 2^7
        store_as<uint16_t>(p + i * 2,
                           static_cast<uint16_t>((neg ? 0x8000 : 0) | exp << 10 | (r & 0x3ff)));
        break;
      }
      case DType::kBFloat16: {
        const auto exp = static_cast<uint16_t>(100 + (r >> 7) % 50);  // about 2^-27 to 2^22
        store_as<uint16_t>(p + i * 2,
                           static_cast<uint16_t>((neg ? 0x8000 : 0) | exp << 7 | (r & 0x7f)));
        break;
      }
      default:
        std::memcpy(p + i * xdev::kernels::element_size(t), &r, xdev::kernels::element_size(t));
    }
  }
}

const DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                         DType::kInt8,    DType::kUInt8,   DType::kInt32,   DType::kInt64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                         ReduceOp::kProduct};
// Empty, shorter than one vector, vector body plus tail, exactly one block (1024), a block plus
// one, and several blocks with a ragged end.
const int64_t kLengths[] = {0, 1, 7, 33, 1000, 1024, 1025, 2600};

// How dst and dst2 relate to the sources.
enum class Placement {
  kSeparate,         // a buffer of its own, no dst2
  kTwoDestinations,  // dst and dst2 both buffers of their own
  kInPlace,          // dst is the last source, dst2 (with two or more sources) the first
};

std::string where(DType t, ReduceOp op, int n, int64_t count, Placement p, int64_t divisor) {
  return std::string(xdev::kernels::to_string(t)) + " " + xdev::kernels::to_string(op) + " " +
         std::to_string(n) + " sources, " + std::to_string(count) + " elements, placement " +
         std::to_string(static_cast<int>(p)) + ", divisor " + std::to_string(divisor);
}

// Runs one reduction and compares every destination with the reference, bit for bit.
void check_one(std::mt19937_64& rng, DType t, ReduceOp op, int n, int64_t count, Placement place,
               int64_t divisor) {
  const size_t es = xdev::kernels::element_size(t);
  const auto bytes = static_cast<size_t>(count) * es;
  // n sources and two destinations, each at its own element offset from a 64-byte boundary (past
  // 16 guard bytes), so no two pointers share an alignment and most are not vector-aligned.
  std::vector<std::vector<unsigned char>> storage(static_cast<size_t>(n) + 2);
  std::vector<unsigned char*> buf(storage.size());
  for (size_t b = 0; b < storage.size(); ++b) {
    storage[b].resize(bytes + 192);
    const auto base = reinterpret_cast<uintptr_t>(storage[b].data());
    const size_t to_line = (64 - base % 64) % 64;
    buf[b] = storage[b].data() + to_line + 16 + ((b * 3 + 1) % 8) * es;
    fill(t, rng, buf[b], count);
  }
  std::vector<const unsigned char*> src(buf.begin(), buf.begin() + n);
  std::vector<unsigned char> expected(bytes);
  reference(t, op, divisor, src, expected.data(), count);

  unsigned char* dst = buf[static_cast<size_t>(n)];
  unsigned char* dst2 =
      place == Placement::kTwoDestinations ? buf[static_cast<size_t>(n) + 1] : nullptr;
  DstLines lines = DstLines::kLocal;
  if (place == Placement::kInPlace) {
    dst = buf[static_cast<size_t>(n) - 1];
    dst2 = n >= 2 ? buf[0] : nullptr;
    lines = DstLines::kPeerCache;  // dst is a source: the prefetch-for-ownership path
  }
  // Guard bytes on each side of each destination must survive.
  const std::vector<unsigned char> before(dst - 8, dst), after(dst + bytes, dst + bytes + 8);
  std::vector<const void*> ptrs(src.begin(), src.end());
  xdev::kernels::reduce(t, op, dst, ptrs.data(), n, count, divisor, dst2, lines);

  const std::string ctx = where(t, op, n, count, place, divisor);
  for (unsigned char* d : {dst, dst2}) {
    if (d == nullptr) continue;
    if (bytes != 0 && std::memcmp(d, expected.data(), bytes) != 0) {
      size_t i = 0;
      while (std::memcmp(d + i * es, expected.data() + i * es, es) == 0) ++i;
      xdev_test::fail(
          __FILE__, __LINE__,
          ctx + ": element " + std::to_string(i) + " differs" + (d == dst2 ? " in dst2" : ""));
      return;
    }
  }
  CHECK(std::vector<unsigned char>(dst - 8, dst) == before);
  CHECK(std::vector<unsigned char>(dst + bytes, dst + bytes + 8) == after);
}

TEST(cpu_reduce_matches_reference_for_every_dtype_op_length_and_source_count) {
  std::mt19937_64 rng(20240611);
  for (const DType t : kDTypes) {
    for (const ReduceOp op : kOps) {
      for (int n = 1; n <= 8; ++n) {
        for (const int64_t count : kLengths) {
          // AVG: the final step (divide by the number of ranks), a non-final step (no divisor),
          // and a divisor that is not the source count.
          const int64_t avg_divisor[] = {n, 0, 3};
          const Placement places[] = {Placement::kSeparate, Placement::kTwoDestinations,
                                      Placement::kInPlace};
          for (int p = 0; p < 3; ++p) {
            const int64_t divisor = op == ReduceOp::kAvg ? avg_divisor[p] : 0;
            check_one(rng, t, op, n, count, places[p], divisor);
          }
        }
      }
    }
  }
}

TEST(cpu_reduce_avg_of_integers_truncates_toward_zero) {
  // -7 / 2 is -3 (not -4); 7 / 2 is 3; int8 sums wrap before the division: 100 + 100 = -56.
  const int32_t a[] = {-4, 4, 100}, b[] = {-3, 3, 100};
  const void* src[] = {a, b};
  int32_t out[3];
  xdev::kernels::reduce(DType::kInt32, ReduceOp::kAvg, out, src, 2, 3, 2);
  CHECK_EQ(out[0], -3);
  CHECK_EQ(out[1], 3);
  CHECK_EQ(out[2], 100);
  const int8_t c[] = {100}, d[] = {100};
  const void* src8[] = {c, d};
  int8_t out8[1];
  xdev::kernels::reduce(DType::kInt8, ReduceOp::kAvg, out8, src8, 2, 1, 2);
  CHECK_EQ(static_cast<int>(out8[0]), -28);
}

TEST(cpu_reduce_avg_of_int32_extremes_is_the_integer_division) {
  // The quotients nearest an integer from below and above, at the ends of int32, for many
  // divisors: AVG must give the integer division's result (truncated toward zero) for each.
  std::vector<int32_t> values;
  for (int64_t k = 0; k < 64; ++k) {
    values.push_back(static_cast<int32_t>(INT32_MAX - k));
    values.push_back(static_cast<int32_t>(INT32_MIN + k));
    values.push_back(static_cast<int32_t>(k - 32));
  }
  const std::vector<int32_t> zeros(values.size(), 0);
  std::vector<int32_t> out(values.size());
  const void* src[] = {values.data(), zeros.data()};
  const int64_t divisors[] = {1, 2, 3, 7, 8, 63, 64, 1000, 65537, int64_t{1} << 30};
  for (const int64_t divisor : divisors) {
    xdev::kernels::reduce(DType::kInt32, ReduceOp::kAvg, out.data(), src, 2,
                          static_cast<int64_t>(values.size()), divisor);
    for (size_t i = 0; i < values.size(); ++i) {
      CHECK_EQ(static_cast<int64_t>(out[i]), static_cast<int64_t>(values[i]) / divisor);
    }
  }
}

// MIN and MAX fold `b < a ? b : a` and `a < b ? b : a` left to right, a NaN b winning, whatever
// the vector instructions: with zeros of both signs (or NaNs of both signs), which comes out
// depends on the order, every lane must give what the scalar fold gives, and a NaN anywhere
// must come out as a NaN.
template <typename T>
void check_selects_match_the_scalar_fold(DType dtype) {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T specials[] = {nan, T(-0.0), T(0.0), T(1.5), T(-2.0), -nan};
  constexpr int kSpecials = 6;
  // Every ordered triple of specials, one per element (216 elements: vector lanes and a tail).
  std::vector<T> a, b, c;
  for (int i = 0; i < kSpecials; ++i)
    for (int j = 0; j < kSpecials; ++j)
      for (int k = 0; k < kSpecials; ++k) {
        a.push_back(specials[i]);
        b.push_back(specials[j]);
        c.push_back(specials[k]);
      }
  const void* src[] = {a.data(), b.data(), c.data()};
  std::vector<T> out(a.size());
  for (const ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    xdev::kernels::reduce(dtype, op, out.data(), src, 3, static_cast<int64_t>(a.size()), 0);
    for (size_t e = 0; e < a.size(); ++e) {
      T v = a[e];
      for (const T x : {b[e], c[e]}) {
        v = x != x ? x : op == ReduceOp::kMin ? (x < v ? x : v) : (v < x ? x : v);
      }
      CHECK(std::memcmp(&out[e], &v, sizeof(T)) == 0);
      const bool any_nan = a[e] != a[e] || b[e] != b[e] || c[e] != c[e];
      CHECK_EQ(out[e] != out[e], any_nan);
    }
  }
}

TEST(cpu_reduce_min_max_keep_nan_and_zero_signs_as_the_scalar_fold) {
  check_selects_match_the_scalar_fold<float>(DType::kFloat32);
  check_selects_match_the_scalar_fold<double>(DType::kFloat64);
}

TEST(cpu_reduce_min_max_of_16bit_floats_keep_a_nan_from_any_source) {
  // 19 elements: two vectors of eight and a tail; the NaN sits in source 1 or 2.
  for (const DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const uint16_t one = dtype == DType::kFloat16 ? 0x3c00 : 0x3f80;
    const uint16_t nan = dtype == DType::kFloat16 ? 0x7e00 : 0x7fc0;
    for (int holder = 1; holder <= 2; ++holder) {
      std::vector<uint16_t> s0(19, one), s1(19, one), s2(19, one), out(19);
      for (size_t e = 0; e < 19; e += 3) (holder == 1 ? s1 : s2)[e] = nan;
      const void* src[] = {s0.data(), s1.data(), s2.data()};
      for (const ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
        xdev::kernels::reduce(dtype, op, out.data(), src, 3, 19, 0);
        for (size_t e = 0; e < 19; ++e) CHECK_EQ(out[e], e % 3 == 0 ? nan : one);
      }
    }
  }
}

TEST(cpu_reduce_rounds_16bit_floats_once) {
  // 2048 + 1 + 1 in fp16: rounding after each add would give 2048 twice (ties to even); one
  // fp32 accumulator gives 2050 exactly. bfloat16: 256 + 1 + 1 likewise.
  const uint16_t big = 0x6800, one = 0x3c00;  // 2048, 1
  const uint16_t a[] = {big}, b[] = {one};
  const void* src[] = {a, b, b};
  uint16_t out[1];
  xdev::kernels::reduce(DType::kFloat16, ReduceOp::kSum, out, src, 3, 1, 0);
  CHECK_EQ(out[0], 0x6801);                             // 2050
  const uint16_t bbig[] = {0x4380}, bone[] = {0x3f80};  // 256, 1 in bfloat16
  const void* bsrc[] = {bbig, bone, bone};
  xdev::kernels::reduce(DType::kBFloat16, ReduceOp::kSum, out, bsrc, 3, 1, 0);
  CHECK_EQ(out[0], 0x4381);  // 258
}

TEST(cpu_reduce_rejects_no_sources) {
  float out[1];
  CHECK_THROWS(xdev::kernels::reduce(DType::kFloat32, ReduceOp::kSum, out, nullptr, 0, 1, 0),
               std::invalid_argument, "at least one source");
}

TEST(copy_taking_source_copies_every_byte) {
  std::mt19937_64 rng(7);
  for (const size_t bytes : {0, 1, 127, 128, 129, 1000, 1024, 1025, 5000, 70000}) {
    std::vector<unsigned char> src(bytes + 3), dst(bytes + 5, 0xab);
    for (auto& c : src) c = static_cast<unsigned char>(rng());
    xdev::kernels::copy_taking_source(dst.data() + 3, src.data() + 1, bytes);
    CHECK(std::memcmp(dst.data() + 3, src.data() + 1, bytes) == 0);
    CHECK(dst[2] == 0xab && dst[bytes + 3] == 0xab);
  }
}

}  // namespace
