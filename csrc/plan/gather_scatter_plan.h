// Reduce-scatter and all-gather over staging slots, as windowed schedules.
//
// Words used here. A rank's *block* is its share of the collective: the C
// elements a reduce-scatter leaves on it, or an all-gather takes from it. The
// *full* tensor holds the blocks of all N ranks in rank order (a
// reduce-scatter's input, an all-gather's output). With several tensors
// (the coalesced forms) a rank's block is the concatenation of each tensor's
// block, in call order; FlatLayout says which tensor holds which part.
//
// A *window* covers the same block elements [a, b) of every rank. In its slot
// coordinates (the Schedule's ranges) rank j's piece of the window lies at
// [j*p, (j+1)*p), p = b - a. A reduce-scatter stages into its slot the N-1
// pieces its peers reduce (its own it reads from its input), packed in rank
// order (slot_memory_offset), so p is at most slot_elems / (N-1); an
// all-gather's slot only ever holds its owner's piece, at the slot's start,
// so there p may fill the slot. Fewer, larger windows: each costs a barrier.
//
// Blocks may differ in size between ranks (the list forms with uneven
// sizes): rank j's block holds C_j elements, a window still covers [a, b) of
// every block, and rank j's piece is the part of it below C_j, possibly empty,
// still at slot offset j*p.
//
// These are the two halves of the flat allreduce (schedule.h): a
// reduce-scatter is its phase 1 with the totals going to the output, an
// all-gather its phase 2. Sums take their sources in rank order, as flat does,
// so a reduce-scatter's block j is bitwise the slice j of flat's allreduce of
// the same inputs.
#pragma once

#include <cstdint>
#include <vector>

#include "schedule.h"

namespace xdev::plan {

enum class GatherScatterKind { kReduceScatter, kAllGather };

const char* to_string(GatherScatterKind k);

// One window of a reduce-scatter, in slot coordinates of pieces of p elements.
// Every rank stages the pieces its peers reduce (all but its own, phase 0);
// rank r reduces piece r over all ranks in rank order, reading its own
// contribution from its input tensor (kOwnInput), into its output (phase 1).
// One barrier per window.
Schedule reduce_scatter_schedule(int world_size, int64_t piece);
// The same with rank j's piece of lengths[j] <= piece elements at [j*piece, ...).
Schedule reduce_scatter_schedule(int64_t piece, const std::vector<int64_t>& lengths);

// One window of an all-gather: every rank stages its own piece (phase 0), then
// copies every rank's piece into its output, its own straight from its input
// (phase 1). One barrier per window.
Schedule all_gather_schedule(int world_size, int64_t piece);
Schedule all_gather_schedule(int64_t piece, const std::vector<int64_t>& lengths);

struct GatherScatterWindow {
  Range block;        // block elements [a, b) of every rank that this window moves
  Schedule schedule;  // rank j's piece at slot offsets [j*p, j*p + its length), p = block.size()
};

// A reduce-scatter's piece (what one window moves per rank) is a multiple of
// this many elements where it exceeds it and the block takes several windows.
inline constexpr int64_t kPieceAlignElems = 16;

class GatherScatterPlan {
 public:
  // block_elems: C, the elements of every rank's block (all tensors together).
  // slot_elems: the elements one rank's staging slot holds. Throws
  // std::invalid_argument for world_size < 1, negative block_elems or
  // slot_elems < world_size (a window must hold one element per rank).
  GatherScatterPlan(GatherScatterKind kind, int world_size, int64_t block_elems,
                    int64_t slot_elems);
  // Blocks of rank_block_elems[j] elements on rank j (world size: their count).
  GatherScatterPlan(GatherScatterKind kind, std::vector<int64_t> rank_block_elems,
                    int64_t slot_elems);

  GatherScatterKind kind() const { return kind_; }
  int world_size() const { return world_size_; }
  // The largest block (every rank's, when they are even).
  int64_t block_elems() const { return block_elems_; }
  int64_t block_elems(int rank) const { return rank_block_elems_[static_cast<size_t>(rank)]; }
  // The largest piece a window moves per rank.
  int64_t piece_elems() const { return piece_elems_; }
  // Zero for an empty block.
  int64_t num_windows() const { return num_windows_; }
  GatherScatterWindow window(int64_t k) const;
  // Where slot coordinate x (a window of pieces of p elements) lies in the
  // memory of rank owner's slot, in elements from its start.
  int64_t slot_memory_offset(int owner, int64_t x, int64_t p) const {
    if (kind_ == GatherScatterKind::kAllGather) return x - owner * p;
    return x / p > owner ? x - p : x;  // the owner's own piece is never staged
  }

 private:
  GatherScatterKind kind_;
  int world_size_ = 0;
  int64_t block_elems_ = 0;
  std::vector<int64_t> rank_block_elems_;
  int64_t piece_elems_ = 0;
  int64_t num_windows_ = 0;
};

}  // namespace xdev::plan
