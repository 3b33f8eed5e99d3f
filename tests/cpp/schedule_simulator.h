// A symbolic simulator for Schedules, shared by the schedule and plan tests: it runs a Schedule
// on values that record *which ranks* were summed into each element and *how often* a finalize
// step produced it, so "every rank ends with the full sum, reduced exactly once" is checked
// exactly, with no floating point in the way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "plan/packing.h"
#include "plan/schedule.h"

// Inside xdev::plan so that the plan's names read unqualified, as in the tests.
namespace xdev::plan::simulator {

// One element's symbolic content. mask == 0 means "never written" (garbage).
struct Value {
  uint64_t mask = 0;  // bit r: rank r's input is summed in
  int finalized = 0;  // finalize reduce steps that produced it (AVG divides there)
};

inline bool operator==(const Value& a, const Value& b) {
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

inline std::string where(int phase, size_t step, int64_t element) {
  return "phase " + std::to_string(phase) + " step " + std::to_string(step) + " element " +
         std::to_string(element) + ": ";
}

// Executes s over a window of `elems` elements the way the backend does: phase 0 stages the
// stagers' inputs (only their staged_ranges when the schedule has them); within a phase steps run
// concurrently, so they all read the slots and tensors as they were when the phase began, and
// their writes land together when it ends.
inline SimState simulate(const Schedule& s, int64_t elems) {
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
inline std::string check_allreduce(const Schedule& s, int64_t elems) {
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
inline std::string check_broadcast(const Schedule& s, int64_t elems, int root) {
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

inline std::vector<PackSlice> slices_of(const std::vector<Range>& packs, int64_t first_id) {
  std::vector<PackSlice> slices;
  for (size_t i = 0; i < packs.size(); ++i) {
    slices.push_back({first_id + static_cast<int64_t>(i), packs[i]});
  }
  return slices;
}

inline std::vector<Range> equal_packs(int64_t total, int64_t num_packs) {
  PackingOptions o;
  o.num_packs = num_packs;
  return make_packs(FlatLayout({total}), 4, o);
}

inline constexpr char kOk[] = "";  // what the checks return when all is well

inline Step make_step(StepKind kind, int phase, int actor, std::vector<int> sources, Target target,
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
inline Schedule hand_reduce_to_one() {
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

inline bool reports(const std::string& error, const char* what) {
  return error.find(what) != std::string::npos;
}

}  // namespace xdev::plan::simulator
