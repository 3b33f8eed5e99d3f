#include "device_program.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "shared_buffer_plan.h"

namespace xdev::plan {
namespace {

// Two ops of one rank and phase must not race on the rank's own slot; an op
// may read and write the same elements (an in-place reduce touches each
// element from one thread only). Phases hold an op per pack, and packs can
// number in the thousands, so the writes are sorted once and each read is
// looked up among them.
void check_phase(const std::vector<DeviceOp>& ops, size_t begin, size_t end, int rank) {
  std::vector<size_t> writes;  // ops that write the slot, by dst_offset
  for (size_t i = begin; i < end; ++i) {
    if (!ops[i].dst_is_output && ops[i].count > 0) writes.push_back(i);
  }
  std::sort(writes.begin(), writes.end(),
            [&](size_t a, size_t b) { return ops[a].dst_offset < ops[b].dst_offset; });
  for (size_t k = 1; k < writes.size(); ++k) {
    const DeviceOp& prev = ops[writes[k - 1]];
    if (ops[writes[k]].dst_offset < prev.dst_offset + prev.count) {
      throw std::invalid_argument("device program: two ops of rank " + std::to_string(rank) +
                                  " write one slot range in phase " + std::to_string(prev.phase));
    }
  }
  // The writes are disjoint now: those a read overlaps follow the first that
  // ends after the read begins.
  for (size_t j = begin; j < end; ++j) {
    const DeviceOp& r = ops[j];
    for (int s = 0; s < r.num_sources && r.count > 0; ++s) {
      if (r.sources[s] != rank) continue;
      const int64_t lo = r.src_offsets[s];
      const int64_t hi = lo + r.count;
      auto it = std::partition_point(writes.begin(), writes.end(), [&](size_t w) {
        return ops[w].dst_offset + ops[w].count <= lo;
      });
      for (; it != writes.end() && ops[*it].dst_offset < hi; ++it) {
        const bool in_place = *it == j && lo == r.dst_offset;
        if (!in_place) {
          throw std::invalid_argument("device program: rank " + std::to_string(rank) +
                                      " reads a slot range it writes in phase " +
                                      std::to_string(r.phase));
        }
      }
    }
  }
}

void check_limits(int world_size, int num_phases, int rank) {
  if (world_size > kMaxDeviceRanks) {
    throw std::invalid_argument("device program: at most " + std::to_string(kMaxDeviceRanks) +
                                " ranks; got " + std::to_string(world_size));
  }
  if (num_phases > kMaxDevicePhases) {
    throw std::invalid_argument("device program: at most " + std::to_string(kMaxDevicePhases) +
                                " phases; got " + std::to_string(num_phases));
  }
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("device program: rank out of range");
  }
}

void check_program(const DeviceProgram& p, int rank) {
  for (int phase = 0; phase <= p.num_phases; ++phase) {
    check_phase(p.ops, static_cast<size_t>(p.phase_begin[phase]),
                static_cast<size_t>(p.phase_begin[phase + 1]), rank);
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
  std::fill(op.src_offsets, op.src_offsets + op.num_sources, src_offset);
  op.dst_offset = dst_offset;
  op.count = count;
  return op;
}

}  // namespace

DeviceProgram compile_device_program(const WindowPlan& w, int rank) {
  const Schedule& sched = w.schedule;
  check_limits(sched.world_size, sched.num_phases, rank);
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
      op.src_offsets[0] = seg.payload_begin;
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
      // Output: the slot range maps back through the window's segments (in
      // ascending slot order), from the first that ends after the range begins.
      auto seg = std::partition_point(w.segments.begin(), w.segments.end(), [&](const Segment& x) {
        return x.slot_begin + x.count <= s.range.begin;
      });
      for (; seg != w.segments.end() && seg->slot_begin < s.range.end; ++seg) {
        const int64_t lo = std::max(s.range.begin, seg->slot_begin);
        const int64_t hi = std::min(s.range.end, seg->slot_begin + seg->count);
        if (hi <= lo) continue;
        p.ops.push_back(
            make_op(phase, s, lo, seg->payload_begin + (lo - seg->slot_begin), hi - lo, true));
      }
    }
    p.phase_begin.push_back(static_cast<int32_t>(p.ops.size()));
  }
  check_program(p, rank);
  return p;
}

