#include "collective_plan.h"

#include <algorithm>
#include <stdexcept>

namespace xdev::plan {

CollectivePlan CollectivePlan::allreduce(Algorithm algorithm, int world_size, int root,
                                         std::vector<Range> packs, int64_t total,
                                         int64_t window_elems, std::vector<PackTree> trees) {
  const bool hierarchical =
      algorithm == Algorithm::kHierarchicalCopy || algorithm == Algorithm::kHierarchicalBalanced;
  if (!hierarchical && algorithm != Algorithm::kReduceToOne && algorithm != Algorithm::kFlat &&
      algorithm != Algorithm::kDirect) {
    throw std::invalid_argument(std::string("CollectivePlan: not a native algorithm: ") +
                                to_string(algorithm));
  }
  if (window_elems < 1) throw std::invalid_argument("CollectivePlan: window_elems must be >= 1");
  if (hierarchical && world_size % 2 != 0) {
    throw std::invalid_argument(std::string(to_string(algorithm)) +
                                " needs an even number of ranks (two groups of N/2); got " +
                                std::to_string(world_size));
  }
  if (algorithm == Algorithm::kHierarchicalBalanced && trees.empty()) {
    throw std::invalid_argument("CollectivePlan: hierarchical_balanced needs its pack trees");
  }
  if (algorithm == Algorithm::kReduceToOne) check_root("reduce_to_rank", root, world_size);
  CollectivePlan p;
  p.algorithm_ = algorithm;
  p.world_size_ = world_size;
  p.root_ = root;
  p.total_ = total;
  p.window_elems_ = window_elems;
  p.trees_ = std::move(trees);
  if (hierarchical) {
    packs.erase(
        std::remove_if(packs.begin(), packs.end(), [](const Range& r) { return r.empty(); }),
        packs.end());
    p.packs_ = std::move(packs);
  }
  const auto num_packs = static_cast<int64_t>(p.packs_.size());
  if (total <= window_elems) {
    p.num_windows_ = total > 0 ? 1 : 0;
    p.split_ = Split::kContiguous;
  } else if (hierarchical && num_packs > 1 && num_packs <= window_elems / 2) {
    // Piece k of a pack of L elements is [L*k/K, L*(k+1)/K): at most L/K + 1
    // elements, so a window holds at most total/K + num_packs elements.
    const int64_t usable = window_elems - num_packs;
    p.num_windows_ = (total + usable - 1) / usable;
    p.split_ = Split::kProportional;
  } else {
    p.num_windows_ = (total + window_elems - 1) / window_elems;
    p.split_ = Split::kContiguous;
  }
  return p;
}

CollectivePlan CollectivePlan::broadcast(int world_size, int root, int64_t total,
                                         int64_t window_elems) {
  if (window_elems < 1) throw std::invalid_argument("CollectivePlan: window_elems must be >= 1");
  check_root("broadcast root", root, world_size);
  CollectivePlan p;
  p.is_broadcast_ = true;
  p.world_size_ = world_size;
  p.root_ = root;
  p.total_ = total;
  p.window_elems_ = window_elems;
  p.num_windows_ = (total + window_elems - 1) / window_elems;
  return p;
}

WindowPlan CollectivePlan::window(int64_t k) const {
  if (k < 0 || k >= num_windows_) throw std::out_of_range("CollectivePlan::window");
  WindowPlan w;
  std::vector<PackSlice> slices;
  if (split_ == Split::kProportional) {
    for (size_t i = 0; i < packs_.size(); ++i) {
      const int64_t len = packs_[i].size();
      const int64_t lo = packs_[i].begin + len * k / num_windows_;
      const int64_t hi = packs_[i].begin + len * (k + 1) / num_windows_;
      if (hi <= lo) continue;
      slices.push_back({static_cast<int64_t>(i), {w.slot_elems, w.slot_elems + (hi - lo)}});
      w.segments.push_back({lo, w.slot_elems, hi - lo});
      w.slot_elems += hi - lo;
    }
  } else {
    const int64_t lo = k * window_elems_;
    const int64_t hi = std::min(total_, lo + window_elems_);
    w.segments.push_back({lo, 0, hi - lo});
    w.slot_elems = hi - lo;
    for (size_t i = 0; i < packs_.size(); ++i) {
      const int64_t a = std::max(lo, packs_[i].begin);
      const int64_t b = std::min(hi, packs_[i].end);
      if (b > a) slices.push_back({static_cast<int64_t>(i), {a - lo, b - lo}});
    }
  }
  const Range whole{0, w.slot_elems};
  w.packs = slices;
  if (is_broadcast_) {
    w.schedule = broadcast_schedule(world_size_, root_, whole);
  } else if (algorithm_ == Algorithm::kHierarchicalCopy) {
    w.schedule = hierarchical_copy_schedule(world_size_, slices);
  } else if (algorithm_ == Algorithm::kHierarchicalBalanced) {
    w.schedule = hierarchical_balanced_schedule(world_size_, trees_, slices);
  } else if (algorithm_ == Algorithm::kReduceToOne) {
    w.schedule = reduce_to_one_schedule(world_size_, root_, whole);
  } else if (algorithm_ == Algorithm::kDirect) {
    w.schedule = direct_schedule(world_size_, whole);
  } else {
    w.schedule = flat_schedule(world_size_, whole);
  }
  return w;
}

}  // namespace xdev::plan
