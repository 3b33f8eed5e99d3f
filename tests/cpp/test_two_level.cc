// Unit tests of the plans across hosts (csrc/plan/two_level.h): where each plan's bytes go, its
// predicted time, the choice, and select_allreduce's and select_gather_scatter's decisions for
// ranks on several hosts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "plan/gather_scatter_plan.h"
#include "plan/gather_scatter_predict.h"
#include "plan/machines.h"
#include "plan/predict.h"
#include "plan/selection.h"
#include "plan/two_level.h"
#include "test_harness.h"
#include "two_level_test_util.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

bool near(double a, double b, double tolerance) {
  return std::abs(a - b) <= tolerance;
}

SelectionInput across_hosts_input(const MachineModel& host, const NetworkParams& net, int hosts,
                                  int per_host, int64_t bytes) {
  SelectionInput in;
  in.world_size = hosts * per_host;
  in.num_hosts = hosts;
  in.payload_bytes = bytes;
  in.transport_available = false;  // no channel of the whole group
  in.two_level_available = true;
  in.ranks_per_host = per_host;
  in.host_model = &host;
  in.network = &net;
  return in;
}

}  // namespace

TEST(two_level_traffic_keeps_intra_host_bytes_off_sockets) {
  const HostLayout layout{2, 4};  // 8 ranks
  const int64_t bytes = 64 * kMiB;
  const Traffic ring = flat_ring_traffic(layout, bytes);
  const Traffic two = two_level_traffic(layout, bytes);
  // The ring: each link carries 2(P-1)/P of the payload; one leaves the host, 3 stay inside.
  CHECK(near(ring.inter_host_bytes, 2.0 * 7 / 8 * bytes, 1.0));
  CHECK(near(ring.intra_host_socket_bytes, 3 * 2.0 * 7 / 8 * bytes, 1.0));
  CHECK_EQ(ring.inter_host_steps, 14);
  CHECK_EQ(ring.inter_host_streams, 1);
  // Two-level: 4 rings of 2 hosts on a quarter each, nothing inside a host through sockets.
  CHECK(near(two.inter_host_bytes, 2.0 * 1 / 2 * bytes, 1.0));
  CHECK(near(two.intra_host_socket_bytes, 0.0, 0.0));
  CHECK_EQ(two.inter_host_steps, 2);
  CHECK_EQ(two.inter_host_streams, 4);
  // Within a factor of 2 across hosts, as any host-contiguous ring: the gain is elsewhere.
  CHECK(two.inter_host_bytes <= ring.inter_host_bytes);
}

TEST(two_level_traffic_of_one_host_is_empty) {
  const Traffic two = two_level_traffic({1, 8}, kMiB);
  CHECK(near(two.inter_host_bytes, 0.0, 0.0));
  CHECK_EQ(two.inter_host_steps, 0);
  CHECK_THROWS(flat_ring_traffic({0, 2}, kMiB), std::invalid_argument, "at least one host");
}

TEST(two_level_is_predicted_faster_with_several_ranks_per_host) {
  NetworkParams net;
  net.host_memory_bytes_per_s = CpuHostParams{}.memory_bytes_per_s;
  for (int per_host : {2, 4, 8}) {
    CpuHostParams params;
    params.cores = per_host;  // a core per rank, as on a real host
    const MachineModel host = cpu_host(per_host, params);
    for (int64_t bytes : {int64_t{4096}, 64 * int64_t{1024}, 16 * kMiB, 256 * kMiB}) {
      const HostLayout layout{2, per_host};
      const double ring = predict_flat_ring_s(layout, bytes, net);
      const double two = predict_two_level_s(layout, bytes, net, host);
      CHECK(two > 0 && ring > 0);
      CHECK(two < ring);
      const AcrossHostsChoice c = choose_across_hosts(layout, bytes, net, host);
      CHECK(c.two_level);
      // In pieces where the model pipelines it, or in the leader form (no worse than one piece).
      CHECK(near(c.predicted_s,
                 c.leader ? predict_two_level_leader_s(layout, bytes, net, host)
                          : predict_two_level_s(layout, bytes, net, host, c.pieces),
                 0.0));
      CHECK(c.predicted_s <= two);
      CHECK(c.reason.find("two-level") != std::string::npos);
    }
  }
}

