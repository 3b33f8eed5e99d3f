// Unit tests of the broadcast across hosts (csrc/plan/two_level.h): the engine's binomial tree
// against the two-level broadcast, their predicted times, and the choice between them.
#include <cmath>
#include <cstdint>

#include "plan/gather_scatter_predict.h"
#include "plan/machines.h"
#include "plan/two_level.h"
#include "test_harness.h"
#include "two_level_test_util.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

bool near(double a, double b) {
  return std::abs(a - b) <= 1e-12 + 1e-9 * std::abs(b);
}

// Links only (no host memory or core limits): the sums below are exact.
NetworkParams links_only() {
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;
  net.host_cores = 0;
  return net;
}

double all_gather_s(const MachineModel& host, int64_t bytes) {
  return predict_gather_scatter(host, GatherScatterKind::kAllGather, GatherScatterCandidate{},
                                bytes, 1)
      .seconds;
}

}  // namespace

TEST(broadcast_tree_steps_inside_the_root_host_then_across) {
  const NetworkParams net = links_only();
  const double bytes = 4.0 * kMiB;
  // 2 hosts x 4 ranks: log2(8) = 3 steps, the first two inside the root's host (1 then 2
  // senders), the last across, every rank of the root's host sending to its counterpart:
  // 4 streams share the host's link.
  const double across_rate = std::min(net.stream_bytes_per_s, net.host_bytes_per_s / 4);
  const double expected =
      2 * (net.latency_s + bytes / net.stream_bytes_per_s) + net.latency_s + bytes / across_rate;
  CHECK(near(predict_flat_broadcast_s({2, 4}, 4 * kMiB, net), expected));
  // 3 hosts x 3 ranks: 9 ranks take 4 steps, 2 of them across (a tree of 3 hosts).
  const double nine = predict_flat_broadcast_s({3, 3}, 4 * kMiB, net);
  CHECK(nine > predict_flat_broadcast_s({3, 2}, 4 * kMiB, net));
  // One rank: nothing to send.
  CHECK_EQ(predict_flat_broadcast_s({1, 1}, 4 * kMiB, net), 0.0);
}

TEST(two_level_broadcast_adds_the_check_the_engine_and_the_host_step) {
  const NetworkParams net = links_only();
  const MachineModel host = cpu_host(4, CpuHostParams{});
  const HostLayout layout{4, 4};
  // Above what rides in the check: the engine's tree over 4 hosts (2 steps, one stream each).
  const int64_t big = 4 * kMiB;
  const double engine = 2 * (net.latency_s + static_cast<double>(big) / net.stream_bytes_per_s);
  CHECK(near(predict_two_level_broadcast_s(layout, big, net, host),
             cross_host_check_s(layout, net, 1) + engine + all_gather_s(host, big)));
  // A payload that rides in the check: no engine step.
  const int64_t small = kCrossHostCarryBytes;
  CHECK(near(predict_two_level_broadcast_s(layout, small, net, host),
             cross_host_check_s(layout, net, 1) + all_gather_s(host, small)));
  // One rank per host: no step inside.
  const MachineModel alone = cpu_host(1, CpuHostParams{});
  CHECK(near(predict_two_level_broadcast_s({4, 1}, big, net, alone),
             cross_host_check_s({4, 1}, net, 1) + engine));
  CHECK_THROWS(predict_two_level_broadcast_s(layout, big, net, alone), std::invalid_argument,
               "host model");
}

TEST(broadcast_choice_follows_the_model) {
  // Many ranks per host, each with a core, on the default network: the engine's tree pays
  // log2(L) socket steps that the shared-memory broadcast saves.
  const NetworkParams net;
  CpuHostParams sixteen_cores;
  sixteen_cores.cores = 16;
  const MachineModel eight = cpu_host(8, sixteen_cores);
  for (int64_t bytes : {int64_t{4096}, kMiB, 64 * kMiB}) {
    const AcrossHostsChoice c = choose_broadcast_across_hosts({2, 8}, bytes, net, eight);
    CHECK(c.two_level);
    CHECK(c.reason.find("two-level broadcast") != std::string::npos);
    CHECK(c.reason.find("tree over all ranks") != std::string::npos);
    CHECK(near(c.predicted_s, predict_two_level_broadcast_s({2, 8}, bytes, net, eight)));
  }
  // Two ranks per host on this 2-core development VM's host model: the fixed-size check and
  // a step inside the host cost more than the tree's one socket step inside the host for a
  // small payload, and less for a large one.
  const MachineModel vm = cpu_host(2, CpuHostParams{});
  CHECK(!choose_broadcast_across_hosts({2, 2}, 4096, net, vm).two_level);
  CHECK(choose_broadcast_across_hosts({2, 2}, 16 * kMiB, net, vm).two_level);
  // Sockets as fast as memory and a slow host: the engine's tree.
  const NetworkParams fast = xdev_test::fast_network();
  const MachineModel slow_host = xdev_test::slow_cpu_host(2);
  const AcrossHostsChoice c = choose_broadcast_across_hosts({2, 2}, 16 * kMiB, fast, slow_host);
  CHECK(!c.two_level);
  CHECK(near(c.predicted_s, predict_flat_broadcast_s({2, 2}, 16 * kMiB, fast)));
}
