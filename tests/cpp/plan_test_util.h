// Helpers shared by the plan tests: printers for CHECK_EQ messages and random pack lists.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <sstream>
#include <vector>

#include "plan/packing.h"
#include "plan/schedule.h"
#include "plan/selection.h"
#include "plan/topology.h"
#include "test_harness.h"

// Found by argument-dependent lookup from the harness's show().
namespace xdev::plan {

inline std::ostream& operator<<(std::ostream& os, const Range& r) {
  return os << "[" << r.begin << ", " << r.end << ")";
}
inline std::ostream& operator<<(std::ostream& os, Algorithm a) {
  return os << to_string(a);
}
inline std::ostream& operator<<(std::ostream& os, GatherScatterPath p) {
  return os << to_string(p);
}
inline std::ostream& operator<<(std::ostream& os, TopologyClass c) {
  return os << to_string(c);
}

}  // namespace xdev::plan

namespace xdev_test {

// Random in [lo, hi], both ends included.
inline int64_t uniform(std::mt19937& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// num_packs ranges tiling [0, total) in order; cut points may repeat, so some packs are empty
// (as concat-and-split of few elements, or zero-element tensors, produce).
inline std::vector<xdev::plan::Range> random_tiling(std::mt19937& rng, int64_t total,
                                                    int num_packs) {
  std::vector<int64_t> cuts;
  for (int i = 0; i + 1 < num_packs; ++i) cuts.push_back(uniform(rng, 0, total));
  std::sort(cuts.begin(), cuts.end());
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(total);
  std::vector<xdev::plan::Range> packs;
  for (int i = 0; i < num_packs; ++i) packs.push_back({cuts[i], cuts[i + 1]});
  return packs;
}

}  // namespace xdev_test

// Relative closeness of two doubles (the model's predictions), with a message on failure.
inline bool relatively_near(double a, double b, double rel = 1e-9) {
  return std::abs(a - b) <= rel * std::max(std::abs(a), std::abs(b));
}

inline void check_near(double a, double b, const char* what, const char* file, int line) {
  if (!relatively_near(a, b)) {
    std::ostringstream os;
    os.precision(17);
    os << what << a << " vs " << b;
    xdev_test::fail(file, line, os.str());
  }
}

#define CHECK_NEAR(a, b) \
  check_near((a), (b), "CHECK_NEAR(" #a ", " #b ") failed: ", __FILE__, __LINE__)
