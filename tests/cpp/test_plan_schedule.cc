// Unit tests of schedules and collective plans. The central tool is a symbolic simulator: it runs
// a Schedule on values that record *which ranks* were summed into each element and *how often* a
// finalize step produced it, so "every rank ends with the full sum, reduced exactly once" is
// checked exactly, with no floating point in the way.
#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan/balanced_plan.h"
#include "plan/collective_plan.h"
#include "plan/machines.h"
#include "plan/packing.h"
#include "plan/predict.h"
#include "plan/ring.h"
#include "plan/schedule.h"
#include "plan/selection.h"
#include "plan/topology.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there
using xdev_test::random_tiling;
using xdev_test::uniform;

namespace {

// One element's symbolic content. mask == 0 means "never written" (garbage).
struct Value {
  uint64_t mask = 0;  // bit r: rank r's input is summed in
  int finalized = 0;  // finalize reduce steps that produced it (AVG divides there)
};

bool operator==(const Value& a, const Value& b) {
  return a.mask == b.mask && a.finalized == b.finalized;
}

struct SimState {
  std::vector<std::vector<Value>> slot;  // [rank][element]
  // [rank][element]: the rank's tensor, input and output at once (collectives run in place),
  // so it starts as the rank's own input.
  std::vector<std::vector<Value>> out;
  std::vector<std::vector<char>> out_written;  // [rank][element]: a step wrote the tensor there
  std::string error;                           // first violation found; empty when none
};

std::string where(int phase, size_t step, int64_t element) {
  return "phase " + std::to_string(phase) + " step " + std::to_string(step) + " element " +
         std::to_string(element) + ": ";
}

// Executes s over a window of `elems` elements the way the backend does: phase 0 stages the
// stagers' inputs (only their staged_ranges when the schedule has them); within a phase steps run
// concurrently, so they all read the slots and tensors as they were when the phase began, and
// their writes land together when it ends.
SimState simulate(const Schedule& s, int64_t elems) {
  SimState st;
  const std::string hazard = find_schedule_hazard(s);
  if (!hazard.empty()) {
    st.error = "find_schedule_hazard: " + hazard;
    return st;
  }
  if (s.world_size < 1 || s.world_size > 64) {
    st.error = "world size does not fit a 64-bit mask";
    return st;
  }
  const auto n = static_cast<size_t>(s.world_size);
  const auto e_count = static_cast<size_t>(elems);
  st.slot.assign(n, std::vector<Value>(e_count));
  st.out.resize(n);
  st.out_written.assign(n, std::vector<char>(e_count, 0));
  for (size_t r = 0; r < n; ++r) st.out[r].assign(e_count, Value{uint64_t{1} << r, 0});
  if (!s.staged_ranges.empty() && s.staged_ranges.size() != n) {
    st.error = "staged_ranges must have one entry per rank";
    return st;
  }
  for (int r : s.stagers) {
    if (r < 0 || r >= s.world_size) {
      st.error = "stager out of range";
      return st;
    }
    std::vector<Range> staged{{0, elems}};
    if (!s.staged_ranges.empty()) staged = s.staged_ranges[static_cast<size_t>(r)];
    for (const Range& range : staged) {
      for (int64_t e = std::max<int64_t>(0, range.begin); e < std::min(range.end, elems); ++e) {
        st.slot[r][e] = {uint64_t{1} << r, 0};
      }
    }
  }
  for (int phase = 1; phase <= s.num_phases; ++phase) {
    const auto snapshot = st.slot;
    const auto tensors = st.out;
    // Two writes to one element in one phase would race; the result would depend on timing.
    std::vector<std::vector<char>> written(2 * n, std::vector<char>(e_count, 0));
    for (size_t i = 0; i < s.steps.size(); ++i) {
      const Step& step = s.steps[i];
      if (step.phase != phase) continue;
      if (step.range.begin < 0 || step.range.end > elems) {
        st.error = where(phase, i, step.range.begin) + "range outside the window";
        return st;
      }
      const bool to_slot = step.target == Target::kStaging;
      const bool to_out = !to_slot || step.also_output;
      const auto actor = static_cast<size_t>(step.actor);
      for (int64_t e = step.range.begin; e < step.range.end; ++e) {
        Value v;
        for (int src : step.sources) {
          const Value& in = src == kOwnInput ? tensors[actor][e] : snapshot[src][e];
          if (in.mask == 0) {
            st.error = where(phase, i, e) + "reads slot " + std::to_string(src) + " unwritten";
            return st;
          }
          if (step.kind == StepKind::kCopy) {
            v = in;
            continue;
          }
          if ((v.mask & in.mask) != 0) {
            st.error = where(phase, i, e) + "counts a rank twice";
            return st;
          }
          if (in.finalized != 0) {
            st.error = where(phase, i, e) + "reduces an already finalized total";
            return st;
          }
          v.mask |= in.mask;
          v.finalized += in.finalized;
        }
        if (step.kind == StepKind::kReduce && step.finalize) ++v.finalized;
        for (const bool slot_side : {true, false}) {
          if (slot_side ? !to_slot : !to_out) continue;
          const size_t rank = slot_side ? static_cast<size_t>(written_slot(step)) : actor;
          auto& marks = written[2 * rank + (slot_side ? 0 : 1)];
          if (marks[e]) {
            st.error = where(phase, i, e) + "written twice in one phase";
            return st;
          }
          marks[e] = 1;
          (slot_side ? st.slot[rank] : st.out[rank])[e] = v;
          if (!slot_side) st.out_written[actor][e] = 1;
        }
      }
    }
  }
  return st;
}

// Empty when every rank's output holds the sum over all ranks, finalized exactly once.
std::string check_allreduce(const Schedule& s, int64_t elems) {
  const SimState st = simulate(s, elems);
  if (!st.error.empty()) return st.error;
  const uint64_t full = s.world_size == 64 ? ~uint64_t{0} : (uint64_t{1} << s.world_size) - 1;
  for (int r = 0; r < s.world_size; ++r) {
    for (int64_t e = 0; e < elems; ++e) {
      const Value& v = st.out[r][e];
      if (v.mask != full || v.finalized != 1) {
        return "rank " + std::to_string(r) + " element " + std::to_string(e) + ": mask " +
               std::to_string(v.mask) + " finalized " + std::to_string(v.finalized);
      }
    }
  }
  return {};
}

// Empty when every rank ends with root's data. The root's tensor is its own input and output, so
// the schedule must leave the root's output alone.
std::string check_broadcast(const Schedule& s, int64_t elems, int root) {
  const SimState st = simulate(s, elems);
  if (!st.error.empty()) return st.error;
  const Value want{uint64_t{1} << root, 0};
  for (int r = 0; r < s.world_size; ++r) {
    for (int64_t e = 0; e < elems; ++e) {
      if (!(st.out[r][e] == want) || (r == root && st.out_written[r][e])) {
        return "rank " + std::to_string(r) + " element " + std::to_string(e) + ": mask " +
               std::to_string(st.out[r][e].mask);
      }
    }
  }
  return {};
}

std::vector<PackSlice> slices_of(const std::vector<Range>& packs, int64_t first_id) {
  std::vector<PackSlice> slices;
  for (size_t i = 0; i < packs.size(); ++i) {
    slices.push_back({first_id + static_cast<int64_t>(i), packs[i]});
  }
  return slices;
}

std::vector<Range> equal_packs(int64_t total, int64_t num_packs) {
  PackingOptions o;
  o.num_packs = num_packs;
  return make_packs(FlatLayout({total}), 4, o);
}

constexpr char kOk[] = "";  // what the checks return when all is well

Step make_step(StepKind kind, int phase, int actor, std::vector<int> sources, Target target,
               bool finalize = false) {
  Step s;
  s.kind = kind;
  s.phase = phase;
  s.actor = actor;
  s.sources = std::move(sources);
  s.target = target;
  s.range = {0, 4};
  s.finalize = finalize;
  return s;
}

// Reduce-to-one over 3 ranks and 4 elements, built by hand so the oracle's own test does not
// depend on the schedule builders it is meant to judge.
Schedule hand_reduce_to_one() {
  Schedule s;
  s.world_size = 3;
  s.num_phases = 2;
  s.stagers = {0, 1, 2};
  s.steps.push_back(make_step(StepKind::kReduce, 1, 1, {0, 1, 2}, Target::kStaging, true));
  for (int r = 0; r < 3; ++r) {
    s.steps.push_back(make_step(StepKind::kCopy, 2, r, {1}, Target::kOutput));
  }
  return s;
}

bool reports(const std::string& error, const char* what) {
  return error.find(what) != std::string::npos;
}

}  // namespace

