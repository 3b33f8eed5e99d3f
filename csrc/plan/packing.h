// Packing: how a list of tensors becomes the units ("packs") an algorithm
// reduces.
//
// Words used here. The *payload* of one dtype is the concatenation of that
// dtype's tensors, flattened, in call order; offsets into it count elements.
// A *pack* is a contiguous element range of the payload that the algorithm
// treats as one unit (the hierarchical plan rotates its lead ranks per pack).
// Packing is pure layout: nothing here touches tensor memory except the
// pack/unpack helpers, which the tests use to prove layouts round-trip.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace xdev::plan {

struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
};

inline bool operator==(const Range& a, const Range& b) {
  return a.begin == b.begin && a.end == b.end;
}

// The most packs num_packs may ask for, and bytes_per_pack makes: plans,
// executors and the cost model take time linear in the pack count (tens of
// microseconds a pack), and no plan gains from more. A bytes_per_pack that
// would make more packs makes packs of ceil(total / kMaxPacks) elements.
inline constexpr int64_t kMaxPacks = 1024;

// TensorFlow's packing knobs (num_packs, agg_small_grads_*) plus the
// bytes_per_pack of its CollectiveHints. Precedence:
// num_packs > 0 (concat-and-split), else bytes_per_pack > 0 (cut the payload
// every bytes_per_pack bytes, into at most kMaxPacks packs), else
// small-tensor aggregation when both agg_* fields are > 0, else no packing
// (every tensor is its own pack).
struct PackingOptions {
  int64_t num_packs = 0;
  int64_t agg_small_grads_max_bytes = 0;
  int64_t agg_small_grads_max_group = 0;
  int64_t bytes_per_pack = 0;

  // Throws std::invalid_argument naming the first negative field.
  void validate() const;
};

// Where each tensor of one dtype lives in that dtype's payload.
class FlatLayout {
 public:
  explicit FlatLayout(std::vector<int64_t> numels);

  int64_t total() const { return total_; }
  size_t num_tensors() const { return numels_.size(); }
  int64_t offset(size_t tensor) const { return offsets_[tensor]; }
  int64_t numel(size_t tensor) const { return numels_[tensor]; }

  // Calls fn(tensor_index, offset_in_tensor, count) for every tensor piece that
  // intersects payload range r, in payload order.
  template <typename Fn>
  void for_each_piece(Range r, Fn&& fn) const;

 private:
  size_t first_tensor_at(int64_t payload_offset) const;

  std::vector<int64_t> numels_;
  std::vector<int64_t> offsets_;
  int64_t total_ = 0;
};

// Concat-and-split: `total` elements as num_packs packs of floor(total /
// num_packs) elements, the last one taking the rest (fewer than one pack
// counts as one).
std::vector<Range> concat_and_split(int64_t total, int64_t num_packs);

// Packs of one dtype's payload. Every element is in exactly one pack; packs are
// in payload order and may be empty (concat-and-split of fewer elements than
// packs).
std::vector<Range> make_packs(const FlatLayout& layout, size_t elem_size,
                              const PackingOptions& options);

// Tensors grouped by dtype, one payload per group, groups in order of first
// appearance. dtype is an opaque id to the plan layer.
struct TensorDesc {
  int dtype = 0;
  size_t elem_size = 0;
  int64_t numel = 0;
};

struct DtypeGroup {
  int dtype = 0;
  size_t elem_size = 0;
  std::vector<size_t> tensor_indices;  // into the caller's tensor list
  FlatLayout layout{{}};
};

std::vector<DtypeGroup> group_by_dtype(const std::vector<TensorDesc>& tensors);

template <typename Fn>
void FlatLayout::for_each_piece(Range r, Fn&& fn) const {
  if (r.empty()) return;
  for (size_t t = first_tensor_at(r.begin); t < numels_.size() && offsets_[t] < r.end; ++t) {
    const int64_t lo = r.begin > offsets_[t] ? r.begin : offsets_[t];
    const int64_t tensor_end = offsets_[t] + numels_[t];
    const int64_t hi = r.end < tensor_end ? r.end : tensor_end;
    if (hi > lo) fn(t, lo - offsets_[t], hi - lo);
  }
}

}  // namespace xdev::plan
