#include "packing.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace xdev::plan {

void PackingOptions::validate() const {
  auto check = [](int64_t v, const char* name) {
    if (v < 0) {
      throw std::invalid_argument(std::string(name) + " must be >= 0, got " + std::to_string(v));
    }
  };
  check(num_packs, "num_packs");
  check(agg_small_grads_max_bytes, "agg_small_grads_max_bytes");
  check(agg_small_grads_max_group, "agg_small_grads_max_group");
  check(bytes_per_pack, "bytes_per_pack");
}

FlatLayout::FlatLayout(std::vector<int64_t> numels) : numels_(std::move(numels)) {
  offsets_.reserve(numels_.size());
  for (int64_t n : numels_) {
    if (n < 0) throw std::invalid_argument("FlatLayout: negative element count");
    offsets_.push_back(total_);
    total_ += n;
  }
}

size_t FlatLayout::first_tensor_at(int64_t payload_offset) const {
  // The last tensor starting at or before the offset; zero-element tensors share
  // their offset with the next one and are skipped by for_each_piece's hi > lo.
  auto it = std::upper_bound(offsets_.begin(), offsets_.end(), payload_offset);
  return it == offsets_.begin() ? 0 : static_cast<size_t>(it - offsets_.begin() - 1);
}

std::vector<Range> concat_and_split(int64_t total, int64_t num_packs) {
  const int64_t p = std::max<int64_t>(1, num_packs);
  const int64_t base = total / p;
  std::vector<Range> packs;
  for (int64_t i = 0; i < p; ++i) {
    const int64_t begin = i * base;
    packs.push_back({begin, i + 1 == p ? total : begin + base});
  }
  return packs;
}

namespace {

// Small-tensor aggregation: runs of consecutive tensors of at most max_bytes
// each, at most max_group per run, become one pack; larger tensors stay alone.
std::vector<Range> aggregate_small(const FlatLayout& layout, size_t elem_size, int64_t max_bytes,
                                   int64_t max_group) {
  std::vector<Range> packs;
  size_t t = 0;
  const size_t n = layout.num_tensors();
  while (t < n) {
    const auto is_small = [&](size_t i) {
      return layout.numel(i) * static_cast<int64_t>(elem_size) <= max_bytes;
    };
    size_t run_end = t + 1;
    if (is_small(t)) {
      while (run_end < n && is_small(run_end) && static_cast<int64_t>(run_end - t) < max_group) {
        ++run_end;
      }
    }
    const int64_t begin = layout.offset(t);
    const int64_t end = layout.offset(run_end - 1) + layout.numel(run_end - 1);
    packs.push_back({begin, end});
    t = run_end;
  }
  return packs;
}

}  // namespace

std::vector<Range> make_packs(const FlatLayout& layout, size_t elem_size,
                              const PackingOptions& options) {
  options.validate();
  if (elem_size == 0) throw std::invalid_argument("make_packs: elem_size must be > 0");
  const int64_t total = layout.total();
  if (options.num_packs > 0) return concat_and_split(total, options.num_packs);
  if (options.bytes_per_pack > 0) {
    const int64_t per_pack =
        std::max({int64_t{1}, options.bytes_per_pack / static_cast<int64_t>(elem_size),
                  (total + kMaxPacks - 1) / kMaxPacks});
    std::vector<Range> packs;
    for (int64_t begin = 0; begin < total; begin += per_pack) {
      packs.push_back({begin, std::min(total, begin + per_pack)});
    }
    return packs;
  }
  if (options.agg_small_grads_max_bytes > 0 && options.agg_small_grads_max_group > 0) {
    return aggregate_small(layout, elem_size, options.agg_small_grads_max_bytes,
                           options.agg_small_grads_max_group);
  }
  std::vector<Range> packs;
  for (size_t t = 0; t < layout.num_tensors(); ++t) {
    packs.push_back({layout.offset(t), layout.offset(t) + layout.numel(t)});
  }
  return packs;
}

std::vector<DtypeGroup> group_by_dtype(const std::vector<TensorDesc>& tensors) {
  std::vector<DtypeGroup> groups;
  std::vector<std::vector<int64_t>> numels;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorDesc& d = tensors[i];
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const DtypeGroup& g) { return g.dtype == d.dtype; });
    if (it == groups.end()) {
      groups.push_back(DtypeGroup{d.dtype, d.elem_size, {}, FlatLayout{{}}});
      numels.emplace_back();
      it = groups.end() - 1;
    } else if (it->elem_size != d.elem_size) {
      throw std::invalid_argument("group_by_dtype: one dtype with two element sizes");
    }
    it->tensor_indices.push_back(i);
    numels[static_cast<size_t>(it - groups.begin())].push_back(d.numel);
  }
  for (size_t g = 0; g < groups.size(); ++g) groups[g].layout = FlatLayout(std::move(numels[g]));
  return groups;
}

}  // namespace xdev::plan
