// Reduce-scatter and all-gather: the plans (csrc/plan/gather_scatter_plan.h) checked as data, and
// the executor (GatherScatterExecutor) end to end with one thread per rank over a real ShmChannel,
// against results computed here and, for reduce-scatter, against the bits of the flat allreduce;
// staged and single copy (in place from a symmetric heap: test_gather_scatter_heap.cc).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/collective_plan.h"
#include "plan/gather_scatter_plan.h"
#include "plan/schedule.h"
#include "plan/selection.h"
#include "plan_test_util.h"
#include "test_harness.h"
#include "transport/gather_scatter_executor.h"
#include "transport/shm_executor.h"
#include "transport_test_util.h"

namespace {

using namespace xdev;
using plan::GatherScatterKind;
using plan::GatherScatterPlan;
using transport::make_ctx;
using transport::make_group;
using transport::on_threads;
using transport::random_floats;

TEST(gather_scatter_selection_weighs_each_input_in_order) {
  using plan::GatherScatterPath;
  plan::GatherScatterInput in;
  in.world_size = 4;
  CHECK_EQ(plan::select_gather_scatter(in).path, GatherScatterPath::kNative);
  // Each refusal on its own, then in the order the decision takes them.
  plan::GatherScatterInput forced = in;
  forced.requested = plan::Algorithm::kFallback;
  CHECK_EQ(plan::select_gather_scatter(forced).path, GatherScatterPath::kFallback);
  // Another forced algorithm is an allreduce plan: gather and scatter stay native.
  forced.requested = plan::Algorithm::kReduceToOne;
  CHECK_EQ(plan::select_gather_scatter(forced).path, GatherScatterPath::kNative);
  plan::GatherScatterInput hosts = in;
  hosts.num_hosts = 2;
  hosts.transport_available = false;
  CHECK_EQ(plan::select_gather_scatter(hosts).reason, "ranks span 2 hosts");
  // CUDA: auto keeps NCCL where it runs; a forced native name, or ranks sharing a GPU (no
  // NCCL), run the native path, one tensor per side, where the IPC transport is open.
  plan::GatherScatterInput cuda = in;
  cuda.device = plan::DeviceKind::kCuda;
  cuda.nccl_available = true;
  CHECK_EQ(plan::select_gather_scatter(cuda).path, GatherScatterPath::kFallback);
  cuda.requested = plan::Algorithm::kFlat;
  CHECK_EQ(plan::select_gather_scatter(cuda).path, GatherScatterPath::kCuda);
  cuda.requested = plan::Algorithm::kAuto;
  cuda.nccl_available = false;  // ranks share a GPU, under MPS
  CHECK_EQ(plan::select_gather_scatter(cuda).path, GatherScatterPath::kCuda);
  cuda.gpu_time_sliced = true;  // without MPS: the engine, unless an algorithm is forced
  CHECK_EQ(plan::select_gather_scatter(cuda).path, GatherScatterPath::kFallback);
  CHECK_EQ(plan::select_gather_scatter(cuda).reason, std::string(plan::kGpuTimeSlicedReason));
  cuda.requested = plan::Algorithm::kFlat;
  CHECK_EQ(plan::select_gather_scatter(cuda).path, GatherScatterPath::kCuda);
  cuda.requested = plan::Algorithm::kAuto;
  cuda.gpu_time_sliced = false;
  cuda.num_tensors = 2;
  CHECK_EQ(plan::select_gather_scatter(cuda).reason,
           "CUDA: the native path takes one tensor per side, or one list of one size");
  cuda.one_list = true;  // a list form: one tensor per rank, packed into one
  CHECK_EQ(plan::select_gather_scatter(cuda).path, GatherScatterPath::kCuda);
  cuda.uneven_list_sizes = true;
  CHECK_EQ(plan::select_gather_scatter(cuda).reason,
           "CUDA: the native path takes one tensor per side, or one list of one size (uneven "
           "list sizes)");
  cuda.uneven_list_sizes = false;
  cuda.one_list = false;
  cuda.num_tensors = 1;
  cuda.transport_available = false;
  cuda.transport_note = "off: ranks span several hosts";
  CHECK_EQ(plan::select_gather_scatter(cuda).reason,
           "no native transport for cuda tensors (off: ranks span several hosts)");
  plan::GatherScatterInput op = in;
  op.op_supported = false;
  op.world_size = 1;  // even a world of one: the engine knows the dtype, the copy would not
  CHECK_EQ(plan::select_gather_scatter(op).path, GatherScatterPath::kFallback);
  // Uneven list sizes: one list runs natively on one host's CPU ranks, several do not.
  plan::GatherScatterInput shapes = in;
  shapes.uneven_list_sizes = true;
  shapes.one_list = true;
  CHECK_EQ(plan::select_gather_scatter(shapes).path, GatherScatterPath::kNative);
  shapes.one_list = false;
  CHECK_EQ(plan::select_gather_scatter(shapes).path, GatherScatterPath::kFallback);
  CHECK_EQ(plan::select_gather_scatter(shapes).reason, "uneven sizes in several lists");
  plan::GatherScatterInput one = in;
  one.world_size = 1;
  one.transport_available = false;  // a world of one has no channel, and needs none
  CHECK_EQ(plan::select_gather_scatter(one).path, GatherScatterPath::kOneRank);
  // Single copy from kCpuSingleCopyMinBytes of one tensor, where every rank may read its peers.
  plan::GatherScatterInput large = in;
  large.payload_bytes = plan::kCpuSingleCopyMinBytes;
  CHECK(!plan::select_gather_scatter(large).single_copy);
  large.single_copy_available = true;
  CHECK(plan::select_gather_scatter(large).single_copy);
  large.num_tensors = 2;
  CHECK(!plan::select_gather_scatter(large).single_copy);
  large.num_tensors = 1;
  large.payload_bytes -= 1;
  CHECK(!plan::select_gather_scatter(large).single_copy);
  plan::GatherScatterInput no_channel = in;
  no_channel.transport_available = false;
  CHECK_EQ(plan::select_gather_scatter(no_channel).path, GatherScatterPath::kFallback);
}

TEST(gather_scatter_schedules_are_hazard_free_and_stage_what_peers_read) {
  for (int world = 1; world <= 8; ++world) {
    for (const int64_t piece : {1, 7, 64}) {
      const plan::Schedule rs = plan::reduce_scatter_schedule(world, piece);
      const plan::Schedule ag = plan::all_gather_schedule(world, piece);
      CHECK_EQ(plan::find_schedule_hazard(rs), "");
      CHECK_EQ(plan::find_schedule_hazard(ag), "");
      CHECK_EQ(rs.num_phases, 1);
      CHECK_EQ(ag.num_phases, 1);
      CHECK_EQ(rs.steps.size(), static_cast<size_t>(world));
      CHECK_EQ(ag.steps.size(), static_cast<size_t>(world * world));
      for (int r = 0; r < world; ++r) {
        // Reduce-scatter: rank r's total of piece r, sources in rank order, its own from its
        // tensor; it stages all (N-1) pieces its peers reduce.
        const plan::Step& s = rs.steps[static_cast<size_t>(r)];
        CHECK_EQ(s.actor, r);
        CHECK(s.finalize);
        CHECK(s.target == plan::Target::kOutput);
        CHECK_EQ(s.range, (plan::Range{r * piece, (r + 1) * piece}));
        for (int src = 0; src < world; ++src) {
          CHECK_EQ(s.sources[static_cast<size_t>(src)], src == r ? plan::kOwnInput : src);
        }
        int64_t staged = 0;
        for (const plan::Range& x : rs.staged_ranges[static_cast<size_t>(r)]) {
          CHECK(!(x.begin < (r + 1) * piece && r * piece < x.end));  // not its own piece
          staged += x.size();
        }
        CHECK_EQ(staged, (world - 1) * piece);
        // All-gather: stages its own piece only when someone else reads it.
        const auto& ag_staged = ag.staged_ranges[static_cast<size_t>(r)];
        CHECK_EQ(ag_staged.size(), world > 1 ? size_t{1} : size_t{0});
      }
    }
  }
}

TEST(gather_scatter_plan_windows_tile_the_block) {
  // A block that fits one window stays one window (the single-copy form asks for exactly one),
  // whatever rounding would make of its piece: 48 ranks, 689 elements, a slot of 48 blocks.
  CHECK_EQ(GatherScatterPlan(GatherScatterKind::kReduceScatter, 48, 689, 689 * 48).num_windows(),
           1);
  CHECK_THROWS((GatherScatterPlan(GatherScatterKind::kAllGather, 4, 10, 3)), std::invalid_argument,
               "cannot hold");
  CHECK_THROWS((GatherScatterPlan(GatherScatterKind::kAllGather, 0, 10, 3)), std::invalid_argument,
               "world_size");
  CHECK_EQ(GatherScatterPlan(GatherScatterKind::kReduceScatter, 2, 0, 8).num_windows(), 0);
  for (const int world : {2, 3, 4, 8}) {
    for (const int64_t block : {1, 5, 100, 1001}) {
      const GatherScatterPlan p(GatherScatterKind::kReduceScatter, world, block, 64);
      // The N-1 pieces peers reduce, packed; where the block takes several windows, each a
      // multiple of 16 elements above 16 (world 4: 21 elements would fit, 16 are taken), so
      // that windows start aligned. A block that fits one window keeps it whole.
      const int64_t fits = 64 / (world - 1);
      const bool rounds = fits > plan::kPieceAlignElems && fits < block;
      CHECK_EQ(p.piece_elems(), rounds ? fits - fits % 16 : fits);
      int64_t next = 0;
      for (int64_t k = 0; k < p.num_windows(); ++k) {
        const plan::GatherScatterWindow w = p.window(k);
        CHECK_EQ(w.block.begin, next);
        CHECK(w.block.size() >= 1 && w.block.size() <= p.piece_elems());
        CHECK(w.block.size() * (world - 1) <= 64);  // fits one slot
        next = w.block.end;
      }
      CHECK_EQ(next, block);
      CHECK_THROWS(p.window(p.num_windows()), std::out_of_range, "");
      // An all-gather's slot holds its owner's piece only, from the slot's start: a whole slot.
      const GatherScatterPlan ag(GatherScatterKind::kAllGather, world, block, 64);
      CHECK_EQ(ag.piece_elems(), 64);
      CHECK_EQ(ag.slot_memory_offset(world - 1, (world - 1) * 64 + 5, 64), 5);
      // A reduce-scatter's slot skips its owner's piece: later pieces move down one.
      CHECK_EQ(p.slot_memory_offset(world - 1, 5, 16), 5);
      CHECK_EQ(p.slot_memory_offset(0, (world - 1) * 16 + 5, 16), (world - 2) * 16 + 5);
    }
  }
}

// Two tensors per rank (the coalesced form), blocks split over several windows.
TEST(gather_scatter_executor_reduce_scatter_is_the_slice_of_flat_allreduce) {
  constexpr int64_t kSlotElems = 30;
  const std::vector<int64_t> block_numels = {37, 1};
  const plan::FlatLayout block_layout(block_numels);
  for (const int world : {2, 3, 4}) {
    for (const kernels::ReduceOp op : {kernels::ReduceOp::kSum, kernels::ReduceOp::kAvg}) {
      // inputs[r][t]: rank r's full tensor t (world blocks).
      std::vector<std::vector<std::vector<float>>> inputs(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        for (size_t t = 0; t < block_numels.size(); ++t) {
          inputs[static_cast<size_t>(r)].push_back(
              random_floats(block_numels[t] * world, 100 * r + t));
        }
      }
      // The flat allreduce of the same inputs, one tensor at a time.
      std::vector<std::vector<std::vector<float>>> reduced = inputs;
      for (size_t t = 0; t < block_numels.size(); ++t) {
        const int64_t total = block_numels[t] * world;
        const plan::FlatLayout layout({total});
        const auto cp = plan::CollectivePlan::allreduce(plan::Algorithm::kFlat, world, 0, {}, total,
                                                        kSlotElems);
        auto channels = make_group(world, kSlotElems * sizeof(float));
        const auto errors = on_threads(world, [&](int r) {
          transport::ShmExecutor exec(channels[static_cast<size_t>(r)]);
          transport::CollectiveRequest req;
          req.plan = &cp;
          req.layout = &layout;
          req.tensors = {reinterpret_cast<char*>(reduced[static_cast<size_t>(r)][t].data())};
          req.op = op;
          req.ctx = make_ctx(1, total);
          exec.run(req);
        });
        for (const std::string& e : errors) CHECK_EQ(e, "");
      }
      const GatherScatterPlan p(GatherScatterKind::kReduceScatter, world, 38, kSlotElems);
      CHECK(p.num_windows() > 1);
      std::vector<std::vector<std::vector<float>>> outputs(static_cast<size_t>(world));
      auto channels = make_group(world, kSlotElems * sizeof(float));
      const auto errors = on_threads(world, [&](int r) {
        auto& out = outputs[static_cast<size_t>(r)];
        for (int64_t n : block_numels) out.emplace_back(static_cast<size_t>(n), -1.0f);
        transport::GatherScatterExecutor exec(channels[static_cast<size_t>(r)]);
        transport::GatherScatterRequest req;
        req.plan = &p;
        req.block_layout = &block_layout;
        for (size_t t = 0; t < block_numels.size(); ++t) {
          req.full.push_back(reinterpret_cast<char*>(inputs[static_cast<size_t>(r)][t].data()));
          req.block.push_back(reinterpret_cast<char*>(out[t].data()));
        }
        req.op = op;
        for (uint64_t seq = 1; seq <= 2; ++seq) {  // twice: the channel stays in step
          req.ctx = make_ctx(seq, 38);
          exec.run(req);
        }
      });
      for (int r = 0; r < world; ++r) {
        CHECK_EQ(errors[static_cast<size_t>(r)], "");
        for (size_t t = 0; t < block_numels.size(); ++t) {
          const auto& all = reduced[static_cast<size_t>(r)][t];
          const std::vector<float> slice(all.begin() + r * block_numels[t],
                                         all.begin() + (r + 1) * block_numels[t]);
          const auto& got = outputs[static_cast<size_t>(r)][t];
          CHECK(std::memcmp(got.data(), slice.data(), slice.size() * sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST(gather_scatter_executor_all_gathers_bytes_in_and_out_of_place) {
  constexpr int64_t kSlotBytes = 50;
  const std::vector<int64_t> block_bytes = {3, 41, 0, 17};
  const plan::FlatLayout block_layout(block_bytes);
  for (const int world : {2, 3, 4}) {
    for (const bool in_place : {false, true}) {
      const GatherScatterPlan p(GatherScatterKind::kAllGather, world, block_layout.total(),
                                kSlotBytes);
      std::vector<std::vector<std::vector<char>>> outputs(static_cast<size_t>(world));
      const auto byte_of = [](int r, size_t t, int64_t i) {
        return static_cast<char>((r * 31 + static_cast<int64_t>(t) * 7 + i) % 251);
      };
      auto channels = make_group(world, kSlotBytes);
      const auto errors = on_threads(world, [&](int r) {
        auto& out = outputs[static_cast<size_t>(r)];
        std::vector<std::vector<char>> in;
        transport::GatherScatterExecutor exec(channels[static_cast<size_t>(r)]);
        transport::GatherScatterRequest req;
        req.plan = &p;
        req.block_layout = &block_layout;
        req.dtype = kernels::DType::kUInt8;
        for (size_t t = 0; t < block_bytes.size(); ++t) {
          const int64_t n = block_bytes[t];
          out.emplace_back(static_cast<size_t>(n * world + 1), 0);  // +1: data() never null
          in.emplace_back(static_cast<size_t>(n + 1), 0);
          char* mine = in_place ? out[t].data() + r * n : in[t].data();
          for (int64_t i = 0; i < n; ++i) mine[i] = byte_of(r, t, i);
        }
        for (size_t t = 0; t < block_bytes.size(); ++t) {
          req.full.push_back(out[t].data());
          req.block.push_back(in_place ? out[t].data() + r * block_bytes[t] : in[t].data());
        }
        req.ctx = make_ctx(1, block_layout.total());
        exec.run(req);
      });
      for (int r = 0; r < world; ++r) {
        CHECK_EQ(errors[static_cast<size_t>(r)], "");
        for (size_t t = 0; t < block_bytes.size(); ++t) {
          bool same = true;
          for (int owner = 0; owner < world; ++owner) {
            for (int64_t i = 0; i < block_bytes[t]; ++i) {
              same = same && outputs[static_cast<size_t>(r)][t]
                                    [static_cast<size_t>(owner * block_bytes[t] + i)] ==
                                 byte_of(owner, t, i);
            }
          }
          CHECK(same);
        }
      }
    }
  }
}

}  // namespace

namespace {

// Runs one reduce-scatter or all-gather of one tensor per rank on threads; returns each rank's
// result (its output: block or full tensor).
std::vector<std::vector<float>> run_one(GatherScatterKind kind, int world, int64_t block,
                                        bool single_copy, bool in_place,
                                        const std::vector<std::vector<float>>& inputs) {
  const bool rs = kind == GatherScatterKind::kReduceScatter;
  const int64_t slot_elems = 64;
  const GatherScatterPlan p(kind, world, block, single_copy ? world * block : slot_elems);
  const plan::FlatLayout layout({block});
  std::vector<std::vector<float>> results(static_cast<size_t>(world));
  auto channels = make_group(world, slot_elems * sizeof(float));
  const auto errors = on_threads(world, [&](int r) {
    std::vector<float> in = inputs[static_cast<size_t>(r)];
    std::vector<float>& out = results[static_cast<size_t>(r)];
    out.assign(static_cast<size_t>(rs ? block : world * block), -1.0f);
    if (!rs && in_place) std::copy(in.begin(), in.end(), out.begin() + r * block);
    transport::GatherScatterExecutor exec(channels[static_cast<size_t>(r)]);
    transport::GatherScatterRequest req;
    req.plan = &p;
    req.block_layout = &layout;
    req.full = {reinterpret_cast<char*>(rs ? in.data() : out.data())};
    req.block = {reinterpret_cast<char*>(rs         ? out.data()
                                         : in_place ? out.data() + r * block
                                                    : in.data())};
    req.op = kernels::ReduceOp::kAvg;
    req.single_copy = single_copy;
    req.ctx = make_ctx(1, block);
    exec.run(req);
  });
  for (const std::string& e : errors) CHECK_EQ(e, "");
  return results;
}

TEST(gather_scatter_executor_single_copy_matches_staged_bitwise) {
  constexpr int64_t kBlock = 100003;  // several reduce chunks of 128 KiB
  for (const int world : {2, 3}) {
    std::vector<std::vector<float>> rs_in, ag_in;
    for (int r = 0; r < world; ++r) {
      rs_in.push_back(random_floats(world * kBlock, 7 + r));
      ag_in.push_back(random_floats(kBlock, 70 + r));
    }
    const auto rs_staged =
        run_one(GatherScatterKind::kReduceScatter, world, kBlock, false, false, rs_in);
    const auto rs_single =
        run_one(GatherScatterKind::kReduceScatter, world, kBlock, true, false, rs_in);
    CHECK(rs_staged == rs_single);
    const auto ag_staged =
        run_one(GatherScatterKind::kAllGather, world, kBlock, false, false, ag_in);
    for (const bool in_place : {false, true}) {
      const auto ag_single =
          run_one(GatherScatterKind::kAllGather, world, kBlock, true, in_place, ag_in);
      CHECK(ag_staged == ag_single);
    }
    std::vector<float> everyone;
    for (const auto& v : ag_in) everyone.insert(everyone.end(), v.begin(), v.end());
    CHECK(ag_staged[0] == everyone);
  }
}

}  // namespace

namespace {

// Uneven blocks (the list forms): rank j's block holds sizes[j] elements, some empty.
TEST(gather_scatter_executor_uneven_blocks) {
  constexpr int64_t kSlotElems = 24;
  for (const std::vector<int64_t>& sizes :
       {std::vector<int64_t>{5, 0, 31}, std::vector<int64_t>{1, 40}, {0, 0, 3, 17}}) {
    const int world = static_cast<int>(sizes.size());
    std::vector<int64_t> starts;
    int64_t total = 0;
    for (int64_t n : sizes) {
      starts.push_back(total);
      total += n;
    }
    const GatherScatterPlan rs(GatherScatterKind::kReduceScatter, sizes, kSlotElems);
    const GatherScatterPlan ag(GatherScatterKind::kAllGather, sizes, kSlotElems);
    for (const GatherScatterPlan* p : {&rs, &ag}) {
      for (int64_t k = 0; k < p->num_windows(); ++k) {
        CHECK_EQ(plan::find_schedule_hazard(p->window(k).schedule), "");
      }
    }
    const plan::FlatLayout layout({rs.block_elems()});
    std::vector<std::vector<float>> full_in, rs_out(sizes.size()), ag_out(sizes.size());
    for (int r = 0; r < world; ++r) full_in.push_back(random_floats(total, 300 + r));
    auto channels = make_group(world, kSlotElems * sizeof(float));
    const auto errors = on_threads(world, [&](int r) {
      const auto me = static_cast<size_t>(r);
      transport::GatherScatterExecutor exec(channels[me]);
      transport::GatherScatterRequest req;
      req.block_layout = &layout;
      req.block_starts = starts;
      rs_out[me].assign(static_cast<size_t>(sizes[me] + 1), -1.0f);
      req.plan = &rs;
      req.full = {reinterpret_cast<char*>(full_in[me].data())};
      req.block = {reinterpret_cast<char*>(rs_out[me].data())};
      req.ctx = make_ctx(1, total);
      exec.run(req);
      // All-gather each rank's reduce-scatter result back: the flat allreduce's totals.
      ag_out[me].assign(static_cast<size_t>(total + 1), -1.0f);
      req.plan = &ag;
      req.full = {reinterpret_cast<char*>(ag_out[me].data())};
      req.ctx = make_ctx(2, total);
      exec.run(req);
    });
    std::vector<float> totals(static_cast<size_t>(total), 0.0f);
    for (int r = 0; r < world; ++r) {
      for (int64_t i = 0; i < total; ++i) totals[i] += full_in[static_cast<size_t>(r)][i];
    }
    for (int r = 0; r < world; ++r) {
      CHECK_EQ(errors[static_cast<size_t>(r)], "");
      const std::vector<float> got(ag_out[static_cast<size_t>(r)].begin(),
                                   ag_out[static_cast<size_t>(r)].begin() + total);
      CHECK(got == totals);  // sums in rank order, as this loop does
    }
  }
}

}  // namespace
