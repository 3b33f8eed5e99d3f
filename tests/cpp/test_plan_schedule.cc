// Unit tests of schedules: each builder's schedule allreduces (or broadcasts) under the symbolic
// simulator of schedule_simulator.h, and the forwarded and handed-back forms keep its sums.
#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
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
#include "schedule_simulator.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there
using xdev_test::random_tiling;
using xdev_test::uniform;
using namespace xdev::plan::simulator;  // NOLINT: the simulator's checks

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

namespace {

// Steps in one order whatever order a builder or rewrite emitted them in.
std::vector<Step> sorted_steps(std::vector<Step> steps) {
  const auto key = [](const Step& s) {
    return std::tie(s.range.begin, s.range.end, s.phase, s.actor, s.target, s.kind, s.sources,
                    s.slot_owner, s.also_output, s.finalize);
  };
  std::sort(steps.begin(), steps.end(),
            [&](const Step& a, const Step& b) { return key(a) < key(b); });
  return steps;
}

}  // namespace

TEST(thousands_of_packs_are_rewritten_as_one_rotation_is) {
  // Packs of equal size rotate their lead ranks every `world` packs, so the staged executor's
  // rewrites of 20000 packs are those of the first `world` packs, repeated: the same steps,
  // shifted. (This also keeps the rewrites fast: they compared every pair of steps, which took
  // minutes at this size.)
  constexpr int kWorld = 8;
  constexpr int64_t kPackElems = 3;
  constexpr int64_t kRotations = 2500;
  const auto rewrite = [](const Schedule& s) { return hand_back_totals(forward_own_input(s)); };
  const Schedule one = rewrite(
      hierarchical_copy_schedule(kWorld, slices_of(equal_packs(kWorld * kPackElems, kWorld), 0)));
  const int64_t elems = kRotations * kWorld * kPackElems;
  const Schedule all = rewrite(
      hierarchical_copy_schedule(kWorld, slices_of(equal_packs(elems, kRotations * kWorld), 0)));
  CHECK_EQ(find_schedule_hazard(all), std::string());

  std::vector<Step> want;
  std::vector<std::vector<Range>> want_staged(kWorld);
  for (int64_t k = 0; k < kRotations; ++k) {
    const int64_t shift = k * kWorld * kPackElems;
    for (Step step : one.steps) {
      step.range = {step.range.begin + shift, step.range.end + shift};
      want.push_back(step);
    }
    for (int r = 0; r < kWorld; ++r) {
      for (const Range& x : one.staged_ranges[static_cast<size_t>(r)]) {
        std::vector<Range>& ranges = want_staged[static_cast<size_t>(r)];
        if (!ranges.empty() && ranges.back().end == x.begin + shift) {
          ranges.back().end = x.end + shift;  // touching ranges are one
        } else {
          ranges.push_back({x.begin + shift, x.end + shift});
        }
      }
    }
  }
  CHECK(sorted_steps(all.steps) == sorted_steps(want));
  CHECK(all.staged_ranges == want_staged);
  CHECK(all.stagers == one.stagers);
}