TEST(the_leader_form_sends_one_message_per_host) {
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;  // links only: the sums below are exact
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{3, 2};
  const int64_t bytes = 40 * 1024;
  const double intra =
      predict_allreduce(host, Candidate::native(Algorithm::kFlat, 0), bytes).seconds;
  // One stream per host: H-1 = 2 steps of the fixed message, then a broadcast costed as
  // half the host's allreduce.
  const double one_stream =
      2 * (net.latency_s + static_cast<double>(kCrossHostMessageBytes) / net.stream_bytes_per_s);
  CHECK(near(cross_host_check_s(layout, net, 1), one_stream, 1e-15));
  CHECK(
      near(predict_two_level_leader_s(layout, bytes, net, host), intra * 1.5 + one_stream, 1e-12));
  CHECK_THROWS(predict_two_level_leader_s(layout, kCrossHostCarryBytes + 1, net, host),
               std::invalid_argument, "leader form carries at most");
}

TEST(the_leader_form_wins_where_streams_outnumber_cores) {
  const MachineModel host2 = cpu_host(2, CpuHostParams{});
  const int64_t bytes = 16 * 1024;
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;
  // A core per local rank, a link each stream fills alone: L messages at once cost what one
  // does, and the leader's broadcast is extra.
  net.host_cores = 2;
  TwoLevelSchedule s = schedule_two_level({2, 2}, bytes, net, host2);
  CHECK(!s.leader);
  CHECK(near(s.predicted_s, predict_two_level_s({2, 2}, bytes, net, host2, 1), 0.0));
  // One core for the host's two streams (two fake hosts of two ranks on two cores): each
  // message of the slices' form waits for the other's turn.
  net.host_cores = 1;
  CHECK(near(cross_host_check_s({2, 2}, net, 2),
             2 * net.latency_s + 2 * kCrossHostMessageBytes / net.stream_bytes_per_s, 1e-15));
  s = schedule_two_level({2, 2}, bytes, net, host2);
  CHECK(s.leader);
  CHECK_EQ(s.pieces, 1);
  CHECK(near(s.predicted_s, predict_two_level_leader_s({2, 2}, bytes, net, host2), 0.0));
  const AcrossHostsChoice c = choose_across_hosts({2, 2}, bytes, net, host2);
  CHECK(c.two_level && c.leader);
  CHECK(c.reason.find("leader form") != std::string::npos);
  // Eight ranks' fixed messages share the host's link (12.5 GB/s over 8 streams is under one
  // stream's 3 GB/s), so one message leaves sooner even with a core per rank.
  CpuHostParams eight_cores;
  eight_cores.cores = 8;
  const MachineModel host8 = cpu_host(8, eight_cores);
  net.host_cores = 8;
  CHECK(cross_host_check_s({2, 8}, net, 1) < cross_host_check_s({2, 8}, net, 8));
  // A payload that does not ride whole keeps the slices' form; so does one rank per host.
  CHECK(!schedule_two_level({2, 8}, kCrossHostCarryBytes + 8, net, host8).leader);
  const MachineModel host1 = cpu_host(1, CpuHostParams{});
  net.host_cores = 1;
  CHECK(!schedule_two_level({2, 1}, bytes, net, host1).leader);
}

TEST(a_fast_network_and_slow_host_memory_favour_the_ring) {
  // With sockets as fast as memory and a host path far slower, the model must say so.
  const AcrossHostsChoice c = choose_across_hosts({2, 2}, 64 * kMiB, xdev_test::fast_network(),
                                                  xdev_test::slow_cpu_host(2));
  CHECK(!c.two_level);
}

TEST(two_level_allreduce_prediction_counts_the_check_across_hosts) {
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;  // links only: the sum below is exact
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{4, 2};
  const int64_t bytes = 8 * kMiB;
  const double intra =
      predict_allreduce(host, Candidate::native(Algorithm::kFlat, 0), bytes).seconds;
  // 2(H-1) = 6 steps of half the payload's quarter, then the check: H-1 = 3
  // steps of its fixed message (two streams per host stay under the link's share).
  const double ring = 6 * (net.latency_s + bytes / 2.0 / 4 / net.stream_bytes_per_s);
  const double check =
      3 * (net.latency_s + static_cast<double>(kCrossHostMessageBytes) / net.stream_bytes_per_s);
  CHECK(near(cross_host_check_s(layout, net, layout.ranks_per_host), check, 1e-15));
  // Cores unknown (0): the check travels while the host reduce-scatters.
  CHECK(near(predict_two_level_s(layout, bytes, net, host),
             std::max(check, intra / 2) + intra / 2 + ring, 1e-12));
  // No core to spare: one after the other.
  net.host_cores = layout.ranks_per_host;
  CHECK(near(predict_two_level_s(layout, bytes, net, host), intra + ring + check, 1e-12));
  // A core per rank to spare: overlapped again.
  net.host_cores = 2 * layout.ranks_per_host;
  CHECK(near(predict_two_level_s(layout, bytes, net, host),
             std::max(check, intra / 2) + intra / 2 + ring, 1e-12));
  CHECK(near(cross_host_check_s({1, 2}, net, 2), 0.0, 0.0));
}

