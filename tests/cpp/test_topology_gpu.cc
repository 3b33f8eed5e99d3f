// Unit tests of classify_gpus and reachable_from_links (csrc/plan/topology.h): how the GPUs of one
// host are classified from NVLink counts and peer reachability, per local rank. The matrices are
// the cases that matter for selection: DGX-1, DGX-1 with one link missing, fully connected 8, 4
// GPUs, PCIe only, and ranks sharing a GPU.
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/topology.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

// The DGX-1 hybrid cube-mesh stated independently of the library's table: two fully linked quads
// {0..3} and {4..7}, plus a link from i to i + 4. Counts as on a V100 DGX-1 (1 or 2 NVLinks).
LinkMatrix dgx1_v100() {
  LinkMatrix m(8);
  for (int a = 0; a < 8; ++a) {
    for (int b = a + 1; b < 8; ++b) {
      if ((a < 4) == (b < 4) || b - a == 4) m.set_links(a, b, (a + b) % 2 == 0 ? 1 : 2);
    }
  }
  return m;
}

// Every pair (and every diagonal entry) reachable, as with peer access everywhere.
LinkMatrix all_reachable(int n) {
  LinkMatrix m = LinkMatrix::fully_connected(n);
  for (int i = 0; i < n; ++i) m.set_links(i, i, 1);
  return m;
}

// Only the diagonal reachable: no peer access at all.
LinkMatrix only_self(int n) {
  LinkMatrix m(n);
  for (int i = 0; i < n; ++i) m.set_links(i, i, 1);
  return m;
}

// Rank r uses GPU gpu_of[r]; ranks on the same GPU reach each other, ranks on different GPUs
// reach each other when peer[gpu_a][gpu_b] is set. NVLinks between ranks come from the GPU
// matrix, and ranks sharing a GPU have none between them.
struct Ranks {
  LinkMatrix nvlink;
  LinkMatrix reachable;
};
Ranks ranks_on_gpus(const std::vector<int>& gpu_of, const LinkMatrix& gpu_links,
                    const LinkMatrix& gpu_peer) {
  const int n = static_cast<int>(gpu_of.size());
  Ranks r{LinkMatrix(n), LinkMatrix(n)};
  for (int a = 0; a < n; ++a) {
    for (int b = a; b < n; ++b) {
      const int ga = gpu_of[a], gb = gpu_of[b];
      if (ga == gb) {
        r.reachable.set_links(a, b, 1);
        continue;
      }
      r.nvlink.set_links(a, b, gpu_links.links(ga, gb));
      if (gpu_peer.links(ga, gb) > 0) r.reachable.set_links(a, b, 1);
    }
  }
  return r;
}

}  // namespace

TEST(gpu_reachable_from_links_marks_links_and_diagonal) {
  const LinkMatrix links = dgx1_v100();
  const LinkMatrix r = reachable_from_links(links);
  CHECK_EQ(r.size(), 8);
  for (int a = 0; a < 8; ++a) {
    for (int b = 0; b < 8; ++b) CHECK_EQ(r.links(a, b), (a == b || links.links(a, b) > 0) ? 1 : 0);
  }
  CHECK_EQ(reachable_from_links(LinkMatrix()).size(), 0);
}

TEST(gpu_dgx1_is_dgx1_with_or_without_peer_access) {
  for (const LinkMatrix& links : {LinkMatrix::dgx1(), dgx1_v100()}) {
    CHECK_EQ(classify_gpus(links, reachable_from_links(links)), TopologyClass::kDgx1);
    CHECK_EQ(classify_gpus(links, all_reachable(8)), TopologyClass::kDgx1);
    // NVML's counts decide; a reachability matrix that misses pairs does not matter.
    CHECK_EQ(classify_gpus(links, only_self(8)), TopologyClass::kDgx1);
  }
}

TEST(gpu_dgx1_minus_one_link) {
  int cases = 0;
  for (int a = 0; a < 8; ++a) {
    for (int b = a + 1; b < 8; ++b) {
      LinkMatrix links = dgx1_v100();
      if (links.links(a, b) == 0) continue;
      links.set_links(a, b, 0);
      // Reachability as the links imply it: the missing pair and the cube-mesh's non-neighbours
      // are not connected.
      CHECK_EQ(classify_gpus(links, reachable_from_links(links)), TopologyClass::kPartial);
      // Peer access everywhere (over PCIe): every pair can reach every other, but the wiring is
      // no longer the DGX-1's.
      CHECK_EQ(classify_gpus(links, all_reachable(8)), TopologyClass::kFullyConnected);
      ++cases;
    }
  }
  CHECK_EQ(cases, 16);
}

