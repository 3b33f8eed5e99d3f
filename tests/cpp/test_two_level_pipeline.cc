// Unit tests of the two-level allreduce as a pipeline of pieces (csrc/plan/two_level.h): its
// predicted time against the schedule worked out by hand, how the host's cores limit the
// overlap, which number of pieces the model picks, and the selection passing it on.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "plan/machines.h"
#include "plan/predict.h"
#include "plan/selection.h"
#include "plan/two_level.h"
#include "test_harness.h"

using namespace xdev::plan;  // NOLINT: test file, every name under test lives there

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

bool near(double a, double b, double tolerance) {
  return std::abs(a - b) <= tolerance;
}

// A network of one stream per local rank at `stream_gbps`, nothing else limiting.
NetworkParams network(double stream_gbps, int host_cores) {
  NetworkParams net;
  net.stream_bytes_per_s = stream_gbps * 1e9;
  net.host_bytes_per_s = 1e15;
  net.host_memory_bytes_per_s = 0;
  net.host_cores = host_cores;
  return net;
}

// One piece's steps inside the host (reduce-scatter and all-gather together).
double intra_s(const MachineModel& host, int64_t piece_bytes) {
  return predict_allreduce(host, Candidate::native(Algorithm::kFlat, 0), piece_bytes).seconds;
}

// One piece's ring across 2 hosts: 2 steps of half of a local rank's slice.
double across_s(const NetworkParams& net, int64_t piece_bytes, int ranks_per_host) {
  const double slice = static_cast<double>(piece_bytes) / ranks_per_host;
  return 2 * (net.latency_s + slice / 2 / net.stream_bytes_per_s);
}

}  // namespace

TEST(a_network_bound_pipeline_hides_all_but_one_piece_of_the_host_steps) {
  // A slow network: each piece's engine ring outlasts its steps inside the host, so the
  // pipeline takes the first reduce-scatter (the check across hosts on its way meanwhile),
  // every ring back to back, and the last all-gather.
  const NetworkParams net = network(0.5, 64);
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{2, 2};
  const int64_t bytes = 64 * kMiB;
  for (int pieces : {2, 4, 8}) {
    const int64_t piece = bytes / pieces;
    const double intra = intra_s(host, piece), across = across_s(net, piece, 2);
    CHECK(across > intra);
    const double check = cross_host_check_s(layout, net, layout.ranks_per_host);
    const double expected = std::max(intra / 2, check) + pieces * across + intra / 2;
    CHECK(near(predict_two_level_s(layout, bytes, net, host, pieces), expected, 1e-9));
  }
  // One piece is the three steps one after another, the check beside the first.
  const double intra = intra_s(host, bytes);
  CHECK(near(predict_two_level_s(layout, bytes, net, host, 1),
             std::max(cross_host_check_s(layout, net, layout.ranks_per_host), intra / 2) +
                 intra / 2 + across_s(net, bytes, 2),
             1e-9));
}

TEST(a_pipeline_lies_between_its_longest_stage_and_its_stages_in_a_row) {
  const MachineModel host = cpu_host(4, CpuHostParams{});
  const HostLayout layout{2, 4};
  for (double gbps : {0.5, 3.0, 50.0}) {
    const NetworkParams net = network(gbps, 64);
    for (int pieces : {2, 4, 16}) {
      const int64_t bytes = 32 * kMiB, piece = bytes / pieces;
      const double intra = intra_s(host, piece), across = across_s(net, piece, 4);
      const double check = cross_host_check_s(layout, net, layout.ranks_per_host);
      const double t = predict_two_level_s(layout, bytes, net, host, pieces);
      CHECK(t >= std::max(check, pieces * std::max(intra, across)) - 1e-12);
      CHECK(t <= check + pieces * (intra + across) + 1e-12);
    }
  }
}

