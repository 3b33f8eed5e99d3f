#include "shared_buffer_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace xdev::plan {

std::vector<Range> shared_buffer_slices(int64_t count, int64_t elem_bytes, int world_size) {
  if (world_size <= 0 || elem_bytes <= 0 || count < 0) {
    throw std::invalid_argument(
        "shared_buffer_slices: bad arguments (count " + std::to_string(count) + ", element bytes " +
        std::to_string(elem_bytes) + ", world size " + std::to_string(world_size) + ")");
  }
  // Whole cache lines of elements (an element wider than the alignment is its
  // own unit); the last unit may be partial.
  const int64_t unit = std::max<int64_t>(1, kSharedSliceAlignBytes / elem_bytes);
  const int64_t units = (count + unit - 1) / unit;
  std::vector<Range> slices(static_cast<size_t>(world_size));
  int64_t begin = 0;
  for (int r = 0; r < world_size; ++r) {
    // The last units % world_size ranks take one unit more: the last rank's
    // may be partial, so sizes stay within one unit of each other.
    const int64_t mine = units / world_size + (r >= world_size - units % world_size ? 1 : 0);
    const int64_t end = std::min(count, begin + mine * unit);
    slices[static_cast<size_t>(r)] = {begin, end};
    begin = end;
  }
  return slices;
}

bool use_shared_buffer(Algorithm requested) {
  return requested == Algorithm::kAuto || requested == Algorithm::kFlat;
}

}  // namespace xdev::plan
