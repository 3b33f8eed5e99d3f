// Unit tests of the built-in machines (csrc/plan/machines.h): their links, routes and shared
// resources, each checked against the hardware it describes.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan/cost_model.h"
#include "plan/machines.h"
#include "plan/topology.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

TEST(cost_dgx1_v100_links_double_eight_pairs) {
  const LinkMatrix links = dgx1_v100_links();
  const LinkMatrix mesh = LinkMatrix::dgx1();
  CHECK_EQ(links.size(), 8);
  const std::vector<std::pair<int, int>> doubled = {{0, 3}, {0, 4}, {1, 2}, {1, 5},
                                                    {2, 3}, {4, 7}, {5, 6}, {6, 7}};
  int total = 0;
  for (int a = 0; a < 8; ++a) {
    int per_gpu = 0;
    for (int b = 0; b < 8; ++b) {
      per_gpu += links.links(a, b);
      CHECK_EQ(links.links(a, b), links.links(b, a));
      const bool is_doubled = std::find(doubled.begin(), doubled.end(),
                                        std::pair{std::min(a, b), std::max(a, b)}) != doubled.end();
      const int expected = is_doubled ? 2 : (mesh.links(a, b) > 0 ? 1 : 0);
      CHECK_EQ(links.links(a, b), expected);
      if (a < b) total += links.links(a, b);
    }
    CHECK_EQ(per_gpu, 6);
    CHECK_EQ(links.neighbors(a), mesh.neighbors(a));  // the same 4 neighbours
  }
  CHECK_EQ(total, 24);  // 16 cube-mesh pairs + 8 doubled
}

TEST(cost_dgx1_p100_is_the_cube_mesh_with_single_links) {
  const MachineModel m = dgx1_p100();
  const LinkMatrix mesh = LinkMatrix::dgx1();
  CHECK_EQ(m.num_devices(), 8);
  CHECK_EQ(m.name(), std::string("dgx1-p100"));
  for (int a = 0; a < 8; ++a) {
    int per_gpu = 0;
    for (int b = 0; b < 8; ++b) {
      CHECK_EQ(m.links.links(a, b), mesh.links(a, b));
      CHECK(m.links.links(a, b) <= 1);
      per_gpu += m.links.links(a, b);
    }
    CHECK_EQ(per_gpu, 4);
  }
  CHECK_EQ(m.route(0, 1).size(), size_t{1});
  CHECK_NEAR(m.resources()[static_cast<size_t>(m.route(0, 1)[0])].bytes_per_s, 20e9);
  CHECK_NEAR(m.resources()[static_cast<size_t>(m.local(0).at(0))].bytes_per_s, 732e9);
}

TEST(cost_dgx1_v100_routes) {
  const MachineModel m = dgx1_v100();
  const auto bw = [&](int id) { return m.resources()[static_cast<size_t>(id)].bytes_per_s; };
  CHECK_EQ(m.num_devices(), 8);
  CHECK_EQ(m.name(), std::string("dgx1-v100"));
  // 0 -> 3: a doubled NVLink pair, one resource of 2 * 25e9.
  CHECK_EQ(m.route(0, 3).size(), size_t{1});
  CHECK_NEAR(bw(m.route(0, 3)[0]), 50e9);
  // 0 -> 1: a single link.
  CHECK_EQ(m.route(0, 1).size(), size_t{1});
  CHECK_NEAR(bw(m.route(0, 1)[0]), 25e9);
  // The two directions are separate resources.
  CHECK(m.route(0, 3)[0] != m.route(3, 0)[0]);
  // 0 -> 5: no NVLink, out of GPU 0's PCIe lane and into GPU 5's.
  const std::vector<int>& pcie = m.route(0, 5);
  CHECK_EQ(pcie.size(), size_t{2});
  if (pcie.size() == 2) {
    CHECK(pcie[0] != pcie[1]);
    CHECK_NEAR(bw(pcie[0]), 12e9);
    CHECK_NEAR(bw(pcie[1]), 12e9);
    // 0 -> 6 leaves by the same lane, 4 -> 5 enters by the same lane.
    CHECK_EQ(m.route(0, 6).at(0), pcie[0]);
    CHECK_EQ(m.route(4, 5).size(), size_t{1});  // 4 and 5 are NVLink neighbours
    CHECK_EQ(m.route(2, 5).at(1), pcie[1]);
  }
  CHECK_EQ(m.local(0).size(), size_t{1});
  CHECK_NEAR(bw(m.local(0).at(0)), 900e9);
  CHECK(m.local(0) != m.local(1));
  CHECK(m.policy == SharingPolicy::kOldestFirst);
  CHECK(!m.barrier_between_phases);
  CHECK_NEAR(m.launch_latency_s, 8.4e-6);
  CHECK_NEAR(m.step_latency_s, 3.4e-6);
  CHECK_EQ(builtin_machine("dgx1-v100").name(), std::string("dgx1-v100"));
  CHECK_EQ(builtin_machine("dgx1-p100").name(), std::string("dgx1-p100"));
}

