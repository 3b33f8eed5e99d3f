// The allreduce of a tensor that lives in memory every rank maps
// (torch_xdev.shared_empty): nothing is staged. Rank r sums its slice of the
// tensor from every rank's copy, in rank order, and writes the total into every
// copy; a barrier before (inputs ready) and one after (totals written) are the
// whole schedule. Each element is summed once, so every rank gets the same bits,
// and they are the bits of the flat plan, which sums in the same order.
#pragma once

#include <cstdint>
#include <vector>

#include "packing.h"
#include "schedule.h"

namespace xdev::plan {

// Slices start on this byte boundary, so no cache line is written by two ranks.
constexpr int64_t kSharedSliceAlignBytes = 64;

// The slice of [0, count) each rank reduces, by rank: contiguous, disjoint,
// covering, in rank order, boundaries on kSharedSliceAlignBytes multiples of
// the element size, sizes as even as that allows. Throws std::invalid_argument
// on a non-positive world size or element size, or a negative count.
std::vector<Range> shared_buffer_slices(int64_t count, int64_t elem_bytes, int world_size);

// Whether an allreduce whose tensor is in a shared buffer on every rank runs
// there: for algorithm "auto" and "flat" (its schedule, minus the staging);
// other forced algorithms keep their staged schedule.
bool use_shared_buffer(Algorithm requested);

}  // namespace xdev::plan
