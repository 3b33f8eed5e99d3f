// A collective over a payload larger than the staging slots runs as a
// sequence of windows; each window stages at most window_elems elements per
// rank and runs one Schedule over them.
//
// For the hierarchical plan every window carries a proportional piece of
// every pack, so the lead ranks keep rotating (and the load stays spread) in
// every window, not only in the one that happens to hold pack i. A Segment
// says which payload elements land where in the slot.
#pragma once

#include <cstdint>
#include <vector>

#include "balanced_plan.h"
#include "packing.h"
#include "schedule.h"

namespace xdev::plan {

struct Segment {
  int64_t payload_begin = 0;
  int64_t slot_begin = 0;
  int64_t count = 0;
};

struct WindowPlan {
  std::vector<Segment> segments;  // payload -> slot, ascending slot offsets
  int64_t slot_elems = 0;         // elements staged in this window
  std::vector<PackSlice> packs;   // the hierarchical plans' packs in this window, in slot order
  Schedule schedule;              // ranges are slot offsets
};

class CollectivePlan {
 public:
  // algorithm must be a native one (hierarchical copy or balanced, reduce-to-one, flat,
  // direct). packs matter to the hierarchical plans only; the balanced plan also needs
  // the tree of every pack (balanced_pack_trees).
  static CollectivePlan allreduce(Algorithm algorithm, int world_size, int root,
                                  std::vector<Range> packs, int64_t total, int64_t window_elems,
                                  std::vector<PackTree> trees = {});
  static CollectivePlan broadcast(int world_size, int root, int64_t total, int64_t window_elems);

  Algorithm algorithm() const { return algorithm_; }
  int64_t total() const { return total_; }
  int64_t num_windows() const { return num_windows_; }
  WindowPlan window(int64_t k) const;

 private:
  enum class Split { kContiguous, kProportional };

  Algorithm algorithm_ = Algorithm::kFlat;
  bool is_broadcast_ = false;
  int world_size_ = 0;
  int root_ = 0;
  std::vector<Range> packs_;
  std::vector<PackTree> trees_;
  int64_t total_ = 0;
  int64_t window_elems_ = 0;
  int64_t num_windows_ = 0;
  Split split_ = Split::kContiguous;
};

}  // namespace xdev::plan
