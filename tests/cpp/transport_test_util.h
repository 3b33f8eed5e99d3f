// Helpers for the transport tests: threads stand in for the ranks of one host.
#pragma once

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/shm_channel.h"
#include "transport/shm_segment.h"

namespace xdev::transport {

// One channel per rank on a fresh segment. The name is unlinked once all have
// attached, as the backend does, so nothing is left in /dev/shm whatever
// happens next.
inline std::vector<ShmChannel> make_group(int world, size_t slot_bytes) {
  const std::string name = ShmSegment::make_name();
  std::vector<ShmChannel> ranks;
  ranks.push_back(ShmChannel::create(name, world, 0, slot_bytes));
  for (int r = 1; r < world; ++r) ranks.push_back(ShmChannel::attach(name, world, r, slot_bytes));
  ranks[0].unlink_name();
  return ranks;
}

// Runs fn(rank) on one thread per rank; returns each rank's exception message, "" if none.
inline std::vector<std::string> on_threads(int world, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline OpContext make_ctx(uint64_t seq, int64_t total) {
  OpContext ctx;
  ctx.descriptor.seq = seq;
  ctx.descriptor.total_elems = total;
  ctx.deadline = Clock::now() + std::chrono::seconds(30);
  ctx.what = "allreduce (op #" + std::to_string(seq) + ")";
  ctx.describe = [](const OpDescriptor& d) { return std::to_string(d.total_elems); };
  return ctx;
}

// Values whose float sums depend on the order (so equal bits mean equal order).
inline std::vector<float> random_floats(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
  return v;
}

}  // namespace xdev::transport
