// Reduce-scatter and all-gather in place from a symmetric heap per rank: the executor
// (GatherScatterExecutor) end to end with one thread per rank over a real ShmChannel, in place
// where every rank's tensor sits at the same place in its heap and staged on every rank where
// one does not, against results computed here, bit for bit.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "plan/collective_plan.h"
#include "plan/gather_scatter_plan.h"
#include "plan_test_util.h"
#include "test_harness.h"
#include "transport/gather_scatter_executor.h"
#include "transport/symmetric_heap.h"
#include "transport_test_util.h"

namespace {

using namespace xdev;
using plan::GatherScatterKind;
using plan::GatherScatterPlan;
using transport::make_ctx;
using transport::make_group;
using transport::on_threads;
using transport::random_floats;

}  // namespace

namespace {

using transport::HeapLocation;
using transport::SymmetricHeap;

// One symmetric heap and one channel per rank, as the backend has. Each rank allocates
// `extra_first[r]` bytes, then its full tensor (reduce-scatter input, all-gather output) from
// the heap, or, where `in_heap[r]` is false, an ordinary buffer, and runs the collective twice
// (then a bare barrier: the ranks stay in step). Rank r's block holds blocks_elems[r] elements
// (uneven where they differ, as the two-level allreduce cuts its slices). Returns, per rank and
// run, whether it ran in place; checks every result against one computed here, bit for bit,
// either way.
std::vector<bool> heap_gather_scatter(GatherScatterKind kind,
                                      const std::vector<size_t>& extra_first,
                                      const std::vector<bool>& in_heap,
                                      const std::vector<int64_t>& blocks_elems,
                                      bool input_inside_output) {
  constexpr int64_t kSlotElems = 512;  // several windows when staged
  const bool rs = kind == GatherScatterKind::kReduceScatter;
  const int world = static_cast<int>(extra_first.size());
  const auto uworld = static_cast<size_t>(world);
  auto channels = make_group(world, kSlotElems * sizeof(float));
  std::vector<std::vector<float>> blocks(uworld);
  const bool even = std::all_of(blocks_elems.begin(), blocks_elems.end(),
                                [&](int64_t c) { return c == blocks_elems[0]; });
  std::vector<int64_t> starts;  // rank j's block starts at element starts[j] of the full tensor
  int64_t full_elems = 0;
  for (const int64_t c : blocks_elems) {
    starts.push_back(full_elems);
    full_elems += c;
  }
  // inputs[r]: rank r's reduce-scatter input or all-gather block.
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < world; ++r)
    inputs.push_back(random_floats(rs ? full_elems : blocks_elems[static_cast<size_t>(r)], 9 + r));
  transport::PlacedTensors placed =
      transport::place_tensors(channels, extra_first, in_heap, full_elems);
  const std::vector<float*>& full = placed.data;
  const std::vector<HeapLocation>& where = placed.where;
  for (int r = 0; r < world; ++r) {
    const auto ur = static_cast<size_t>(r);
    std::fill(full[ur], full[ur] + full_elems, -1.0f);
    blocks[ur].assign(static_cast<size_t>(blocks_elems[ur]), -1.0f);
    if (rs) {
      std::copy(inputs[ur].begin(), inputs[ur].end(), full[ur]);
    } else if (input_inside_output) {  // FSDP's all-gather input: its block of the output
      std::copy(inputs[ur].begin(), inputs[ur].end(), full[ur] + starts[ur]);
    } else {
      blocks[ur] = inputs[ur];
    }
  }
  const GatherScatterPlan p(kind, blocks_elems, kSlotElems);
  CHECK(p.num_windows() > 1);
  const plan::FlatLayout layout({p.block_elems()});
  std::vector<bool> in_place(2 * uworld, false);
  const auto errors = on_threads(world, [&](int r) {
    const auto ur = static_cast<size_t>(r);
    transport::ShmChannel& ch = channels[ur];
    transport::GatherScatterExecutor exec(ch);
    transport::GatherScatterRequest req;
    req.plan = &p;
    req.block_layout = &layout;
    req.full = {reinterpret_cast<char*>(full[ur])};
    req.block = {reinterpret_cast<char*>(!rs && input_inside_output ? full[ur] + starts[ur]
                                                                    : blocks[ur].data())};
    if (!even) req.block_starts = starts;
    req.op = kernels::ReduceOp::kSum;
    SymmetricHeap& heap = *placed.heaps[ur];
    if (in_heap[ur]) {
      req.full_copies = [&] {
        std::vector<char*> copies;
        for (int peer = 0; peer < world; ++peer) {
          const int arena = where[ur].arena;
          copies.push_back(heap.arena_of(peer, arena, ch.arena_of(peer, arena)) + where[ur].offset);
        }
        return copies;
      };
    }
    for (uint64_t seq = 1; seq <= 2; ++seq) {
      req.ctx = make_ctx(seq, full_elems);
      req.ctx.descriptor.heap_arena = in_heap[ur] ? where[ur].arena : -1;
      req.ctx.descriptor.heap_offset = in_heap[ur] ? where[ur].offset : 0;
      in_place[(seq - 1) * uworld + ur] = exec.run(req);
    }
    ch.barrier(transport::Clock::now() + std::chrono::seconds(30), "closing barrier");
  });
  for (int r = 0; r < world; ++r) {
    const auto ur = static_cast<size_t>(r);
    CHECK_EQ(errors[ur], "");
    if (rs) {
      // The sum in rank order, as the flat allreduce takes it: bit for bit.
      std::vector<float> want(static_cast<size_t>(blocks_elems[ur]), 0.0f);
      for (int src = 0; src < world; ++src) {
        for (int64_t i = 0; i < blocks_elems[ur]; ++i)
          want[i] += inputs[static_cast<size_t>(src)][starts[ur] + i];
      }
      CHECK(blocks[ur] == want);
    } else {
      std::vector<float> want;
      for (const auto& v : inputs) want.insert(want.end(), v.begin(), v.end());
      CHECK(std::vector<float>(full[ur], full[ur] + full_elems) == want);
    }
  }
  return in_place;
}

