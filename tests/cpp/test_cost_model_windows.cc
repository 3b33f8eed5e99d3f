// Unit tests of the cost model's programs of windows (csrc/plan/cost_model.h, append_window):
// which tasks a window's schedule becomes on a machine, and what they cost. Every expected time is
// computed by hand in the test, with the arithmetic in a comment next to it; doubles are compared
// with a relative tolerance.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "plan/cost_model.h"
#include "plan/gather_scatter_predict.h"
#include "plan/machines.h"
#include "plan/predict.h"
#include "plan/schedule.h"
#include "plan/topology.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

// The index of the task with this label; -1 (and a failure) when there is none.
int find_task(const Program& p, const std::string& label) {
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    if (p.tasks[i].label == label) return static_cast<int>(i);
  }
  xdev_test::fail(__FILE__, __LINE__, "no task labelled '" + label + "'");
  return -1;
}

// The staging copies of rank r, in program order: labelled "stage r<r>" (then, where a stager's
// copy is cut into pieces, " [begin,end)").
std::vector<int> stage_tasks(const Program& p, int r) {
  const std::string name = "stage r" + std::to_string(r);
  std::vector<int> ids;
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    const std::string& label = p.tasks[i].label;
    if (label.rfind(name, 0) == 0 && (label.size() == name.size() || label[name.size()] == ' ')) {
      ids.push_back(static_cast<int>(i));
    }
  }
  return ids;
}

// The one staging copy of rank r (a stager copies its window in one piece when every step
// covers the whole window); -1 (and a failure) otherwise.
int whole_stage(const Program& p, int r) {
  const std::vector<int> ids = stage_tasks(p, r);
  if (ids.size() == 1) return ids[0];
  xdev_test::fail(__FILE__, __LINE__,
                  "rank " + std::to_string(r) + " has " + std::to_string(ids.size()) +
                      " staging tasks, expected 1");
  return -1;
}

