#include "balanced_plan.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

namespace xdev::plan {
namespace {

using Edge = std::pair<int, int>;  // (smaller, larger)

Edge edge(int a, int b) {
  return a < b ? Edge{a, b} : Edge{b, a};
}

struct TreeShape {
  std::vector<Edge> edges;
  int center = -1;  // a star's; -1 for a chain
};

// Chains (Hamiltonian paths over linked pairs) and stars spanning `members`.
std::vector<TreeShape> tree_shapes(const LinkMatrix& links, const std::vector<int>& members) {
  std::vector<TreeShape> shapes;
  const size_t g = members.size();
  if (g == 1) return {TreeShape{}};
  for (int center : members) {
    TreeShape star;
    star.center = center;
    for (int m : members) {
      if (m != center && links.links(center, m) > 0) star.edges.push_back(edge(center, m));
    }
    if (star.edges.size() == g - 1) shapes.push_back(star);
  }
  if (g <= 6) {
    std::vector<int> path;
    std::vector<bool> used(g, false);
    std::function<void()> extend = [&]() {
      if (path.size() == g) {
        if (path.front() < path.back()) {  // each undirected chain once
          TreeShape chain;
          for (size_t i = 0; i + 1 < g; ++i) chain.edges.push_back(edge(path[i], path[i + 1]));
          shapes.push_back(chain);
        }
        return;
      }
      for (size_t i = 0; i < g; ++i) {
        if (used[i] || (!path.empty() && links.links(path.back(), members[i]) == 0)) continue;
        used[i] = true;
        path.push_back(members[i]);
        extend();
        path.pop_back();
        used[i] = false;
      }
    };
    extend();
  }
  if (shapes.empty()) {
    throw std::invalid_argument(
        "hierarchical_balanced: a group has no chain or star over its direct links");
  }
  return shapes;
}

// Parent of every rank in the tree rooted at `root` (-1 at the root and for
// ranks outside the group).
std::vector<int> root_at(const TreeShape& t, int root, int world_size) {
  std::vector<int> parent(static_cast<size_t>(world_size), -1);
  std::vector<int> frontier{root};
  std::vector<bool> seen(static_cast<size_t>(world_size), false);
  seen[static_cast<size_t>(root)] = true;
  while (!frontier.empty()) {
    std::vector<int> next;
    for (int v : frontier) {
      for (const Edge& e : t.edges) {
        const int w = e.first == v ? e.second : e.second == v ? e.first : -1;
        if (w < 0 || seen[static_cast<size_t>(w)]) continue;
        seen[static_cast<size_t>(w)] = true;
        parent[static_cast<size_t>(w)] = v;
        next.push_back(w);
      }
    }
    frontier.swap(next);
  }
  return parent;
}

// Steps from v up to the root of its tree (parent: -1 at roots and outside the group).
int depth_of(const std::vector<int>& parent, int v) {
  int d = 0;
  for (int u = v; parent[static_cast<size_t>(u)] >= 0; u = parent[static_cast<size_t>(u)]) ++d;
  return d;
}

int height_of(const std::vector<int>& parent) {
  int height = 0;
  for (size_t v = 0; v < parent.size(); ++v) {
    height = std::max(height, depth_of(parent, static_cast<int>(v)));
  }
  return height;
}

int tree_height(const TreeShape& t, int root, int world_size) {
  return height_of(root_at(t, root, world_size));
}

// The root of least height (lowest rank on ties).
int center_of(const TreeShape& t, const std::vector<int>& members, int world_size) {
  int best = members.front();
  int best_height = std::numeric_limits<int>::max();
  for (int m : members) {
    const int h = tree_height(t, m, world_size);
    if (h < best_height) {
      best = m;
      best_height = h;
    }
  }
  return best;
}

class LinkLoads {
 public:
  explicit LinkLoads(const LinkMatrix& links) : links_(links), load_(links.size() * links.size()) {}
  double& at(const Edge& e) {
    return load_[static_cast<size_t>(e.first) * links_.size() + e.second];
  }
  double ratio(const Edge& e) const {
    return load_[static_cast<size_t>(e.first) * links_.size() + e.second] /
           links_.links(e.first, e.second);
  }
  const std::vector<double>& raw() const { return load_; }

