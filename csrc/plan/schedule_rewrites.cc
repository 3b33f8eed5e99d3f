// The schedule hazard check and the rewrites for particular executors
// (forward_own_input, hand_back_totals, in_place_variant; see schedule.h).
//
// Each of them asks, for every step, which other steps touch the same element
// range. A hierarchical schedule has about 2 + world steps per pack, and packs
// can number in the thousands (bytes_per_pack, or one pack per tensor of a
// coalesced call), so comparing every pair of steps took seconds. Steps are
// found through an index of their ranges instead: one query costs a binary
// search plus the steps it visits, which for pack-shaped schedules are the few
// steps of the same pack.
#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "schedule.h"

namespace xdev::plan {
namespace {

// The steps of one schedule in order of where their ranges begin. It reads
// only the ranges, so the steps' other fields may change while it is in use.
class StepsByRange {
 public:
  explicit StepsByRange(const std::vector<Step>& steps) : steps_(steps), order_(steps.size()) {
    std::iota(order_.begin(), order_.end(), size_t{0});
    std::sort(order_.begin(), order_.end(),
              [&](size_t a, size_t b) { return steps[a].range.begin < steps[b].range.begin; });
    reach_.reserve(order_.size());
    int64_t reach = std::numeric_limits<int64_t>::min();
    for (size_t i : order_) {
      reach = std::max(reach, steps[i].range.end);
      reach_.push_back(reach);
    }
  }

  // Calls fn(i) for every step i whose range overlaps r (begins before r ends
  // and ends after r begins), in no particular order. Visits the steps that
  // begin before r ends, from the last back to the first whose predecessors
  // all end before r begins.
  template <typename Fn>
  void for_each_overlapping(Range r, Fn&& fn) const {
    auto it = std::partition_point(order_.begin(), order_.end(),
                                   [&](size_t i) { return steps_[i].range.begin < r.end; });
    for (auto k = static_cast<size_t>(it - order_.begin()); k > 0 && reach_[k - 1] > r.begin;) {
      const size_t i = order_[--k];
      if (steps_[i].range.end > r.begin) fn(i);
    }
  }

