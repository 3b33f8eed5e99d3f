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
      if (src != kOwnInput && !in_world(src)) {
        return "step " + std::to_string(i) + ": source out of range";
      }
    }
    if (a.also_output && a.target != Target::kStaging) {
      return "step " + std::to_string(i) + ": also_output on a step that writes the output";
    }
    if (a.slot_owner >= 0 && (a.target != Target::kStaging || !in_world(a.slot_owner))) {
      return "step " + std::to_string(i) + ": slot_owner needs a staging target in range";
    }
    if (a.kind == StepKind::kCopy && a.sources.size() != 1) {
      return "step " + std::to_string(i) + ": a copy has exactly one source";
    }
    if (a.target != Target::kStaging) continue;
    // a writes that slot over a.range: nobody else may touch that range of it
    // in the same phase.
    const int slot = written_slot(a);
    for (size_t j = 0; j < s.steps.size(); ++j) {
      const Step& b = s.steps[j];
      if (j == i || b.phase != a.phase || !overlaps(a.range, b.range)) continue;
      const bool b_writes = b.target == Target::kStaging && written_slot(b) == slot;
      if (b_writes || (reads_slot(b, slot) && b.actor != a.actor)) {
        return "phase " + std::to_string(a.phase) + ": step " + std::to_string(j) +
               " touches slot " + std::to_string(slot) + " while step " + std::to_string(i) +
               " writes it";
      }
    }
  }
  return {};
}

namespace {

bool writes_output(const Step& s) {
  return s.target == Target::kOutput || s.also_output;
}

// Whether a step other than `self`, by `actor`, writes its slot (to_slot) or its
// output over r in a phase before `phase` (or up to and including it: inclusive).
bool actor_writes(const std::vector<Step>& steps, size_t self, int actor, bool to_slot, Range r,
                  int phase, bool inclusive) {
  for (size_t j = 0; j < steps.size(); ++j) {
    const Step& t = steps[j];
    if (j == self || t.actor != actor || !overlaps(t.range, r)) continue;
    if (t.phase > phase || (t.phase == phase && !inclusive)) continue;
    if (to_slot ? t.target == Target::kStaging : writes_output(t)) return true;
  }
  return false;
}

// Adds r to a sorted list of disjoint ranges, merging what touches it.
void add_range(std::vector<Range>& set, Range r) {
  if (r.empty()) return;
  std::vector<Range> merged;
  for (const Range& x : set) {
    if (x.end < r.begin || r.end < x.begin) {
      merged.push_back(x);
    } else {
      r = {std::min(r.begin, x.begin), std::max(r.end, x.end)};
    }
  }
  merged.push_back(r);
  std::sort(merged.begin(), merged.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  set = std::move(merged);
}

// Rewrite 1 of forward_own_input for the ranks marked in `forward`: reads of the
// actor's own slot that still holds its staged input, while its tensor is still
// untouched, read the tensor.
std::vector<Step> forward_reads(const Schedule& s, const std::vector<char>& forward) {
  std::vector<Step> steps = s.steps;
  for (size_t i = 0; i < steps.size(); ++i) {
    Step& step = steps[i];
    for (int& src : step.sources) {
      if (src != step.actor || !forward[static_cast<size_t>(src)]) continue;
      if (actor_writes(s.steps, i, step.actor, true, step.range, step.phase, false)) continue;
      if (actor_writes(s.steps, i, step.actor, false, step.range, step.phase, true)) continue;
      src = kOwnInput;
    }
  }
  return steps;
}

// Rewrite 3: a stager stages what is read from its slot before it writes there.
std::vector<std::vector<Range>> ranges_to_stage(const Schedule& s, const std::vector<Step>& steps) {
  std::vector<std::vector<Range>> staged(static_cast<size_t>(s.world_size));
  for (const Step& step : steps) {
    for (int src : step.sources) {
      if (src == kOwnInput ||
          std::find(s.stagers.begin(), s.stagers.end(), src) == s.stagers.end()) {
        continue;
      }
      std::vector<Range> pristine{step.range};
      for (const Step& t : steps) {
        if (t.actor != src || t.target != Target::kStaging || t.phase >= step.phase) continue;
        std::vector<Range> rest;
        for (const Range& p : pristine) {
          if (!overlaps(p, t.range)) {
            rest.push_back(p);
            continue;
          }
          if (p.begin < t.range.begin) rest.push_back({p.begin, t.range.begin});
          if (t.range.end < p.end) rest.push_back({t.range.end, p.end});
        }
        pristine = std::move(rest);
      }
      for (const Range& p : pristine) add_range(staged[static_cast<size_t>(src)], p);
    }
  }
  return staged;
}

int64_t total_size(const std::vector<Range>& ranges) {
  int64_t total = 0;
  for (const Range& r : ranges) total += r.size();
  return total;
}

void check_own_slots_only(const Schedule& s, const char* what) {
  for (const Step& step : s.steps) {
    if (step.slot_owner >= 0) {
      throw std::invalid_argument(std::string(what) +
                                  ": a step already writes another rank's slot");
    }
  }
}

}  // namespace

Schedule forward_own_input(const Schedule& s) {
  check_own_slots_only(s, "forward_own_input");
  const auto n = static_cast<size_t>(s.world_size);
  Schedule out = s;
  std::vector<char> forward(n, 1);
  std::vector<Step>& steps = out.steps;
  steps = forward_reads(s, forward);
  // Staging runs on every rank at once, so a window's staging takes as long as
  // its busiest stager's. A rank that would stage less than half of that (the
  // reduce-to-one root, which would stage nothing) gains nothing while it
  // waits, and would pay for reading its tensor from memory later, in a phase
  // the others wait for. Such ranks keep staging and reading their slots.
  std::vector<std::vector<Range>> staged = ranges_to_stage(s, steps);
  int64_t busiest = 0;
  for (const auto& ranges : staged) busiest = std::max(busiest, total_size(ranges));
  bool changed = false;
  for (size_t r = 0; r < n; ++r) {
    if (2 * total_size(staged[r]) < busiest) {
      forward[r] = 0;
      changed = true;
    }
  }
  if (changed) steps = forward_reads(s, forward);
  // 2. A copy of the actor's own slot into its output joins the step that last
  // wrote that slot range, unless the tensor is read or written in between.
  std::vector<char> dropped(steps.size(), 0);
  for (size_t c = 0; c < steps.size(); ++c) {
    const Step& copy = steps[c];
    if (copy.kind != StepKind::kCopy || copy.target != Target::kOutput) continue;
    if (copy.sources[0] == kOwnInput) {  // the tensor onto itself
      dropped[c] = 1;
      continue;
    }
    if (copy.sources[0] != copy.actor) continue;
    size_t writer = steps.size();
    for (size_t j = 0; j < steps.size(); ++j) {
      const Step& t = steps[j];
      if (t.actor != copy.actor || t.target != Target::kStaging || t.phase >= copy.phase ||
          !overlaps(t.range, copy.range)) {
        continue;
      }
      if (writer == steps.size() || t.phase > steps[writer].phase) writer = j;
    }
    if (writer == steps.size() || !(steps[writer].range == copy.range)) continue;
    bool tensor_busy = false;
    for (size_t j = 0; j < steps.size() && !tensor_busy; ++j) {
      const Step& t = steps[j];
      if (j == c || j == writer || t.actor != copy.actor || !overlaps(t.range, copy.range) ||
          t.phase < steps[writer].phase) {
        continue;
      }
      tensor_busy = (reads_own_input(t) || writes_output(t)) && t.phase <= copy.phase;
      // The slot range must keep the writer's values until the copy.
      tensor_busy = tensor_busy || (t.target == Target::kStaging && t.phase < copy.phase);
    }
    if (tensor_busy) continue;
    steps[writer].also_output = true;
    dropped[c] = 1;
  }
  std::vector<Step> kept;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (!dropped[i]) kept.push_back(steps[i]);
  }
  steps = std::move(kept);
  out.staged_ranges = ranges_to_stage(s, steps);
  out.stagers.clear();
  for (int r = 0; r < s.world_size; ++r) {
    if (!out.staged_ranges[static_cast<size_t>(r)].empty()) out.stagers.push_back(r);
  }
  return out;
}