 private:
  const LinkMatrix& links_;
  std::vector<double> load_;
};

struct Option {
  PackTree tree;
  std::vector<std::pair<Edge, double>> adds;
  int hops = 0;
};

int root_of(const std::vector<int>& parent, const std::vector<int>& members) {
  for (int m : members) {
    if (parent[static_cast<size_t>(m)] < 0) return m;
  }
  return members.front();
}

std::vector<int> group_members(int group, int g) {
  std::vector<int> m(static_cast<size_t>(g));
  std::iota(m.begin(), m.end(), group * g);
  return m;
}

// Every way a pack can cross: group-first through each cross link with every
// pair of the groups' tree shapes, and pair-first with every pair of shapes.
// With `centred_only`, only stars centred where the pack crosses.
std::vector<Option> tree_options(int n, const std::vector<int> (&members)[2],
                                 const std::vector<TreeShape> (&shapes)[2], bool centred_only) {
  const int g = n / 2;
  const auto centred_at = [centred_only](const TreeShape& t, int rank) {
    return !centred_only || t.center == rank;
  };
  std::vector<Option> options;
  // Group-first through each cross link, every pair of tree shapes.
  for (int a = 0; a < g; ++a) {
    for (const TreeShape& t0 : shapes[0]) {
      if (!centred_at(t0, a)) continue;
      for (const TreeShape& t1 : shapes[1]) {
        if (!centred_at(t1, a + g)) continue;
        Option o;
        o.tree.cross = a;
        o.tree.parent[0] = root_at(t0, a, n);
        o.tree.parent[1] = root_at(t1, a + g, n);
        for (const Edge& e : t0.edges) o.adds.push_back({e, 1.0});
        for (const Edge& e : t1.edges) o.adds.push_back({e, 1.0});
        o.adds.push_back({edge(a, a + g), 1.0});
        o.hops = std::max(height_of(o.tree.parent[0]), height_of(o.tree.parent[1])) * 2 + 2;
        options.push_back(std::move(o));
      }
    }
  }
  // Pair-first: every cross link, half a pack through each group's tree.
  for (const TreeShape& t0 : shapes[0]) {
    for (const TreeShape& t1 : shapes[1]) {
      if (centred_only && (t0.center < 0 || t1.center != t0.center + g)) continue;
      Option o;
      o.tree.pair_first = true;
      o.tree.parent[0] = root_at(t0, center_of(t0, members[0], n), n);
      o.tree.parent[1] = root_at(t1, center_of(t1, members[1], n), n);
      for (int i = 0; i < g; ++i) o.adds.push_back({edge(i, i + g), 1.0});
      for (const Edge& e : t0.edges) o.adds.push_back({e, 0.5});
      for (const Edge& e : t1.edges) o.adds.push_back({e, 0.5});
      o.hops = std::max(height_of(o.tree.parent[0]), height_of(o.tree.parent[1])) * 2 + 2;
      options.push_back(std::move(o));
    }
  }
  return options;
}

}  // namespace

std::vector<PackTree> assign_pack_trees(const LinkMatrix& links, int64_t num_packs) {
  const int n = links.size();
  if (n < 2 || n % 2 != 0) {
    throw std::invalid_argument(
        "hierarchical_balanced needs an even number of ranks (two groups of N/2); got " +
        std::to_string(n));
  }
  const int g = n / 2;
  for (int i = 0; i < g; ++i) {
    if (links.links(i, i + g) == 0) {
      throw std::invalid_argument("hierarchical_balanced: rank " + std::to_string(i) +
                                  " has no direct link to its partner " + std::to_string(i + g));
    }
  }
  const std::vector<int> members[2] = {group_members(0, g), group_members(1, g)};
  const std::vector<TreeShape> shapes[2] = {tree_shapes(links, members[0]),
                                            tree_shapes(links, members[1])};

  // Every pair of shapes through every cross link, each weighed at every pick:
  // with many shapes (two fully connected groups of 16 have 16 stars each:
  // 4352 options) that takes seconds, and minutes at 64 ranks (a 64-core host).
  // Past kMaxOptions only stars centred where the pack crosses are tried,
  // which spread uniform links (a CPU host, a switch) as evenly; where links
  // are so sparse that no such pair of stars exists, the whole search runs.
  constexpr size_t kMaxOptions = 4096;
  const size_t all_options = (static_cast<size_t>(g) + 1) * shapes[0].size() * shapes[1].size();
  std::vector<Option> options = tree_options(n, members, shapes, all_options > kMaxOptions);
  if (options.empty())
    options = tree_options(n, members, shapes, false);  // no centred pair of stars: all of them
  LinkLoads loads(links);
  std::vector<Edge> all_edges;
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      if (links.links(a, b) > 0) all_edges.push_back({a, b});
    }
  }
  // Lowest sum of squared loads (spread) or lowest peak first, then the other, then fewest hops.
  // With no more packs than ranks the payload is small: hops (latency) matter
  // more than spreading bytes.
  const bool fewest_hops_first = num_packs <= n;
  // Each option is weighed by what it changes: the other edges' loads stay,
  // so an option's spread is the current spread plus its own edges' change,
  // and its peak the larger of the current peak and its edges' new loads
  // (adds only grow loads). Summing every edge per option instead took
  // seconds at 128 ranks and minutes at 256 (a group's first call per size).
  std::vector<uint64_t> counted(static_cast<size_t>(n) * static_cast<size_t>(n), 0);
  uint64_t stamp = 0;
  const auto spread_of = [](double r) {
    const double r2 = r * r, r4 = r2 * r2;
    return r4 * r4;  // a smooth stand-in for the peak
  };
  const auto edge_index = [n](const Edge& e) {
    return static_cast<size_t>(e.first) * static_cast<size_t>(n) + static_cast<size_t>(e.second);
  };
  // Sum over the option's distinct edges of spread_of(load ratio).
  const auto spread_of_edges = [&](const Option& o) {
    ++stamp;
    double sum = 0;
    for (const auto& added : o.adds) {
      uint64_t& seen = counted[edge_index(added.first)];
      if (seen == stamp) continue;
      seen = stamp;
      sum += spread_of(loads.ratio(added.first));
    }
    return sum;
  };
  auto pick = [&](bool peak_first) {
    double current_peak = 0, current_spread = 0;
    for (const Edge& e : all_edges) {
      const double r = loads.ratio(e);
      current_peak = std::max(current_peak, r);
      current_spread += spread_of(r);
    }
    const Option* best = nullptr;
    double best_key[2] = {0, 0};
    for (const Option& o : options) {
      const double before = spread_of_edges(o);
      for (const auto& [e, w] : o.adds) loads.at(e) += w;
      double peak = current_peak;
      for (const auto& added : o.adds) peak = std::max(peak, loads.ratio(added.first));
      const double spread = current_spread - before + spread_of_edges(o);
      for (const auto& [e, w] : o.adds) loads.at(e) -= w;
      const double key[2] = {peak_first ? peak : spread, peak_first ? spread : peak};
      if (fewest_hops_first && best != nullptr && o.hops != best->hops) {
        if (o.hops > best->hops) continue;
        best = nullptr;  // fewer hops wins outright
      }
      const double eps = 1e-9;
      const bool better =
          best == nullptr || key[0] < best_key[0] - eps ||
          (key[0] < best_key[0] + eps &&
           (key[1] < best_key[1] - eps || (key[1] < best_key[1] + eps && o.hops < best->hops)));
      if (better) {
        best = &o;
        best_key[0] = key[0];
        best_key[1] = key[1];
      }
    }
    for (const auto& [e, w] : best->adds) loads.at(e) += w;
    return best;
  };
  auto peak_load = [&]() {
    double peak = 0;
    for (const Edge& e : all_edges) peak = std::max(peak, loads.ratio(e));
    return peak;
  };
  // Greedy, pack by pack; then rounds in which each pack, in turn, is taken
  // out and placed again given all the others (smoothing the spread first,
  // then the peak), keeping the assignment with the lowest peak seen.
  std::vector<const Option*> chosen;
  for (int64_t k = 0; k < num_packs; ++k) chosen.push_back(pick(false));
  std::vector<const Option*> best_chosen = chosen;
  double best_peak = peak_load();
  for (int round = 0; round < 8; ++round) {
    for (const Option*& c : chosen) {
      for (const auto& [e, w] : c->adds) loads.at(e) -= w;
      c = pick(round >= 4);
    }
    if (peak_load() < best_peak - 1e-9) {
      best_peak = peak_load();
      best_chosen = chosen;
    }
  }
  chosen = best_chosen;
  std::vector<PackTree> trees;
  for (const Option* c : chosen) trees.push_back(c->tree);
  return trees;
}

