// Unit tests of the gather/scatter cost model (csrc/plan/gather_scatter_predict.h) and of
// select_gather_scatter's choice by it (csrc/plan/selection.h). Expected times are worked out
// by hand on a CPU host whose cores are far faster than its memory, so that every byte's cost
// is its memory traffic: the arithmetic is in a comment next to each.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "plan/gather_scatter_plan.h"
#include "plan/gather_scatter_predict.h"
#include "plan/machines.h"
#include "plan/ring.h"
#include "plan/selection.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

constexpr auto kRS = GatherScatterKind::kReduceScatter;
constexpr auto kAG = GatherScatterKind::kAllGather;
constexpr GatherScatterCandidate kStaged{GatherScatterForm::kStaged, 0, false, false, {}};
constexpr GatherScatterCandidate kSingleCopy{GatherScatterForm::kSingleCopy, 0, false, false, {}};
constexpr GatherScatterCandidate kInPlace{GatherScatterForm::kInPlace, 0, false, false, {}};

bool near(double a, double b) {
  return std::abs(a - b) <= 1e-9 * std::max(std::abs(a), std::abs(b));
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Two ranks on two cores: memory 10 GB/s, cores 1e18 B/s, launch 50 us, barrier 2 us, the
// kernel's cross-process copy 1 GB/s per reader and 3 us per call, a 64 KiB window.
CpuHostParams hand_params() {
  CpuHostParams p;
  p.cores = 2;
  p.core_bytes_per_s = 1e18;
  p.memory_bytes_per_s = 10e9;
  p.launch_latency_s = 50e-6;
  p.barrier_latency_s = 2e-6;
  p.step_latency_s = 0;
  p.window_bytes = 64 * 1024;
  p.cross_process_bytes_per_s = 1e9;
  p.cross_process_call_s = 3e-6;
  return p;
}

// Four ranks on two cores (barriers sleep), otherwise the calibrated defaults.
MachineModel oversubscribed() {
  CpuHostParams p;
  p.cores = 2;
  return cpu_host(4, p);
}

GatherScatterInput native_input(const MachineModel& model, GatherScatterKind kind, int64_t bytes) {
  GatherScatterInput in;
  in.world_size = model.num_devices();
  in.kind = kind;
  in.payload_bytes = bytes;
  in.model = &model;
  return in;
}

}  // namespace

TEST(gather_scatter_model_staged_costs_its_memory_traffic) {
  const MachineModel m = cpu_host(2, hand_params());
  const double mem = 10e9;
  // Reduce-scatter of float32 blocks of 64 KiB, one window: a slot holds the N-1 pieces
  // peers reduce, 64 KiB / 4 B / 1 = 16384 elements, p*e = 64 KiB. Staging: each rank copies
  // its peer's piece (read + write, 2pe), both at once: 4pe of memory traffic. Then a barrier,
  // then each rank reduces: its peer's piece (pe) and its own (pe) read, its output written
  // (pe): 6pe in all. Memory is the only bottleneck throughout, so a window takes
  // 10pe / mem + barrier.
  const double pe = 64.0 * 1024;
  const int64_t bytes = 2 * 64 * 1024;  // both ranks' blocks
  const double rs = predict_gather_scatter(m, kRS, kStaged, bytes).seconds;
  CHECK(near(rs, 50e-6 + 10 * pe / mem + 2e-6));
  // All-gather, one window of C = 16 KiB blocks (a slot holds a whole piece): each rank stages
  // its block (2C, 4C in all); then copies its own block from its input (2C) and its peer's
  // from the slot (C read, C written): 8C in all.
  const double c = 16.0 * 1024;
  const double ag = predict_gather_scatter(m, kAG, kStaged, 2 * 16 * 1024).seconds;
  CHECK(near(ag, 50e-6 + 12 * c / mem + 2e-6));
  // A window as a parameter: 16 KiB slots make the reduce-scatter above 4 windows, each of
  // a quarter of the traffic and one barrier.
  const GatherScatterCandidate small{GatherScatterForm::kStaged, 16 * 1024, false, false, {}};
  CHECK_EQ(small.label(), std::string("staged/16KiB"));
  const double rs_small = predict_gather_scatter(m, kRS, small, bytes).seconds;
  CHECK(near(rs_small, 50e-6 + 4 * (10 * pe / 4 / mem + 2e-6)));
}

