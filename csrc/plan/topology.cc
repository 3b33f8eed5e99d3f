#include "topology.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <stdexcept>

namespace xdev::plan {
namespace {

// Row i lists the GPUs that GPU i reaches over NVLink on a DGX-1.
const std::vector<std::vector<int>>& dgx1_rows() {
  static const std::vector<std::vector<int>> rows = {
      {1, 2, 3, 4}, {0, 2, 3, 5}, {0, 1, 3, 6}, {0, 1, 2, 7},
      {0, 5, 6, 7}, {1, 4, 6, 7}, {2, 4, 5, 7}, {3, 4, 5, 6},
  };
  return rows;
}

}  // namespace

const char* to_string(TopologyClass c) {
  switch (c) {
    case TopologyClass::kNone:
      return "none";
    case TopologyClass::kPartial:
      return "partial";
    case TopologyClass::kFullyConnected:
      return "fully_connected";
    case TopologyClass::kDgx1:
      return "dgx1";
    case TopologyClass::kNvSwitch:
      return "nvswitch";
  }
  return "unknown";
}

LinkMatrix::LinkMatrix(int num_devices) : n_(num_devices) {
  if (num_devices < 0) throw std::invalid_argument("LinkMatrix: negative device count");
  links_.assign(static_cast<size_t>(n_) * n_, 0);
}

LinkMatrix LinkMatrix::from_neighbors(const std::vector<std::vector<int>>& neighbors) {
  LinkMatrix m(static_cast<int>(neighbors.size()));
  for (int i = 0; i < m.n_; ++i) {
    for (int j : neighbors[i]) {
      if (j < 0 || j >= m.n_) {
        throw std::invalid_argument("LinkMatrix: device " + std::to_string(i) + " lists peer " +
                                    std::to_string(j) + " out of range");
      }
      if (j != i) m.set_links(i, j, std::max(1, m.links(i, j)));
    }
  }
  return m;
}

LinkMatrix LinkMatrix::fully_connected(int num_devices) {
  LinkMatrix m(num_devices);
  for (int i = 0; i < num_devices; ++i) {
    for (int j = 0; j < num_devices; ++j) {
      if (i != j) m.links_[static_cast<size_t>(i) * num_devices + j] = 1;
    }
  }
  return m;
}

LinkMatrix LinkMatrix::dgx1() {
  return from_neighbors(dgx1_rows());
}

LinkMatrix LinkMatrix::from_rows(const std::vector<std::vector<int64_t>>& rows,
                                 const std::string& what, int64_t max_links) {
  const size_t n = rows.size();
  if (static_cast<int64_t>(n) > kMaxMatrixDevices) {
    throw std::invalid_argument(what + " has " + std::to_string(n) + " rows, more than " +
                                std::to_string(kMaxMatrixDevices));
  }
  for (size_t i = 0; i < n; ++i) {
    if (rows[i].size() != n) {
      throw std::invalid_argument(what + " is not square: row " + std::to_string(i) + " has " +
                                  std::to_string(rows[i].size()) + " entries, expected " +
                                  std::to_string(n));
    }
  }
  auto at = [](size_t i, size_t j) {
    return "[" + std::to_string(i) + "][" + std::to_string(j) + "]";
  };
  LinkMatrix m(static_cast<int>(n));
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      const int64_t v = rows[i][j];
      if (v < 0 || v > max_links) {
        throw std::invalid_argument(what + " has " + std::to_string(v) + " at " + at(i, j) +
                                    ", expected 0.." + std::to_string(max_links));
      }
      if (rows[j][i] != v) {
        throw std::invalid_argument(what + " is not symmetric: " + at(i, j) + " = " +
                                    std::to_string(v) + " but " + at(j, i) + " = " +
                                    std::to_string(rows[j][i]));
      }
      m.set_links(static_cast<int>(i), static_cast<int>(j), static_cast<int>(v));
    }
  }
  return m;
}

std::vector<std::vector<int64_t>> LinkMatrix::to_rows() const {
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(n_));
  for (int i = 0; i < n_; ++i) {
    for (int j = 0; j < n_; ++j) rows[static_cast<size_t>(i)].push_back(links(i, j));
  }
  return rows;
}

// No iostreams: where libstdc++ is linked statically into the extension (the
// H100 image's compiler does that), `std::ostringstream << int` segfaulted.
std::string LinkMatrix::to_text() const {
  std::string text = std::to_string(n_);
  for (int i = 0; i < n_; ++i) {
    for (int j = 0; j < n_; ++j) text += ' ' + std::to_string(links(i, j));
  }
  return text;
}

LinkMatrix LinkMatrix::from_text(const std::string& text, const std::string& what) {
  const char* p = text.c_str();
  auto next = [&]() {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p) throw std::invalid_argument(what + ": malformed text '" + text + "'");
    p = end;
    return static_cast<int64_t>(v);
  };
  const int64_t n = next();
  if (n < 0 || n > kMaxMatrixDevices) {
    throw std::invalid_argument(what + ": malformed text '" + text + "' (bad size)");
  }
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(n));
  for (auto& row : rows) {
    for (int64_t j = 0; j < n; ++j) row.push_back(next());
  }
  while (*p == ' ' || *p == '\n') ++p;
  if (*p != '\0') throw std::invalid_argument(what + ": malformed text '" + text + "' (trailing)");
  return from_rows(rows, what);
}

