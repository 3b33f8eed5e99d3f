// The symmetric heap (transport/symmetric_heap.h): its allocator (the same calls in the same
// order give the same places; frees coalesce and are reused; arenas grow) and the in-place
// allreduce of blocks in it, with threads standing in for ranks. Within one process a "peer"
// arena is opened exactly as across processes, through /proc/<pid>/fd/<fd>.

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/collective_plan.h"
#include "test_harness.h"
#include "transport/shared_buffer.h"
#include "transport/shm_channel.h"
#include "transport/shm_executor.h"
#include "transport/symmetric_heap.h"
#include "transport_test_util.h"

namespace {

using namespace xdev;
using transport::HeapLocation;
using transport::SymmetricHeap;

constexpr size_t kMiB = size_t{1} << 20;

TEST(symmetric_heap_places_the_same_calls_alike) {
  SymmetricHeap a(0, 2, 2 * kMiB, nullptr), b(1, 2, 2 * kMiB, nullptr);
  std::vector<HeapLocation> places_a, places_b;
  for (size_t bytes : {size_t{100}, size_t{4096}, size_t{0}, kMiB, size_t{300}}) {
    places_a.push_back(a.allocate(bytes).where);
    places_b.push_back(b.allocate(bytes).where);
  }
  a.free(places_a[1]);
  b.free(places_b[1]);
  places_a.push_back(a.allocate(1000).where);
  places_b.push_back(b.allocate(1000).where);
  CHECK(places_a == places_b);
  // Blocks are aligned and disjoint: 100 -> 256 bytes, 4096, 0 -> 256, then 1 MiB.
  CHECK_EQ(places_a[0].offset, 0);
  CHECK_EQ(places_a[1].offset, 256);
  CHECK_EQ(places_a[2].offset, 256 + 4096);
  CHECK_EQ(places_a[3].offset, 512 + 4096);
  // The freed 4096-byte hole takes the 1000-byte block (first fit).
  CHECK_EQ(places_a[5].offset, 256);
  CHECK_EQ(a.live_blocks(), 5);
}

TEST(symmetric_heap_coalesces_frees_and_grows) {
  SymmetricHeap heap(0, 1, 2 * kMiB, nullptr);
  const auto x = heap.allocate(kMiB), y = heap.allocate(kMiB / 2), z = heap.allocate(kMiB / 2);
  CHECK_EQ(heap.arenas(), 1);
  CHECK_EQ(heap.bytes_in_use(), 2 * kMiB);
  // Freed out of order, the three blocks merge back into the whole arena.
  heap.free(y.where);
  heap.free(x.where);
  heap.free(z.where);
  CHECK_EQ(heap.bytes_in_use(), size_t{0});
  const auto whole = heap.allocate(2 * kMiB);
  CHECK_EQ(whole.where.arena, 0);
  CHECK_EQ(whole.where.offset, 0);
  // No room left: a second arena, at least as large as the first.
  const auto more = heap.allocate(100);
  CHECK_EQ(more.where.arena, 1);
  CHECK_EQ(heap.bytes_reserved(), 4 * kMiB);
  // locate finds a range inside a block, and nothing outside the heap.
  const HeapLocation inside = heap.locate(whole.data + 4096, 8);
  CHECK_EQ(inside.arena, 0);
  CHECK_EQ(inside.offset, 4096);
  int on_stack = 0;
  CHECK_EQ(heap.locate(&on_stack, sizeof on_stack).arena, -1);
  // Memory is real and writable end to end.
  std::memset(whole.data, 0x5a, 2 * kMiB);
  CHECK_EQ(static_cast<unsigned char>(whole.data[2 * kMiB - 1]), 0x5a);
}

// One heap and one channel per rank. Each rank allocates `extra_first[r]` bytes, then the
// tensor (or, where `in_heap[r]` is false, uses an ordinary buffer), and allreduces it as the
// backend does: the staged flat plan, which turns in place after its first barrier when every
// rank's block is at the same place. Returns, per rank, whether it ran in place; checks the
// totals either way, and that a bare barrier afterwards keeps the ranks in step.
std::vector<bool> heap_allreduce(const std::vector<size_t>& extra_first,
                                 const std::vector<bool>& in_heap, int64_t count) {
  const int world = static_cast<int>(extra_first.size());
  constexpr int64_t kWindow = 1024;  // elements: several windows when staged
  auto channels = transport::make_group(world, kWindow * sizeof(float));
  transport::PlacedTensors placed = transport::place_tensors(channels, extra_first, in_heap, count);
  const std::vector<float*>& data = placed.data;
  const std::vector<HeapLocation>& where = placed.where;
  for (int r = 0; r < world; ++r) {
    const auto ur = static_cast<size_t>(r);
    for (int64_t i = 0; i < count; ++i) data[ur][i] = static_cast<float>((i % 97) * (r + 1));
  }
  const plan::FlatLayout layout({count});
  const auto plan =
      plan::CollectivePlan::allreduce(plan::Algorithm::kFlat, world, 0, {}, count, kWindow);
  std::vector<bool> in_place(static_cast<size_t>(world), false);
  const auto errors = transport::on_threads(world, [&](int r) {
    const auto ur = static_cast<size_t>(r);
    transport::ShmChannel& ch = channels[ur];
    transport::ShmExecutor staged(ch);
    transport::SharedBufferExecutor exec(ch);
    transport::CollectiveRequest req;
    req.plan = &plan;
    req.layout = &layout;
    req.tensors = {reinterpret_cast<char*>(data[ur])};
    req.ctx = transport::make_ctx(1, count);
    transport::SharedBufferRequest heap_req;
    if (in_heap[ur]) {
      req.ctx.descriptor.heap_arena = where[ur].arena;
      req.ctx.descriptor.heap_offset = where[ur].offset;
      heap_req.count = count;
      heap_req.ctx = req.ctx;
      SymmetricHeap& heap = *placed.heaps[ur];
      heap_req.copies = [&] {
        std::vector<char*> copies;
        for (int peer = 0; peer < world; ++peer) {
          const int arena = where[ur].arena;
          copies.push_back(heap.arena_of(peer, arena, ch.arena_of(peer, arena)) + where[ur].offset);
        }
        return copies;
      };
      req.after_first_barrier = [&] { return in_place[ur] = exec.run_opened(heap_req); };
    }
    staged.run(req);
    staged.barrier(transport::make_ctx(2, 0));
  });
  const float factor = static_cast<float>(world * (world + 1) / 2);
  for (int r = 0; r < world; ++r) {
    CHECK_EQ(errors[static_cast<size_t>(r)], "");
    bool all_equal = true;
    for (int64_t i = 0; i < count; ++i) {
      all_equal =
          all_equal && data[static_cast<size_t>(r)][i] == static_cast<float>(i % 97) * factor;
    }
    CHECK(all_equal);
  }
  return in_place;
}

TEST(heap_blocks_at_the_same_place_allreduce_in_place) {
  CHECK(heap_allreduce({0, 0, 0}, {true, true, true}, 100000) == std::vector<bool>(3, true));
  // Same extra allocation on every rank: still the same place.
  CHECK(heap_allreduce({512, 512}, {true, true}, 5000) == std::vector<bool>(2, true));
}

TEST(heap_blocks_at_different_places_stage_on_every_rank) {
  // Rank 1 allocated something first: its block is elsewhere, so every rank stages.
  CHECK(heap_allreduce({0, 4096, 0}, {true, true, true}, 10000) == std::vector<bool>(3, false));
}

TEST(heap_block_on_some_ranks_only_stages_on_every_rank) {
  // Rank 1's tensor is an ordinary one (as DDP's Join passes zeros_like buckets).
  CHECK(heap_allreduce({0, 0, 0}, {true, false, true}, 10000) == std::vector<bool>(3, false));
}

}  // namespace

