// The symmetric heap (transport/symmetric_heap.h): its allocator (the same calls in the same
// order give the same places; frees coalesce and are reused; arenas grow) and the in-place
// allreduce of blocks in it, with threads standing in for ranks. Within one process a "peer"
// arena is opened exactly as across processes, through /proc/<pid>/fd/<fd>.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "test_harness.h"
#include "transport/shared_buffer.h"
#include "transport/shm_channel.h"
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

// One heap and one channel per rank; each rank allocates `extra_first[r]` bytes, then the
// tensor, and allreduces it in place. Returns whether the executor ran in place on each rank.
std::vector<bool> heap_allreduce(const std::vector<size_t>& extra_first, int64_t count) {
  const int world = static_cast<int>(extra_first.size());
  auto channels = transport::make_group(world, 4096);
  std::vector<std::unique_ptr<SymmetricHeap>> heaps;
  for (int r = 0; r < world; ++r) {
    transport::ShmChannel& ch = channels[static_cast<size_t>(r)];
    heaps.push_back(std::make_unique<SymmetricHeap>(
        r, world, 2 * kMiB,
        [&ch](int arena, const transport::ArenaAddress& a) { ch.publish_arena(arena, a); }));
  }
  std::vector<SymmetricHeap::Block> blocks;
  for (int r = 0; r < world; ++r) {
    SymmetricHeap& heap = *heaps[static_cast<size_t>(r)];
    if (extra_first[static_cast<size_t>(r)] > 0) heap.allocate(extra_first[static_cast<size_t>(r)]);
    blocks.push_back(heap.allocate(static_cast<size_t>(count) * sizeof(float)));
    auto* data = reinterpret_cast<float*>(blocks.back().data);
    for (int64_t i = 0; i < count; ++i) data[i] = static_cast<float>((i % 97) * (r + 1));
  }
  std::vector<bool> in_place(static_cast<size_t>(world));
  const auto errors = transport::on_threads(world, [&](int r) {
    transport::SharedBufferExecutor exec(channels[static_cast<size_t>(r)]);
    transport::SharedBufferRequest req;
    req.count = count;
    req.op = kernels::ReduceOp::kSum;
    req.ctx = transport::make_ctx(1, count);
    const HeapLocation where = blocks[static_cast<size_t>(r)].where;
    req.ctx.descriptor.heap_arena = where.arena;
    req.ctx.descriptor.heap_offset = where.offset;
    SymmetricHeap& heap = *heaps[static_cast<size_t>(r)];
    transport::ShmChannel& ch = channels[static_cast<size_t>(r)];
    req.copies = [&] {
      std::vector<char*> copies;
      for (int peer = 0; peer < world; ++peer) {
        copies.push_back(heap.arena_of(peer, where.arena, ch.arena_of(peer, where.arena)) +
                         where.offset);
      }
      return copies;
    };
    in_place[static_cast<size_t>(r)] = exec.run(req);
  });
  for (int r = 0; r < world; ++r) CHECK_EQ(errors[static_cast<size_t>(r)], "");
  if (in_place[0]) {
    const float factor = static_cast<float>(world * (world + 1) / 2);
    for (int r = 0; r < world; ++r) {
      const auto* data = reinterpret_cast<const float*>(blocks[static_cast<size_t>(r)].data);
      bool all_equal = true;
      for (int64_t i = 0; i < count; ++i) {
        all_equal = all_equal && data[i] == static_cast<float>(i % 97) * factor;
      }
      CHECK(all_equal);
    }
  }
  return in_place;
}

TEST(heap_blocks_at_the_same_place_allreduce_in_place) {
  CHECK(heap_allreduce({0, 0, 0}, 100000) == std::vector<bool>(3, true));
  // Same extra allocation on every rank: still the same place.
  CHECK(heap_allreduce({512, 512}, 5000) == std::vector<bool>(2, true));
}

TEST(heap_blocks_at_different_places_are_refused_on_every_rank) {
  // Rank 1 allocated something first: its block is elsewhere, so no rank runs in place.
  CHECK(heap_allreduce({0, 4096, 0}, 1000) == std::vector<bool>(3, false));
}

TEST(heap_block_on_some_ranks_only_fails_on_every_rank) {
  // Rank 1's tensor is not in the heap: its path differs, so the descriptor check fails on
  // both ranks at the first barrier, before anyone reads or writes a peer's memory.
  auto channels = transport::make_group(2, 4096);
  const auto errors = transport::on_threads(2, [&](int r) {
    transport::SharedBufferExecutor exec(channels[static_cast<size_t>(r)]);
    transport::SharedBufferRequest req;
    req.count = 16;
    req.ctx = transport::make_ctx(1, 16);
    req.ctx.descriptor.heap_arena = r == 0 ? 0 : -1;
    req.copies = [] { return std::vector<char*>(); };  // never reached
    exec.run(req);
  });
  for (const std::string& e : errors) CHECK(e.find("mismatched collectives") != std::string::npos);
}

}  // namespace
