// Unit tests of the shared-buffer allreduce's slicing and its selection rule.
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "plan/shared_buffer_plan.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

TEST(shared_buffer_slices_tile_the_payload_on_cache_lines) {
  for (int world = 1; world <= 8; ++world) {
    for (int64_t elem : {1, 2, 4, 8}) {
      for (int64_t count : {0, 1, 7, 15, 16, 17, 64, 1000, 4097, 1 << 20}) {
        const std::vector<Range> s = shared_buffer_slices(count, elem, world);
        CHECK_EQ(s.size(), static_cast<size_t>(world));
        int64_t at = 0, smallest = count, largest = 0;
        for (const Range& r : s) {
          CHECK_EQ(r.begin, at);  // contiguous, in rank order, covering
          CHECK(r.end >= r.begin);
          // Every boundary inside the payload is a cache-line multiple.
          if (r.end < count) CHECK_EQ((r.end * elem) % kSharedSliceAlignBytes, 0);
          smallest = std::min(smallest, r.size());
          largest = std::max(largest, r.size());
          at = r.end;
        }
        CHECK_EQ(at, count);
        // As even as whole lines allow: sizes differ by at most one line.
        CHECK(largest - smallest <= kSharedSliceAlignBytes / elem);
      }
    }
  }
}

TEST(shared_buffer_slices_split_evenly_when_lines_divide) {
  const std::vector<Range> s = shared_buffer_slices(int64_t{4} << 20, 4, 2);
  CHECK_EQ(s[0], (Range{0, int64_t{2} << 20}));
  CHECK_EQ(s[1], (Range{int64_t{2} << 20, int64_t{4} << 20}));
}

TEST(shared_buffer_slices_give_small_payloads_to_the_last_ranks) {
  // 20 floats are two lines (16 + 4): ranks 1 and 2 get one each, rank 0 none.
  const std::vector<Range> s = shared_buffer_slices(20, 4, 3);
  CHECK(s[0].empty());
  CHECK_EQ(s[1], (Range{0, 16}));
  CHECK_EQ(s[2], (Range{16, 20}));
}

TEST(shared_buffer_slices_refuse_bad_arguments) {
  CHECK_THROWS(shared_buffer_slices(10, 4, 0), std::invalid_argument, "world size 0");
  CHECK_THROWS(shared_buffer_slices(10, 0, 2), std::invalid_argument, "element bytes 0");
  CHECK_THROWS(shared_buffer_slices(-1, 4, 2), std::invalid_argument, "count -1");
}

TEST(shared_buffer_runs_for_auto_and_flat_only) {
  CHECK(use_shared_buffer(Algorithm::kAuto));
  CHECK(use_shared_buffer(Algorithm::kFlat));
  for (Algorithm a : {Algorithm::kDirect, Algorithm::kReduceToOne, Algorithm::kHierarchicalCopy,
                      Algorithm::kHierarchicalBalanced, Algorithm::kFallback}) {
    CHECK(!use_shared_buffer(a));
  }
}