TEST(simulator_catches_broken_schedules) {
  // The oracle must be able to fail, or the tests below prove nothing.
  CHECK_EQ(check_allreduce(hand_reduce_to_one(), 4), kOk);
  Schedule twice = hand_reduce_to_one();
  twice.steps[0].sources.push_back(2);
  CHECK(reports(check_allreduce(twice, 4), "twice"));
  Schedule unfinalized = hand_reduce_to_one();
  unfinalized.steps[0].finalize = false;
  CHECK(reports(check_allreduce(unfinalized, 4), "finalized 0"));
  Schedule dropped = hand_reduce_to_one();
  dropped.steps.pop_back();
  CHECK(reports(check_allreduce(dropped, 4), "rank 2"));
  Schedule racing = hand_reduce_to_one();
  racing.steps.push_back(make_step(StepKind::kCopy, 2, 0, {1}, Target::kOutput));
  CHECK(reports(check_allreduce(racing, 4), "written twice"));
  Schedule early = hand_reduce_to_one();
  early.steps.back().phase = 1;  // copies root's slot while root is still writing it
  CHECK(reports(check_allreduce(early, 4), "find_schedule_hazard"));
  Schedule missing_stager = hand_reduce_to_one();
  missing_stager.stagers.pop_back();
  CHECK(reports(check_allreduce(missing_stager, 4), "unwritten"));
  // A partial sum marked final and then reduced again: AVG would divide twice.
  Schedule double_final = hand_reduce_to_one();
  double_final.num_phases = 3;
  double_final.steps[0].sources = {0, 1};
  for (size_t i = 1; i < double_final.steps.size(); ++i) double_final.steps[i].phase = 3;
  double_final.steps.push_back(make_step(StepKind::kReduce, 2, 1, {1, 2}, Target::kStaging, true));
  CHECK(reports(check_allreduce(double_final, 4), "already finalized"));
  Schedule outside = hand_reduce_to_one();
  outside.steps[1].range.end = 5;
  CHECK(reports(check_allreduce(outside, 4), "outside the window"));
  // A broadcast must not overwrite the root's own tensor.
  Schedule bcast;
  bcast.world_size = 2;
  bcast.num_phases = 1;
  bcast.stagers = {0};
  bcast.steps.push_back(make_step(StepKind::kCopy, 1, 1, {0}, Target::kOutput));
  CHECK_EQ(check_broadcast(bcast, 4, 0), kOk);
  bcast.steps.push_back(make_step(StepKind::kCopy, 1, 0, {0}, Target::kOutput));
  CHECK(reports(check_broadcast(bcast, 4, 0), "rank 0"));
}

TEST(hierarchical_copy_schedule_allreduces) {
  std::mt19937 rng(21);
  for (int world : {2, 4, 6, 8}) {
    CHECK_EQ(check_allreduce(hierarchical_copy_schedule(world, {}), 0), kOk);
    for (int trial = 0; trial < 150; ++trial) {
      const int64_t elems = uniform(rng, 0, 40);
      const int num_packs = static_cast<int>(uniform(rng, 1, 20));
      // Pack ids need not start at 0 (a window may begin mid-list); ids past N wrap around.
      const auto slices = slices_of(random_tiling(rng, elems, num_packs), uniform(rng, 0, 20));
      const Schedule s = hierarchical_copy_schedule(world, slices);
      CHECK_EQ(s.world_size, world);
      CHECK_EQ(check_allreduce(s, elems), kOk);
    }
  }
}