namespace {

// The search above costs tens of milliseconds at 32 ranks and hundreds at 64,
// and every prediction of a balanced candidate asks for it again (the cost
// model predicts each size from two or three programs; a group's first call
// of each size class predicts every candidate). The answer depends on the
// links and the pack count alone, so it is computed once per process.
std::vector<PackTree> memoized_pack_trees(const LinkMatrix& links, int64_t num_packs) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int64_t>, std::vector<PackTree>> memo;
  constexpr size_t kMaxEntries = 64;  // a process sees a handful of machines
  std::pair<std::string, int64_t> key{links.to_text(), num_packs};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = memo.find(key);
    if (it != memo.end()) return it->second;
  }
  std::vector<PackTree> trees = assign_pack_trees(links, num_packs);  // unlocked: may be slow
  const std::lock_guard<std::mutex> lock(mutex);
  if (memo.size() >= kMaxEntries) memo.clear();
  memo.emplace(std::move(key), trees);
  return trees;
}

}  // namespace

std::vector<PackTree> balanced_pack_trees(const LinkMatrix& links, int64_t num_packs) {
  // Long pack lists repeat a balanced pattern of 3N packs (on a DGX-1 V100 a
  // pattern of 24 balances every link exactly); the search cost stays fixed.
  const int64_t period = 3 * static_cast<int64_t>(links.size());
  if (num_packs <= period) return memoized_pack_trees(links, num_packs);
  const std::vector<PackTree> pattern = memoized_pack_trees(links, period);
  std::vector<PackTree> trees;
  for (int64_t k = 0; k < num_packs; ++k) trees.push_back(pattern[static_cast<size_t>(k % period)]);
  return trees;
}