TEST(without_a_spare_core_per_rank_the_pieces_run_one_after_another) {
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{2, 2};
  const int64_t bytes = 64 * kMiB, piece = bytes / 4;
  // Two local ranks on two cores (the development VM): no overlap at all.
  const NetworkParams busy = network(0.5, 2);
  const double serial = cross_host_check_s(layout, busy, layout.ranks_per_host) +
                        4 * (intra_s(host, piece) + across_s(busy, piece, 2));
  CHECK(near(predict_two_level_s(layout, bytes, busy, host, 4), serial, 1e-9));
  // So more pieces only add their fixed costs, and the model keeps one.
  const TwoLevelSchedule kept = schedule_two_level(layout, bytes, busy, host);
  CHECK_EQ(kept.pieces, 1);
  // Three cores: half the overlap of four.
  const NetworkParams half = network(0.5, 3), full = network(0.5, 4);
  const double overlapped = predict_two_level_s(layout, bytes, full, host, 4);
  CHECK(overlapped < serial);
  CHECK(near(predict_two_level_s(layout, bytes, half, host, 4), (serial + overlapped) / 2, 1e-9));
  // Unmodelled cores (0): full overlap.
  CHECK(near(predict_two_level_s(layout, bytes, network(0.5, 0), host, 4), overlapped, 1e-12));
}

TEST(the_schedule_picks_the_fastest_number_of_pieces_and_keeps_them_large) {
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const HostLayout layout{2, 2};
  const NetworkParams net = network(3.0, 64);
  const int64_t bytes = 64 * kMiB;
  const TwoLevelSchedule s = schedule_two_level(layout, bytes, net, host);
  CHECK(s.pieces > 1);
  CHECK(s.pieces <= kMaxTwoLevelPieces);
  CHECK(near(s.predicted_s, predict_two_level_s(layout, bytes, net, host, s.pieces), 0.0));
  for (int pieces = 1; pieces <= kMaxTwoLevelPieces; pieces *= 2) {
    CHECK(s.predicted_s <= predict_two_level_s(layout, bytes, net, host, pieces));
  }
  // A payload whose halves' slices would ride in the exchange of calls stays whole.
  const int64_t small = 4 * kMinPieceSliceBytes;  // 2 pieces: 2 slices of exactly the minimum
  CHECK_EQ(schedule_two_level(layout, small, net, host).pieces, 1);
  // Forced: that many pieces, whatever the model says.
  const TwoLevelSchedule forced = schedule_two_level(layout, small, net, host, 3);
  CHECK_EQ(forced.pieces, 3);
  CHECK(near(forced.predicted_s, predict_two_level_s(layout, small, net, host, 3), 0.0));
  // ...but a payload that rides in the exchange of calls stays whole.
  const int64_t carried = 2 * kCrossHostCarryBytes;  // a slice of exactly the carried bytes
  CHECK_EQ(schedule_two_level(layout, carried, net, host, 3).pieces, 1);
  CHECK_EQ(schedule_two_level(layout, carried + 2, net, host, 3).pieces, 3);
  CHECK_THROWS(predict_two_level_s(layout, bytes, net, host, 0), std::invalid_argument,
               "pieces must be >= 1");
}

TEST(the_selection_passes_the_pieces_on_and_names_them) {
  const MachineModel host = cpu_host(2, CpuHostParams{});
  const NetworkParams net = network(3.0, 64);
  SelectionInput in;
  in.world_size = 4;
  in.num_hosts = 2;
  in.ranks_per_host = 2;
  in.payload_bytes = 64 * kMiB;
  in.two_level_available = true;
  in.host_model = &host;
  in.network = &net;
  const Selection s = select_allreduce(in);
  CHECK(s.two_level);
  CHECK(s.two_level_pieces > 1);
  CHECK(s.reason.find(" in " + std::to_string(s.two_level_pieces) + " pipelined pieces") !=
        std::string::npos);
  in.two_level_pieces = 5;  // Options.two_level_pieces
  const Selection forced = select_allreduce(in);
  CHECK_EQ(forced.two_level_pieces, 5);
  // A small payload rides in the exchange of calls: one piece, even when forced, and the
  // reason says nothing of pieces.
  in.payload_bytes = 4096;
  const Selection small = select_allreduce(in);
  CHECK_EQ(small.two_level_pieces, 1);
  CHECK(small.reason.find("pieces") == std::string::npos);
}