TEST(reduce_to_one_schedule_allreduces_for_every_root) {
  for (int world = 1; world <= 8; ++world) {
    for (int root = 0; root < world; ++root) {
      for (int64_t elems : {0, 1, 5, 17}) {
        CHECK_EQ(check_allreduce(reduce_to_one_schedule(world, root, {0, elems}), elems), kOk);
      }
    }
    CHECK_THROWS(reduce_to_one_schedule(world, world, {0, 4}), std::invalid_argument,
                 "reduce_to_rank");
    CHECK_THROWS(reduce_to_one_schedule(world, -1, {0, 4}), std::invalid_argument, "");
  }
}

TEST(flat_schedule_allreduces_including_tiny_windows) {
  for (int world = 1; world <= 8; ++world) {
    for (int64_t elems = 0; elems <= 20; ++elems) {
      const Schedule s = flat_schedule(world, {0, elems});
      CHECK_EQ(check_allreduce(s, elems), kOk);
      // The reduction is spread: no rank finalizes more than its ceil share.
      for (int r = 0; r < world; ++r) {
        int64_t work = 0;
        for (const Step& step : s.steps) {
          if (step.finalize && step.actor == r) work += step.range.size();
        }
        CHECK(work <= (elems + world - 1) / world);
      }
    }
  }
  CHECK_THROWS(flat_schedule(0, {0, 4}), std::invalid_argument, "world_size");
}

TEST(broadcast_schedule_delivers_root_data) {
  for (int world = 1; world <= 8; ++world) {
    for (int root = 0; root < world; ++root) {
      for (int64_t elems : {0, 1, 9}) {
        const Schedule s = broadcast_schedule(world, root, {0, elems});
        CHECK(s.stagers == std::vector<int>{root});
        CHECK_EQ(check_broadcast(s, elems, root), kOk);
      }
    }
    CHECK_THROWS(broadcast_schedule(world, world, {0, 4}), std::invalid_argument, "root");
  }
}

TEST(hierarchical_on_dgx1_only_uses_direct_links) {
  const LinkMatrix dgx1 = LinkMatrix::dgx1();
  for (int64_t num_packs : {8, 16}) {
    const Schedule s = hierarchical_copy_schedule(8, slices_of(equal_packs(1000, num_packs), 0));
    CHECK_EQ(check_allreduce(s, 1000), kOk);
    for (const Step& step : s.steps) {
      for (int src : step.sources) {
        if (src != step.actor) CHECK(dgx1.links(src, step.actor) > 0);
      }
    }
  }
}

TEST(hierarchical_with_eight_packs_spreads_work_equally) {
  const int64_t pack_elems = 37;
  const Schedule s = hierarchical_copy_schedule(8, slices_of(equal_packs(8 * pack_elems, 8), 0));
  std::vector<int> main0(8, 0), main1(8, 0);
  std::vector<int64_t> phase1_work(8, 0);
  for (const Step& step : s.steps) {
    if (step.kind != StepKind::kReduce) continue;
    if (step.finalize) {
      // The finalize step is main0 adding main1's group sum to its own.
      ++main0[step.actor];
      CHECK_EQ(step.sources.size(), size_t{2});
      for (int src : step.sources) {
        if (src != step.actor) ++main1[src];
      }
    }
    if (step.phase == 1) phase1_work[step.actor] += step.range.size();
  }
  for (int r = 0; r < 8; ++r) {
    CHECK_EQ(main0[r], 1);
    CHECK_EQ(main1[r], 1);
    CHECK_EQ(phase1_work[r], 2 * pack_elems);  // its own pack as main0, another as main1
  }
}

TEST(hierarchical_needs_an_even_world) {
  for (int world : {1, 3, 5, 7}) {
    CHECK_THROWS(hierarchical_copy_schedule(world, {{0, {0, 4}}}), std::invalid_argument, "even");
    CHECK_THROWS(CollectivePlan::allreduce(Algorithm::kHierarchicalCopy, world, 0, {{0, 4}}, 4, 8),
                 std::invalid_argument, "even");
  }
}

TEST(direct_schedule_allreduces_with_one_phase) {
  for (int world = 1; world <= 8; ++world) {
    for (int64_t elems = 0; elems <= 20; ++elems) {
      const Schedule s = direct_schedule(world, {0, elems});
      CHECK_EQ(s.num_phases, 1);  // one barrier per window: the point of the plan
      CHECK_EQ(check_allreduce(s, elems), kOk);
    }
  }
  CHECK_THROWS(direct_schedule(0, {0, 4}), std::invalid_argument, "world_size");
}

TEST(algorithm_names_round_trip) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kHierarchicalCopy, Algorithm::kReduceToOne,
                      Algorithm::kFlat, Algorithm::kDirect, Algorithm::kFallback}) {
    CHECK_EQ(algorithm_from_string(to_string(a)), a);
  }
  CHECK_THROWS(algorithm_from_string("ring"), std::invalid_argument, "hierarchical_copy");
  CHECK_THROWS(algorithm_from_string(""), std::invalid_argument, "got ''");
  CHECK_THROWS(algorithm_from_string("Flat"), std::invalid_argument, "Flat");
}