// Two GPUs with one NVLink between them and round numbers:
//   NVLink 10e9 B/s per direction, 1e-6 s per NVLink read; memory 100e9 B/s;
//   step latency 2e-6 s; no launch latency (append_window does not charge it anyway).
MachineModel two_gpus() {
  LinkMatrix links(2);
  links.set_links(0, 1, 1);
  GpuHostParams p;
  p.nvlink_bytes_per_s = 10e9;
  p.nvlink_latency_s = 1e-6;
  p.pcie_bytes_per_s = 1e9;
  p.pcie_latency_s = 7e-6;
  p.memory_bytes_per_s = 100e9;
  p.launch_latency_s = 0;
  p.step_latency_s = 2e-6;
  return gpu_host("two-gpus", links, p);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// append_window

TEST(cost_append_window_reduce_to_one_on_two_gpus) {
  const MachineModel m = two_gpus();
  CHECK(!m.barrier_between_phases);
  const Schedule s = reduce_to_one_schedule(2, 0, {0, 1000});
  Program p;
  const std::vector<int> ids = append_window(m, s, 1000, 4, {}, p);
  CHECK_EQ(ids.size(), size_t{5});  // 2 stagers + 1 reduce + 2 copies
  CHECK_EQ(p.tasks.size(), size_t{5});

  // The tasks, 4 bytes per element, b = 4000 bytes:
  //  stage r0, r1: 2b = 8000 bytes over its memory (read input, write slot); latency 2e-6.
  //  reduce by r0 of slots 0 and 1 into its slot: 4000 bytes over NVLink 1->0 and
  //    4000 (own slot) + 4000 (write) = 8000 over memory 0; latency 2e-6 + 1e-6 (NVLink).
  //  copy by r0 from slot 0: 8000 over memory 0; latency 2e-6.
  //  copy by r1 from slot 0: 4000 over NVLink 0->1 and 4000 (write) over memory 1; 3e-6.
  const int stage0 = whole_stage(p, 0), stage1 = whole_stage(p, 1);
  const int reduce = find_task(p, "reduce p1 r0 [0,1000)");
  const int copy0 = find_task(p, "copy p2 r0 [0,1000)");
  const int copy1 = find_task(p, "copy p2 r1 [0,1000)");
  if (stage0 < 0 || stage1 < 0 || reduce < 0 || copy0 < 0 || copy1 < 0) return;
  const auto& red = p.tasks[static_cast<size_t>(reduce)];
  CHECK_EQ(red.flows.size(), size_t{2});
  CHECK_EQ(red.flows[0].resources, m.route(1, 0));
  CHECK_NEAR(red.flows[0].bytes, 4000);
  CHECK_EQ(red.flows[1].resources, m.local(0));
  CHECK_NEAR(red.flows[1].bytes, 8000);
  CHECK_NEAR(red.latency_s, 3e-6);
  CHECK_NEAR(p.tasks[static_cast<size_t>(stage0)].flows.at(0).bytes, 8000);
  CHECK_NEAR(p.tasks[static_cast<size_t>(copy0)].flows.at(0).bytes, 8000);
  CHECK_EQ(p.tasks[static_cast<size_t>(copy1)].flows.size(), size_t{2});

  const SimulationResult r = simulate(m, p, m.policy);
  const auto fin = [&](int t) { return r.finish_s[static_cast<size_t>(t)]; };
  // Stages: 2e-6 + 8000 / 100e9 = 2e-6 + 8e-8 = 2.08e-6.
  CHECK_NEAR(fin(stage0), 2.08e-6);
  CHECK_NEAR(fin(stage1), 2.08e-6);
  // Reduce: starts 2.08e-6 + 3e-6 = 5.08e-6; its flows run side by side on different
  // resources: max(4000 / 10e9, 8000 / 100e9) = max(4e-7, 8e-8) = 4e-7; ends 5.48e-6.
  CHECK_NEAR(r.start_s[static_cast<size_t>(reduce)], 5.08e-6);
  CHECK_NEAR(fin(reduce), 5.48e-6);
  // copy r0: 5.48e-6 + 2e-6 + 8000 / 100e9 = 7.48e-6 + 8e-8 = 7.56e-6.
  CHECK_NEAR(fin(copy0), 7.56e-6);
  // copy r1: 5.48e-6 + 3e-6 + max(4000 / 10e9, 4000 / 100e9) = 8.48e-6 + 4e-7 = 8.88e-6.
  CHECK_NEAR(fin(copy1), 8.88e-6);
  CHECK_NEAR(r.seconds, 8.88e-6);

  // A second window after the first: its stagers wait for every task of the first, so the
  // whole thing takes twice as long: 2 * 8.88e-6 = 1.776e-5.
  // Its priorities start at priority_base: reduce 10 + 0 + 1 = 11, stagers 11 - 0.5.
  const std::vector<int> ids2 = append_window(m, s, 1000, 4, ids, p, {}, 10);
  CHECK_EQ(ids2.size(), size_t{5});
  for (int id : ids2) {
    const Task& t = p.tasks[static_cast<size_t>(id)];
    if (t.label.rfind("stage", 0) == 0) {
      CHECK_EQ(t.deps, ids);
      CHECK_NEAR(t.priority, 10.5);
    }
    if (t.label.rfind("reduce", 0) == 0) CHECK_NEAR(t.priority, 11);
    if (t.label.rfind("copy", 0) == 0) CHECK_NEAR(t.priority, 12);
  }
  CHECK_NEAR(simulate(m, p, m.policy).seconds, 1.776e-5);
}

TEST(cost_append_window_phase_barriers_wait_for_the_whole_phase) {
  // A hand-written schedule on two GPUs: phase 1, r0 reduces [0,500) and r1 reduces
  // [500,1000) (each from both slots, into its slot); phase 2, each copies its own half out
  // of its own slot. NVLink 0->1 slowed to 1e9 so that r1's reduce is the slow one.
  MachineModel m = two_gpus();
  m.resource(m.route(0, 1).at(0)).bytes_per_s = 1e9;
  Schedule s;
  s.world_size = 2;
  s.num_phases = 2;
  s.stagers = {0, 1};
  const Range lo{0, 500}, hi{500, 1000};
  Step step;
  step.kind = StepKind::kReduce;
  step.phase = 1;
  step.sources = {0, 1};
  step.target = Target::kStaging;
  step.finalize = true;
  step.actor = 0;
  step.range = lo;
  s.steps.push_back(step);
  step.actor = 1;
  step.range = hi;
  s.steps.push_back(step);
  step.kind = StepKind::kCopy;
  step.phase = 2;
  step.target = Target::kOutput;
  step.finalize = false;
  step.actor = 0;
  step.sources = {0};
  step.range = lo;
  s.steps.push_back(step);
  step.actor = 1;
  step.sources = {1};
  step.range = hi;
  s.steps.push_back(step);

  // Half a window: 500 elements * 4 = 2000 bytes.
  //  stage r0, r1: each stager's copy is cut where the steps' ranges are, into [0,500) and
  //    [500,1000): 4000 bytes each over its memory, latency 2e-6, both ready at 2e-6.
  //    (Together 8000 bytes, the whole window read and written.) A piece takes the priority of
  //    its first reader less 0.5.
  //  reduce r0 [0,500): 2000 over NVLink 1->0 (10e9, 2e-7), 4000 over memory 0 (4e-8);
  //    latency 3e-6. reduce r1 [500,1000): 2000 over NVLink 0->1 (1e9, 2e-6), 4000 over
  //    memory 1 (4e-8); latency 3e-6. No resource in common.
  //  copy r0 [0,500) from slot 0, copy r1 [500,1000) from slot 1: 4000 over their memory
  //    (4e-8), latency 2e-6.
  {
    // Data flow, no packs: every step of phase t has priority t (reduces 1, copies 2), every
    // piece 1 - 0.5 = 0.5, so a stager's two pieces share its memory: both end at
    // 2e-6 + 8000 / 100e9 = 2.08e-6.
    Program p;
    append_window(m, s, 1000, 4, {}, p);
    const std::vector<int> pieces0 = stage_tasks(p, 0), pieces1 = stage_tasks(p, 1);
    CHECK_EQ(pieces0.size(), size_t{2});
    CHECK_EQ(pieces1.size(), size_t{2});
    const int piece0_lo = find_task(p, "stage r0 [0,500)");
    const int piece0_hi = find_task(p, "stage r0 [500,1000)");
    const int red0 = find_task(p, "reduce p1 r0 [0,500)");
    const int red1 = find_task(p, "reduce p1 r1 [500,1000)");
    const int copy0 = find_task(p, "copy p2 r0 [0,500)");
    const int copy1 = find_task(p, "copy p2 r1 [500,1000)");
    if (piece0_lo < 0 || piece0_hi < 0 || red0 < 0 || red1 < 0 || copy0 < 0 || copy1 < 0) return;
    const auto prio = [&](int t) { return p.tasks[static_cast<size_t>(t)].priority; };
    for (int piece : pieces0) {
      CHECK_NEAR(p.tasks[static_cast<size_t>(piece)].flows.at(0).bytes, 4000);
      CHECK_NEAR(prio(piece), 0.5);
    }
    CHECK_NEAR(prio(red0), 1);
    CHECK_NEAR(prio(red1), 1);
    CHECK_NEAR(prio(copy0), 2);
    CHECK_NEAR(prio(copy1), 2);
    const SimulationResult r = simulate(m, p, m.policy);
    const auto at = [](const std::vector<double>& v, int t) { return v[static_cast<size_t>(t)]; };
    CHECK_NEAR(at(r.finish_s, piece0_lo), 2.08e-6);
    CHECK_NEAR(at(r.finish_s, piece0_hi), 2.08e-6);
    CHECK_NEAR(at(r.start_s, red0), 5.08e-6);    // 2.08e-6 + 3e-6
    CHECK_NEAR(at(r.finish_s, red0), 5.28e-6);   // + 2e-7
    CHECK_NEAR(at(r.start_s, red1), 5.08e-6);    // 2.08e-6 + 3e-6
    CHECK_NEAR(at(r.finish_s, red1), 7.08e-6);   // + 2e-6
    CHECK_NEAR(at(r.start_s, copy0), 7.28e-6);   // 5.28e-6 + 2e-6: not waiting for reduce r1
    CHECK_NEAR(at(r.finish_s, copy0), 7.32e-6);  // + 4e-8
    CHECK_NEAR(at(r.start_s, copy1), 9.08e-6);   // 7.08e-6 + 2e-6
    CHECK_NEAR(r.seconds, 9.12e-6);              // + 4e-8
  }
  {
    // Data flow with packs [0,500) and [500,1000): priority = pack + phase, so reduce r0 1,
    // reduce r1 2, copy r0 2, copy r1 3; piece [0,500) 1 - 0.5 = 0.5, piece [500,1000)
    // 2 - 0.5 = 1.5. The first piece takes the memory first and ends at
    // 2e-6 + 4000 / 100e9 = 2.04e-6, the second at 2.08e-6: reduce r0 starts earlier.
    Program p;
    append_window(m, s, 1000, 4, {}, p, {lo, hi});
    const int piece0_lo = find_task(p, "stage r0 [0,500)");
    const int piece0_hi = find_task(p, "stage r0 [500,1000)");
    const int piece1_lo = find_task(p, "stage r1 [0,500)");
    const int red0 = find_task(p, "reduce p1 r0 [0,500)");
    const int red1 = find_task(p, "reduce p1 r1 [500,1000)");
    const int copy0 = find_task(p, "copy p2 r0 [0,500)");
    const int copy1 = find_task(p, "copy p2 r1 [500,1000)");
    if (piece0_lo < 0 || piece0_hi < 0 || piece1_lo < 0 || red0 < 0 || red1 < 0 || copy0 < 0 ||
        copy1 < 0) {
      return;
    }
    const auto prio = [&](int t) { return p.tasks[static_cast<size_t>(t)].priority; };
    CHECK_NEAR(prio(piece0_lo), 0.5);
    CHECK_NEAR(prio(piece0_hi), 1.5);
    CHECK_NEAR(prio(red0), 1);
    CHECK_NEAR(prio(red1), 2);
    CHECK_NEAR(prio(copy0), 2);
    CHECK_NEAR(prio(copy1), 3);
    const SimulationResult r = simulate(m, p, m.policy);
    const auto at = [](const std::vector<double>& v, int t) { return v[static_cast<size_t>(t)]; };
    CHECK_NEAR(at(r.finish_s, piece0_lo), 2.04e-6);
    CHECK_NEAR(at(r.finish_s, piece1_lo), 2.04e-6);
    CHECK_NEAR(at(r.finish_s, piece0_hi), 2.08e-6);
    CHECK_NEAR(at(r.start_s, red0), 5.04e-6);    // 2.04e-6 + 3e-6: needs [0,500) only
    CHECK_NEAR(at(r.finish_s, red0), 5.24e-6);   // + 2e-7
    CHECK_NEAR(at(r.start_s, red1), 5.08e-6);    // 2.08e-6 + 3e-6
    CHECK_NEAR(at(r.finish_s, red1), 7.08e-6);   // + 2e-6
    CHECK_NEAR(at(r.start_s, copy0), 7.24e-6);   // 5.24e-6 + 2e-6
    CHECK_NEAR(at(r.finish_s, copy0), 7.28e-6);  // + 4e-8
    CHECK_NEAR(at(r.start_s, copy1), 9.08e-6);   // 7.08e-6 + 2e-6
    CHECK_NEAR(r.seconds, 9.12e-6);              // + 4e-8
  }
  {
    // Barriers (5e-6 each) between phases: every step is charged one and waits for the whole
    // previous phase; the stagers (phase 0) are not charged.
    m.barrier_between_phases = true;
    m.barrier_latency_s = 5e-6;
    Program p;
    append_window(m, s, 1000, 4, {}, p);
    std::vector<int> phase0 = stage_tasks(p, 0);
    for (int t : stage_tasks(p, 1)) phase0.push_back(t);
    std::sort(phase0.begin(), phase0.end());
    CHECK_EQ(phase0.size(), size_t{4});
    const int red0 = find_task(p, "reduce p1 r0 [0,500)");
    const int red1 = find_task(p, "reduce p1 r1 [500,1000)");
    const int copy0 = find_task(p, "copy p2 r0 [0,500)");
    const int copy1 = find_task(p, "copy p2 r1 [500,1000)");
    if (red0 < 0 || red1 < 0 || copy0 < 0 || copy1 < 0) return;
    auto sorted_deps = [&](int t) {
      std::vector<int> d = p.tasks[static_cast<size_t>(t)].deps;
      std::sort(d.begin(), d.end());
      return d;
    };
    // A task without bytes stands for each barrier: the whole phase before it, then the
    // steps after it, and the last after all the window's work.
    const int after0 = find_task(p, "barrier after phase 0");
    const int after1 = find_task(p, "barrier after phase 1");
    const int after2 = find_task(p, "barrier after phase 2");
    if (after0 < 0 || after1 < 0 || after2 < 0) return;
    const std::vector<int> phase1 = {std::min(red0, red1), std::max(red0, red1)};
    const std::vector<int> phase2 = {std::min(copy0, copy1), std::max(copy0, copy1)};
    CHECK_EQ(sorted_deps(after0), phase0);
    CHECK_EQ(sorted_deps(red0), std::vector<int>{after0});
    CHECK_EQ(sorted_deps(red1), std::vector<int>{after0});
    CHECK_EQ(sorted_deps(after1), phase1);
    CHECK_EQ(sorted_deps(copy0), std::vector<int>{after1});
    CHECK_EQ(sorted_deps(copy1), std::vector<int>{after1});
    CHECK_EQ(sorted_deps(after2), phase2);
    CHECK_EQ(after2, static_cast<int>(p.tasks.size()) - 1);
    for (int b : {after0, after1, after2}) {
      CHECK(p.tasks[static_cast<size_t>(b)].flows.empty());
      CHECK_NEAR(p.tasks[static_cast<size_t>(b)].latency_s, 0);
    }

    const SimulationResult r = simulate(m, p, m.policy);
    const auto at = [](const std::vector<double>& v, int t) { return v[static_cast<size_t>(t)]; };
    // The barrier after phase 0 waits for the last piece (2.08e-6), so reduce r0 cannot start
    // early: 2.08e-6 + 2e-6 + 1e-6 + 5e-6 = 10.08e-6.
    CHECK_NEAR(at(r.start_s, red0), 10.08e-6);
    CHECK_NEAR(at(r.start_s, red1), 10.08e-6);
    CHECK_NEAR(at(r.finish_s, red0), 10.28e-6);  // + 2e-7
    CHECK_NEAR(at(r.finish_s, red1), 12.08e-6);  // + 2e-6
    // Both copies wait for reduce r1: 12.08e-6 + 2e-6 + 5e-6 = 19.08e-6 (copy r0 would start at
    // 10.28e-6 + 7e-6 = 17.28e-6 if it waited for its data only).
    CHECK_NEAR(at(r.start_s, copy0), 19.08e-6);
    CHECK_NEAR(at(r.start_s, copy1), 19.08e-6);
    CHECK_NEAR(r.seconds, 19.12e-6);  // + 4e-8
  }
}

TEST(cost_append_window_on_a_cpu_host_shares_cores_and_memory) {
  // cpu_host(2): cores 5e9 each (2 cores, 2 ranks: share 1), host memory 10e9, no latencies.
  // Local flows of rank r cross {core r, memory}; a read of rank a's slot by rank b crosses
  // {core b, memory}. Barrier phases, fair share.
  CpuHostParams params;
  params.cores = 2;
  params.core_bytes_per_s = 5e9;
  params.memory_bytes_per_s = 10e9;
  params.launch_latency_s = 0;
  params.barrier_latency_s = 0;
  const MachineModel m = cpu_host(2, params);
  Program p;
  append_window(m, reduce_to_one_schedule(2, 0, {0, 1000}), 1000, 4, {}, p);
  const SimulationResult r = simulate(m, p, m.policy);
  // Phase 0: two stagers, 8000 bytes each, over their core (5e9) and the memory (10e9 / 2
  // flows = 5e9): 8000 / 5e9 = 1.6e-6.
  const int stage0 = whole_stage(p, 0), stage1 = whole_stage(p, 1);
  if (stage0 < 0 || stage1 < 0) return;
  CHECK_NEAR(r.finish_s[static_cast<size_t>(stage0)], 1.6e-6);
  CHECK_NEAR(r.finish_s[static_cast<size_t>(stage1)], 1.6e-6);
  // Phase 1: rank 0 reduces: 4000 (from slot 1) and 8000 (own slot + write), both over core 0:
  // 2.5e9 each until the first ends at 4000 / 2.5e9 = 1.6e-6, then 4000 left at 5e9: 0.8e-6.
  // Ends 1.6e-6 + 2.4e-6 = 4.0e-6 (12000 bytes through core 0 at 5e9).
  CHECK_NEAR(r.finish_s[static_cast<size_t>(find_task(p, "reduce p1 r0 [0,1000)"))], 4.0e-6);
  // Phase 2: copy r0 (8000 over {core 0, memory}) and copy r1 (4000 + 4000, both over
  // {core 1, memory}). Filling: min(core0 5e9 / 1, core1 5e9 / 2, memory 10e9 / 3) = 2.5e9;
  // core 1 full. Core 0 and memory have 2.5e9 left: copy r0 gets 5e9. All end after
  // 8000 / 5e9 = 4000 / 2.5e9 = 1.6e-6: at 5.6e-6.
  CHECK_NEAR(r.finish_s[static_cast<size_t>(find_task(p, "copy p2 r0 [0,1000)"))], 5.6e-6);
  CHECK_NEAR(r.finish_s[static_cast<size_t>(find_task(p, "copy p2 r1 [0,1000)"))], 5.6e-6);
  CHECK_NEAR(r.seconds, 5.6e-6);
}

TEST(cost_phase_barriers_keep_dependences_linear_in_the_packs) {
  // A step waits for the whole previous phase through one barrier task: with every task of a
  // phase feeding every task of the next, 1024 packs on 8 ranks made tens of millions of
  // dependences and took seconds to predict. Every task now has few, and windows after the
  // first wait for one task: the barrier after all of the previous window's work.
  const MachineModel m = builtin_machine("cpu-8");
  CHECK(m.barrier_between_phases);
  const int64_t bytes = 2 * (m.window_bytes > 0 ? m.window_bytes : int64_t{1} << 20);
  for (int64_t packs : {8, 1024}) {
    const Program p =
        allreduce_program(m, Candidate::native(Algorithm::kHierarchicalCopy, packs), bytes, 4);
    size_t deps = 0;
    for (const Task& t : p.tasks) deps += t.deps.size();
    CHECK(deps <= 4 * p.tasks.size());
  }
}

TEST(cost_large_payloads_are_predicted_as_their_whole_simulation) {
  // Beyond 16 windows a prediction extrapolates from two short simulations. It once scaled one
  // run of "8 windows" by the payload, but plans cut their windows their own way (the
  // hierarchical plans into 9 smaller ones, the staged reduce-scatter with a 2-element 8th), so
  // every window's barriers were counted up to 6% too often. 64 windows, simulated whole:
  for (const char* name : {"cpu-4", "cpu-8"}) {
    const MachineModel m = builtin_machine(name);
    CHECK(m.barrier_between_phases && m.window_bytes > 0);
    const int n = m.num_devices();
    const int64_t bytes = 64 * m.window_bytes / (4 * n) * (4 * n);
    for (const Candidate& c : {Candidate::native(Algorithm::kFlat, 0),
                               Candidate::native(Algorithm::kHierarchicalCopy, n)}) {
      const double whole = simulate(m, allreduce_program(m, c, bytes, 4), m.policy).seconds;
      CHECK(relatively_near(predict_allreduce(m, c, bytes).seconds, whole, 1e-6));
    }
    GatherScatterCandidate staged;
    staged.window_bytes = m.window_bytes;
    const GatherScatterKind kind = GatherScatterKind::kReduceScatter;
    const double whole =
        simulate(m, gather_scatter_program(m, kind, staged, bytes, 4), m.policy).seconds;
    CHECK(relatively_near(predict_gather_scatter(m, kind, staged, bytes, 4).seconds, whole, 1e-6));
  }
}