int LinkMatrix::links(int a, int b) const {
  if (a < 0 || b < 0 || a >= n_ || b >= n_) throw std::out_of_range("LinkMatrix: device index");
  return links_[static_cast<size_t>(a) * n_ + b];
}

void LinkMatrix::set_links(int a, int b, int count) {
  if (a < 0 || b < 0 || a >= n_ || b >= n_) throw std::out_of_range("LinkMatrix: device index");
  if (count < 0) throw std::invalid_argument("LinkMatrix: negative link count");
  links_[static_cast<size_t>(a) * n_ + b] = count;
  links_[static_cast<size_t>(b) * n_ + a] = count;
}

std::vector<int> LinkMatrix::neighbors(int i) const {
  std::vector<int> out;
  for (int j = 0; j < n_; ++j) {
    if (j != i && links(i, j) > 0) out.push_back(j);
  }
  return out;
}

bool is_dgx1_like(const std::vector<std::vector<int>>& neighbors) {
  const auto& rows = dgx1_rows();
  if (neighbors.size() != rows.size()) return false;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::set<int> expected(rows[i].begin(), rows[i].end());
    // A device may list itself as well; nothing else may differ.
    std::set<int> given(neighbors[i].begin(), neighbors[i].end());
    given.erase(static_cast<int>(i));
    if (given != expected) return false;
  }
  return true;
}

bool is_dgx1_like(const LinkMatrix& m) {
  std::vector<std::vector<int>> rows;
  for (int i = 0; i < m.size(); ++i) rows.push_back(m.neighbors(i));
  return is_dgx1_like(rows);
}

TopologyClass classify(const LinkMatrix& m) {
  if (is_dgx1_like(m)) return TopologyClass::kDgx1;
  int linked_pairs = 0;
  const int n = m.size();
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) linked_pairs += m.links(i, j) > 0 ? 1 : 0;
  }
  const int all_pairs = n * (n - 1) / 2;
  if (n <= 1 || linked_pairs == all_pairs) return TopologyClass::kFullyConnected;
  if (linked_pairs == 0) return TopologyClass::kNone;
  return TopologyClass::kPartial;
}

namespace {

void check_nvswitch(const std::vector<int>& nvswitch, int n, const char* who) {
  if (!nvswitch.empty() && static_cast<int>(nvswitch.size()) != n) {
    throw std::invalid_argument(std::string(who) + ": " + std::to_string(nvswitch.size()) +
                                " NVSwitch link counts for " + std::to_string(n) + " ranks");
  }
}

}  // namespace

TopologyClass classify_gpus(const LinkMatrix& nvlink, const LinkMatrix& reachable,
                            const std::vector<int>& nvswitch) {
  if (nvlink.size() != reachable.size()) {
    throw std::invalid_argument(
        "classify_gpus: the NVLink matrix has " + std::to_string(nvlink.size()) +
        " ranks but the reachability matrix has " + std::to_string(reachable.size()));
  }
  const int n = nvlink.size();
  check_nvswitch(nvswitch, n, "classify_gpus");
  if (n == 0) return TopologyClass::kNone;
  // The DGX-1 test looks at NVLinks only: hierarchical copy relies on the
  // cube-mesh's direct links, which peer access over PCIe does not give.
  if (is_dgx1_like(nvlink)) return TopologyClass::kDgx1;
  if (n > 1 && !nvswitch.empty() &&
      std::all_of(nvswitch.begin(), nvswitch.end(), [](int c) { return c > 0; })) {
    return TopologyClass::kNvSwitch;
  }
  int connected_pairs = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      const bool peer = reachable.links(i, j) > 0 && reachable.links(j, i) > 0;
      connected_pairs += (nvlink.links(i, j) > 0 || peer) ? 1 : 0;
    }
  }
  if (connected_pairs == n * (n - 1) / 2) return TopologyClass::kFullyConnected;
  return connected_pairs == 0 ? TopologyClass::kNone : TopologyClass::kPartial;
}

LinkMatrix direct_links(const LinkMatrix& nvlink, const std::vector<int>& nvswitch) {
  const int n = nvlink.size();
  check_nvswitch(nvswitch, n, "direct_links");
  LinkMatrix direct = nvlink;
  if (nvswitch.empty()) return direct;
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      const int switched =
          std::min(nvswitch[static_cast<size_t>(a)], nvswitch[static_cast<size_t>(b)]);
      direct.set_links(a, b, std::max(0, nvlink.links(a, b) - std::max(0, switched)));
    }
  }
  return direct;
}

LinkMatrix reachable_from_links(const LinkMatrix& nvlink) {
  const int n = nvlink.size();
  LinkMatrix reachable(n);
  for (int i = 0; i < n; ++i) {
    reachable.set_links(i, i, 1);
    for (int j = i + 1; j < n; ++j) {
      if (nvlink.links(i, j) > 0 || nvlink.links(j, i) > 0) reachable.set_links(i, j, 1);
    }
  }
  return reachable;
}

}  // namespace xdev::plan
