#include "gather_scatter_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

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

Range piece_of(int rank, int64_t piece) {
  return {rank * piece, (rank + 1) * piece};
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
  Schedule s = one_phase_schedule(world_size);
  if (piece <= 0) return s;
  for (int r = 0; r < world_size; ++r) {
    std::vector<Range>& staged = s.staged_ranges[static_cast<size_t>(r)];
    // Everything but its own piece, which only r reads, from its tensor.
    if (r > 0) staged.push_back({0, r * piece});
    if (r + 1 < world_size) staged.push_back({(r + 1) * piece, world_size * piece});
    std::vector<int> sources;
    for (int src = 0; src < world_size; ++src) sources.push_back(src == r ? kOwnInput : src);
    s.steps.push_back(reduce_step(1, r, sources, Target::kOutput, piece_of(r, piece), true));
  }
  set_stagers(s);
  return s;
}

Schedule all_gather_schedule(int world_size, int64_t piece) {
  Schedule s = one_phase_schedule(world_size);
  if (piece <= 0) return s;
  for (int r = 0; r < world_size; ++r) {
    if (world_size > 1) s.staged_ranges[static_cast<size_t>(r)].push_back(piece_of(r, piece));
    for (int owner = 0; owner < world_size; ++owner) {
      s.steps.push_back(
          copy_step(1, r, owner == r ? kOwnInput : owner, Target::kOutput, piece_of(owner, piece)));
    }
  }
  set_stagers(s);
  return s;
}

GatherScatterPlan::GatherScatterPlan(GatherScatterKind kind, int world_size, int64_t block_elems,
                                     int64_t slot_elems)
    : kind_(kind), world_size_(world_size), block_elems_(block_elems) {
  if (world_size < 1) {
    throw std::invalid_argument("GatherScatterPlan: world_size must be >= 1; got " +
                                std::to_string(world_size));
  }
  if (block_elems < 0) throw std::invalid_argument("GatherScatterPlan: negative block_elems");
  if (slot_elems < world_size) {
    throw std::invalid_argument("GatherScatterPlan: a slot of " + std::to_string(slot_elems) +
                                " element(s) cannot hold one element of each of " +
                                std::to_string(world_size) + " ranks");
  }
  piece_elems_ = slot_elems / world_size;
  num_windows_ = (block_elems + piece_elems_ - 1) / piece_elems_;
}

GatherScatterWindow GatherScatterPlan::window(int64_t k) const {
  if (k < 0 || k >= num_windows_) throw std::out_of_range("GatherScatterPlan::window");
  GatherScatterWindow w;
  w.block = {k * piece_elems_, std::min(block_elems_, (k + 1) * piece_elems_)};
  w.schedule = kind_ == GatherScatterKind::kReduceScatter
                   ? reduce_scatter_schedule(world_size_, w.block.size())
                   : all_gather_schedule(world_size_, w.block.size());
  return w;
}

}  // namespace xdev::plan
