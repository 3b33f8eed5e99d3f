// Unit tests of the plan layer: topology and packing. Selection is in test_selection.cc,
// schedules and collective plans in test_plan_schedule.cc. Build: c++ -std=c++17 -I csrc
// csrc/plan/*.cc tests/cpp/*.cc
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "plan/packing.h"
#include "plan/topology.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there
using xdev_test::uniform;

namespace {

// Copies tensors[i] (raw bytes) of one group into the group's payload buffer at
// the offsets its layout gives, and back: what a caller of group_by_dtype does.
void pack_group(const DtypeGroup& group, const std::vector<const void*>& tensors, void* payload) {
  auto* out = static_cast<char*>(payload);
  for (size_t k = 0; k < group.tensor_indices.size(); ++k) {
    const size_t bytes = static_cast<size_t>(group.layout.numel(k)) * group.elem_size;
    if (bytes == 0) continue;
    std::memcpy(out + group.layout.offset(k) * group.elem_size, tensors[group.tensor_indices[k]],
                bytes);
  }
}

void unpack_group(const DtypeGroup& group, const void* payload, const std::vector<void*>& tensors) {
  const auto* in = static_cast<const char*>(payload);
  for (size_t k = 0; k < group.tensor_indices.size(); ++k) {
    const size_t bytes = static_cast<size_t>(group.layout.numel(k)) * group.elem_size;
    if (bytes == 0) continue;
    std::memcpy(tensors[group.tensor_indices[k]], in + group.layout.offset(k) * group.elem_size,
                bytes);
  }
}

// The DGX-1 hybrid cube-mesh stated independently of the library's table: two fully linked
// quads {0..3} and {4..7}, plus a link from i to i + 4.
bool dgx1_pair(int a, int b) {
  return a != b && ((a < 4) == (b < 4) || a - b == 4 || b - a == 4);
}

std::vector<std::vector<int>> dgx1_lists() {
  std::vector<std::vector<int>> rows(8);
  for (int a = 0; a < 8; ++a) {
    for (int b = 0; b < 8; ++b) {
      if (dgx1_pair(a, b)) rows[a].push_back(b);
    }
  }
  return rows;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Topology

TEST(dgx1_matrix_is_the_hybrid_cube_mesh) {
  const LinkMatrix m = LinkMatrix::dgx1();
  CHECK_EQ(m.size(), 8);
  for (int a = 0; a < 8; ++a) {
    CHECK_EQ(m.neighbors(a).size(), size_t{4});
    for (int b = 0; b < 8; ++b) {
      CHECK_EQ(m.links(a, b) > 0, dgx1_pair(a, b));
      CHECK_EQ(m.links(a, b), m.links(b, a));
    }
  }
  CHECK(is_dgx1_like(m));
  CHECK_EQ(classify(m), TopologyClass::kDgx1);
}

TEST(is_dgx1_like_accepts_exact_rows_with_optional_self) {
  auto rows = dgx1_lists();
  CHECK(is_dgx1_like(rows));
  // Order and repeats do not change a peer set; listing oneself is explicitly allowed.
  for (auto& row : rows) std::reverse(row.begin(), row.end());
  rows[2].push_back(2);
  rows[5].insert(rows[5].begin(), 5);
  rows[7].push_back(rows[7].front());
  CHECK(is_dgx1_like(rows));
  for (int i = 0; i < 8; ++i) rows[i].push_back(i);
  CHECK(is_dgx1_like(rows));
}

TEST(is_dgx1_like_rejects_any_other_difference) {
  const auto base = dgx1_lists();
  for (int i = 0; i < 8; ++i) {
    auto missing = base;
    missing[i].pop_back();
    CHECK(!is_dgx1_like(missing));
    for (int extra = 0; extra < 8; ++extra) {
      if (extra == i || dgx1_pair(i, extra)) continue;
      auto more = base;
      more[i].push_back(extra);
      CHECK(!is_dgx1_like(more));
    }
    auto out_of_range = base;
    out_of_range[i].push_back(i % 2 == 0 ? 8 : -1);
    CHECK(!is_dgx1_like(out_of_range));
  }
  // The rule compares lists row by row, so a one-sided entry fails even though a LinkMatrix
  // built from the lists would be symmetric.
  auto one_sided = base;
  one_sided[4].erase(std::find(one_sided[4].begin(), one_sided[4].end(), 0));
  CHECK(!is_dgx1_like(one_sided));
  CHECK(is_dgx1_like(LinkMatrix::from_neighbors(one_sided)));
  // Same shape under another labelling is not "DGX-1-like": the rows are fixed.
  auto relabelled = base;
  std::swap(relabelled[0], relabelled[1]);
  for (auto& row : relabelled) {
    for (int& p : row) p = p == 0 ? 1 : p == 1 ? 0 : p;
  }
  CHECK(!is_dgx1_like(relabelled));
  // Exactly 8 devices.
  auto seven = base;
  seven.pop_back();
  CHECK(!is_dgx1_like(seven));
  auto nine = base;
  nine.push_back({});
  CHECK(!is_dgx1_like(nine));
  CHECK(!is_dgx1_like(std::vector<std::vector<int>>{}));
}

TEST(dgx1_with_a_link_removed_is_partial) {
  int removed = 0;
  for (int a = 0; a < 8; ++a) {
    for (int b = a + 1; b < 8; ++b) {
      if (!dgx1_pair(a, b)) continue;
      LinkMatrix m = LinkMatrix::dgx1();
      m.set_links(a, b, 0);
      CHECK(!is_dgx1_like(m));
      CHECK_EQ(classify(m), TopologyClass::kPartial);
      ++removed;
    }
  }
  CHECK_EQ(removed, 16);
}

TEST(classify_fully_connected_and_none) {
  CHECK_EQ(classify(LinkMatrix::fully_connected(8)), TopologyClass::kFullyConnected);
  CHECK(!is_dgx1_like(LinkMatrix::fully_connected(8)));
  const LinkMatrix four = LinkMatrix::from_neighbors({{1, 2, 3}, {0, 2, 3}, {0, 1, 3}, {0, 1, 2}});
  CHECK_EQ(classify(four), TopologyClass::kFullyConnected);
  CHECK(!is_dgx1_like(four));
  CHECK_EQ(classify(LinkMatrix::fully_connected(4)), TopologyClass::kFullyConnected);
  CHECK_EQ(classify(LinkMatrix::fully_connected(1)), TopologyClass::kFullyConnected);
  CHECK_EQ(classify(LinkMatrix(8)), TopologyClass::kNone);
  CHECK(!is_dgx1_like(LinkMatrix(8)));
  CHECK_EQ(classify(LinkMatrix::from_neighbors({{1}, {0}, {}})), TopologyClass::kPartial);
  CHECK_EQ(std::string(to_string(TopologyClass::kDgx1)), "dgx1");
}

TEST(link_matrix_rejects_out_of_range_devices) {
  CHECK_THROWS(LinkMatrix::from_neighbors({{1}, {2}}), std::invalid_argument, "out of range");
  CHECK_THROWS(LinkMatrix::from_neighbors({{-1}, {0}}), std::invalid_argument, "out of range");
  const LinkMatrix m = LinkMatrix::fully_connected(4);
  CHECK_THROWS(m.links(0, 4), std::out_of_range, "");
  CHECK_THROWS(m.links(-1, 0), std::out_of_range, "");
  LinkMatrix w(4);
  CHECK_THROWS(w.set_links(4, 0, 1), std::out_of_range, "");
  CHECK_THROWS(w.set_links(0, 1, -1), std::invalid_argument, "negative");
  CHECK_THROWS(LinkMatrix(-1), std::invalid_argument, "negative");
}

TEST(link_matrix_rows_and_text_round_trip) {
  // A DGX-1 V100's NVLink counts (NV1 / NV2), the diagonal deliberately non-zero: it is ignored.
  const std::vector<std::vector<int64_t>> v100 = {
      {9, 1, 1, 2, 2, 0, 0, 0}, {1, 9, 2, 1, 0, 2, 0, 0}, {1, 2, 9, 2, 0, 0, 1, 0},
      {2, 1, 2, 9, 0, 0, 0, 1}, {2, 0, 0, 0, 9, 1, 1, 2}, {0, 2, 0, 0, 1, 9, 2, 1},
      {0, 0, 1, 0, 1, 2, 9, 2}, {0, 0, 0, 1, 2, 1, 2, 9}};
  const LinkMatrix m = LinkMatrix::from_rows(v100);
  CHECK_EQ(m.size(), 8);
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) CHECK_EQ(m.links(i, j), i == j ? 0 : static_cast<int>(v100[i][j]));
  }
  CHECK(is_dgx1_like(m));
  const auto rows = m.to_rows();
  CHECK_EQ(LinkMatrix::from_rows(rows).to_rows(), rows);
  CHECK_EQ(rows[0], (std::vector<int64_t>{0, 1, 1, 2, 2, 0, 0, 0}));
  CHECK_EQ(LinkMatrix(2).to_text(), std::string("2 0 0 0 0"));
  LinkMatrix two(2);
  two.set_links(0, 1, 3);
  CHECK_EQ(two.to_text(), std::string("2 0 3 3 0"));
  CHECK_EQ(LinkMatrix::from_text(m.to_text()).to_rows(), rows);
  CHECK_EQ(LinkMatrix::from_text("0").size(), 0);
  CHECK_EQ(LinkMatrix::from_rows({}).size(), 0);
}