TEST(gpu_dgx1_plus_one_link_is_not_dgx1) {
  LinkMatrix links = LinkMatrix::dgx1();
  links.set_links(0, 5, 1);
  CHECK_EQ(classify_gpus(links, reachable_from_links(links)), TopologyClass::kPartial);
  CHECK_EQ(classify_gpus(links, all_reachable(8)), TopologyClass::kFullyConnected);
}

TEST(gpu_fully_connected_8) {
  const LinkMatrix links = LinkMatrix::fully_connected(8);  // e.g. NVSwitch: all to all
  CHECK_EQ(classify_gpus(links, reachable_from_links(links)), TopologyClass::kFullyConnected);
  CHECK_EQ(classify_gpus(links, only_self(8)), TopologyClass::kFullyConnected);
}

TEST(gpu_four_all_nvlinked) {
  LinkMatrix links(4);
  for (int a = 0; a < 4; ++a) {
    for (int b = a + 1; b < 4; ++b) links.set_links(a, b, 4);
  }
  CHECK_EQ(classify_gpus(links, reachable_from_links(links)), TopologyClass::kFullyConnected);
  // Half of a DGX-1 (one quad) is fully connected, never DGX-1-like.
  LinkMatrix quad(4);
  for (int a = 0; a < 4; ++a) {
    for (int b = a + 1; b < 4; ++b) quad.set_links(a, b, dgx1_v100().links(a, b));
  }
  CHECK_EQ(classify_gpus(quad, reachable_from_links(quad)), TopologyClass::kFullyConnected);
  // Four GPUs in a ring: 0-2 and 1-3 lack a link.
  const LinkMatrix ring = LinkMatrix::from_neighbors({{1, 3}, {0, 2}, {1, 3}, {0, 2}});
  CHECK_EQ(classify_gpus(ring, reachable_from_links(ring)), TopologyClass::kPartial);
}

TEST(gpu_pcie_only) {
  const LinkMatrix none(8);
  CHECK_EQ(classify_gpus(none, only_self(8)), TopologyClass::kNone);
  CHECK_EQ(classify_gpus(none, reachable_from_links(none)), TopologyClass::kNone);
  CHECK_EQ(classify_gpus(none, all_reachable(8)), TopologyClass::kFullyConnected);
  // Peer access within each PCIe switch only: {0..3} and {4..7}.
  LinkMatrix islands = only_self(8);
  for (int a = 0; a < 8; ++a) {
    for (int b = a + 1; b < 8; ++b) {
      if ((a < 4) == (b < 4)) islands.set_links(a, b, 1);
    }
  }
  CHECK_EQ(classify_gpus(none, islands), TopologyClass::kPartial);
  // A diagonal-only reachability matrix without its diagonal means the same.
  CHECK_EQ(classify_gpus(none, LinkMatrix(8)), TopologyClass::kNone);
}

TEST(gpu_size_mismatch_throws) {
  CHECK_THROWS(classify_gpus(LinkMatrix::dgx1(), all_reachable(4)), std::invalid_argument,
               "classify_gpus");
  CHECK_THROWS(classify_gpus(LinkMatrix(0), all_reachable(1)), std::invalid_argument, "0 ranks");
}

TEST(gpu_no_ranks_and_one_rank) {
  CHECK_EQ(classify_gpus(LinkMatrix(), LinkMatrix()), TopologyClass::kNone);
  CHECK_EQ(classify_gpus(LinkMatrix(1), only_self(1)), TopologyClass::kFullyConnected);
  CHECK_EQ(classify_gpus(LinkMatrix(1), LinkMatrix(1)), TopologyClass::kFullyConnected);
}

