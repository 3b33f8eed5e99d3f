// Unit tests of NCCL's tuning model across nodes (csrc/plan/nccl_model.h with an NcclNetwork) and
// of the comparison of NCCL with a two-level CUDA allreduce across hosts
// (csrc/plan/cuda_across_hosts.h). The expected values are worked by hand from NCCL 2.20.3's
// src/graph/tuning.cc.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "plan/cuda_across_hosts.h"
#include "plan/machines.h"
#include "plan/nccl_model.h"
#include "plan_test_util.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

// 8 NICs of 400 Gb/s per node, Intel CPUs: a DGX H100's network.
NcclNetwork dgx_h100_network(int nodes) {
  NcclNetwork net;
  net.nodes = nodes;
  net.nics = 8;
  net.nic_gbps = 50;
  return net;
}

bool has(const std::vector<NcclCandidate>& cs, NcclAlgo a, NcclProto p) {
  for (const NcclCandidate& c : cs) {
    if (c.algo == a && c.proto == p) return true;
  }
  return false;
}

}  // namespace

TEST(nccl_ring_simple_across_two_nodes_by_hand) {
  // 2 x 8 H100s. Each of the 16 channels keeps its NVLink rate (23.175 GB/s < 400 / 16), so the
  // bus bandwidth is the single node's 370.8 GB/s. Latency: 8.4 + (30 - 4) x 3.4 (NVLink, above
  // the 3 us Simple net overhead) + 4 x 14 us across the network; above 64 B per channel and rank
  // the ring's plateau multiplies it by 1.4.
  const NcclHost host = hgx_h100().nccl;
  const NcclCandidate ring{NcclAlgo::kRing, NcclProto::kSimple};
  const NcclPrediction small =
      predict_nccl_allreduce(host, ring, 16, 16 * 16 * 63, dgx_h100_network(2));
  CHECK_NEAR(small.latency_s, (8.4 + 26 * 3.4 + 4 * 14.0) * 1e-6);
  CHECK_NEAR(small.algbw, 370.8e9 * 16 / 30);
  const NcclPrediction big =
      predict_nccl_allreduce(host, ring, 16, 16 * 16 * 64, dgx_h100_network(2));
  CHECK_NEAR(big.latency_s, 1.4 * (8.4 + 26 * 3.4 + 4 * 14.0) * 1e-6);
}

TEST(nccl_across_nodes_is_capped_by_the_nics) {
  // One 100 Gb/s NIC per node: 12.5 GB/s split over 16 channels is all the ring gets.
  NcclNetwork slow = dgx_h100_network(2);
  slow.nics = 1;
  slow.nic_gbps = 12.5;
  const NcclPrediction p = predict_nccl_allreduce(
      hgx_h100().nccl, {NcclAlgo::kRing, NcclProto::kSimple}, 16, 1 << 20, slow);
  CHECK_NEAR(p.algbw, 12.5e9 * 16 / 30);
  CHECK_NEAR(slow.channel_gbps_across(16, 23.175), 12.5 / 16);
}

TEST(nccl_tree_ll128_across_four_nodes_by_hand) {
  // 4 x 8 H100s: bus min(370.8 x 0.92, 16 x 36.0), then LL128's min(x 120/128, 16 x 29.0).
  // Latency 14 + 2 ((8 - 1) x 1.25 + log2(4) x 8.5) us. At 256 MiB the tree correction is 1.
  const NcclPrediction p =
      predict_nccl_allreduce(hgx_h100().nccl, {NcclAlgo::kTree, NcclProto::kLL128}, 32,
                             int64_t{1} << 28, dgx_h100_network(4));
  const double bus = std::min(std::min(370.8 * 0.92, 16 * 36.0) * 120 / 128, 16 * 29.0);
  CHECK_NEAR(p.algbw, bus * 0.5 * 1e9);
  CHECK_NEAR(p.latency_s, (14.0 + 2 * (7 * 1.25 + 2 * 8.5)) * 1e-6);
}