TEST(link_matrix_from_rows_names_the_first_problem) {
  using Rows = std::vector<std::vector<int64_t>>;
  CHECK_THROWS(LinkMatrix::from_rows(Rows{{0, 1, 1}, {1, 0, 1}}, "the NVLink matrix"),
               std::invalid_argument, "the NVLink matrix is not square: row 0 has 3 entries");
  CHECK_THROWS(LinkMatrix::from_rows(Rows{{0, 1}, {2, 0}}, "M"), std::invalid_argument,
               "M is not symmetric: [0][1] = 1 but [1][0] = 2");
  CHECK_THROWS(LinkMatrix::from_rows(Rows{{0, -1}, {-1, 0}}, "M"), std::invalid_argument,
               "M has -1 at [0][1], expected 0..1024");
  CHECK_THROWS(LinkMatrix::from_rows(Rows{{0, 1025}, {1025, 0}}), std::invalid_argument,
               "has 1025 at [0][1]");
  CHECK_THROWS(LinkMatrix::from_rows(Rows{{1, 2}, {2, 1}}, "R", 1), std::invalid_argument,
               "R has 2 at [0][1], expected 0..1");
  // The lower triangle is checked through symmetry.
  CHECK_THROWS(LinkMatrix::from_rows(Rows{{0, 1}, {-1, 0}}, "M"), std::invalid_argument,
               "not symmetric");
  CHECK_THROWS(LinkMatrix::from_text("2 0 1 1"), std::invalid_argument, "malformed");
  CHECK_THROWS(LinkMatrix::from_text("x"), std::invalid_argument, "malformed");
  CHECK_THROWS(LinkMatrix::from_text("1 0 7"), std::invalid_argument, "trailing");
  CHECK_THROWS(LinkMatrix::from_text("2 0 1 2 0"), std::invalid_argument, "not symmetric");
}

