// The CUDA heap's pending frees (transport/heap_pending_frees.h), with integers for events:
// an allocation waits for exactly the frees whose bytes it overlaps, and a free is forgotten
// only once every stream that used it has passed it.

#include <set>
#include <stdexcept>
#include <vector>

#include "test_harness.h"
#include "transport/heap_pending_frees.h"

namespace {

using Frees = xdev::transport::PendingFrees<int>;
using Range = Frees::Range;

// Events by number; `passed` holds those the GPU has passed.
struct FakeGpu {
  std::set<int> passed;
  std::vector<int> waited;
  std::vector<int> released;

  void wait_for(Frees& frees, const Range& range) {
    frees.wait_for(
        range, [&](int e) { waited.push_back(e); }, [&](int e) { return passed.count(e) > 0; },
        [&](int e) { released.push_back(e); });
  }
};

TEST(an_allocation_waits_only_for_frees_it_overlaps) {
  Frees frees;
  FakeGpu gpu;
  frees.add({0, 0, 256}, {1});
  frees.add({0, 256, 512}, {2, 3});  // used on two streams
  frees.add({1, 0, 256}, {4});       // another arena, same offsets
  gpu.wait_for(frees, {0, 128, 256});
  CHECK(gpu.waited == std::vector<int>({1, 2, 3}));
  gpu.waited.clear();
  // Touching ends do not overlap.
  gpu.wait_for(frees, {0, 768, 256});
  CHECK(gpu.waited.empty());
  gpu.wait_for(frees, {1, 255, 1});
  CHECK(gpu.waited == std::vector<int>({4}));
  CHECK_EQ(frees.size(), size_t{3});
  CHECK(gpu.released.empty());
}

TEST(a_free_is_forgotten_once_every_stream_passed_it) {
  Frees frees;
  FakeGpu gpu;
  frees.add({0, 0, 256}, {1, 2});
  frees.add({0, 4096, 256}, {3});
  gpu.passed = {1, 3};
  // Not overlapping the second free, which goes anyway: its one stream has passed it.
  gpu.wait_for(frees, {0, 0, 64});
  CHECK(gpu.waited == std::vector<int>({1, 2}));
  CHECK(gpu.released == std::vector<int>({3}));
  CHECK_EQ(frees.size(), size_t{1});
  // Still pending on stream 2: a later allocation on the same bytes waits for it again.
  gpu.waited.clear();
  gpu.wait_for(frees, {0, 64, 64});
  CHECK(gpu.waited == std::vector<int>({1, 2}));
  gpu.passed.insert(2);
  gpu.wait_for(frees, {2, 0, 64});
  CHECK_EQ(frees.size(), size_t{0});
  CHECK(gpu.released == std::vector<int>({3, 1, 2}));
}

TEST(a_failed_wait_forgets_nothing) {
  Frees frees;
  frees.add({0, 0, 256}, {1});
  frees.add({0, 0, 256}, {});  // no stream used it: nothing to wait for
  CHECK_EQ(frees.size(), size_t{1});
  bool threw = false;
  try {
    frees.wait_for(
        {0, 0, 256}, [](int) { throw std::runtime_error("no wait"); }, [](int) { return true; },
        [](int) {});
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw);
  CHECK_EQ(frees.size(), size_t{1});
  std::vector<int> released;
  frees.clear([&](int e) { released.push_back(e); });
  CHECK(released == std::vector<int>({1}));
  CHECK_EQ(frees.size(), size_t{0});
}

}  // namespace