TEST(gpu_ranks_sharing_one_gpu) {
  const LinkMatrix one_gpu_links(1);
  const LinkMatrix one_gpu_peer = only_self(1);
  // 2 and 8 ranks on one GPU: no NVLinks between them, all reach the same memory.
  for (int n : {2, 8}) {
    const Ranks r = ranks_on_gpus(std::vector<int>(n, 0), one_gpu_links, one_gpu_peer);
    CHECK_EQ(r.nvlink.neighbors(0).size(), size_t{0});
    CHECK_EQ(classify_gpus(r.nvlink, r.reachable), TopologyClass::kFullyConnected);
  }
  // 8 ranks on one GPU with a DGX-1 injected as their NVLink matrix: the file wins (this is how
  // hierarchical copy is tested on one GPU).
  CHECK_EQ(classify_gpus(LinkMatrix::dgx1(), all_reachable(8)), TopologyClass::kDgx1);

  // 4 ranks on 2 GPUs without peer access: only the ranks of one GPU are connected.
  const Ranks two = ranks_on_gpus({0, 0, 1, 1}, LinkMatrix(2), only_self(2));
  CHECK_EQ(classify_gpus(two.nvlink, two.reachable), TopologyClass::kPartial);
  // The same with the two GPUs NVLinked.
  LinkMatrix pair(2);
  pair.set_links(0, 1, 2);
  const Ranks linked = ranks_on_gpus({0, 0, 1, 1}, pair, reachable_from_links(pair));
  CHECK_EQ(linked.nvlink.links(0, 2), 2);
  CHECK_EQ(linked.nvlink.links(0, 1), 0);
  CHECK_EQ(classify_gpus(linked.nvlink, linked.reachable), TopologyClass::kFullyConnected);

  // 16 ranks, two per GPU of a DGX-1: 16 ranks are never DGX-1-like, even though each GPU is.
  std::vector<int> gpu_of;
  for (int r = 0; r < 16; ++r) gpu_of.push_back(r / 2);
  const LinkMatrix dgx = dgx1_v100();
  const Ranks sixteen = ranks_on_gpus(gpu_of, dgx, reachable_from_links(dgx));
  CHECK_EQ(classify_gpus(sixteen.nvlink, sixteen.reachable), TopologyClass::kPartial);
  const Ranks sixteen_peer = ranks_on_gpus(gpu_of, dgx, all_reachable(8));
  CHECK_EQ(classify_gpus(sixteen_peer.nvlink, sixteen_peer.reachable),
           TopologyClass::kFullyConnected);
  // 8 ranks on the 4 GPUs of one DGX-1 quad: 8 ranks, every pair linked or sharing a GPU, yet not
  // DGX-1-like (each rank has 6 NVLinked peers).
  const Ranks eight = ranks_on_gpus({0, 1, 2, 3, 0, 1, 2, 3}, dgx, reachable_from_links(dgx));
  CHECK(!is_dgx1_like(eight.nvlink));
  CHECK_EQ(classify_gpus(eight.nvlink, eight.reachable), TopologyClass::kFullyConnected);
}

TEST(gpu_nvswitch_host_is_nvswitch_and_its_direct_links_are_what_is_left) {
  // An HGX H100 as NVML reports it: every pair joined through the switches (18 = min of the
  // two GPUs' switch links), no direct GPU-to-GPU links.
  LinkMatrix links(8);
  for (int a = 0; a < 8; ++a) {
    for (int b = a + 1; b < 8; ++b) links.set_links(a, b, 18);
  }
  const std::vector<int> nvswitch(8, 18);
  CHECK_EQ(classify_gpus(links, all_reachable(8), nvswitch), TopologyClass::kNvSwitch);
  CHECK_EQ(classify_gpus(links, all_reachable(8)), TopologyClass::kFullyConnected);
  CHECK_EQ(std::string(to_string(TopologyClass::kNvSwitch)), std::string("nvswitch"));
  const LinkMatrix direct = direct_links(links, nvswitch);
  for (int a = 0; a < 8; ++a) {
    for (int b = 0; b < 8; ++b) CHECK_EQ(direct.links(a, b), 0);
  }
  // One GPU without switch links: not an NVSwitch host; its direct links stay.
  std::vector<int> partial = nvswitch;
  partial[3] = 0;
  links.set_links(3, 4, 2);
  CHECK(classify_gpus(links, all_reachable(8), partial) != TopologyClass::kNvSwitch);
  CHECK_EQ(direct_links(links, partial).links(3, 4), 2);
  CHECK_EQ(direct_links(links, partial).links(0, 1), 0);
  // A DGX-1 stays a DGX-1 whatever the switch counts say; one rank is not a switch host.
  CHECK_EQ(classify_gpus(LinkMatrix::dgx1(), all_reachable(8), nvswitch), TopologyClass::kDgx1);
  CHECK_EQ(classify_gpus(LinkMatrix(1), all_reachable(1), {18}), TopologyClass::kFullyConnected);
  CHECK_THROWS(classify_gpus(links, all_reachable(8), {18}), std::invalid_argument,
               "1 NVSwitch link counts for 8 ranks");
}
