#include "device_program.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace xdev::plan {
namespace {

bool overlaps(int64_t a, int64_t a_count, int64_t b, int64_t b_count) {
  return a < b + b_count && b < a + a_count;
}

bool reads_own_slot(const DeviceOp& op, int rank) {
  return std::find(op.sources, op.sources + op.num_sources, rank) != op.sources + op.num_sources;
}

// Two ops of one rank and phase must not race on the rank's own slot; an op
// may read and write the same elements (an in-place reduce touches each
// element from one thread only).
void check_phase(const std::vector<DeviceOp>& ops, size_t begin, size_t end, int rank) {
  for (size_t i = begin; i < end; ++i) {
    const DeviceOp& w = ops[i];
    if (w.dst_is_output) continue;
    for (size_t j = begin; j < end; ++j) {
      const DeviceOp& r = ops[j];
      const bool same_op = i == j;
      if (!same_op && !r.dst_is_output && overlaps(w.dst_offset, w.count, r.dst_offset, r.count)) {
        throw std::invalid_argument("device program: two ops of rank " + std::to_string(rank) +
                                    " write one slot range in phase " + std::to_string(w.phase));
      }
      if (!reads_own_slot(r, rank)) continue;
      const bool in_place = same_op && r.src_offset == w.dst_offset;
      if (!in_place && overlaps(w.dst_offset, w.count, r.src_offset, r.count)) {
        throw std::invalid_argument("device program: rank " + std::to_string(rank) +
                                    " reads a slot range it writes in phase " +
                                    std::to_string(w.phase));
      }
    }
  }
}

DeviceOp make_op(int phase, const Step& s, int64_t src_offset, int64_t dst_offset, int64_t count,
                 bool to_output) {
  DeviceOp op;
  op.phase = phase;
  op.is_reduce = s.kind == StepKind::kReduce ? 1 : 0;
  op.finalize = s.finalize ? 1 : 0;
  op.dst_is_output = to_output ? 1 : 0;
  op.num_sources = static_cast<int32_t>(s.sources.size());
  std::copy(s.sources.begin(), s.sources.end(), op.sources);
  op.src_offset = src_offset;
  op.dst_offset = dst_offset;
  op.count = count;
  return op;
}

}  // namespace

DeviceProgram compile_device_program(const WindowPlan& w, int rank) {
  const Schedule& sched = w.schedule;
  if (sched.world_size > kMaxDeviceRanks) {
    throw std::invalid_argument("device program: at most " + std::to_string(kMaxDeviceRanks) +
                                " ranks; got " + std::to_string(sched.world_size));
  }
  if (sched.num_phases > kMaxDevicePhases) {
    throw std::invalid_argument("device program: at most " + std::to_string(kMaxDevicePhases) +
                                " phases; got " + std::to_string(sched.num_phases));
  }
  if (rank < 0 || rank >= sched.world_size) {
    throw std::invalid_argument("device program: rank out of range");
  }
  // The GPU window kernel stages whole windows and has one destination per op.
  bool forwarded = !sched.staged_ranges.empty();
  for (const Step& s : sched.steps) {
    forwarded = forwarded || s.also_output || reads_own_input(s) || s.slot_owner >= 0;
  }
  if (forwarded) {
    throw std::invalid_argument(
        "device program: schedules in forward_own_input or hand_back_totals form run on the CPU "
        "executor only");
  }
  DeviceProgram p;
  p.num_phases = sched.num_phases;
  p.phase_begin.push_back(0);

  // Phase 0: stage this rank's payload pieces into its slot.
  if (std::find(sched.stagers.begin(), sched.stagers.end(), rank) != sched.stagers.end()) {
    for (const Segment& seg : w.segments) {
      if (seg.count == 0) continue;
      DeviceOp op;
      op.phase = 0;
      op.num_sources = 1;
      op.sources[0] = kOwnInput;
      op.src_offset = seg.payload_begin;
      op.dst_offset = seg.slot_begin;
      op.count = seg.count;
      p.ops.push_back(op);
    }
  }
  p.phase_begin.push_back(static_cast<int32_t>(p.ops.size()));

  for (int phase = 1; phase <= sched.num_phases; ++phase) {
    for (const Step& s : sched.steps) {
      if (s.actor != rank || s.phase != phase || s.range.empty()) continue;
      if (static_cast<int>(s.sources.size()) > kMaxDeviceRanks || s.sources.empty()) {
        throw std::invalid_argument("device program: a step needs 1.." +
                                    std::to_string(kMaxDeviceRanks) + " sources");
      }
      if (s.target == Target::kStaging) {
        // A copy of the actor's own slot onto itself moves nothing.
        if (s.kind == StepKind::kCopy && s.sources[0] == rank) continue;
        p.ops.push_back(make_op(phase, s, s.range.begin, s.range.begin, s.range.size(), false));
        continue;
      }
      // Output: the slot range maps back through the window's segments.
      for (const Segment& seg : w.segments) {
        const int64_t lo = std::max(s.range.begin, seg.slot_begin);
        const int64_t hi = std::min(s.range.end, seg.slot_begin + seg.count);
        if (hi <= lo) continue;
        p.ops.push_back(
            make_op(phase, s, lo, seg.payload_begin + (lo - seg.slot_begin), hi - lo, true));
      }
    }
    p.phase_begin.push_back(static_cast<int32_t>(p.ops.size()));
  }
  for (int phase = 0; phase <= p.num_phases; ++phase) {
    check_phase(p.ops, static_cast<size_t>(p.phase_begin[phase]),
                static_cast<size_t>(p.phase_begin[phase + 1]), rank);
  }
  return p;
}

int device_blocks_per_rank(int multiprocessors, int ranks_on_gpu, int max_blocks) {
  const int share = multiprocessors / 2 / std::max(1, ranks_on_gpu);
  return std::max(1, std::min(share, max_blocks));
}

}  // namespace xdev::plan