TEST(a_small_allreduce_crosses_hosts_in_the_check_alone) {
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{4, 2};
  // A slice of exactly the carried bytes rides in the check; one more byte's worth takes the ring.
  const int64_t carried = 2 * kCrossHostCarryBytes;
  const double intra =
      predict_allreduce(host, Candidate::native(Algorithm::kFlat, 0), carried).seconds;
  CHECK(near(predict_two_level_s(layout, carried, net, host),
             intra + cross_host_check_s(layout, net, layout.ranks_per_host), 1e-12));
  const int64_t over = carried + 2;
  const double intra_over =
      predict_allreduce(host, Candidate::native(Algorithm::kFlat, 0), over).seconds;
  // Beyond it the engine's ring follows (the check travelling while the host reduce-scatters).
  CHECK(predict_two_level_s(layout, over, net, host) >
        std::max(intra_over / 2, cross_host_check_s(layout, net, layout.ranks_per_host)) +
            intra_over / 2 + 6 * net.latency_s);
  CHECK(carried_across_hosts(kCrossHostCarryBytes));
  CHECK(!carried_across_hosts(kCrossHostCarryBytes + 1));
}

TEST(steps_inside_a_host_run_in_place_where_staging_takes_several_windows) {
  // The two-level allreduce of a heap tensor, 2 local ranks, 256 KiB slots of float32: a
  // reduce-scatter piece of 65536 elements per window.
  const int64_t slot_elems = (256 << 10) / 4;
  for (const int64_t total : {int64_t{1000}, 2 * slot_elems, 2 * slot_elems + 2, 4 * kMiB}) {
    const GatherScatterPlan rs(GatherScatterKind::kReduceScatter, {(total + 1) / 2, total / 2},
                               slot_elems);
    CHECK_EQ(in_host_step_in_place(rs.num_windows()), rs.num_windows() >= 2);
    CHECK_EQ(in_host_step_in_place(rs.num_windows()), total > 2 * slot_elems);
  }
  CHECK(!in_host_step_in_place(0));
  CHECK(!in_host_step_in_place(1));
}

TEST(predict_two_level_checks_the_host_model) {
  const MachineModel host = cpu_host(4, CpuHostParams{});
  CHECK_THROWS(predict_two_level_s({2, 2}, kMiB, NetworkParams{}, host), std::invalid_argument,
               "host model of 4 devices");
}

TEST(select_allreduce_across_hosts) {
  NetworkParams net;
  net.host_memory_bytes_per_s = CpuHostParams{}.memory_bytes_per_s;
  const MachineModel host = cpu_host(2, CpuHostParams{});
  SelectionInput in = across_hosts_input(host, net, 2, 2, kMiB);
  Selection s = select_allreduce(in);
  CHECK(s.two_level);
  CHECK(s.algorithm == Algorithm::kFlat);
  CHECK(!s.single_copy && !s.in_place_shared);
  CHECK(s.predicted_s > 0);
  CHECK(s.reason.find("symmetric heap") == std::string::npos);
  // A heap tensor (a DDP bucket) takes the same plan; the steps inside hosts may run in place.
  in.in_symmetric_heap = true;
  const Selection heap = select_allreduce(in);
  CHECK(heap.two_level && !heap.in_place_shared);
  CHECK(heap.reason.find("symmetric heap") != std::string::npos);

  in.op_supported = false;
  s = select_allreduce(in);
  CHECK(!s.two_level && s.algorithm == Algorithm::kFallback);
  CHECK(s.reason.find("no native kernel") != std::string::npos);

  in = across_hosts_input(host, net, 2, 2, kMiB);
  in.two_level_available = false;
  in.two_level_note = "hosts hold different numbers of ranks";
  s = select_allreduce(in);
  CHECK(!s.two_level && s.algorithm == Algorithm::kFallback);
  CHECK(s.reason.find("different numbers of ranks") != std::string::npos);

  in = across_hosts_input(host, net, 2, 2, kMiB);
  in.device = DeviceKind::kCuda;
  s = select_allreduce(in);
  CHECK(!s.two_level && s.algorithm == Algorithm::kFallback);
  CHECK(s.reason.find("torch_xdev.plan --hosts") != std::string::npos);

  in = across_hosts_input(host, net, 2, 2, kMiB);
  in.requested = Algorithm::kFallback;
  s = select_allreduce(in);
  CHECK(!s.two_level && s.algorithm == Algorithm::kFallback);

  in = across_hosts_input(host, net, 2, 2, kMiB);
  in.network = nullptr;
  CHECK_THROWS(select_allreduce(in), std::invalid_argument, "network");
}