TEST(gather_scatter_model_direct_forms_skip_staging) {
  const MachineModel m = cpu_host(2, hand_params());
  const double mem = 10e9;
  // In place, reduce-scatter of C*e = 1 MB blocks: no staging; each rank reads its peer's
  // part (Ce) and its own (Ce) and writes Ce: 6Ce of traffic. One barrier before (inputs
  // ready), one after (nobody reads them any more).
  const double ce = 1e6;
  const double rs = predict_gather_scatter(m, kRS, kInPlace, 2000000).seconds;
  CHECK(near(rs, 50e-6 + 2e-6 + 6 * ce / mem + 2e-6));
  // Single copy: the peer's part also crosses the reader's 1 GB/s cross-process copy, so it
  // takes Ce / 1 GB/s = 1 ms while the own-block traffic (4 flows share memory: the two
  // remote ones hold 1 GB/s each, the local ones 4 GB/s each) is done at 0.5 ms; plus one call.
  const double sc = predict_gather_scatter(m, kRS, kSingleCopy, 2000000).seconds;
  CHECK(near(sc, 50e-6 + 2e-6 + 3e-6 + ce / 1e9 + 2e-6));
  // Direct reads beat staging at this size; the same bytes staged cost 10Ce / mem.
  const double staged = predict_gather_scatter(m, kRS, kStaged, 2000000).seconds;
  CHECK(rs < staged);
  CHECK(rs < sc);
  // A machine without a cross-process path has no single copy.
  const MachineModel gpu = dgx1_v100();
  CHECK_THROWS(predict_gather_scatter(gpu, kAG, kSingleCopy, 1 << 20), std::invalid_argument,
               "no cross-process read path");
  CHECK_EQ(gather_scatter_candidates(gpu, {true, false}).size(), size_t{1});
  // Nothing to move: the launch only.
  CHECK(near(predict_gather_scatter(m, kRS, kInPlace, 4).seconds, 50e-6));
}

TEST(gather_scatter_model_is_monotone_in_size) {
  for (const MachineModel& m : {builtin_machine("cpu-2"), oversubscribed(), dgx1_v100()}) {
    for (GatherScatterKind kind : {kRS, kAG}) {
      const GatherScatterChoice first = choose_gather_scatter(m, kind, 4, {true, true}, true);
      std::vector<double> last(first.predictions.size(), 0.0);
      for (int64_t bytes = 4; bytes <= (int64_t{64} << 20); bytes *= 4) {
        const GatherScatterChoice c = choose_gather_scatter(m, kind, bytes, {true, true}, true);
        CHECK_EQ(c.predictions.size(), last.size());
        for (size_t i = 0; i < last.size(); ++i) {
          CHECK(c.predictions[i].seconds >= last[i]);
          last[i] = c.predictions[i].seconds;
        }
        CHECK(c.predictions.back().candidate.ring_reference);
        // The choice is the fastest candidate that can run, never the reference.
        for (const GatherScatterPrediction& p : c.predictions) {
          if (!p.candidate.ring_reference) CHECK(c.best.seconds <= p.seconds);
        }
        CHECK(!c.best.candidate.ring_reference);
      }
    }
  }
}

TEST(gather_scatter_model_chooses_staged_small_and_direct_large) {
  // Four ranks on two cores: each barrier sleeps, so the direct form's closing barrier costs
  // more than staging a few KiB saves; at 16 MiB staging costs more than any barrier.
  const MachineModel m = oversubscribed();
  for (GatherScatterKind kind : {kRS, kAG}) {
    CHECK_EQ(choose_gather_scatter(m, kind, 4096, {false, true}).best.candidate.form,
             GatherScatterForm::kStaged);
    CHECK_EQ(choose_gather_scatter(m, kind, 16 << 20, {false, true}).best.candidate.form,
             GatherScatterForm::kInPlace);
    // Only staged allowed: staged, whatever the size.
    CHECK_EQ(choose_gather_scatter(m, kind, 16 << 20, {}).best.candidate.form,
             GatherScatterForm::kStaged);
  }
}

TEST(gather_scatter_model_ring_halves_split_the_ring_allreduce) {
  // The ring reference's two halves together are the ring allreduce's steps.
  const MachineModel m = dgx1_v100();
  const Schedule all = ring_allreduce_schedule(8, find_rings(m.links), {0, 8000});
  const Program rs =
      gather_scatter_program(m, kRS, {GatherScatterForm::kStaged, 0, true, false, {}}, 32000, 4);
  const Program ag =
      gather_scatter_program(m, kAG, {GatherScatterForm::kStaged, 0, true, false, {}}, 8000, 1);
  size_t rs_steps = 0, ag_steps = 0;
  for (const Task& t : rs.tasks) rs_steps += t.label.rfind("stage", 0) != 0 && t.label != "launch";
  for (const Task& t : ag.tasks) ag_steps += t.label.rfind("stage", 0) != 0 && t.label != "launch";
  CHECK_EQ(rs_steps + ag_steps, all.steps.size());
  // On a DGX-1 the direct form reads from every peer, three of them over PCIe: NVLink rings
  // move large payloads several times faster (the link-aware form the model says would pay).
  for (GatherScatterKind kind : {kRS, kAG}) {
    const GatherScatterChoice c = choose_gather_scatter(m, kind, 64 << 20, {false, true}, true);
    CHECK(c.predictions.back().seconds * 3 < c.best.seconds);
  }
}