// ---------------------------------------------------------------------------------------------
// Packing

namespace {

// Packs must be in payload order and cover every element exactly once.
bool tiles(const std::vector<Range>& packs, int64_t total) {
  int64_t at = 0;
  for (const Range& p : packs) {
    if (p.begin != at || p.end < p.begin) return false;
    at = p.end;
  }
  return at == total;
}

std::vector<int64_t> random_numels(std::mt19937& rng, int max_tensors, int64_t max_numel) {
  std::vector<int64_t> numels(static_cast<size_t>(uniform(rng, 0, max_tensors)));
  // One in four tensors is empty: zero-element tensors are legal and easy to mishandle.
  for (int64_t& n : numels) n = uniform(rng, 0, 3) == 0 ? 0 : uniform(rng, 1, max_numel);
  return numels;
}

// Small-tensor aggregation restated as a single pass that closes the open run when a big tensor
// arrives or the run is full.
std::vector<Range> expected_aggregation(const FlatLayout& l, int64_t elem_size, int64_t max_bytes,
                                        int64_t max_group) {
  std::vector<Range> packs;
  int64_t run_size = 0;
  for (size_t t = 0; t < l.num_tensors(); ++t) {
    const Range r{l.offset(t), l.offset(t) + l.numel(t)};
    const bool small = l.numel(t) * elem_size <= max_bytes;
    if (small && run_size > 0 && run_size < max_group) {
      packs.back().end = r.end;
      ++run_size;
    } else {
      packs.push_back(r);
      run_size = small ? 1 : 0;
    }
  }
  return packs;
}

}  // namespace