namespace {

// Checks one plan window by window: slots stay within the window, segments tile the slot, every
// payload element is staged exactly once over all windows, and each window's schedule is correct.
// broadcast_root < 0 checks an allreduce, otherwise a broadcast from that root.
void check_plan(const CollectivePlan& plan, int64_t window_elems, int broadcast_root) {
  std::vector<int> staged(static_cast<size_t>(plan.total()), 0);
  for (int64_t k = 0; k < plan.num_windows(); ++k) {
    const WindowPlan w = plan.window(k);
    CHECK(w.slot_elems >= 1);
    CHECK(w.slot_elems <= window_elems);
    int64_t slot_at = 0;
    for (const Segment& seg : w.segments) {
      CHECK_EQ(seg.slot_begin, slot_at);  // ascending and gap-free
      CHECK(seg.count >= 1);
      slot_at = seg.slot_begin + seg.count;
      const bool in_payload =
          seg.payload_begin >= 0 && seg.payload_begin + seg.count <= plan.total();
      CHECK(in_payload);
      if (!in_payload) continue;
      for (int64_t x = seg.payload_begin; x < seg.payload_begin + seg.count; ++x) ++staged[x];
    }
    CHECK_EQ(slot_at, w.slot_elems);
    CHECK_EQ(broadcast_root < 0 ? check_allreduce(w.schedule, w.slot_elems)
                                : check_broadcast(w.schedule, w.slot_elems, broadcast_root),
             kOk);
  }
  CHECK(std::all_of(staged.begin(), staged.end(), [](int c) { return c == 1; }));
  CHECK_THROWS(plan.window(plan.num_windows()), std::out_of_range, "");
  CHECK_THROWS(plan.window(-1), std::out_of_range, "");
}

}  // namespace

TEST(allreduce_plan_covers_payload_once_in_every_algorithm) {
  std::mt19937 rng(22);
  const Algorithm algorithms[] = {Algorithm::kHierarchicalCopy, Algorithm::kReduceToOne,
                                  Algorithm::kFlat, Algorithm::kDirect};
  for (int trial = 0; trial < 800; ++trial) {
    const Algorithm a = algorithms[trial % 4];
    const int world = a == Algorithm::kHierarchicalCopy ? 2 * static_cast<int>(uniform(rng, 1, 4))
                                                        : static_cast<int>(uniform(rng, 1, 8));
    const int64_t total = uniform(rng, 0, 3) == 0 ? uniform(rng, 0, 20) : uniform(rng, 0, 3000);
    const int64_t window = uniform(rng, 0, 3) == 0 ? uniform(rng, 1, 8) : uniform(rng, 9, 400);
    const int num_packs = static_cast<int>(uniform(rng, 1, 12));
    const auto packs =
        trial % 2 == 0 ? random_tiling(rng, total, num_packs) : equal_packs(total, 8);
    const int root = static_cast<int>(uniform(rng, 0, world - 1));
    const auto plan = CollectivePlan::allreduce(a, world, root, packs, total, window);
    CHECK_EQ(plan.algorithm(), a);
    CHECK_EQ(plan.total(), total);
    CHECK_EQ(plan.num_windows() == 0, total == 0);
    check_plan(plan, window, -1);
  }
}

TEST(hierarchical_plan_splits_every_pack_across_windows) {
  const int64_t total = 100003;
  const int64_t window = 1000;
  // Equal packs, then uneven packs with empty ones among them.
  std::vector<Range> uneven = {{0, 0},         {0, 20000},     {20000, 20000}, {20000, 50000},
                               {50000, 65000}, {65000, 65000}, {65000, 100003}};
  for (const auto& packs : {equal_packs(total, 8), uneven}) {
    const auto plan =
        CollectivePlan::allreduce(Algorithm::kHierarchicalCopy, 8, 0, packs, total, window);
    CHECK(plan.num_windows() > 50);
    check_plan(plan, window, -1);
    std::vector<Range> non_empty;
    for (const Range& p : packs) {
      if (!p.empty()) non_empty.push_back(p);
    }
    for (int64_t k = 0; k < plan.num_windows(); ++k) {
      const WindowPlan w = plan.window(k);
      for (const Range& p : non_empty) {
        const auto in_pack = [&](const Segment& s) {
          return s.payload_begin >= p.begin && s.payload_begin + s.count <= p.end;
        };
        CHECK(std::any_of(w.segments.begin(), w.segments.end(), in_pack));
      }
      // Every pack's lead rank finalizes in every window, so the load keeps rotating.
      std::set<int> finalizers;
      for (const Step& step : w.schedule.steps) {
        if (step.finalize) finalizers.insert(step.actor);
      }
      CHECK_EQ(finalizers.size(), non_empty.size());
    }
  }
}

TEST(broadcast_plan_covers_payload_once) {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = static_cast<int>(uniform(rng, 1, 8));
    const int root = static_cast<int>(uniform(rng, 0, world - 1));
    const int64_t total = uniform(rng, 0, 2000);
    const int64_t window = uniform(rng, 1, 300);
    const auto plan = CollectivePlan::broadcast(world, root, total, window);
    CHECK_EQ(plan.num_windows(), (total + window - 1) / window);
    check_plan(plan, window, root);
  }
  CHECK_THROWS(CollectivePlan::broadcast(4, 4, 10, 10), std::invalid_argument, "root");
  CHECK_THROWS(CollectivePlan::broadcast(4, 0, 10, 0), std::invalid_argument, "window_elems");
}

TEST(allreduce_plan_rejects_bad_arguments) {
  for (Algorithm a : {Algorithm::kAuto, Algorithm::kFallback}) {
    CHECK_THROWS(CollectivePlan::allreduce(a, 4, 0, {}, 10, 10), std::invalid_argument,
                 "not a native algorithm");
  }
  CHECK_THROWS(CollectivePlan::allreduce(Algorithm::kFlat, 4, 0, {}, 10, 0), std::invalid_argument,
               "window_elems");
  CHECK_THROWS(CollectivePlan::allreduce(Algorithm::kReduceToOne, 4, 4, {}, 10, 10),
               std::invalid_argument, "reduce_to_rank");
}