TEST(gather_scatter_selection_is_the_models_choice_at_the_size_class) {
  const MachineModel m = oversubscribed();
  GatherScatterChoiceCache cache;
  for (GatherScatterKind kind : {kRS, kAG}) {
    for (int64_t bytes : {int64_t{4096}, int64_t{100000}, int64_t{16} << 20}) {
      int64_t bucket = 4;
      while (bucket < bytes) bucket <<= 1;
      // The model weighs staged against in place; single copy is the user's call.
      const GatherScatterChoice want =
          choose_gather_scatter(m, kind, bucket, {false, true}, false, kind == kRS ? 4 : 1);
      for (GatherScatterChoiceCache* c :
           {static_cast<GatherScatterChoiceCache*>(nullptr), &cache, &cache}) {
        GatherScatterInput in = native_input(m, kind, bytes);
        in.in_symmetric_heap = true;
        in.model_cache = c;
        const GatherScatterSelection s = select_gather_scatter(in);
        CHECK_EQ(s.path, GatherScatterPath::kNative);
        CHECK(!s.single_copy);
        CHECK_EQ(s.in_place, want.best.candidate.form == GatherScatterForm::kInPlace);
        CHECK_EQ(s.predicted_s, want.best.seconds);
        CHECK(contains(s.reason, "model '" + m.name() + "': " + want.best.candidate.label()));
        CHECK(contains(s.reason, ", next "));
      }
    }
  }
  // The choice flips with size, and the reason says which form runs.
  GatherScatterInput in = native_input(m, kRS, 4096);
  in.in_symmetric_heap = true;
  GatherScatterSelection s = select_gather_scatter(in);
  CHECK(!s.in_place && !s.single_copy);
  CHECK(contains(s.reason, "staged through shared memory"));
  in.payload_bytes = 16 << 20;
  s = select_gather_scatter(in);
  CHECK(s.in_place && !s.single_copy);
  CHECK(contains(s.reason, "in place: peers read each other's inputs in the symmetric heap"));
  // Options.single_copy turns one tensor of at least kCpuSingleCopyMinBytes single copy, as for
  // the allreduce, whether or not this rank's tensor lies in the heap: that may differ between
  // the ranks of one call, and their forms must not.
  in.single_copy_available = true;
  for (int64_t bytes : {kCpuSingleCopyMinBytes, int64_t{16} << 20}) {
    in.payload_bytes = bytes;
    for (bool heap : {true, false}) {
      in.in_symmetric_heap = heap;
      s = select_gather_scatter(in);
      CHECK(s.single_copy && !s.in_place);
      CHECK(contains(s.reason, "(Options.single_copy, one tensor of at least 256 KiB)"));
    }
  }
  in.in_symmetric_heap = true;
  in.single_copy_available = false;
  // Several tensors: staged, without a prediction.
  in.num_tensors = 2;
  in.payload_bytes = 16 << 20;
  s = select_gather_scatter(in);
  CHECK(!s.in_place && !s.single_copy && contains(s.reason, "several tensors"));
  CHECK_EQ(s.predicted_s, 0.0);
  // Another model in the same cache, or a model of another world size, is refused.
  const MachineModel other = builtin_machine("cpu-4");
  CHECK_THROWS(cache.get(other, kRS, 4096, 4, {}), std::invalid_argument, "after model");
  in.num_tensors = 1;
  in.world_size = 2;
  CHECK_THROWS(select_gather_scatter(in), std::invalid_argument, "model of 4 devices for 2 ranks");
}

TEST(gather_scatter_selection_keeps_the_fixed_facts_with_a_model) {
  const MachineModel m = builtin_machine("cpu-2");
  GatherScatterInput in = native_input(m, kAG, 16 << 20);
  in.single_copy_available = true;
  in.in_symmetric_heap = true;
  GatherScatterInput fallback = in;
  fallback.requested = Algorithm::kFallback;
  CHECK_EQ(select_gather_scatter(fallback).path, GatherScatterPath::kFallback);
  GatherScatterInput op = in;
  op.op_supported = false;
  CHECK_EQ(select_gather_scatter(op).reason,
           std::string("no native kernel for this reduce op / dtype"));
  GatherScatterInput no_channel = in;
  no_channel.transport_available = false;
  CHECK_EQ(select_gather_scatter(no_channel).path, GatherScatterPath::kFallback);
  // A world of one needs no model of its size.
  GatherScatterInput one = in;
  one.world_size = 1;
  CHECK_EQ(select_gather_scatter(one).path, GatherScatterPath::kOneRank);
  // Outside the heap: single copy from kCpuSingleCopyMinBytes of one tensor, model or not.
  for (const MachineModel* model : {&m, static_cast<const MachineModel*>(nullptr)}) {
    GatherScatterInput fixed = in;
    fixed.model = model;
    fixed.in_symmetric_heap = false;
    fixed.payload_bytes = kCpuSingleCopyMinBytes;
    CHECK(select_gather_scatter(fixed).single_copy);
    CHECK(!select_gather_scatter(fixed).in_place);
    fixed.payload_bytes -= 1;
    CHECK(!select_gather_scatter(fixed).single_copy);
    CHECK_EQ(select_gather_scatter(fixed).reason,
             std::string("staged through shared memory, one barrier per window"));
  }
  // In the heap without a model: staged (the model decides when to read in place).
  GatherScatterInput no_model = in;
  no_model.model = nullptr;
  no_model.single_copy_available = false;
  CHECK(!select_gather_scatter(no_model).in_place);
}
