// Helpers for the transport tests: threads stand in for the ranks of one host.
#pragma once

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/shm_channel.h"
#include "transport/shm_segment.h"
#include "transport/symmetric_heap.h"

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

// Each rank's tensor of `elems` floats, as the backend would place it: one symmetric heap per
// rank that publishes its arenas on the rank's channel; rank r allocates extra_first[r] bytes
// first, then the tensor from its heap, or, where in_heap[r] is false, in ordinary memory.
struct PlacedTensors {
  std::vector<std::unique_ptr<SymmetricHeap>> heaps;
  std::vector<std::vector<float>> ordinary;
  std::vector<float*> data;
  std::vector<HeapLocation> where;
};

inline PlacedTensors place_tensors(std::vector<ShmChannel>& channels,
                                   const std::vector<size_t>& extra_first,
                                   const std::vector<bool>& in_heap, int64_t elems) {
  constexpr size_t kArenaBytes = size_t{2} << 20;
  const size_t world = channels.size();
  PlacedTensors placed;
  placed.ordinary.resize(world);
  placed.data.resize(world);
  placed.where.resize(world);
  for (size_t r = 0; r < world; ++r) {
    ShmChannel& ch = channels[r];
    placed.heaps.push_back(std::make_unique<SymmetricHeap>(
        static_cast<int>(r), static_cast<int>(world), kArenaBytes,
        [&ch](int arena, const ArenaAddress& a) { ch.publish_arena(arena, a); }));
    if (extra_first[r] > 0) placed.heaps[r]->allocate(extra_first[r]);
    if (in_heap[r]) {
      const auto block = placed.heaps[r]->allocate(static_cast<size_t>(elems) * sizeof(float));
      placed.data[r] = reinterpret_cast<float*>(block.data);
      placed.where[r] = block.where;
    } else {
      placed.ordinary[r].resize(static_cast<size_t>(elems));
      placed.data[r] = placed.ordinary[r].data();
    }
  }
  return placed;
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