 private:
  const std::vector<Step>& steps_;
  std::vector<size_t> order_;   // step indices by range.begin
  std::vector<int64_t> reach_;  // reach_[k]: the largest range.end among order_[0..k]
};

}  // namespace

std::string find_schedule_hazard(const Schedule& s) {
  const auto in_world = [&](int r) { return r >= 0 && r < s.world_size; };
  const StepsByRange by_range(s.steps);
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
    // in the same phase. The first such step is reported.
    const int slot = written_slot(a);
    size_t first = s.steps.size();
    by_range.for_each_overlapping(a.range, [&](size_t j) {
      const Step& b = s.steps[j];
      if (j == i || j >= first || b.phase != a.phase) return;
      const bool b_writes = b.target == Target::kStaging && written_slot(b) == slot;
      if (b_writes || (reads_slot(b, slot) && b.actor != a.actor)) first = j;
    });
    if (first != s.steps.size()) {
      return "phase " + std::to_string(a.phase) + ": step " + std::to_string(first) +
             " touches slot " + std::to_string(slot) + " while step " + std::to_string(i) +
             " writes it";
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
bool actor_writes(const std::vector<Step>& steps, const StepsByRange& by_range, size_t self,
                  int actor, bool to_slot, Range r, int phase, bool inclusive) {
  bool found = false;
  by_range.for_each_overlapping(r, [&](size_t j) {
    const Step& t = steps[j];
    if (found || j == self || t.actor != actor) return;
    if (t.phase > phase || (t.phase == phase && !inclusive)) return;
    found = to_slot ? t.target == Target::kStaging : writes_output(t);
  });
  return found;
}

// The part of r that none of `cuts` covers, appended to `out` in pieces.
void append_uncovered(Range r, std::vector<Range> cuts, std::vector<Range>& out) {
  std::sort(cuts.begin(), cuts.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  int64_t at = r.begin;
  for (const Range& cut : cuts) {
    if (cut.begin > at) out.push_back({at, std::min(cut.begin, r.end)});
    at = std::max(at, cut.end);
  }
  if (at < r.end) out.push_back({at, r.end});
}

// Sorts ranges and merges those that overlap or touch.
std::vector<Range> merged(std::vector<Range> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<Range> out;
  for (const Range& r : ranges) {
    if (r.empty()) continue;
    if (!out.empty() && r.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, r.end);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// Rewrite 1 of forward_own_input for the ranks marked in `forward`: reads of the
// actor's own slot that still holds its staged input, while its tensor is still
// untouched, read the tensor.
std::vector<Step> forward_reads(const Schedule& s, const std::vector<char>& forward) {
  const StepsByRange by_range(s.steps);
  std::vector<Step> steps = s.steps;
  for (size_t i = 0; i < steps.size(); ++i) {
    Step& step = steps[i];
    for (int& src : step.sources) {
      if (src != step.actor || !forward[static_cast<size_t>(src)]) continue;
      if (actor_writes(s.steps, by_range, i, step.actor, true, step.range, step.phase, false)) {
        continue;
      }
      if (actor_writes(s.steps, by_range, i, step.actor, false, step.range, step.phase, true)) {
        continue;
      }
      src = kOwnInput;
    }
  }
  return steps;
}

// Rewrite 3: a stager stages what is read from its slot before it writes there.
std::vector<std::vector<Range>> ranges_to_stage(const Schedule& s, const std::vector<Step>& steps) {
  const auto n = static_cast<size_t>(s.world_size);
  std::vector<char> stages(n, 0);
  for (int r : s.stagers) {
    if (r >= 0 && r < s.world_size) stages[static_cast<size_t>(r)] = 1;
  }
  const auto stager = [&](int r) {
    return r >= 0 && r < s.world_size && stages[static_cast<size_t>(r)];
  };
  const StepsByRange by_range(steps);
  std::vector<std::vector<Range>> pieces(n);
  // overwritten[r]: what stager r wrote over its slot, in the step's range, in an
  // earlier phase than the step's: that part no longer holds its input. One pass
  // over the overlapping steps serves all of a step's sources (a flat allreduce
  // step reads from every rank).
  std::vector<std::vector<Range>> overwritten(n);
  std::vector<int> written;  // the ranks whose overwritten[] this step filled
  for (const Step& step : steps) {
    if (std::none_of(step.sources.begin(), step.sources.end(), stager)) continue;
    by_range.for_each_overlapping(step.range, [&](size_t j) {
      const Step& t = steps[j];
      if (t.target != Target::kStaging || t.phase >= step.phase || !stager(t.actor)) return;
      std::vector<Range>& ranges = overwritten[static_cast<size_t>(t.actor)];
      if (ranges.empty()) written.push_back(t.actor);
      ranges.push_back(t.range);
    });
    for (int src : step.sources) {
      if (!stager(src)) continue;
      append_uncovered(step.range, overwritten[static_cast<size_t>(src)],
                       pieces[static_cast<size_t>(src)]);
    }
    for (int r : written) overwritten[static_cast<size_t>(r)].clear();
    written.clear();
  }
  std::vector<std::vector<Range>> staged(n);
  for (size_t r = 0; r < n; ++r) staged[r] = merged(std::move(pieces[r]));
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
  // Copies are taken in order: a fold marks its writer also_output, which the
  // later copies' checks see.
  const StepsByRange by_range(steps);
  std::vector<char> dropped(steps.size(), 0);
  for (size_t c = 0; c < steps.size(); ++c) {
    const Step& copy = steps[c];
    if (copy.kind != StepKind::kCopy || copy.target != Target::kOutput) continue;
    if (copy.sources[0] == kOwnInput) {  // the tensor onto itself
      dropped[c] = 1;
      continue;
    }
    if (copy.sources[0] != copy.actor) continue;
    // The writer: the latest phase's, and of those the first listed.
    size_t writer = steps.size();
    by_range.for_each_overlapping(copy.range, [&](size_t j) {
      const Step& t = steps[j];
      if (t.actor != copy.actor || t.target != Target::kStaging || t.phase >= copy.phase) return;
      if (writer == steps.size() || t.phase > steps[writer].phase ||
          (t.phase == steps[writer].phase && j < writer)) {
        writer = j;
      }
    });
    if (writer == steps.size() || !(steps[writer].range == copy.range)) continue;
    bool tensor_busy = false;
    by_range.for_each_overlapping(copy.range, [&](size_t j) {
      const Step& t = steps[j];
      if (j == c || j == writer || t.actor != copy.actor || t.phase < steps[writer].phase) return;
      if ((reads_own_input(t) || writes_output(t)) && t.phase <= copy.phase) tensor_busy = true;
      // The slot range must keep the writer's values until the copy.
      if (t.target == Target::kStaging && t.phase < copy.phase) tensor_busy = true;
    });
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
  // Totals are taken in order; a hand-back changes the sources and slot of two
  // steps, which the later totals' checks see.
  const StepsByRange by_range(steps);
  // Whether a step other than steps[except] reads or writes slot `rank` over r.
  const auto others_touch = [&](int rank, Range r, size_t except) {
    bool touched = false;
    by_range.for_each_overlapping(r, [&](size_t j) {
      const Step& t = steps[j];
      if (j == except) return;
      if (reads_slot(t, rank) || (t.target == Target::kStaging && written_slot(t) == rank)) {
        touched = true;
      }
    });
    return touched;
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    Step& total = steps[i];
    if (total.kind != StepKind::kReduce || total.target != Target::kStaging) continue;
    // The one later reader of the total: a copy by another rank.
    size_t reader = steps.size();
    int readers = 0;
    by_range.for_each_overlapping(total.range, [&](size_t j) {
      const Step& t = steps[j];
      if (j == i || t.phase <= total.phase || !reads_slot(t, total.actor)) return;
      ++readers;
      reader = j;
    });
    if (readers != 1) continue;
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