std::vector<PackTree> balanced_pack_trees_for(const LinkMatrix& links, int64_t num_packs) {
  const int64_t packs = std::max<int64_t>(1, num_packs);
  const LinkMatrix every_pair = LinkMatrix::fully_connected(links.size());
  bool any = false;
  for (int i = 0; i < links.size() && !any; ++i) any = !links.neighbors(i).empty();
  if (!any) return balanced_pack_trees(every_pair, packs);
  try {
    return balanced_pack_trees(links, packs);
  } catch (const std::invalid_argument&) {
    // Too sparse for the two-level trees (a rank without a link to its
    // partner, or a group without a chain or star): weigh every pair alike.
    return balanced_pack_trees(every_pair, packs);
  }
}

LinkBalance link_balance(const LinkMatrix& links, const std::vector<PackTree>& trees) {
  const int n = links.size();
  const int g = n / 2;
  LinkLoads loads(links);
  for (const PackTree& t : trees) {
    const double w = t.pair_first ? 0.5 : 1.0;
    for (int group = 0; group < 2; ++group) {
      for (int v = 0; v < n; ++v) {
        const int p = t.parent[group][static_cast<size_t>(v)];
        if (p >= 0) loads.at(edge(v, p)) += w;
      }
    }
    if (t.pair_first) {
      for (int i = 0; i < g; ++i) loads.at(edge(i, i + g)) += 1.0;
    } else {
      loads.at(edge(t.cross, t.cross + g)) += 1.0;
    }
  }
  LinkBalance b;
  double total = 0;
  int capacity = 0;
  for (int a = 0; a < n; ++a) {
    for (int c = a + 1; c < n; ++c) {
      if (links.links(a, c) == 0) continue;
      total += loads.at({a, c});
      capacity += links.links(a, c);
      b.max_load_per_link = std::max(b.max_load_per_link, loads.ratio({a, c}));
    }
  }
  b.ideal_load_per_link = capacity > 0 ? total / capacity : 0;
  return b;
}

