#include "schedule.h"

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

void check_root(const char* what, int root, int world_size) {
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

namespace {

bool overlaps(const Range& a, const Range& b) {
  return a.begin < b.end && b.begin < a.end;
}

}  // namespace

std::string find_schedule_hazard(const Schedule& s) {
  const auto in_world = [&](int r) { return r >= 0 && r < s.world_size; };
  for (size_t i = 0; i < s.steps.size(); ++i) {
    const Step& a = s.steps[i];
    if (!in_world(a.actor)) return "step " + std::to_string(i) + ": actor out of range";
    if (a.phase < 1 || a.phase > s.num_phases) return "step " + std::to_string(i) + ": bad phase";
    if (a.sources.empty()) return "step " + std::to_string(i) + ": no sources";
    for (int src : a.sources) {
      if (!in_world(src)) return "step " + std::to_string(i) + ": source out of range";
    }
    if (a.kind == StepKind::kCopy && a.sources.size() != 1) {
      return "step " + std::to_string(i) + ": a copy has exactly one source";
    }
    if (a.target != Target::kStaging) continue;
    // a writes slot[a.actor] over a.range: nobody else may touch that range of
    // that slot in the same phase.
    for (size_t j = 0; j < s.steps.size(); ++j) {
      const Step& b = s.steps[j];
      if (j == i || b.phase != a.phase || !overlaps(a.range, b.range)) continue;
      const bool b_writes = b.target == Target::kStaging && b.actor == a.actor;
      bool b_reads = false;
      for (int src : b.sources) b_reads = b_reads || src == a.actor;
      if (b_writes || (b_reads && b.actor != a.actor)) {
        return "phase " + std::to_string(a.phase) + ": step " + std::to_string(j) +
               " touches slot " + std::to_string(a.actor) + " while step " + std::to_string(i) +
               " writes it";
      }
    }
  }
  return {};
}

Schedule in_place_variant(const Schedule& s) {
  Schedule out = s;
  out.stagers.clear();  // inputs are read where they are
  out.steps.clear();
  for (const Step& step : s.steps) {
    if (step.kind == StepKind::kCopy && step.sources[0] == step.actor) continue;
    Step aliased = step;
    aliased.target = Target::kStaging;
    out.steps.push_back(aliased);
  }
  const std::string hazard = find_schedule_hazard(out);
  if (!hazard.empty()) {
    throw std::invalid_argument("schedule cannot run in place: " + hazard);
  }
  return out;
}

}  // namespace xdev::plan