TEST(packing_options_validate_names_the_negative_field) {
  PackingOptions ok;
  ok.validate();  // all zero is valid: no packing
  const char* names[] = {"num_packs", "agg_small_grads_max_bytes", "agg_small_grads_max_group",
                         "bytes_per_pack"};
  for (int field = 0; field < 4; ++field) {
    PackingOptions o;
    int64_t* fields[] = {&o.num_packs, &o.agg_small_grads_max_bytes, &o.agg_small_grads_max_group,
                         &o.bytes_per_pack};
    *fields[field] = -3;
    CHECK_THROWS(o.validate(), std::invalid_argument, names[field]);
    CHECK_THROWS(make_packs(FlatLayout({4, 4}), 4, o), std::invalid_argument, names[field]);
  }
}

TEST(concat_and_split_gives_equal_packs_and_remainder_last) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const FlatLayout layout(random_numels(rng, 6, 20));
    PackingOptions o;
    o.num_packs = uniform(rng, 1, 12);
    o.bytes_per_pack = uniform(rng, 0, 64);  // num_packs takes precedence
    const auto packs = make_packs(layout, 4, o);
    const int64_t total = layout.total();
    const int64_t base = total / o.num_packs;
    CHECK_EQ(static_cast<int64_t>(packs.size()), o.num_packs);
    CHECK(tiles(packs, total));
    for (size_t i = 0; i + 1 < packs.size(); ++i) CHECK_EQ(packs[i].size(), base);
    if (!packs.empty()) CHECK_EQ(packs.back().size(), total - base * (o.num_packs - 1));
  }
  // Fewer elements than packs: the leading packs are empty, the last holds everything.
  PackingOptions o;
  o.num_packs = 5;
  const auto packs = make_packs(FlatLayout({2, 1}), 8, o);
  CHECK_EQ(packs.size(), size_t{5});
  for (int i = 0; i < 4; ++i) CHECK_EQ(packs[i], (Range{0, 0}));
  CHECK_EQ(packs[4], (Range{0, 3}));
  // The function itself, as the cost model calls it: fewer than one pack counts as one.
  for (int64_t p : {int64_t{0}, int64_t{-2}}) {
    CHECK_EQ(concat_and_split(7, p).size(), size_t{1});
    CHECK_EQ(concat_and_split(7, p)[0], (Range{0, 7}));
  }
  const auto three = concat_and_split(11, 3);
  CHECK_EQ(three.size(), size_t{3});
  CHECK_EQ(three[0], (Range{0, 3}));
  CHECK_EQ(three[1], (Range{3, 6}));
  CHECK_EQ(three[2], (Range{6, 11}));
}

TEST(bytes_per_pack_cuts_every_n_elements) {
  std::mt19937 rng(12);
  for (int trial = 0; trial < 300; ++trial) {
    const FlatLayout layout(random_numels(rng, 6, 40));
    const int64_t elem_size = int64_t{1} << uniform(rng, 0, 3);
    PackingOptions o;
    o.bytes_per_pack = elem_size * uniform(rng, 1, 16);
    o.agg_small_grads_max_bytes = 64;  // bytes_per_pack takes precedence
    o.agg_small_grads_max_group = 4;
    const int64_t per = o.bytes_per_pack / elem_size;
    const auto packs = make_packs(layout, static_cast<size_t>(elem_size), o);
    CHECK(tiles(packs, layout.total()));
    CHECK_EQ(static_cast<int64_t>(packs.size()), (layout.total() + per - 1) / per);
    for (size_t i = 0; i < packs.size(); ++i) {
      CHECK_EQ(packs[i].begin, static_cast<int64_t>(i) * per);
      if (i + 1 < packs.size()) CHECK_EQ(packs[i].size(), per);
    }
  }
  // A pack smaller than one element still advances by one element.
  PackingOptions o;
  o.bytes_per_pack = 3;
  CHECK_EQ(make_packs(FlatLayout({3}), 8, o).size(), size_t{3});
}

