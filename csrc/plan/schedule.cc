#include "schedule.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace xdev::plan {

const char* to_string(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto:
      return "auto";
    case Algorithm::kHierarchicalCopy:
      return "hierarchical_copy";
    case Algorithm::kHierarchicalBalanced:
      return "hierarchical_balanced";
    case Algorithm::kReduceToOne:
      return "reduce_to_one";
    case Algorithm::kFlat:
      return "flat";
    case Algorithm::kDirect:
      return "direct";
    case Algorithm::kFallback:
      return "fallback";
  }
  return "unknown";
}

Algorithm algorithm_from_string(const std::string& name) {
  for (Algorithm a :
       {Algorithm::kAuto, Algorithm::kHierarchicalCopy, Algorithm::kHierarchicalBalanced,
        Algorithm::kReduceToOne, Algorithm::kFlat, Algorithm::kDirect, Algorithm::kFallback}) {
    if (name == to_string(a)) return a;
  }
  throw std::invalid_argument(
      "algorithm must be one of 'auto', 'hierarchical_copy', 'hierarchical_balanced', "
      "'reduce_to_one', 'flat', 'direct', 'fallback'; got '" +
      name + "'");
}

namespace {

std::vector<int> all_ranks(int world_size) {
  std::vector<int> ranks(static_cast<size_t>(world_size));
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}

void check_world(int world_size) {
  if (world_size < 1) throw std::invalid_argument("schedule: world_size must be >= 1");
}

Schedule empty_schedule(int world_size, int num_phases, std::vector<int> stagers) {
  check_world(world_size);
  Schedule s;
  s.world_size = world_size;
  s.num_phases = num_phases;
  s.stagers = std::move(stagers);
  return s;
}

}  // namespace

bool operator==(const Step& a, const Step& b) {
  return a.kind == b.kind && a.phase == b.phase && a.actor == b.actor && a.sources == b.sources &&
         a.target == b.target && a.range == b.range && a.finalize == b.finalize &&
         a.also_output == b.also_output && a.slot_owner == b.slot_owner;
}

bool operator==(const Schedule& a, const Schedule& b) {
  return a.world_size == b.world_size && a.num_phases == b.num_phases && a.stagers == b.stagers &&
         a.staged_ranges == b.staged_ranges && a.steps == b.steps;
}

bool reads_slot(const Step& s, int rank) {
  return std::find(s.sources.begin(), s.sources.end(), rank) != s.sources.end();
}

bool reads_own_input(const Step& s) {
  return reads_slot(s, kOwnInput);
}

int written_slot(const Step& s) {
  return s.slot_owner < 0 ? s.actor : s.slot_owner;
}

Step reduce_step(int phase, int actor, std::vector<int> sources, Target target, Range r,
                 bool finalize) {
  Step s;
  s.kind = StepKind::kReduce;
  s.phase = phase;
  s.actor = actor;
  s.sources = std::move(sources);
  s.target = target;
  s.range = r;
  s.finalize = finalize;
  return s;
}

Step copy_step(int phase, int actor, int source, Target target, Range r) {
  Step s;
  s.kind = StepKind::kCopy;
  s.phase = phase;
  s.actor = actor;
  s.sources = {source};
  s.target = target;
  s.range = r;
  return s;
}

void check_root(const char* what, int64_t root, int world_size) {
  if (root < 0 || root >= world_size) {
    throw std::invalid_argument(std::string(what) + " must be in [0, " +
                                std::to_string(world_size) + "); got " + std::to_string(root));
  }
}

Schedule hierarchical_copy_schedule(int world_size, const std::vector<PackSlice>& packs) {
  check_world(world_size);
  if (world_size % 2 != 0) {
    throw std::invalid_argument(
        "hierarchical_copy needs an even number of ranks (two groups of N/2); got " +
        std::to_string(world_size));
  }
  const int n = world_size;
  const int g = n / 2;
  Schedule s = empty_schedule(n, 4, all_ranks(n));
  for (const PackSlice& p : packs) {
    if (p.range.empty()) continue;
    const int main0 = static_cast<int>(p.pack_id % n);
    const int main1 = (main0 + g) % n;
    const int group0 = main0 < g ? 0 : g;  // first rank of main0's group
    const int group1 = main1 < g ? 0 : g;
    std::vector<int> members0(static_cast<size_t>(g)), members1(static_cast<size_t>(g));
    std::iota(members0.begin(), members0.end(), group0);
    std::iota(members1.begin(), members1.end(), group1);

    s.steps.push_back(reduce_step(1, main0, members0, Target::kStaging, p.range, false));
    s.steps.push_back(reduce_step(1, main1, members1, Target::kStaging, p.range, false));
    s.steps.push_back(reduce_step(2, main0, {main0, main1}, Target::kStaging, p.range, true));
    s.steps.push_back(copy_step(3, main1, main0, Target::kStaging, p.range));
    for (int r : members0) s.steps.push_back(copy_step(3, r, main0, Target::kOutput, p.range));
    for (int r : members1) s.steps.push_back(copy_step(4, r, main1, Target::kOutput, p.range));
  }
  return s;
}

Schedule reduce_to_one_schedule(int world_size, int root, Range range) {
  check_root("reduce_to_rank", root, world_size);
  Schedule s = empty_schedule(world_size, 2, all_ranks(world_size));
  if (range.empty()) return s;
  s.steps.push_back(reduce_step(1, root, all_ranks(world_size), Target::kStaging, range, true));
  for (int r = 0; r < world_size; ++r) {
    s.steps.push_back(copy_step(2, r, root, Target::kOutput, range));
  }
  return s;
}

Schedule flat_schedule(int world_size, Range range) {
  Schedule s = empty_schedule(world_size, 2, all_ranks(world_size));
  const int64_t total = range.size();
  if (total <= 0) return s;
  std::vector<Range> slices;
  for (int r = 0; r < world_size; ++r) {
    slices.push_back(
        {range.begin + total * r / world_size, range.begin + total * (r + 1) / world_size});
  }
  for (int r = 0; r < world_size; ++r) {
    if (slices[r].empty()) continue;
    s.steps.push_back(reduce_step(1, r, all_ranks(world_size), Target::kStaging, slices[r], true));
  }
  for (int r = 0; r < world_size; ++r) {
    for (int owner = 0; owner < world_size; ++owner) {
      if (slices[owner].empty()) continue;
      s.steps.push_back(copy_step(2, r, owner, Target::kOutput, slices[owner]));
    }
  }
  return s;
}

Schedule direct_schedule(int world_size, Range range) {
  Schedule s = empty_schedule(world_size, 1, all_ranks(world_size));
  if (range.empty()) return s;
  for (int r = 0; r < world_size; ++r) {
    s.steps.push_back(reduce_step(1, r, all_ranks(world_size), Target::kOutput, range, true));
  }
  return s;
}

Schedule broadcast_schedule(int world_size, int root, Range range) {
  check_root("broadcast root", root, world_size);
  Schedule s = empty_schedule(world_size, 1, {root});
  if (range.empty()) return s;
  for (int r = 0; r < world_size; ++r) {
    if (r != root) s.steps.push_back(copy_step(1, r, root, Target::kOutput, range));
  }
  return s;
}

}  // namespace xdev::plan