TEST(gather_scatter_across_hosts_is_half_the_allreduce_traffic) {
  const HostLayout layout{2, 4};  // 8 ranks
  const int64_t bytes = 64 * kMiB;
  const Traffic ring = flat_ring_gather_scatter_traffic(layout, bytes);
  const Traffic two = two_level_gather_scatter_traffic(layout, bytes);
  // The ring: P-1 = 7 messages of bytes/8 per link; one link leaves the host, 3 stay inside.
  CHECK(near(ring.inter_host_bytes, 7.0 / 8 * bytes, 1.0));
  CHECK(near(ring.intra_host_socket_bytes, 3 * 7.0 / 8 * bytes, 1.0));
  CHECK_EQ(ring.inter_host_steps, 7);
  // Two-level: each of 4 local ranks sends its block to the other host, once.
  CHECK(near(two.inter_host_bytes, 0.5 * bytes, 1.0));
  CHECK(near(two.intra_host_socket_bytes, 0.0, 0.0));
  CHECK_EQ(two.inter_host_steps, 1);
  CHECK_EQ(two.inter_host_streams, 4);
  // Exactly half of the allreduce's, either way.
  CHECK(near(2 * two.inter_host_bytes, two_level_traffic(layout, bytes).inter_host_bytes, 1.0));
  CHECK(near(2 * ring.inter_host_bytes, flat_ring_traffic(layout, bytes).inter_host_bytes, 1.0));
}

TEST(gather_scatter_predictions_add_up) {
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;  // links only: the sums below are exact
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{3, 2};  // 6 ranks
  const int64_t bytes = 6 * kMiB;
  // The ring: 5 steps of a MiB at one stream's rate, each with its latency.
  const double ring = predict_flat_ring_gather_scatter_s(layout, bytes, net);
  CHECK(near(ring, 5 * (net.latency_s + kMiB / net.stream_bytes_per_s), 1e-12));
  for (GatherScatterKind kind :
       {GatherScatterKind::kAllGather, GatherScatterKind::kReduceScatter}) {
    const double intra = predict_gather_scatter(host, kind, GatherScatterCandidate{}, bytes,
                                                kind == GatherScatterKind::kAllGather ? 1 : 4)
                             .seconds;
    // Two steps across 3 hosts, each of one block of a MiB, 2 streams per host, and the
    // check's two steps of its fixed message.
    const double across = 2 * (net.latency_s + kMiB / net.stream_bytes_per_s);
    const double check =
        2 * (net.latency_s + static_cast<double>(kCrossHostMessageBytes) / net.stream_bytes_per_s);
    CHECK(near(cross_host_check_s(layout, net, layout.ranks_per_host), check, 1e-15));
    // An all-gather checks before its first step; a reduce-scatter's check travels while its
    // host reduces (cores unknown: wholly).
    const double two_level = kind == GatherScatterKind::kAllGather
                                 ? check + intra + across
                                 : std::max(check, intra) + across;
    CHECK(near(predict_two_level_gather_scatter_s(kind, layout, bytes, 4, net, host), two_level,
               1e-12));
    const AcrossHostsChoice c =
        choose_gather_scatter_across_hosts(kind, layout, bytes, 4, net, host);
    CHECK_EQ(c.two_level, two_level < ring);
    // No core to spare: the check and the host's step one after the other.
    NetworkParams busy = net;
    busy.host_cores = layout.ranks_per_host;
    CHECK(near(predict_two_level_gather_scatter_s(kind, layout, bytes, 4, busy, host),
               check + intra + across, 1e-12));
    CHECK(c.reason.find(to_string(kind)) != std::string::npos);
  }
  CHECK_THROWS(
      predict_two_level_gather_scatter_s(GatherScatterKind::kAllGather, {2, 4}, kMiB, 4, net, host),
      std::invalid_argument, "host model of 2 devices");
}