TEST(bytes_per_pack_makes_at_most_kMaxPacks_packs) {
  // One byte per pack of 100,000 floats would be 100,000 packs: seconds of
  // planning per call. The packs grow instead, to ceil(total / kMaxPacks).
  PackingOptions o;
  o.bytes_per_pack = 1;
  const FlatLayout layout({60000, 1, 39999});
  const auto packs = make_packs(layout, 4, o);
  CHECK(tiles(packs, layout.total()));
  CHECK_EQ(packs.size(), size_t{1021});  // ceil(100000 / 1024) = 98 elements a pack
  for (size_t i = 0; i + 1 < packs.size(); ++i) CHECK_EQ(packs[i].size(), int64_t{98});
  // At exactly kMaxPacks packs' worth the option is taken as given.
  o.bytes_per_pack = 8;
  CHECK_EQ(static_cast<int64_t>(make_packs(FlatLayout({2 * kMaxPacks}), 4, o).size()), kMaxPacks);
}

TEST(small_tensor_aggregation_groups_runs_of_small_tensors) {
  // Bytes per tensor (elem size 4): 4 4 400 4 4 4 4 4 with max_bytes 16 and max_group 3.
  PackingOptions o;
  o.agg_small_grads_max_bytes = 16;
  o.agg_small_grads_max_group = 3;
  const auto packs = make_packs(FlatLayout({1, 1, 100, 1, 1, 1, 1, 1}), 4, o);
  const std::vector<Range> want = {{0, 2}, {2, 102}, {102, 105}, {105, 107}};
  CHECK_EQ(packs.size(), want.size());
  CHECK(packs == want);

  std::mt19937 rng(13);
  for (int trial = 0; trial < 500; ++trial) {
    const FlatLayout layout(random_numels(rng, 12, 10));
    const int64_t elem_size = int64_t{1} << uniform(rng, 0, 3);
    PackingOptions a;
    a.agg_small_grads_max_bytes = uniform(rng, 1, 48);
    a.agg_small_grads_max_group = uniform(rng, 1, 5);
    const auto got = make_packs(layout, static_cast<size_t>(elem_size), a);
    CHECK(tiles(got, layout.total()));
    CHECK(got == expected_aggregation(layout, elem_size, a.agg_small_grads_max_bytes,
                                      a.agg_small_grads_max_group));
  }
}

TEST(no_packing_is_one_pack_per_tensor) {
  std::mt19937 rng(14);
  for (int trial = 0; trial < 100; ++trial) {
    const FlatLayout layout(random_numels(rng, 8, 10));
    PackingOptions o;
    // Aggregation needs both knobs; one alone means no packing.
    (trial % 2 == 0 ? o.agg_small_grads_max_bytes : o.agg_small_grads_max_group) = 1000;
    const auto packs = make_packs(layout, 2, o);
    CHECK(tiles(packs, layout.total()));
    CHECK_EQ(packs.size(), layout.num_tensors());
    for (size_t t = 0; t < packs.size(); ++t) {
      CHECK_EQ(packs[t], (Range{layout.offset(t), layout.offset(t) + layout.numel(t)}));
    }
  }
  CHECK_THROWS(make_packs(FlatLayout({1}), 0, PackingOptions{}), std::invalid_argument,
               "elem_size");
}