namespace {

std::vector<int> children_of(const std::vector<int>& parent, int v) {
  std::vector<int> c;
  for (size_t u = 0; u < parent.size(); ++u) {
    if (parent[u] == v) c.push_back(static_cast<int>(u));
  }
  return c;
}

int subtree_height(const std::vector<int>& parent, int v) {
  int h = 0;
  for (int c : children_of(parent, v)) h = std::max(h, subtree_height(parent, c) + 1);
  return h;
}

// Reduces r up the tree into the root's slot: a rank of height h adds its
// children's partial sums at phase base + h - 1. Returns the root's height.
int reduce_up(Schedule& s, const std::vector<int>& parent, const std::vector<int>& members, Range r,
              int base, bool finalize_at_root) {
  const int root = root_of(parent, members);
  for (int v : members) {
    const std::vector<int> kids = children_of(parent, v);
    if (kids.empty()) continue;
    std::vector<int> sources{v};
    sources.insert(sources.end(), kids.begin(), kids.end());
    s.steps.push_back(reduce_step(base + subtree_height(parent, v) - 1, v, sources,
                                  Target::kStaging, r, finalize_at_root && v == root));
  }
  return subtree_height(parent, root);
}

// Copies r down the tree from the root's slot, which holds it at phase
// base - 1: a rank at depth d copies from its parent at phase base + d - 1,
// into its slot when `keep_in_slot` or it has children (then on to its
// output one phase later), straight into its output otherwise. Returns the
// last phase used.
int copy_down(Schedule& s, const std::vector<int>& parent, const std::vector<int>& members, Range r,
              int base, bool keep_in_slot) {
  int last = base;
  for (int v : members) {
    const int p = parent[static_cast<size_t>(v)];
    if (p < 0) {
      s.steps.push_back(copy_step(base, v, v, Target::kOutput, r));
      continue;
    }
    const int phase = base + depth_of(parent, v) - 1;
    if (keep_in_slot || !children_of(parent, v).empty()) {
      s.steps.push_back(copy_step(phase, v, p, Target::kStaging, r));
      s.steps.push_back(copy_step(phase + 1, v, v, Target::kOutput, r));
      last = std::max(last, phase + 1);
    } else {
      s.steps.push_back(copy_step(phase, v, p, Target::kOutput, r));
      last = std::max(last, phase);
    }
  }
  return last;
}

}  // namespace

Schedule hierarchical_balanced_schedule(int world_size, const std::vector<PackTree>& trees,
                                        const std::vector<PackSlice>& packs) {
  const int n = world_size;
  if (n < 2 || n % 2 != 0) {
    throw std::invalid_argument(
        "hierarchical_balanced needs an even number of ranks (two groups of N/2); got " +
        std::to_string(n));
  }
  if (trees.empty()) throw std::invalid_argument("hierarchical_balanced: no pack trees");
  const int g = n / 2;
  const std::vector<int> members[2] = {group_members(0, g), group_members(1, g)};
  Schedule s;
  s.world_size = n;
  s.stagers.resize(static_cast<size_t>(n));
  std::iota(s.stagers.begin(), s.stagers.end(), 0);
  for (const PackSlice& p : packs) {
    if (p.range.empty()) continue;
    const PackTree& t = trees[static_cast<size_t>(p.pack_id % static_cast<int64_t>(trees.size()))];
    for (int group = 0; group < 2; ++group) {
      if (t.parent[group].size() != static_cast<size_t>(n)) {
        throw std::invalid_argument("hierarchical_balanced: pack trees are for another world size");
      }
    }
    const int64_t mid = p.range.begin + p.range.size() / 2;
    const Range half[2] = {{p.range.begin, mid}, {mid, p.range.end}};
    if (!t.pair_first) {
      const int a = t.cross, b = t.cross + g;
      const int top = std::max(reduce_up(s, t.parent[0], members[0], p.range, 1, false),
                               reduce_up(s, t.parent[1], members[1], p.range, 1, false));
      // Half 0 is finalised by a, half 1 by b, both as op(group 0 sum, group 1 sum).
      const int at[2] = {a, b};
      for (int h = 0; h < 2; ++h) {
        if (half[h].empty()) continue;
        s.steps.push_back(reduce_step(top + 1, at[h], {a, b}, Target::kStaging, half[h], true));
        s.steps.push_back(copy_step(top + 2, at[1 - h], at[h], Target::kStaging, half[h]));
      }
      copy_down(s, t.parent[0], members[0], p.range, top + 3, false);
      copy_down(s, t.parent[1], members[1], p.range, top + 3, false);
      continue;
    }
    // Pair-first: half h is led by group h.
    for (int h = 0; h < 2; ++h) {
      if (half[h].empty()) continue;
      const std::vector<int>& lead = members[h];
      const std::vector<int>& parent = t.parent[h];
      const bool one_per_group = g == 1;
      for (int i : lead) {
        const int partner = (i + g) % n;
        s.steps.push_back(reduce_step(1, i, {std::min(i, partner), std::max(i, partner)},
                                      Target::kStaging, half[h], one_per_group));
      }
      const int top = 1 + reduce_up(s, parent, lead, half[h], 2, true);
      copy_down(s, parent, lead, half[h], top + 1, true);
      for (int i : lead) {
        // i holds the total in its slot from phase top + depth(i) on.
        s.steps.push_back(
            copy_step(top + depth_of(parent, i) + 1, (i + g) % n, i, Target::kOutput, half[h]));
      }
    }
  }
  for (const Step& st : s.steps) s.num_phases = std::max(s.num_phases, st.phase);
  return s;
}

}  // namespace xdev::plan