Schedule hand_back_totals(const Schedule& s) {
  check_own_slots_only(s, "hand_back_totals");
  Schedule out = s;
  std::vector<Step>& steps = out.steps;
  // Whether a step other than steps[except] reads or writes slot `rank` over r.
  const auto others_touch = [&](int rank, Range r, size_t except) {
    for (size_t j = 0; j < steps.size(); ++j) {
      const Step& t = steps[j];
      if (j == except || !overlaps(t.range, r)) continue;
      if (reads_slot(t, rank) || (t.target == Target::kStaging && written_slot(t) == rank)) {
        return true;
      }
    }
    return false;
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    Step& total = steps[i];
    if (total.kind != StepKind::kReduce || total.target != Target::kStaging) continue;
    // The one later reader of the total: a copy by another rank.
    size_t reader = steps.size();
    bool single = true;
    for (size_t j = 0; j < steps.size() && single; ++j) {
      const Step& t = steps[j];
      if (j == i || t.phase <= total.phase || !overlaps(t.range, total.range)) continue;
      if (!reads_slot(t, total.actor)) continue;
      single = reader == steps.size();
      reader = j;
    }
    if (!single || reader == steps.size()) continue;
    Step& copy = steps[reader];
    const int back_to = copy.actor;
    if (copy.kind != StepKind::kCopy || back_to == total.actor || !(copy.range == total.range)) {
      continue;
    }
    // The reader's slot carries its input to the total, then the total to the
    // copy, and nothing else.
    if (!reads_slot(total, back_to) || others_touch(back_to, total.range, i)) continue;
    total.slot_owner = back_to;
    copy.sources = {back_to};
  }
  return out;
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
