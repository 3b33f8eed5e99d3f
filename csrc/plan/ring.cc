#include "ring.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <stdexcept>

namespace xdev::plan {
namespace {

// Undirected Hamiltonian cycles through the linked pairs, each listed once
// (starting at device 0, second device smaller than the last).
std::vector<std::vector<int>> hamiltonian_cycles(const LinkMatrix& links, size_t limit) {
  const int n = links.size();
  std::vector<std::vector<int>> cycles;
  if (n < 3) return cycles;
  std::vector<int> path{0};
  std::vector<bool> used(static_cast<size_t>(n), false);
  used[0] = true;
  std::function<void()> extend = [&]() {
    if (cycles.size() >= limit) return;
    const int last = path.back();
    if (static_cast<int>(path.size()) == n) {
      if (links.links(last, 0) > 0 && path[1] < path.back()) cycles.push_back(path);
      return;
    }
    for (int next = 0; next < n; ++next) {
      if (used[static_cast<size_t>(next)] || links.links(last, next) == 0) continue;
      used[static_cast<size_t>(next)] = true;
      path.push_back(next);
      extend();
      path.pop_back();
      used[static_cast<size_t>(next)] = false;
    }
  };
  extend();
  return cycles;
}

}  // namespace

std::vector<std::vector<int>> find_rings(const LinkMatrix& links) {
  const int n = links.size();
  if (n < 2) return {std::vector<int>(static_cast<size_t>(n), 0)};
  // No set of cycles can use more links at a device than it has.
  int bound = 1 << 30;
  for (int d = 0; d < n; ++d) {
    int degree = 0;
    for (int e = 0; e < n; ++e) degree += e == d ? 0 : links.links(d, e);
    bound = std::min(bound, degree / 2);
  }
  const std::vector<std::vector<int>> cycles = hamiltonian_cycles(links, 20000);

  std::vector<int> remaining(static_cast<size_t>(n) * n);
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) remaining[static_cast<size_t>(a) * n + b] = links.links(a, b);
  }
  auto edges = [&](const std::vector<int>& c, int delta) {
    for (size_t i = 0; i < c.size(); ++i) {
      const int a = c[i], b = c[(i + 1) % c.size()];
      remaining[static_cast<size_t>(a) * n + b] += delta;
      remaining[static_cast<size_t>(b) * n + a] += delta;
    }
  };
  auto fits = [&](const std::vector<int>& c) {
    for (size_t i = 0; i < c.size(); ++i) {
      if (remaining[static_cast<size_t>(c[i]) * n + c[(i + 1) % c.size()]] <= 0) return false;
    }
    return true;
  };
  // Depth-first over cycle multisets (a cycle may repeat where links are
  // doubled), keeping the largest set found.
  std::vector<size_t> chosen, best;
  long work = 0;
  std::function<void(size_t)> search = [&](size_t from) {
    if (chosen.size() > best.size()) best = chosen;
    if (static_cast<int>(best.size()) >= bound || ++work > 200000) return;
    for (size_t i = from; i < cycles.size(); ++i) {
      if (!fits(cycles[i])) continue;
      edges(cycles[i], -1);
      chosen.push_back(i);
      search(i);
      chosen.pop_back();
      edges(cycles[i], +1);
      if (static_cast<int>(best.size()) >= bound) return;
    }
  };
  search(0);

  std::vector<std::vector<int>> rings;
  for (size_t i : best) {
    rings.push_back(cycles[i]);
    std::vector<int> reverse = cycles[i];
    std::reverse(reverse.begin() + 1, reverse.end());
    rings.push_back(reverse);
  }
  if (rings.empty()) {
    std::vector<int> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    rings.push_back(order);
    if (n > 2) {
      std::reverse(order.begin() + 1, order.end());
      rings.push_back(order);
    }
  }
  return rings;
}

Schedule ring_allreduce_schedule(int world_size, const std::vector<std::vector<int>>& rings,
                                 Range range) {
  const int n = world_size;
  if (n < 1) throw std::invalid_argument("ring: world_size must be >= 1");
  if (rings.empty()) throw std::invalid_argument("ring: no rings");
  for (const auto& ring : rings) {
    std::vector<int> sorted = ring;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    if (sorted != all) throw std::invalid_argument("ring: a ring must visit every rank once");
  }
  Schedule s;
  s.world_size = n;
  s.num_phases = 2 * n - 1;
  s.stagers.resize(static_cast<size_t>(n));
  std::iota(s.stagers.begin(), s.stagers.end(), 0);
  const int64_t total = range.size();
  if (total <= 0) return s;
  if (n == 1) {  // nothing to pass around: the rank's own input is the total
    s.steps.push_back(reduce_step(1, 0, {0}, Target::kOutput, range, true));
    return s;
  }
  const auto num_rings = static_cast<int64_t>(rings.size());
  auto mod = [n](int64_t v) { return static_cast<int>(((v % n) + n) % n); };
  for (int64_t k = 0; k < num_rings; ++k) {
    const std::vector<int>& ring = rings[static_cast<size_t>(k)];
    const int64_t part_lo = range.begin + total * k / num_rings;
    const int64_t part_len = range.begin + total * (k + 1) / num_rings - part_lo;
    auto chunk = [&](int c) {
      return Range{part_lo + part_len * c / n, part_lo + part_len * (c + 1) / n};
    };
    for (int t = 1; t < n; ++t) {
      for (int j = 0; j < n; ++j) {
        const Range r = chunk(mod(j - t));
        if (r.empty()) continue;
        const int actor = ring[static_cast<size_t>(j)];
        s.steps.push_back(reduce_step(t, actor, {ring[static_cast<size_t>(mod(j - 1))], actor},
                                      Target::kStaging, r, t == n - 1));
      }
    }
    for (int t = 1; t < n; ++t) {
      for (int j = 0; j < n; ++j) {
        const Range r = chunk(mod(j + 1 - t));
        if (r.empty()) continue;
        s.steps.push_back(copy_step(n - 1 + t, ring[static_cast<size_t>(j)],
                                    ring[static_cast<size_t>(mod(j - 1))], Target::kStaging, r));
      }
    }
    // Each total goes to the output the phase after the rank has it (one
    // chunk at a time, as NCCL writes the output while forwarding).
    for (int j = 0; j < n; ++j) {
      for (int t = 0; t < n; ++t) {
        // t = 0: the chunk this rank finalised; t >= 1: the one it copied in allgather step t.
        const Range r = chunk(mod(j + 1 - t));
        if (r.empty()) continue;
        const int actor = ring[static_cast<size_t>(j)];
        s.steps.push_back(copy_step(n + t, actor, actor, Target::kOutput, r));
      }
    }
  }
  return s;
}

}  // namespace xdev::plan