TEST(gather_scatter_in_place_from_the_heap_when_every_place_agrees) {
  for (const GatherScatterKind kind :
       {GatherScatterKind::kReduceScatter, GatherScatterKind::kAllGather}) {
    for (const bool inside : {true, false}) {
      CHECK(heap_gather_scatter(kind, {0, 0, 0}, {true, true, true}, {3001, 3001, 3001}, inside) ==
            std::vector<bool>(6, true));
      // The same extra allocation on every rank: still the same place.
      CHECK(heap_gather_scatter(kind, {512, 512}, {true, true}, {2000, 2000}, inside) ==
            std::vector<bool>(4, true));
      // Uneven blocks, as the two-level allreduce cuts a payload that does not divide.
      CHECK(heap_gather_scatter(kind, {0, 0, 0}, {true, true, true}, {2001, 2000, 2000}, inside) ==
            std::vector<bool>(6, true));
    }
  }
}

TEST(gather_scatter_heap_tensors_at_different_places_stage_on_every_rank) {
  for (const GatherScatterKind kind :
       {GatherScatterKind::kReduceScatter, GatherScatterKind::kAllGather}) {
    // Rank 1 allocated something first: its tensor is elsewhere, so every rank stages.
    CHECK(heap_gather_scatter(kind, {0, 4096, 0}, {true, true, true}, {3001, 3001, 3001}, true) ==
          std::vector<bool>(6, false));
    CHECK(heap_gather_scatter(kind, {0, 4096}, {true, true}, {1001, 1000}, true) ==
          std::vector<bool>(4, false));
  }
}

TEST(gather_scatter_heap_tensor_on_some_ranks_only_stages_on_every_rank) {
  for (const GatherScatterKind kind :
       {GatherScatterKind::kReduceScatter, GatherScatterKind::kAllGather}) {
    for (const bool inside : {true, false}) {
      CHECK(heap_gather_scatter(kind, {0, 0, 0}, {true, false, true}, {3001, 3001, 3001}, inside) ==
            std::vector<bool>(6, false));
    }
  }
}

}  // namespace
