// Throughput of xdev's CPU reduction kernels (csrc/kernels/cpu_reduce.h) for every dtype and op,
// next to memcpy of the same bytes. Built and run by benchmarks/cpu_kernels.py; torch-free.
//
//   cpu_kernels SIZE_BYTES... [--sources N] [--reps N]
//
// Prints one JSON object per line: dtype, op, sources, bytes (per source), seconds (the best of
// --reps timed batches, per call) and gbps (bytes read and written per second: sources + 1
// tensors of `bytes`), then one line per size for memcpy (2 x bytes moved). Sources start as
// small positive values, so no sum overflows and no product leaves the normal range for long.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu_reduce.h"

namespace {

using xdev::kernels::DType;
using xdev::kernels::ReduceOp;
using Clock = std::chrono::steady_clock;

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                             DType::kInt32,   DType::kInt64,   DType::kInt8,    DType::kUInt8};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kProduct};

// Fills p with count values of dtype t near 1 (integers: 1 to 3).
void fill(DType t, unsigned char* p, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const int small = 1 + static_cast<int>(i % 3);
    switch (t) {
      case DType::kFloat32: {
        const float v = 1.0f + 0.001f * static_cast<float>(small);
        std::memcpy(p + i * 4, &v, 4);
        break;
      }
      case DType::kFloat64: {
        const double v = 1.0 + 0.001 * small;
        std::memcpy(p + i * 8, &v, 8);
        break;
      }
      case DType::kFloat16: {
        const uint16_t v = static_cast<uint16_t>(0x3c00 + small);  // just above 1.0
        std::memcpy(p + i * 2, &v, 2);
        break;
      }
      case DType::kBFloat16: {
        const uint16_t v = static_cast<uint16_t>(0x3f80 + small);
        std::memcpy(p + i * 2, &v, 2);
        break;
      }
      default: {
        const size_t es = xdev::kernels::element_size(t);
        std::memset(p + i * static_cast<int64_t>(es), 0, es);
        p[i * static_cast<int64_t>(es)] = static_cast<unsigned char>(small);  // little endian
      }
    }
  }
}

// Best seconds per call of fn over reps batches, each batch long enough to time (>= 5 ms).
template <typename Fn>
double best_seconds(Fn&& fn, int reps) {
  fn();  // warm: pages touched, caches filled
  int per_batch = 1;
  for (;;) {
    const auto t0 = Clock::now();
    for (int i = 0; i < per_batch; ++i) fn();
    if (std::chrono::duration<double>(Clock::now() - t0).count() >= 5e-3) break;
    per_batch *= 2;
  }
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < per_batch; ++i) fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / per_batch);
  }
  return best;
}

int usage(const char* why) {
  std::fprintf(stderr,
               "cpu_kernels: %s\nusage: cpu_kernels SIZE_BYTES... [--sources N] [--reps N]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes;
  int sources = 2;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--sources" || arg == "--reps") && i + 1 < argc) {
      const int value = std::atoi(argv[++i]);
      if (value < 1) return usage("--sources and --reps take a positive number");
      (arg == "--sources" ? sources : reps) = value;
    } else {
      const long long bytes = std::atoll(arg.c_str());
      if (bytes <= 0) return usage(("bad size " + arg).c_str());
      sizes.push_back(bytes);
    }
  }
  if (sizes.empty()) return usage("no sizes");
  for (const int64_t bytes : sizes) {
    std::vector<std::vector<unsigned char>> inputs(static_cast<size_t>(sources),
                                                   std::vector<unsigned char>(bytes));
    std::vector<unsigned char> out(static_cast<size_t>(bytes));
    std::vector<const void*> src(static_cast<size_t>(sources));
    for (int s = 0; s < sources; ++s) src[static_cast<size_t>(s)] = inputs[s].data();
    for (const DType dtype : kDTypes) {
      const int64_t count = bytes / static_cast<int64_t>(xdev::kernels::element_size(dtype));
      for (auto& input : inputs) fill(dtype, input.data(), count);
      for (const ReduceOp op : kOps) {
        const double seconds = best_seconds(
            [&] {
              xdev::kernels::reduce(dtype, op, out.data(), src.data(), sources, count, sources);
            },
            reps);
        const double moved = static_cast<double>(bytes) * (sources + 1);
        std::printf(
            "{\"dtype\": \"%s\", \"op\": \"%s\", \"sources\": %d, \"bytes\": %lld, \"seconds\": "
            "%.9g, \"gbps\": %.4g}\n",
            xdev::kernels::to_string(dtype), xdev::kernels::to_string(op), sources,
            static_cast<long long>(bytes), seconds, moved / seconds / 1e9);
      }
    }
    const double seconds =
        best_seconds([&] { std::memcpy(out.data(), inputs[0].data(), out.size()); }, reps);
    std::printf(
        "{\"dtype\": \"bytes\", \"op\": \"memcpy\", \"sources\": 1, \"bytes\": %lld, \"seconds\": "
        "%.9g, \"gbps\": %.4g}\n",
        static_cast<long long>(bytes), seconds, 2.0 * static_cast<double>(bytes) / seconds / 1e9);
    std::fflush(stdout);
  }
  return 0;
}