TEST(nccl_ring_ll_across_nodes_follows_the_cpu_vendor) {
  // LL across nodes keeps a quarter of the bus, capped by the CPU's figure (AMD, 2 nodes: 22.5);
  // every step inside a node costs at least the net overhead (AMD: 2 us).
  NcclNetwork amd = dgx_h100_network(2);
  amd.amd_cpu = true;
  const NcclPrediction p =
      predict_nccl_allreduce(hgx_h100().nccl, {NcclAlgo::kRing, NcclProto::kLL}, 16, 0, amd);
  CHECK_NEAR(p.algbw, 22.5e9 * 16 / 30);
  CHECK_NEAR(p.latency_s, (6.6 + 26 * 2.0 + 4 * 2.7) * 1e-6);
  // Intel, 2 nodes: the cap is 39 GB/s, and the overhead 1 us.
  const NcclPrediction intel = predict_nccl_allreduce(
      hgx_h100().nccl, {NcclAlgo::kRing, NcclProto::kLL}, 16, 0, dgx_h100_network(2));
  CHECK_NEAR(intel.algbw, 39.0e9 * 16 / 30);
  CHECK_NEAR(intel.latency_s, (6.6 + 26 * 1.0 + 4 * 2.7) * 1e-6);
}

TEST(nccl_nvls_becomes_nvls_tree_across_nodes) {
  const NcclHost host = hgx_h100().nccl;
  const std::vector<NcclCandidate> one = nccl_candidates(host);
  const std::vector<NcclCandidate> four = nccl_candidates(host, dgx_h100_network(4));
  CHECK(has(one, NcclAlgo::kNvls, NcclProto::kSimple));
  CHECK(!has(one, NcclAlgo::kNvlsTree, NcclProto::kSimple));
  CHECK(has(four, NcclAlgo::kNvlsTree, NcclProto::kSimple));
  CHECK(!has(four, NcclAlgo::kNvls, NcclProto::kSimple));
  // Beyond two nodes NVLS tree gets half the network's rate per channel: min(20.6, 25 / 2).
  // Latency: 23 us inside the node, 2 log2(4) crossings of 14 us.
  const NcclPrediction p = predict_nccl_allreduce(host, {NcclAlgo::kNvlsTree, NcclProto::kSimple},
                                                  32, 0, dgx_h100_network(4));
  CHECK_NEAR(p.algbw, 16 * 12.5e9 * 5 / 6);
  CHECK_NEAR(p.latency_s, (23.0 + 4 * 14.0) * 1e-6);
  CHECK_THROWS(predict_nccl_allreduce(host, {NcclAlgo::kNvls, NcclProto::kSimple}, 32, 0,
                                      dgx_h100_network(4)),
               std::invalid_argument, "no nvls");
  CHECK_THROWS(predict_nccl_allreduce(host, {NcclAlgo::kNvlsTree, NcclProto::kSimple}, 8, 0),
               std::invalid_argument, "no nvls_tree");
  // Reduce-scatter and all-gather across nodes: the ring alone.
  for (const NcclCandidate& c : nccl_gather_scatter_candidates(host, dgx_h100_network(4))) {
    CHECK(c.algo == NcclAlgo::kRing);
  }
}

TEST(nccl_gather_scatter_across_nodes_by_hand) {
  // A reduce-scatter of 2 x 8 ranks: 15 steps, one across the network; LL keeps a quarter of
  // the bus (a third on one node), capped at 39 GB/s (Intel, 2 nodes). No plateau.
  const NcclHost host = hgx_h100().nccl;
  const NcclPrediction simple = predict_nccl_gather_scatter(
      host, {NcclAlgo::kRing, NcclProto::kSimple}, 16, int64_t{1} << 30, dgx_h100_network(2));
  CHECK_NEAR(simple.latency_s, (8.4 + 14 * 3.4 + 14.0) * 1e-6);
  CHECK_NEAR(simple.algbw, 370.8e9 * 16 / 15);
  const NcclPrediction ll = predict_nccl_gather_scatter(host, {NcclAlgo::kRing, NcclProto::kLL}, 16,
                                                        0, dgx_h100_network(2));
  CHECK_NEAR(ll.algbw, 39.0e9 * 16 / 15);
}