TEST(small_gather_scatter_payloads_cross_hosts_in_the_check_alone) {
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{3, 2};  // 6 ranks
  // An all-gather rank sends its block (bytes/6), a reduce-scatter rank its host's
  // partial sums of 3 blocks (bytes/2): each rides in the check up to the carried bytes.
  const struct {
    GatherScatterKind kind;
    int64_t carried_bytes;
  } cases[] = {{GatherScatterKind::kAllGather, 6 * kCrossHostCarryBytes},
               {GatherScatterKind::kReduceScatter, 2 * kCrossHostCarryBytes}};
  for (const auto& c : cases) {
    const double intra =
        predict_gather_scatter(host, c.kind, GatherScatterCandidate{}, c.carried_bytes,
                               c.kind == GatherScatterKind::kAllGather ? 1 : 4)
            .seconds;
    CHECK(near(predict_two_level_gather_scatter_s(c.kind, layout, c.carried_bytes, 4, net, host),
               intra + cross_host_check_s(layout, net, layout.ranks_per_host), 1e-12));
    const int64_t over = c.carried_bytes + 24;
    CHECK(predict_two_level_gather_scatter_s(c.kind, layout, over, 4, net, host) >
          cross_host_check_s(layout, net, layout.ranks_per_host) + 2 * net.latency_s);
  }
}

TEST(gather_scatter_leader_forms_add_up_and_win_where_streams_outnumber_cores) {
  NetworkParams net;
  net.host_memory_bytes_per_s = 0;  // links only: the sums below are exact
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{3, 2};  // 6 ranks
  const int64_t bytes = 48 * 1024;
  const auto all_gather = [&](int64_t n) {
    return predict_gather_scatter(host, GatherScatterKind::kAllGather, GatherScatterCandidate{}, n,
                                  1)
        .seconds;
  };
  // All-gather: the host's 16 KiB inside it, one stream's exchange, the other hosts' 32 KiB
  // broadcast inside it.
  CHECK(near(
      predict_two_level_gather_scatter_leader_s(GatherScatterKind::kAllGather, layout, bytes, net,
                                                host),
      all_gather(bytes / 3) + cross_host_check_s(layout, net, 1) + all_gather(bytes - bytes / 3),
      1e-12));
  // Reduce-scatter: the allreduce's leader form on the whole input.
  CHECK(near(predict_two_level_gather_scatter_leader_s(GatherScatterKind::kReduceScatter, layout,
                                                       bytes, net, host),
             predict_two_level_leader_s(layout, bytes, net, host), 0.0));
  // What fits: an all-gather's host's share of the output, a reduce-scatter's whole input.
  CHECK(
      gather_scatter_leader_fits(GatherScatterKind::kAllGather, layout, 3 * kCrossHostCarryBytes));
  CHECK(!gather_scatter_leader_fits(GatherScatterKind::kAllGather, layout,
                                    3 * kCrossHostCarryBytes + 3));
  CHECK(
      gather_scatter_leader_fits(GatherScatterKind::kReduceScatter, layout, kCrossHostCarryBytes));
  CHECK(!gather_scatter_leader_fits(GatherScatterKind::kReduceScatter, layout,
                                    kCrossHostCarryBytes + 4));
  CHECK_THROWS(predict_two_level_gather_scatter_leader_s(GatherScatterKind::kReduceScatter, layout,
                                                         kCrossHostCarryBytes + 4, net, host),
               std::invalid_argument, "leader form of a reduce_scatter carries at most");

  // The choice: a core per local rank keeps every rank crossing; one core for the host's two
  // streams (two fake hosts of two ranks on two cores) makes one message per host win.
  net.latency_s = 5e-3;  // a slow network: two levels win over the ring either way
  for (GatherScatterKind kind :
       {GatherScatterKind::kAllGather, GatherScatterKind::kReduceScatter}) {
    net.host_cores = 2;
    AcrossHostsChoice c = choose_gather_scatter_across_hosts(kind, {2, 2}, 16 * 1024, 4, net, host);
    CHECK(c.two_level && !c.leader);
    CHECK(c.reason.find("leader form") == std::string::npos);
    net.host_cores = 1;
    c = choose_gather_scatter_across_hosts(kind, {2, 2}, 16 * 1024, 4, net, host);
    CHECK(c.two_level && c.leader);
    CHECK(near(c.predicted_s,
               predict_two_level_gather_scatter_leader_s(kind, {2, 2}, 16 * 1024, net, host), 0.0));
    CHECK(c.reason.find("leader form") != std::string::npos);
    // Too large to ride whole: every rank crosses.
    CHECK(!choose_gather_scatter_across_hosts(kind, {2, 2}, 4 * kMiB, 4, net, host).leader);
  }
  // select_gather_scatter carries the choice.
  GatherScatterInput in;
  in.world_size = 4;
  in.num_hosts = 2;
  in.transport_available = false;
  in.payload_bytes = 16 * 1024;
  in.two_level_available = true;
  in.ranks_per_host = 2;
  in.host_model = &host;
  in.network = &net;
  const GatherScatterSelection s = select_gather_scatter(in);
  CHECK_EQ(s.path, GatherScatterPath::kTwoLevel);
  CHECK(s.two_level_leader);
}

