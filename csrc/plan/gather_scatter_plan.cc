#include "gather_scatter_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace xdev::plan {
namespace {

Schedule one_phase_schedule(int world_size) {
  if (world_size < 1) {
    throw std::invalid_argument("world_size must be >= 1; got " + std::to_string(world_size));
  }
  Schedule s;
  s.world_size = world_size;
  s.num_phases = 1;
  s.staged_ranges.resize(static_cast<size_t>(world_size));
  return s;
}

// Rank r's piece in slot coordinates: lengths[r] elements from r * piece.
Range piece_of(int rank, int64_t piece, const std::vector<int64_t>& lengths) {
  const int64_t length = lengths[static_cast<size_t>(rank)];
  if (length < 0 || length > piece) {
    throw std::invalid_argument("gather/scatter schedule: piece length " + std::to_string(length) +
                                " outside [0, " + std::to_string(piece) + "]");
  }
  return {rank * piece, rank * piece + length};
}

// Ranks with anything to stage, from staged_ranges.
void set_stagers(Schedule& s) {
  for (int r = 0; r < s.world_size; ++r) {
    if (!s.staged_ranges[static_cast<size_t>(r)].empty()) s.stagers.push_back(r);
  }
}

}  // namespace

const char* to_string(GatherScatterKind k) {
  return k == GatherScatterKind::kReduceScatter ? "reduce_scatter" : "all_gather";
}

Schedule reduce_scatter_schedule(int world_size, int64_t piece) {
  return reduce_scatter_schedule(piece,
                                 std::vector<int64_t>(static_cast<size_t>(world_size), piece));
}

Schedule reduce_scatter_schedule(int64_t piece, const std::vector<int64_t>& lengths) {
  const int world_size = static_cast<int>(lengths.size());
  Schedule s = one_phase_schedule(world_size);
  for (int r = 0; r < world_size; ++r) {
    const Range mine = piece_of(r, piece, lengths);
    if (mine.empty()) continue;
    // Everyone else stages its part of r's piece; r reads its own from its tensor.
    std::vector<int> sources;
    for (int src = 0; src < world_size; ++src) {
      sources.push_back(src == r ? kOwnInput : src);
      if (src != r) s.staged_ranges[static_cast<size_t>(src)].push_back(mine);
    }
    s.steps.push_back(reduce_step(1, r, sources, Target::kOutput, mine, true));
  }
  set_stagers(s);
  return s;
}

Schedule all_gather_schedule(int world_size, int64_t piece) {
  return all_gather_schedule(piece, std::vector<int64_t>(static_cast<size_t>(world_size), piece));
}

Schedule all_gather_schedule(int64_t piece, const std::vector<int64_t>& lengths) {
  const int world_size = static_cast<int>(lengths.size());
  Schedule s = one_phase_schedule(world_size);
  for (int owner = 0; owner < world_size; ++owner) {
    const Range theirs = piece_of(owner, piece, lengths);
    if (theirs.empty()) continue;
    if (world_size > 1) s.staged_ranges[static_cast<size_t>(owner)].push_back(theirs);
    for (int r = 0; r < world_size; ++r) {
      s.steps.push_back(copy_step(1, r, r == owner ? kOwnInput : owner, Target::kOutput, theirs));
    }
  }
  set_stagers(s);
  return s;
}

GatherScatterPlan::GatherScatterPlan(GatherScatterKind kind, int world_size, int64_t block_elems,
                                     int64_t slot_elems)
    : GatherScatterPlan(
          kind, std::vector<int64_t>(static_cast<size_t>(std::max(world_size, 0)), block_elems),
          slot_elems) {}

GatherScatterPlan::GatherScatterPlan(GatherScatterKind kind, std::vector<int64_t> rank_block_elems,
                                     int64_t slot_elems)
    : kind_(kind),
      world_size_(static_cast<int>(rank_block_elems.size())),
      rank_block_elems_(std::move(rank_block_elems)) {
  if (world_size_ < 1) {
    throw std::invalid_argument("GatherScatterPlan: world_size must be >= 1; got " +
                                std::to_string(world_size_));
  }
  for (int64_t c : rank_block_elems_) {
    if (c < 0) throw std::invalid_argument("GatherScatterPlan: negative block_elems");
    block_elems_ = std::max(block_elems_, c);
  }
  if (slot_elems < world_size_) {
    throw std::invalid_argument("GatherScatterPlan: a slot of " + std::to_string(slot_elems) +
                                " element(s) cannot hold one element of each of " +
                                std::to_string(world_size_) + " ranks");
  }
  piece_elems_ = kind == GatherScatterKind::kAllGather || world_size_ == 1
                     ? slot_elems
                     : slot_elems / (world_size_ - 1);
  // A reduce-scatter of several windows: windows and the pieces in a slot
  // then start at multiples of 16 elements (16 bytes at least, given aligned
  // slots and tensors), which the vector loops of the reductions need to run
  // whole. A block that fits one window keeps it (the single-copy form needs
  // exactly one).
  if (kind == GatherScatterKind::kReduceScatter && piece_elems_ < block_elems_ &&
      piece_elems_ > kPieceAlignElems) {
    piece_elems_ -= piece_elems_ % kPieceAlignElems;
  }
  // Rounded up without the sum, which overflows for blocks near 2^63.
  num_windows_ = block_elems_ / piece_elems_ + (block_elems_ % piece_elems_ != 0 ? 1 : 0);
}

GatherScatterWindow GatherScatterPlan::window(int64_t k) const {
  if (k < 0 || k >= num_windows_) throw std::out_of_range("GatherScatterPlan::window");
  GatherScatterWindow w;
  w.block = {k * piece_elems_, std::min(block_elems_, (k + 1) * piece_elems_)};
  std::vector<int64_t> lengths;
  for (int64_t c : rank_block_elems_) {
    lengths.push_back(std::clamp<int64_t>(c - w.block.begin, 0, w.block.size()));
  }
  w.schedule = kind_ == GatherScatterKind::kReduceScatter
                   ? reduce_scatter_schedule(w.block.size(), lengths)
                   : all_gather_schedule(w.block.size(), lengths);
  return w;
}

}  // namespace xdev::plan