namespace {

// In-place semantics (single-copy transport): rank r's slot is its tensor,
// starting with r's own contribution; at the end every slot must hold the
// full set, each element reduced without double counting. Phases read a
// snapshot taken at their start, as concurrent ranks would.
bool in_place_allreduces(const Schedule& s, int64_t elems) {
  const int n = s.world_size;
  std::vector<std::vector<uint64_t>> slot(n, std::vector<uint64_t>(elems));
  for (int r = 0; r < n; ++r) std::fill(slot[r].begin(), slot[r].end(), uint64_t{1} << r);
  for (int phase = 1; phase <= s.num_phases; ++phase) {
    const auto before = slot;
    for (const Step& step : s.steps) {
      if (step.phase != phase || step.target != Target::kStaging) continue;
      for (int64_t x = step.range.begin; x < step.range.end; ++x) {
        uint64_t v = 0;
        for (int src : step.sources) {
          if (step.kind == StepKind::kReduce && (v & before[src][x]) != 0) return false;
          v = step.kind == StepKind::kReduce ? (v | before[src][x]) : before[src][x];
        }
        slot[step.actor][x] = v;
      }
    }
  }
  const uint64_t full = n == 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
  for (int r = 0; r < n; ++r) {
    for (int64_t x = 0; x < elems; ++x) {
      if (slot[r][x] != full) return false;
    }
  }
  return true;
}

}  // namespace

TEST(in_place_variants_allreduce_where_aliasing_is_safe) {
  for (int world = 1; world <= 8; ++world) {
    for (int64_t elems : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{64}}) {
      const Schedule flat = in_place_variant(flat_schedule(world, {0, elems}));
      CHECK(flat.stagers.empty());
      CHECK(in_place_allreduces(flat, elems));
      for (int root = 0; root < world; ++root) {
        CHECK(in_place_allreduces(in_place_variant(reduce_to_one_schedule(world, root, {0, elems})),
                                  elems));
      }
      if (world % 2 == 0) {
        std::vector<PackSlice> packs;
        for (int64_t i = 0; i < 5; ++i) packs.push_back({i, {elems * i / 5, elems * (i + 1) / 5}});
        CHECK(
            in_place_allreduces(in_place_variant(hierarchical_copy_schedule(world, packs)), elems));
      }
    }
  }
  // In the direct plan every rank overwrites its tensor while peers read it.
  CHECK_THROWS(in_place_variant(direct_schedule(2, {0, 8})), std::invalid_argument, "in place");
}

TEST(single_copy_only_for_large_single_buffers_of_in_place_plans) {
  const int64_t big = kCpuSingleCopyMinBytes;
  CHECK(use_single_copy(Algorithm::kFlat, big, true, true));
  CHECK(use_single_copy(Algorithm::kHierarchicalCopy, big, true, true));
  CHECK(use_single_copy(Algorithm::kReduceToOne, big, true, true));
  CHECK(!use_single_copy(Algorithm::kDirect, big, true, true));
  CHECK(!use_single_copy(Algorithm::kFlat, big - 1, true, true));
  CHECK(!use_single_copy(Algorithm::kFlat, big, false, true));
  CHECK(!use_single_copy(Algorithm::kFlat, big, true, false));
}

// ---------------------------------------------------------------------------
// Ring reference and the balanced hierarchical plan

namespace {

// Every transfer (a source other than the actor) crosses a direct link.
bool uses_direct_links_only(const Schedule& s, const LinkMatrix& links) {
  for (const Step& step : s.steps) {
    for (int src : step.sources) {
      if (src != step.actor && links.links(src, step.actor) == 0) return false;
    }
  }
  return true;
}

}  // namespace

TEST(find_rings_uses_every_link_the_cube_mesh_allows) {
  // Rings come in pairs (a cycle and its reverse); P100 has 2 link-disjoint
  // cycles (4 links per GPU), V100 3 (6 links per GPU: the whitepaper's "three
  // interwoven rings").
  CHECK_EQ(find_rings(LinkMatrix::dgx1()).size(), size_t{4});
  CHECK_EQ(find_rings(dgx1_v100_links()).size(), size_t{6});
  for (const LinkMatrix& links : {LinkMatrix::dgx1(), dgx1_v100_links()}) {
    std::vector<int> used(64, 0);
    for (const auto& ring : find_rings(links)) {
      CHECK_EQ(ring.size(), size_t{8});
      for (size_t i = 0; i < ring.size(); ++i) {
        const int a = ring[i], b = ring[(i + 1) % ring.size()];
        CHECK(links.links(a, b) > 0);
        ++used[static_cast<size_t>(a * 8 + b)];
      }
    }
    for (int a = 0; a < 8; ++a) {
      for (int b = 0; b < 8; ++b) CHECK(used[static_cast<size_t>(a * 8 + b)] <= links.links(a, b));
    }
  }
  // No links at all: one ring in rank order and its reverse, over whatever joins the devices.
  CHECK_EQ(find_rings(LinkMatrix(8)).size(), size_t{2});
}

TEST(ring_allreduce_schedule_allreduces) {
  for (int world = 1; world <= 8; ++world) {
    const auto rings = find_rings(LinkMatrix::fully_connected(world));
    for (int64_t elems : {0, 1, 5, 17, 300}) {
      CHECK_EQ(check_allreduce(ring_allreduce_schedule(world, rings, {0, elems}), elems), kOk);
    }
  }
  for (const LinkMatrix& links : {LinkMatrix::dgx1(), dgx1_v100_links()}) {
    const Schedule s = ring_allreduce_schedule(8, find_rings(links), {0, 1000});
    CHECK_EQ(check_allreduce(s, 1000), kOk);
    CHECK(uses_direct_links_only(s, links));
  }
  CHECK_THROWS(ring_allreduce_schedule(3, {{0, 1}}, {0, 4}), std::invalid_argument, "every rank");
}