DeviceProgram compile_gather_scatter_program(const GatherScatterPlan& plan, int64_t k, int rank) {
  const int world = plan.world_size();
  const GatherScatterWindow w = plan.window(k);
  const Schedule& sched = w.schedule;
  check_limits(world, sched.num_phases, rank);
  const bool reduce_scatter = plan.kind() == GatherScatterKind::kReduceScatter;
  const int64_t p = w.block.size();
  std::vector<int64_t> block_start(static_cast<size_t>(world), 0);  // in the full tensor
  for (int j = 1; j < world; ++j) {
    block_start[static_cast<size_t>(j)] =
        block_start[static_cast<size_t>(j - 1)] + plan.block_elems(j - 1);
  }
  // fn(j, x, n) for each part of slot range r that lies in rank j's piece.
  const auto for_each_piece = [p](Range r, auto&& fn) {
    for (int64_t j = r.begin / p; j * p < r.end; ++j) {
      const int64_t lo = std::max(r.begin, j * p);
      const int64_t hi = std::min(r.end, (j + 1) * p);
      if (hi > lo) fn(static_cast<int>(j), lo, hi - lo);
    }
  };
  // Slot coordinate x of rank j's piece, in the full tensor and in j's block.
  const auto in_full = [&](int j, int64_t x) {
    return block_start[static_cast<size_t>(j)] + w.block.begin + (x - j * p);
  };
  const auto in_block = [&](int j, int64_t x) { return w.block.begin + (x - j * p); };
  const auto in_input = [&](int j, int64_t x) {
    return reduce_scatter ? in_full(j, x) : in_block(j, x);
  };
  const auto in_output = [&](int j, int64_t x) {
    return reduce_scatter ? in_block(j, x) : in_full(j, x);
  };

  DeviceProgram prog;
  prog.num_phases = sched.num_phases;
  prog.phase_begin.push_back(0);
  for (const Range& r : sched.staged_ranges[static_cast<size_t>(rank)]) {
    for_each_piece(r, [&](int j, int64_t x, int64_t n) {
      DeviceOp op;
      op.num_sources = 1;
      op.sources[0] = kOwnInput;
      op.src_offsets[0] = in_input(j, x);
      op.dst_offset = plan.slot_memory_offset(rank, x, p);
      op.count = n;
      prog.ops.push_back(op);
    });
  }
  prog.phase_begin.push_back(static_cast<int32_t>(prog.ops.size()));
  for (int phase = 1; phase <= sched.num_phases; ++phase) {
    for (const Step& s : sched.steps) {
      if (s.actor != rank || s.phase != phase || s.range.empty()) continue;
      if (s.target != Target::kOutput || s.also_output ||
          static_cast<int>(s.sources.size()) > kMaxDeviceRanks || s.sources.empty()) {
        throw std::invalid_argument(
            "device program: a gather/scatter step writes the output from 1.." +
            std::to_string(kMaxDeviceRanks) + " sources");
      }
      for_each_piece(s.range, [&](int j, int64_t x, int64_t n) {
        DeviceOp op = make_op(phase, s, 0, in_output(j, x), n, true);
        for (int i = 0; i < op.num_sources; ++i) {
          const int src = op.sources[i];
          op.src_offsets[i] =
              src == kOwnInput ? in_input(j, x) : plan.slot_memory_offset(src, x, p);
        }
        prog.ops.push_back(op);
      });
    }
    prog.phase_begin.push_back(static_cast<int32_t>(prog.ops.size()));
  }
  check_program(prog, rank);
  return prog;
}

DeviceProgram compile_in_place_program(int64_t total, int64_t elem_bytes, int world_size,
                                       int rank) {
  constexpr int kPhases = 3;
  check_limits(world_size, kPhases, rank);
  const std::vector<Range> slices = shared_buffer_slices(total, elem_bytes, world_size);
  const auto copy_op = [](int phase, Range slice) {
    DeviceOp op;
    op.phase = phase;
    op.dst_is_output = 1;
    op.sources_are_copies = 1;
    op.dst_offset = slice.begin;
    op.count = slice.size();
    return op;
  };
  DeviceProgram p;
  p.num_phases = kPhases;
  p.phase_begin = {0, 0};  // phase 0: nothing to stage
  const Range mine = slices[static_cast<size_t>(rank)];
  if (!mine.empty()) {
    DeviceOp op = copy_op(1, mine);
    op.is_reduce = 1;
    op.finalize = 1;
    op.num_sources = world_size;
    for (int r = 0; r < world_size; ++r) {
      op.sources[r] = r;
      op.src_offsets[r] = mine.begin;
    }
    p.ops.push_back(op);
  }
  p.phase_begin.push_back(static_cast<int32_t>(p.ops.size()));
  for (int owner = 0; owner < world_size; ++owner) {
    const Range theirs = slices[static_cast<size_t>(owner)];
    if (owner == rank || theirs.empty()) continue;
    DeviceOp op = copy_op(2, theirs);
    op.num_sources = 1;
    op.sources[0] = owner;
    op.src_offsets[0] = theirs.begin;
    p.ops.push_back(op);
  }
  p.phase_begin.push_back(static_cast<int32_t>(p.ops.size()));
  p.phase_begin.push_back(static_cast<int32_t>(p.ops.size()));  // phase 3: the last barrier
  return p;
}

int device_blocks_per_rank(int multiprocessors, int ranks_on_gpu, int max_blocks) {
  const int share = multiprocessors / 2 / std::max(1, ranks_on_gpu);
  return std::max(1, std::min(share, max_blocks));
}

}  // namespace xdev::plan