TEST(select_gather_scatter_across_hosts) {
  NetworkParams net;
  net.latency_s = 5e-3;  // a slow network: two-level wins at every size
  const MachineModel host = cpu_host(2, CpuHostParams{});
  GatherScatterInput in;
  in.world_size = 4;
  in.num_hosts = 2;
  in.transport_available = false;  // no channel of the whole group
  in.payload_bytes = kMiB;
  in.two_level_available = true;
  in.ranks_per_host = 2;
  in.host_model = &host;
  in.network = &net;
  GatherScatterSelection s = select_gather_scatter(in);
  CHECK_EQ(s.path, GatherScatterPath::kTwoLevel);
  CHECK(s.predicted_s > 0);
  CHECK(s.reason.find("two-level reduce_scatter") != std::string::npos);

  GatherScatterInput fast = in;
  fast.network = nullptr;
  CHECK_THROWS(select_gather_scatter(fast), std::invalid_argument, "network");

  GatherScatterInput no = in;
  no.two_level_available = false;
  no.two_level_note = "hosts hold different numbers of ranks";
  s = select_gather_scatter(no);
  CHECK_EQ(s.path, GatherScatterPath::kFallback);
  CHECK(s.reason.find("different numbers of ranks") != std::string::npos);

  no = in;
  no.op_supported = false;
  CHECK_EQ(select_gather_scatter(no).path, GatherScatterPath::kFallback);
  no = in;
  no.uneven_list_sizes = true;  // even one list: the engine's step takes blocks of one size
  no.one_list = true;
  s = select_gather_scatter(no);
  CHECK_EQ(s.path, GatherScatterPath::kFallback);
  CHECK(s.reason.find("uneven list sizes (the two-level form needs one size)") !=
        std::string::npos);
  no = in;
  no.device = DeviceKind::kCuda;
  CHECK_EQ(select_gather_scatter(no).path, GatherScatterPath::kFallback);
  no = in;
  no.requested = Algorithm::kFallback;
  CHECK_EQ(select_gather_scatter(no).path, GatherScatterPath::kFallback);
}

TEST(a_floating_point_min_or_max_takes_two_levels_where_the_ring_is_predicted_faster) {
  // The engine's ring can drop a NaN that the two-level plans keep: the result must not
  // depend on which one the model predicts faster.
  const NetworkParams net = xdev_test::fast_network();
  const MachineModel host = xdev_test::slow_cpu_host(2);
  SelectionInput in = across_hosts_input(host, net, 2, 2, 64 * kMiB);
  const Selection sum = select_allreduce(in);
  CHECK(!sum.two_level);  // the model's own choice: the ring
  in.engine_may_drop_nan = true;
  const Selection max = select_allreduce(in);
  CHECK(max.two_level && max.algorithm == Algorithm::kFlat);
  CHECK(max.predicted_s > sum.predicted_s);  // the two-level plan's time, not the ring's
  CHECK(max.reason.find("keeps a NaN") != std::string::npos);
  in.two_level_available = false;  // where two levels cannot run, the engine still does
  CHECK(!select_allreduce(in).two_level);

  GatherScatterInput gs;
  gs.world_size = 4;
  gs.num_hosts = 2;
  gs.transport_available = false;
  gs.payload_bytes = 64 * kMiB;
  gs.two_level_available = true;
  gs.ranks_per_host = 2;
  gs.host_model = &host;
  gs.network = &net;
  CHECK_EQ(select_gather_scatter(gs).path, GatherScatterPath::kFallback);
  gs.engine_may_drop_nan = true;
  const GatherScatterSelection s = select_gather_scatter(gs);
  CHECK_EQ(s.path, GatherScatterPath::kTwoLevel);
  CHECK(s.reason.find("keeps a NaN") != std::string::npos);
}