TEST(balanced_schedule_allreduces_on_any_even_world) {
  std::mt19937 rng(7);
  for (int world = 2; world <= 8; world += 2) {
    for (int64_t num_packs : {1, world, 3 * world, 7 * world}) {
      const auto trees = balanced_pack_trees(LinkMatrix::fully_connected(world), num_packs);
      CHECK_EQ(trees.size(), static_cast<size_t>(num_packs));
      for (int64_t elems : {0, 1, 3, 101, 1000}) {
        const auto packs = random_tiling(rng, elems, static_cast<int>(num_packs));
        const Schedule s = hierarchical_balanced_schedule(world, trees, slices_of(packs, 0));
        CHECK_EQ(check_allreduce(s, elems), kOk);
      }
    }
  }
  CHECK_THROWS(balanced_pack_trees(LinkMatrix::fully_connected(3), 3), std::invalid_argument,
               "even number");
  LinkMatrix missing_partner = LinkMatrix::fully_connected(4);
  missing_partner.set_links(1, 3, 0);
  CHECK_THROWS(balanced_pack_trees(missing_partner, 4), std::invalid_argument, "partner");
}

TEST(every_hierarchical_plan_on_both_dgx1s_uses_direct_links_only) {
  for (const LinkMatrix& links : {LinkMatrix::dgx1(), dgx1_v100_links()}) {
    for (int64_t num_packs : {1, 8, 24, 48, 384}) {
      const auto packs = equal_packs(5000, num_packs);
      const Schedule copy = hierarchical_copy_schedule(8, slices_of(packs, 0));
      CHECK(uses_direct_links_only(copy, links));
      const Schedule balanced = hierarchical_balanced_schedule(
          8, balanced_pack_trees(links, num_packs), slices_of(packs, 0));
      CHECK_EQ(check_allreduce(balanced, 5000), kOk);
      CHECK(uses_direct_links_only(balanced, links));
    }
  }
}

TEST(balanced_trees_load_every_v100_link_by_its_capacity) {
  // 24 packs carry 7 link-loads each (6 tree edges + 1 cross, or 4 cross + 3 tree); the V100
  // cube-mesh has 24 links, so a perfect assignment loads every link with 7 packs' worth.
  const LinkBalance b = link_balance(dgx1_v100_links(), balanced_pack_trees(dgx1_v100_links(), 24));
  CHECK(std::abs(b.ideal_load_per_link - 7.0) < 1e-9);
  CHECK(std::abs(b.max_load_per_link - 7.0) < 1e-9);
}

TEST(balanced_plan_through_windows_covers_the_payload) {
  std::mt19937 rng(31);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 2 * static_cast<int>(uniform(rng, 1, 4));
    const int64_t total = uniform(rng, 0, 3000);
    const int64_t window = uniform(rng, 1, 400);
    const int num_packs = static_cast<int>(uniform(rng, 1, 30));
    auto trees = balanced_pack_trees(LinkMatrix::fully_connected(world), num_packs);
    const auto plan =
        CollectivePlan::allreduce(Algorithm::kHierarchicalBalanced, world, 0,
                                  random_tiling(rng, total, num_packs), total, window, trees);
    check_plan(plan, window, -1);
  }
  CHECK_THROWS(CollectivePlan::allreduce(Algorithm::kHierarchicalBalanced, 4, 0, {{0, 8}}, 8, 8),
               std::invalid_argument, "pack trees");
}

TEST(model_choice_is_never_slower_than_a_candidate) {
  for (const char* name : {"dgx1-v100", "dgx1-p100", "pcie-8gpu", "cpu-2", "cpu-3", "cpu-4"}) {
    const MachineModel m = builtin_machine(name);
    for (int64_t bytes : {int64_t{4} << 10, int64_t{256} << 10, int64_t{4} << 20}) {
      const ModelChoice c = choose_allreduce(m, bytes, -1, true);
      for (const Prediction& p : c.predictions) {
        if (!p.candidate.ring_reference) CHECK(c.best.seconds <= p.seconds);
      }
      CHECK(!c.best.candidate.ring_reference);
      CHECK(c.predictions.back().candidate.ring_reference);
    }
  }
}

TEST(balanced_plan_meets_its_targets_against_ring_on_dgx1_v100) {
  // The model's claims in the README: at 64 MiB and above the balanced plan's busbw is at least
  // ring's; at 256 KiB and below the hierarchical plans are at least 2x faster than ring.
  const MachineModel m = dgx1_v100();
  Candidate ring;
  ring.ring_reference = true;
  for (int64_t bytes : {int64_t{64} << 20}) {
    const Prediction r = predict_allreduce(m, ring, bytes);
    const Prediction b =
        predict_allreduce(m, Candidate::native(Algorithm::kHierarchicalBalanced, 384), bytes);
    CHECK(b.busbw >= r.busbw);
  }
  for (int64_t bytes : {int64_t{4} << 10, int64_t{256} << 10}) {
    const Prediction r = predict_allreduce(m, ring, bytes);
    const Prediction b =
        predict_allreduce(m, Candidate::native(Algorithm::kHierarchicalBalanced, 8), bytes);
    CHECK(2 * b.seconds <= r.seconds);
  }
}