TEST(group_by_dtype_pack_unpack_round_trips) {
  const int dtype_ids[] = {7, 3, 11, 5};
  const size_t elem_sizes[] = {1, 2, 4, 8};
  std::mt19937 rng(15);
  for (int trial = 0; trial < 400; ++trial) {
    std::vector<TensorDesc> descs(static_cast<size_t>(uniform(rng, 0, 12)));
    std::vector<std::vector<unsigned char>> data;
    for (TensorDesc& d : descs) {
      const auto kind = static_cast<size_t>(uniform(rng, 0, 3));
      d = {dtype_ids[kind], elem_sizes[kind], uniform(rng, 0, 3) == 0 ? 0 : uniform(rng, 1, 50)};
      data.emplace_back(static_cast<size_t>(d.numel) * d.elem_size);
      for (unsigned char& byte : data.back()) byte = static_cast<unsigned char>(rng());
    }
    const auto groups = group_by_dtype(descs);
    std::vector<const void*> inputs;
    for (const auto& buf : data) inputs.push_back(buf.data());
    std::vector<std::vector<unsigned char>> outputs;
    for (const auto& buf : data) outputs.emplace_back(buf.size(), 0);
    std::vector<void*> output_ptrs;
    for (auto& buf : outputs) output_ptrs.push_back(buf.data());

    std::vector<int> seen(descs.size(), 0);
    std::set<int> group_dtypes;
    for (const DtypeGroup& g : groups) {
      CHECK(group_dtypes.insert(g.dtype).second);  // one group per dtype
      CHECK_EQ(g.layout.num_tensors(), g.tensor_indices.size());
      // Groups appear in order of their first tensor; members keep call order.
      CHECK(&g == &groups.front() || (&g - 1)->tensor_indices.front() < g.tensor_indices.front());
      for (size_t k = 0; k < g.tensor_indices.size(); ++k) {
        const size_t i = g.tensor_indices[k];
        if (k > 0) CHECK(g.tensor_indices[k - 1] < i);
        ++seen[i];
        CHECK_EQ(descs[i].dtype, g.dtype);
        CHECK_EQ(g.elem_size, descs[i].elem_size);
        CHECK_EQ(g.layout.numel(k), descs[i].numel);
      }
      std::vector<unsigned char> payload(static_cast<size_t>(g.layout.total()) * g.elem_size);
      pack_group(g, inputs, payload.data());
      for (size_t k = 0; k < g.tensor_indices.size(); ++k) {
        const auto& src = data[g.tensor_indices[k]];
        if (src.empty()) continue;
        const size_t at = static_cast<size_t>(g.layout.offset(k)) * g.elem_size;
        CHECK(std::memcmp(payload.data() + at, src.data(), src.size()) == 0);
      }
      unpack_group(g, payload.data(), output_ptrs);
    }
    for (size_t i = 0; i < descs.size(); ++i) {
      CHECK_EQ(seen[i], 1);
      if (data[i].empty()) continue;
      CHECK(std::memcmp(outputs[i].data(), data[i].data(), data[i].size()) == 0);
    }
  }
  CHECK_THROWS(group_by_dtype({{1, 4, 2}, {1, 8, 2}}), std::invalid_argument, "two element sizes");
}

TEST(for_each_piece_matches_per_element_mapping) {
  std::mt19937 rng(16);
  for (int trial = 0; trial < 500; ++trial) {
    const FlatLayout layout(random_numels(rng, 8, 12));
    const int64_t total = layout.total();
    // Brute force: the (tensor, offset) of every payload element.
    std::vector<std::pair<size_t, int64_t>> owner;
    for (size_t t = 0; t < layout.num_tensors(); ++t) {
      CHECK_EQ(layout.offset(t), static_cast<int64_t>(owner.size()));
      for (int64_t j = 0; j < layout.numel(t); ++j) owner.emplace_back(t, j);
    }
    CHECK_EQ(static_cast<int64_t>(owner.size()), total);
    for (int query = 0; query < 10; ++query) {
      int64_t b = uniform(rng, 0, total);
      int64_t e = uniform(rng, 0, total);
      if (query % 3 != 0 && b > e) std::swap(b, e);  // an inverted range now and then
      std::vector<std::tuple<size_t, int64_t, int64_t>> want;
      for (int64_t x = b; x < e; ++x) {
        const auto [t, j] = owner[static_cast<size_t>(x)];
        if (!want.empty() && std::get<0>(want.back()) == t) {
          ++std::get<2>(want.back());
        } else {
          want.emplace_back(t, j, 1);
        }
      }
      std::vector<std::tuple<size_t, int64_t, int64_t>> got;
      layout.for_each_piece(Range{b, e}, [&](size_t t, int64_t offset, int64_t count) {
        got.emplace_back(t, offset, count);
      });
      CHECK(got == want);
    }
  }
}

int main() {
  return xdev_test::run_all();
}