TEST(channel_carries_device_arena_addresses_apart_from_host_arenas) {
  auto channels = transport::make_group(3, 4096);
  transport::DeviceArenaAddress a;
  a.bytes = 64 * kMiB;
  for (size_t i = 0; i < sizeof a.handle; ++i) a.handle[i] = static_cast<unsigned char>(i * 7 + 1);
  CHECK_EQ(channels[2].device_arena_of(1, 3).bytes, uint64_t{0});  // not published yet
  channels[1].publish_device_arena(3, a);
  for (int reader = 0; reader < 3; ++reader) {
    const transport::DeviceArenaAddress got = channels[reader].device_arena_of(1, 3);
    CHECK_EQ(got.bytes, a.bytes);
    CHECK(std::memcmp(got.handle, a.handle, sizeof a.handle) == 0);
    CHECK_EQ(channels[reader].arena_of(1, 3).bytes, uint64_t{0});  // the host heap's: untouched
    CHECK_EQ(channels[reader].device_arena_of(0, 3).bytes, uint64_t{0});
  }
  CHECK_EQ(channels[0].device_arena_of(1, SymmetricHeap::kMaxArenas).bytes, uint64_t{0});
  bool threw = false;
  try {
    channels[0].publish_device_arena(SymmetricHeap::kMaxArenas, a);
  } catch (const std::out_of_range&) {
    threw = true;
  }
  CHECK(threw);
}