namespace {

int64_t staged_elems(const Schedule& s, int64_t elems) {
  int64_t total = 0;
  for (int r : s.stagers) {
    if (s.staged_ranges.empty()) {
      total += elems;
      continue;
    }
    for (const Range& range : s.staged_ranges[static_cast<size_t>(r)]) total += range.size();
  }
  return total;
}

// Empty when forward_own_input(s) still allreduces (or broadcasts), stages no more than s, and
// every reduce keeps s's source order (kOwnInput standing for the actor), so the bits agree.
std::string check_forwarded(const Schedule& s, int64_t elems, int broadcast_root = -1) {
  const Schedule f = forward_own_input(s);
  const std::string result =
      broadcast_root >= 0 ? check_broadcast(f, elems, broadcast_root) : check_allreduce(f, elems);
  if (!result.empty()) return "forwarded: " + result;
  if (staged_elems(f, elems) > staged_elems(s, elems)) return "forwarded stages more";
  size_t reduces = 0;
  for (const Step& step : f.steps) {
    if (step.kind != StepKind::kReduce) continue;
    ++reduces;
    std::vector<int> original = step.sources;
    for (int& src : original) src = src == kOwnInput ? step.actor : src;
    bool found = false;
    for (const Step& o : s.steps) {
      found = found || (o.kind == StepKind::kReduce && o.actor == step.actor &&
                        o.phase == step.phase && o.range == step.range && o.sources == original);
    }
    if (!found) return "a forwarded reduce changed its sources";
  }
  size_t original_reduces = 0;
  for (const Step& step : s.steps) original_reduces += step.kind == StepKind::kReduce ? 1 : 0;
  if (reduces != original_reduces) return "forwarded reduce count differs";
  // What the staged executor runs: the same reduces and staging, totals handed back.
  const Schedule h = hand_back_totals(f);
  const std::string handed =
      broadcast_root >= 0 ? check_broadcast(h, elems, broadcast_root) : check_allreduce(h, elems);
  if (!handed.empty()) return "handed back: " + handed;
  if (h.staged_ranges != f.staged_ranges || h.stagers != f.stagers) return "hand-back restages";
  if (h.steps.size() != f.steps.size()) return "hand-back changed the step count";
  for (size_t i = 0; i < h.steps.size(); ++i) {
    Step same = h.steps[i];
    same.slot_owner = -1;
    if (same.kind == StepKind::kCopy) same.sources = f.steps[i].sources;
    if (!(same == f.steps[i])) return "hand-back changed more than targets and copy sources";
  }
  return {};
}

}  // namespace

TEST(simulator_catches_reads_of_an_overwritten_tensor) {
  // Rank 0 copies rank 1's slot into its tensor, then reads the tensor as its input: rank 1
  // would be counted twice.
  Schedule s;
  s.world_size = 2;
  s.num_phases = 2;
  s.stagers = {1};
  s.steps.push_back(make_step(StepKind::kCopy, 1, 0, {1}, Target::kOutput));
  s.steps.push_back(make_step(StepKind::kReduce, 2, 0, {kOwnInput, 1}, Target::kStaging, true));
  CHECK(reports(simulate(s, 4).error, "twice"));
  // A rank that stages only part of its slot leaves the rest unwritten for its readers.
  Schedule partial = hand_reduce_to_one();
  partial.staged_ranges = {{{0, 4}}, {{0, 4}}, {{0, 2}}};
  CHECK(reports(check_allreduce(partial, 4), "unwritten"));
}

TEST(forwarded_flat_on_two_ranks_stages_half_and_reads_its_own_tensor) {
  const Schedule f = forward_own_input(flat_schedule(2, {0, 10}));
  CHECK_EQ(check_allreduce(f, 10), kOk);
  // Each rank stages only the half its peer reduces.
  CHECK_EQ(f.staged_ranges.size(), size_t{2});
  CHECK_EQ(f.staged_ranges[0].size(), size_t{1});
  CHECK_EQ(f.staged_ranges[0][0], (Range{5, 10}));
  CHECK_EQ(f.staged_ranges[1][0], (Range{0, 5}));
  // Phase 1: rank r sums its own tensor and the peer's slot, in rank order, into its slot and
  // its tensor; phase 2: one copy of the peer's half. Nothing else.
  CHECK_EQ(f.steps.size(), size_t{4});
  for (const Step& step : f.steps) {
    if (step.kind == StepKind::kReduce) {
      CHECK(step.also_output);
      CHECK_EQ(step.sources[static_cast<size_t>(step.actor)], kOwnInput);
    } else {
      CHECK_EQ(step.phase, 2);
      CHECK(step.sources[0] != step.actor);
    }
  }
}

TEST(forwarded_reduce_to_one_root_keeps_staging_and_writes_its_tensor_once) {
  for (int world = 2; world <= 8; ++world) {
    for (int root = 0; root < world; ++root) {
      const Schedule f = forward_own_input(reduce_to_one_schedule(world, root, {0, 9}));
      // Forwarding would leave the root nothing to stage while the others stage the window,
      // so it keeps staging its own and reads its slot.
      CHECK_EQ(f.stagers.size(), static_cast<size_t>(world));
      for (const auto& ranges : f.staged_ranges) CHECK_EQ(ranges, (std::vector<Range>{{0, 9}}));
      for (const Step& step : f.steps) {
        CHECK(std::find(step.sources.begin(), step.sources.end(), kOwnInput) == step.sources.end());
        // The root's copy-out is folded into its reduce.
        if (step.actor == root) CHECK(step.kind == StepKind::kReduce && step.also_output);
      }
    }
  }
}

TEST(forwarded_schedules_allreduce_with_the_same_sums) {
  std::mt19937 rng(5);
  for (int world = 1; world <= 8; ++world) {
    for (int64_t elems : {0, 1, 5, 17, 64}) {
      CHECK_EQ(check_forwarded(flat_schedule(world, {0, elems}), elems), kOk);
      CHECK_EQ(check_forwarded(direct_schedule(world, {0, elems}), elems), kOk);
      for (int root = 0; root < world; ++root) {
        CHECK_EQ(check_forwarded(reduce_to_one_schedule(world, root, {0, elems}), elems), kOk);
        CHECK_EQ(check_forwarded(broadcast_schedule(world, root, {0, elems}), elems, root), kOk);
      }
      const auto rings = find_rings(LinkMatrix::fully_connected(world));
      CHECK_EQ(check_forwarded(ring_allreduce_schedule(world, rings, {0, elems}), elems), kOk);
    }
  }
  for (int world = 2; world <= 8; world += 2) {
    const auto trees = balanced_pack_trees(LinkMatrix::fully_connected(world), 3 * world);
    for (int trial = 0; trial < 60; ++trial) {
      const int64_t elems = uniform(rng, 0, 40);
      const int num_packs = static_cast<int>(uniform(rng, 1, 20));
      const auto slices = slices_of(random_tiling(rng, elems, num_packs), uniform(rng, 0, 20));
      CHECK_EQ(check_forwarded(hierarchical_copy_schedule(world, slices), elems), kOk);
      const auto packs = random_tiling(rng, elems, 3 * world);
      CHECK_EQ(
          check_forwarded(hierarchical_balanced_schedule(world, trees, slices_of(packs, 0)), elems),
          kOk);
    }
  }
}