TEST(nccl_across_nodes_refuses_what_it_cannot_model) {
  const NcclHost host = hgx_h100().nccl;
  CHECK_THROWS(best_nccl_allreduce(host, 12, 0, dgx_h100_network(8)), std::invalid_argument,
               "multiple of the nodes");
  NcclNetwork no_nics = dgx_h100_network(2);
  no_nics.nics = 0;
  CHECK_THROWS(best_nccl_allreduce(host, 16, 0, no_nics), std::invalid_argument, "NICs");
  // One rank per node: LL128 keeps 0.7 of the bus instead of 0.92.
  const NcclHost one_gpu = across_hosts_nccl_host(host, 8);
  const NcclPrediction p =
      predict_nccl_allreduce(one_gpu, {NcclAlgo::kRing, NcclProto::kLL128}, 2, 0,
                             across_hosts_nccl_network(dgx_h100_network(2), 8));
  CHECK_EQ(one_gpu.channels, 2);
  CHECK_EQ(one_gpu.nvls_channels, 0);
  CHECK_NEAR(p.algbw, 2 * 23.175 * 0.7 * 1e9 * 2 / 2);
}

TEST(cuda_across_hosts_adds_up_its_steps) {
  const MachineModel host = hgx_h100();
  const CudaAcrossHostsPrediction p =
      predict_cuda_across_hosts(host, dgx_h100_network(2), int64_t{16} << 20);
  CHECK_EQ(p.hosts, 2);
  CHECK_EQ(p.ranks_per_host, 8);
  CHECK_NEAR(p.two_level_s, p.reduce_scatter.seconds + p.across.seconds + p.all_gather.seconds);
  CHECK_NEAR(p.nccl.seconds,
             best_nccl_allreduce(host.nccl, 16, int64_t{16} << 20, dgx_h100_network(2)).seconds);
  // Step 2 is one of 8 communicators of one GPU per node, on an eighth of the payload and of
  // the NICs.
  CHECK_NEAR(p.across.seconds,
             best_nccl_allreduce(across_hosts_nccl_host(host.nccl, 8), 2, int64_t{2} << 20,
                                 across_hosts_nccl_network(dgx_h100_network(2), 8))
                 .seconds);
  CHECK_EQ(p.two_level_faster, p.two_level_s < p.nccl.seconds);
  CHECK(p.reason.find("2 hosts x 8 GPUs") != std::string::npos);
  // At 16 MiB NCCL's NVLS tree crosses the network once per node; two levels pay two steps
  // inside the host on top of the same network time.
  CHECK(!p.two_level_faster);
  CHECK_THROWS(predict_cuda_across_hosts(host, dgx_h100_network(1), 0), std::invalid_argument,
               "two hosts");
  CHECK_THROWS(predict_cuda_across_hosts(cpu_host(4, CpuHostParams{}), dgx_h100_network(2), 0),
               std::invalid_argument, "NCCL");
}

TEST(cuda_across_hosts_window_as_the_readme_states) {
  // The table in docs/multi_host.md: on 2 x 8 H100s two levels win between 64 KiB and 1 MiB (by
  // up to about 1.5x, at 256 KiB) and lose from 16 MiB; on 2 DGX-1s with four 100 Gb/s NICs the
  // two stay within 15% of each other from 64 KiB to 256 MiB.
  const MachineModel h100 = hgx_h100();
  const CudaAcrossHostsPrediction mid =
      predict_cuda_across_hosts(h100, dgx_h100_network(2), 256 << 10);
  CHECK(mid.two_level_faster);
  CHECK(mid.nccl.seconds / mid.two_level_s > 1.4 && mid.nccl.seconds / mid.two_level_s < 1.6);
  CHECK(!predict_cuda_across_hosts(h100, dgx_h100_network(2), 16 << 20).two_level_faster);
  NcclNetwork dgx1_net;
  dgx1_net.nodes = 2;
  dgx1_net.nics = 4;
  dgx1_net.nic_gbps = 12.5;
  for (int64_t bytes = 64 << 10; bytes <= (int64_t{256} << 20); bytes *= 4) {
    const CudaAcrossHostsPrediction p = predict_cuda_across_hosts(dgx1_v100(), dgx1_net, bytes);
    const double ratio = p.nccl.seconds / p.two_level_s;
    CHECK(ratio > 0.9 && ratio < 1.15);
  }
}