TEST(cost_pcie_8gpu_routes_through_switches_root_complexes_and_the_socket_link) {
  const MachineModel m = pcie_8gpu();
  CHECK_EQ(m.num_devices(), 8);
  // GPUs 2k and 2k+1 share a switch; switches 0-1 hang off socket 0, 2-3 off socket 1.
  const auto hops = [&](int a, int b) { return m.route(a, b).size(); };
  for (int a = 0; a < 8; ++a) {
    for (int b = 0; b < 8; ++b) {
      if (a == b) continue;
      CHECK_EQ(m.links.links(a, b), 0);
      const bool same_switch = a / 2 == b / 2, same_socket = a / 4 == b / 4;
      CHECK_EQ(hops(a, b), same_switch ? size_t{2} : same_socket ? size_t{4} : size_t{5});
    }
  }
  // The socket link is the slowest resource on a cross-socket route.
  double slowest = 1e30;
  for (int r : m.route(0, 7)) slowest = std::min(slowest, m.resources()[r].bytes_per_s);
  CHECK_NEAR(slowest, 10e9);
  // xdev's CUDA executor: a barrier (one PCIe flag hand-off) per phase, 32 MiB windows.
  CHECK(m.barrier_between_phases);
  CHECK_NEAR(m.barrier_latency_s, 5.7e-6);
  CHECK_EQ(m.window_bytes, int64_t{32} << 20);
  CHECK_EQ(builtin_machine("pcie-8gpu").name(), std::string("pcie-8gpu"));
}

TEST(cost_nvswitch_hosts_route_every_pair_over_the_two_ports) {
  for (const MachineModel& m : {hgx_h100(), hgx_a100()}) {
    const double port = m.name() == "hgx-h100" ? 18 * 20.6e9 : 12 * 20e9;
    CHECK_EQ(m.num_devices(), 8);
    for (int a = 0; a < 8; ++a) {
      for (int b = 0; b < 8; ++b) {
        if (a == b) continue;
        CHECK(m.links.linked(a, b));
        CHECK_EQ(m.route(a, b).size(), size_t{2});
        for (int r : m.route(a, b)) CHECK_NEAR(m.resources()[r].bytes_per_s, port);
      }
    }
    CHECK(m.barrier_between_phases);
    CHECK_NEAR(m.barrier_latency_s, 2e-6);
    // One port per direction per GPU: GPU 0's sends to 1 and 2 share its port out.
    CHECK_EQ(m.route(0, 1)[0], m.route(0, 2)[0]);
    CHECK(m.route(0, 1)[1] != m.route(0, 2)[1]);
    CHECK_EQ(builtin_machine(m.name()).name(), m.name());
  }
}

TEST(cost_gpu_host_checks_nvswitch_link_counts) {
  GpuHostParams p;
  CHECK_THROWS(gpu_host("x", LinkMatrix(2), p, {18}), std::invalid_argument, "1 NVSwitch");
  CHECK_THROWS(gpu_host("x", LinkMatrix(2), p, {18, -1}), std::invalid_argument, "negative");
  // A GPU without switch links reaches the others over PCIe.
  const MachineModel m = gpu_host("x", LinkMatrix(3), p, {4, 4, 0});
  CHECK_EQ(m.route(0, 1).size(), size_t{2});
  CHECK_NEAR(m.resources()[m.route(0, 1)[0]].bytes_per_s, 4 * p.nvlink_bytes_per_s);
  CHECK_NEAR(m.resources()[m.route(0, 2)[0]].bytes_per_s, p.pcie_bytes_per_s);
  CHECK(!m.links.linked(0, 2));
}

TEST(cost_nvlink_bridged_hosts_link_every_pair) {
  const MachineModel two = nvlink_2gpu(), four = nvlink_4gpu();
  CHECK_EQ(two.links.links(0, 1), 12);
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) {
      if (a != b) CHECK_EQ(four.links.links(a, b), 4);
    }
  }
}

TEST(cost_cpu_host_shares_cores_between_ranks) {
  CpuHostParams params;
  params.cores = 2;
  params.core_bytes_per_s = 6e9;
  params.memory_bytes_per_s = 20e9;
  const MachineModel m = cpu_host(4, params);
  const auto bw = [&](int id) { return m.resources()[static_cast<size_t>(id)].bytes_per_s; };
  CHECK_EQ(m.num_devices(), 4);
  CHECK(m.barrier_between_phases);
  CHECK(m.policy == SharingPolicy::kFairShare);
  CHECK_EQ(m.window_bytes, params.window_bytes);
  // Every rank's local resources: its core (2 cores for 4 ranks: 6e9 * 0.5 = 3e9) and the
  // host memory (shared by all).
  for (int r = 0; r < 4; ++r) {
    CHECK_EQ(m.local(r).size(), size_t{2});
    if (m.local(r).size() != 2) continue;
    CHECK_NEAR(bw(m.local(r)[0]), params.core_bytes_per_s * 0.5);
    CHECK_NEAR(bw(m.local(r)[1]), 20e9);
    CHECK_EQ(m.local(r)[1], m.local(0)[1]);
    for (int a = 0; a < 4; ++a) {
      // A read of a's slot by r uses r's core: the reader moves the bytes.
      if (a != r) CHECK_EQ(m.route(a, r), m.local(r));
      if (a != r) CHECK(m.links.links(a, r) == 1);
    }
  }
  // As many cores as ranks (or more): each core at full speed.
  const MachineModel two = cpu_host(2, params);
  CHECK_NEAR(two.resources()[static_cast<size_t>(two.local(1).at(0))].bytes_per_s, 6e9);
  params.cores = 8;
  const MachineModel eight_cores = cpu_host(3, params);
  CHECK_NEAR(eight_cores.resources()[static_cast<size_t>(eight_cores.local(2).at(0))].bytes_per_s,
             6e9);
  const MachineModel cpu3 = builtin_machine("cpu-3");
  CHECK_EQ(cpu3.num_devices(), 3);
  CHECK_EQ(cpu3.name(), std::string("cpu-3"));
}