TEST(forwarding_keeps_a_copy_when_the_tensor_is_read_in_between) {
  // Rank 0 overwrites its slot with rank 1's data while it also sums its own tensor into its
  // output; folding the later copy-out into the overwrite would write the tensor twice in
  // phase 1. The forwarded schedule must end exactly as the original does.
  Schedule s;
  s.world_size = 2;
  s.num_phases = 2;
  s.stagers = {0, 1};
  s.steps.push_back(make_step(StepKind::kCopy, 1, 0, {1}, Target::kStaging));
  s.steps.push_back(make_step(StepKind::kReduce, 1, 0, {0, 1}, Target::kOutput, true));
  s.steps.push_back(make_step(StepKind::kCopy, 2, 0, {0}, Target::kOutput));
  const Schedule f = forward_own_input(s);
  CHECK_EQ(f.steps.size(), s.steps.size());
  const SimState want = simulate(s, 4);
  const SimState got = simulate(f, 4);
  CHECK_EQ(want.error, kOk);
  CHECK_EQ(got.error, kOk);
  CHECK(got.out == want.out);
}

TEST(totals_go_back_to_the_slot_they_came_from_on_two_ranks) {
  // Flat: rank r sums its half from the peer's slot and writes the total back there; the
  // peer copies its own slot.
  const Schedule flat = hand_back_totals(forward_own_input(flat_schedule(2, {0, 10})));
  CHECK_EQ(check_allreduce(flat, 10), kOk);
  for (const Step& step : flat.steps) {
    if (step.kind == StepKind::kReduce) {
      CHECK_EQ(written_slot(step), 1 - step.actor);
      CHECK(step.also_output);
    } else {
      CHECK_EQ(step.sources, (std::vector<int>{step.actor}));
    }
  }
  // Reduce-to-one: the root's total goes back to the other rank's slot.
  for (int root = 0; root < 2; ++root) {
    const Schedule r = hand_back_totals(forward_own_input(reduce_to_one_schedule(2, root, {0, 7})));
    CHECK_EQ(check_allreduce(r, 7), kOk);
    for (const Step& step : r.steps) {
      if (step.kind == StepKind::kReduce) CHECK_EQ(written_slot(step), 1 - root);
      if (step.kind == StepKind::kCopy) CHECK_EQ(step.sources[0], step.actor);
    }
  }
}

TEST(a_total_several_ranks_copy_keeps_its_slot) {
  for (int world = 3; world <= 8; ++world) {
    const Schedule f = forward_own_input(flat_schedule(world, {0, 3 * world}));
    CHECK(hand_back_totals(f) == f);
    const Schedule r = forward_own_input(reduce_to_one_schedule(world, 0, {0, 5}));
    CHECK(hand_back_totals(r) == r);
  }
  const Schedule d = forward_own_input(direct_schedule(2, {0, 6}));
  CHECK(hand_back_totals(d) == d);
}

TEST(writing_a_peer_slot_is_checked_like_writing_ones_own) {
  // Rank 0 writes rank 1's slot while rank 1 reads it in the same phase: a race.
  Schedule s;
  s.world_size = 2;
  s.num_phases = 1;
  s.stagers = {0, 1};
  Step total = make_step(StepKind::kReduce, 1, 0, {0, 1}, Target::kStaging, true);
  total.slot_owner = 1;
  s.steps.push_back(total);
  s.steps.push_back(make_step(StepKind::kCopy, 1, 1, {1}, Target::kOutput));
  CHECK(reports(find_schedule_hazard(s), "touches slot 1"));
  // An owner on an output step, or out of range, is malformed.
  Schedule bad = s;
  bad.steps.pop_back();
  bad.steps[0].slot_owner = 2;
  CHECK(reports(find_schedule_hazard(bad), "slot_owner"));
  // The transforms take schedules whose steps write their own slots.
  bad.steps[0].slot_owner = 1;
  bool threw = false;
  try {
    forward_own_input(bad);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

TEST(a_total_is_not_handed_back_over_an_input_someone_still_reads) {
  // Rank 1 alone copies rank 0's partial sum of ranks 0 and 1, but rank 2 reads rank 1's staged
  // input afterwards: writing the sum over it would change rank 2's result.
  Schedule s;
  s.world_size = 3;
  s.num_phases = 2;
  s.stagers = {0, 1, 2};
  s.steps.push_back(make_step(StepKind::kReduce, 1, 0, {0, 1}, Target::kStaging, false));
  s.steps.push_back(make_step(StepKind::kCopy, 2, 1, {0}, Target::kOutput));
  s.steps.push_back(make_step(StepKind::kReduce, 2, 2, {1, 2}, Target::kOutput, false));
  CHECK(hand_back_totals(s) == s);
  // Without rank 2's read the sum goes back to rank 1's slot, and every output is the same.
  Schedule alone = s;
  alone.steps.pop_back();
  const Schedule h = hand_back_totals(alone);
  CHECK_EQ(written_slot(h.steps[0]), 1);
  const SimState want = simulate(alone, 4);
  const SimState got = simulate(h, 4);
  CHECK_EQ(want.error, kOk);
  CHECK_EQ(got.error, kOk);
  CHECK(got.out == want.out);
}
