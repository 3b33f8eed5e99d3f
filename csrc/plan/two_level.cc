#include "two_level.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "gather_scatter_predict.h"
#include "predict.h"

namespace xdev::plan {
namespace {

void check(const HostLayout& hosts) {
  if (hosts.num_hosts < 1 || hosts.ranks_per_host < 1) {
    throw std::invalid_argument("two-level plan: need at least one host of one rank; got " +
                                std::to_string(hosts.num_hosts) + " host(s) of " +
                                std::to_string(hosts.ranks_per_host) + " rank(s)");
  }
}

// A ring of n ranks moving `bytes` (reduce-scatter then all-gather): 2(n-1)
// steps, each as long as its slowest message of bytes/n takes at `rate`.
double ring_s(int n, double bytes, double rate, double latency_s) {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) * (latency_s + bytes / n / rate);
}

// Half of that ring (a reduce-scatter or an all-gather alone): n-1 steps.
double half_ring_s(int n, double bytes, double rate, double latency_s) {
  return ring_s(n, bytes, rate, latency_s) / 2;
}

void check_host_model(const HostLayout& hosts, const MachineModel& host) {
  if (host.num_devices() != hosts.ranks_per_host) {
    throw std::invalid_argument("two-level plan: a host model of " +
                                std::to_string(host.num_devices()) + " devices for " +
                                std::to_string(hosts.ranks_per_host) + " ranks per host");
  }
}

// The share of a core each of `streams` streams of one host gets
// (NetworkParams::host_cores).
double core_share(const NetworkParams& net, int streams) {
  if (net.host_cores <= 0 || streams <= net.host_cores) return 1.0;
  return static_cast<double>(net.host_cores) / streams;
}

// The share of the work inside a host that overlaps the engine's: that needs
// a core per local rank for the steps inside the host and another for its
// engine's stream (1: cores not modelled).
double overlap_share(const HostLayout& hosts, const NetworkParams& net) {
  if (net.host_cores <= 0) return 1.0;
  const int spare = net.host_cores - hosts.ranks_per_host;
  return std::clamp(static_cast<double>(spare) / hosts.ranks_per_host, 0.0, 1.0);
}

// The exchange of calls sent as the host's ranks agree on the call, beside
// the reduce-scatter inside the host it travels during, as far as `overlap`.
double check_beside(double exchange, double reduce_scatter, double overlap) {
  return overlap * std::max(exchange, reduce_scatter) + (1 - overlap) * (exchange + reduce_scatter);
}

// The latency of each of `streams` messages a host sends at once.
double message_latency(const NetworkParams& net, int streams) {
  return net.latency_s / core_share(net, streams);
}

// The rate of each of `streams` messages a host sends at once through
// sockets: one stream's own limit on its share of a core, the host's share of
// its link (for streams that leave it), and the host's memory, which all of
// them cross.
double stream_rate(const NetworkParams& net, int streams, int leaving) {
  double rate = net.stream_bytes_per_s * core_share(net, streams);
  if (net.host_memory_bytes_per_s > 0) {
    rate = std::min(rate, net.host_memory_bytes_per_s / kSocketMemoryPasses / streams);
  }
  if (leaving > 0) rate = std::min(rate, net.host_bytes_per_s / leaving);
  return rate;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Steps of a binomial tree over n ranks.
int tree_steps(int n) {
  int steps = 0;
  while ((int64_t{1} << steps) < n) ++steps;
  return steps;
}

}  // namespace

Traffic flat_ring_traffic(const HostLayout& hosts, int64_t bytes) {
  check(hosts);
  Traffic t;
  const int p = hosts.world_size();
  if (p == 1) return t;
  // Every link of the ring carries 2(P-1) messages of bytes/P. A host-contiguous
  // ring leaves each host by one link; the other L-1 links of a host join its
  // own ranks, through loopback sockets.
  const double per_link = 2.0 * (p - 1) * static_cast<double>(bytes) / p;
  if (hosts.num_hosts > 1) {
    t.inter_host_bytes = per_link;
    t.inter_host_steps = 2 * (p - 1);
    t.inter_host_streams = 1;
  }
  t.intra_host_socket_bytes = per_link * (hosts.ranks_per_host - 1);
  return t;
}

Traffic two_level_traffic(const HostLayout& hosts, int64_t bytes) {
  check(hosts);
  Traffic t;
  const int h = hosts.num_hosts;
  if (h == 1) return t;
  // Each of the L local ranks rings its slice of bytes/L among the H hosts.
  t.inter_host_bytes = 2.0 * (h - 1) * static_cast<double>(bytes) / h;
  t.inter_host_steps = 2 * (h - 1);
  t.inter_host_streams = hosts.ranks_per_host;
  return t;
}

double cross_host_check_s(const HostLayout& hosts, const NetworkParams& net, int streams) {
  check(hosts);
  const double rate = stream_rate(net, streams, streams);
  return (hosts.num_hosts - 1) *
         (message_latency(net, streams) + static_cast<double>(kCrossHostMessageBytes) / rate);
}

double predict_flat_ring_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net) {
  check(hosts);
  // Every rank of a host sends at each step: one message leaves the host, the
  // others go to its neighbours on the host, all through sockets.
  const double rate = stream_rate(net, hosts.ranks_per_host, hosts.num_hosts > 1 ? 1 : 0);
  return ring_s(hosts.world_size(), static_cast<double>(bytes), rate,
                message_latency(net, hosts.ranks_per_host));
}

double predict_two_level_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net,
                           const MachineModel& host, int pieces) {
  check(hosts);
  check_host_model(hosts, host);
  if (pieces < 1) {
    throw std::invalid_argument("two-level plan: pieces must be >= 1; got " +
                                std::to_string(pieces));
  }
  const int64_t piece_bytes = ceil_div(bytes, pieces);
  // One piece's reduce-scatter and all-gather inside the host.
  const double intra =
      hosts.ranks_per_host > 1
          ? predict_allreduce(host, Candidate::native(Algorithm::kFlat, 0), piece_bytes).seconds
          : 0.0;
  const double reduce_scatter = intra / 2, all_gather = intra / 2;
  const int streams = hosts.ranks_per_host;
  const double exchange = cross_host_check_s(hosts, net, streams);
  // L streams leave each host at once, sharing its link, its memory and its
  // cores; a slice too large to ride in the exchange of calls takes the
  // engine's ring.
  const int64_t slice = ceil_div(piece_bytes, hosts.ranks_per_host);
  if (pieces == 1 && carried_across_hosts(slice)) return exchange + intra;
  const double rate = stream_rate(net, streams, streams);
  const double across =
      ring_s(hosts.num_hosts, static_cast<double>(slice), rate, message_latency(net, streams));
  // Work inside the host and the engine's overlap as far as the host's cores
  // allow; where they do not, one waits for the other. The exchange of the
  // call travels while the host's ranks reduce-scatter the first piece.
  const double overlap = overlap_share(hosts, net);
  const double first = check_beside(exchange, reduce_scatter, overlap);
  const double serial = first + all_gather + across + (pieces - 1) * (intra + across);
  if (pieces == 1) return serial;

  // The pipeline as the backend runs it: this rank reduce-scatters piece 0
  // (the exchange on its way), starts the engine on it; then for each later
  // piece reduce-scatters it, starts the engine on it (which runs one piece
  // at a time), and all-gathers the previous piece once the engine is done
  // with it.
  double t = first;
  double engine_done = t + across;
  for (int k = 1; k < pieces; ++k) {
    t += reduce_scatter;
    const double next_engine_done = std::max(t, engine_done) + across;
    t = std::max(t, engine_done) + all_gather;
    engine_done = next_engine_done;
  }
  const double pipelined = std::max(t, engine_done) + all_gather;
  return overlap * pipelined + (1 - overlap) * serial;
}

double predict_two_level_leader_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net,
                                  const MachineModel& host) {
  check(hosts);
  check_host_model(hosts, host);
  if (!leader_form_fits(bytes)) {
    throw std::invalid_argument("two-level plan: the leader form carries at most " +
                                std::to_string(kCrossHostCarryBytes) + " bytes; got " +
                                std::to_string(bytes));
  }
  const double intra =
      hosts.ranks_per_host > 1
          ? predict_allreduce(host, Candidate::native(Algorithm::kFlat, 0), bytes).seconds
          : 0.0;
  const double broadcast = intra / 2;
  return intra + cross_host_check_s(hosts, net, 1) + broadcast;
}

TwoLevelSchedule schedule_two_level(const HostLayout& hosts, int64_t bytes,
                                    const NetworkParams& net, const MachineModel& host,
                                    int forced_pieces) {
  TwoLevelSchedule best;
  const bool whole_is_carried = carried_across_hosts(ceil_div(bytes, hosts.ranks_per_host));
  if (forced_pieces > 0 && !whole_is_carried) {
    best.pieces = forced_pieces;
    best.predicted_s = predict_two_level_s(hosts, bytes, net, host, forced_pieces);
    return best;
  }
  best.predicted_s = predict_two_level_s(hosts, bytes, net, host, 1);
  if (hosts.ranks_per_host > 1 && leader_form_fits(bytes)) {
    const double leader = predict_two_level_leader_s(hosts, bytes, net, host);
    if (leader < best.predicted_s) best = {1, true, leader};
  }
  for (int pieces = 2; pieces <= kMaxTwoLevelPieces; pieces *= 2) {
    if (ceil_div(bytes, int64_t{pieces} * hosts.ranks_per_host) <= kMinPieceSliceBytes) break;
    const double s = predict_two_level_s(hosts, bytes, net, host, pieces);
    if (s < best.predicted_s) best = {pieces, false, s};
  }
  return best;
}

AcrossHostsChoice choose_across_hosts(const HostLayout& hosts, int64_t bytes,
                                      const NetworkParams& net, const MachineModel& host,
                                      int forced_pieces) {
  const double ring = predict_flat_ring_s(hosts, bytes, net);
  const TwoLevelSchedule two = schedule_two_level(hosts, bytes, net, host, forced_pieces);
  AcrossHostsChoice c;
  c.two_level = two.predicted_s < ring;
  c.predicted_s = std::min(two.predicted_s, ring);
  c.two_level_s = two.predicted_s;
  c.pieces = two.pieces;
  c.leader = two.leader;
  const std::string in_pieces = two.leader ? " (leader form: one rank per host crosses)"
                                : two.pieces > 1
                                    ? " in " + std::to_string(two.pieces) + " pipelined pieces"
                                    : "";
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%d hosts x %d ranks: two-level (shared memory inside hosts, the engine across) "
                "predicted %.1f us%s, the engine's ring over all ranks %.1f us",
                hosts.num_hosts, hosts.ranks_per_host, two.predicted_s * 1e6, in_pieces.c_str(),
                ring * 1e6);
  c.reason = buf;
  return c;
}

Traffic flat_ring_gather_scatter_traffic(const HostLayout& hosts, int64_t bytes) {
  // Half the allreduce's ring: P-1 messages of bytes/P on every link.
  Traffic t = flat_ring_traffic(hosts, bytes);
  t.inter_host_bytes /= 2;
  t.inter_host_steps /= 2;
  t.intra_host_socket_bytes /= 2;
  return t;
}

Traffic two_level_gather_scatter_traffic(const HostLayout& hosts, int64_t bytes) {
  check(hosts);
  Traffic t;
  const int h = hosts.num_hosts;
  if (h == 1) return t;
  // Each of the L local ranks of a host sends H-1 blocks of bytes/P: (H-1)/H of the payload.
  t.inter_host_bytes = static_cast<double>(h - 1) * static_cast<double>(bytes) / h;
  t.inter_host_steps = h - 1;
  t.inter_host_streams = hosts.ranks_per_host;
  return t;
}

double predict_flat_ring_gather_scatter_s(const HostLayout& hosts, int64_t bytes,
                                          const NetworkParams& net) {
  check(hosts);
  const double rate = stream_rate(net, hosts.ranks_per_host, hosts.num_hosts > 1 ? 1 : 0);
  return half_ring_s(hosts.world_size(), static_cast<double>(bytes), rate,
                     message_latency(net, hosts.ranks_per_host));
}

double predict_two_level_gather_scatter_s(GatherScatterKind kind, const HostLayout& hosts,
                                          int64_t bytes, int64_t elem_bytes,
                                          const NetworkParams& net, const MachineModel& host) {
  check(hosts);
  check_host_model(hosts, host);
  // Inside the host the full payload moves among L ranks (each holding H blocks).
  const double intra =
      hosts.ranks_per_host > 1
          ? predict_gather_scatter(host, kind, GatherScatterCandidate{}, bytes,
                                   kind == GatherScatterKind::kAllGather ? 1 : elem_bytes)
                .seconds
          : 0.0;
  // Across hosts L rings of H ranks at once, each on H blocks of bytes/P,
  // unless what a rank sends rides in the exchange of calls: its own block
  // for an all-gather, its host's partial sums of H blocks for a
  // reduce-scatter.
  const double rate = stream_rate(net, hosts.ranks_per_host, hosts.ranks_per_host);
  const double per_ring = static_cast<double>(bytes) / hosts.ranks_per_host;
  const int64_t sent = kind == GatherScatterKind::kAllGather
                           ? ceil_div(bytes, hosts.world_size())
                           : ceil_div(bytes, hosts.ranks_per_host);
  const double across = carried_across_hosts(sent)
                            ? 0.0
                            : half_ring_s(hosts.num_hosts, per_ring, rate,
                                          message_latency(net, hosts.ranks_per_host));
  const double exchange = cross_host_check_s(hosts, net, hosts.ranks_per_host);
  // A reduce-scatter whose partial sums do not ride sends its call while its
  // host reduces (an all-gather's exchange comes first: nothing to overlap).
  if (kind == GatherScatterKind::kReduceScatter && across > 0) {
    return check_beside(exchange, intra, overlap_share(hosts, net)) + across;
  }
  return exchange + intra + across;
}

bool gather_scatter_leader_fits(GatherScatterKind kind, const HostLayout& hosts, int64_t bytes) {
  check(hosts);
  return leader_form_fits(kind == GatherScatterKind::kAllGather ? ceil_div(bytes, hosts.num_hosts)
                                                                : bytes);
}

double predict_two_level_gather_scatter_leader_s(GatherScatterKind kind, const HostLayout& hosts,
                                                 int64_t bytes, const NetworkParams& net,
                                                 const MachineModel& host) {
  if (!gather_scatter_leader_fits(kind, hosts, bytes)) {
    throw std::invalid_argument(
        std::string("two-level plan: the leader form of a ") + to_string(kind) +
        " carries at most " + std::to_string(kCrossHostCarryBytes) + " bytes per host; got " +
        std::to_string(bytes) + " bytes over " + std::to_string(hosts.num_hosts) + " hosts");
  }
  if (kind == GatherScatterKind::kReduceScatter) {
    return predict_two_level_leader_s(hosts, bytes, net, host);
  }
  check_host_model(hosts, host);
  const auto all_gather = [&](int64_t n) {
    return hosts.ranks_per_host > 1
               ? predict_gather_scatter(host, kind, GatherScatterCandidate{}, n, 1).seconds
               : 0.0;
  };
  const int64_t own_host = ceil_div(bytes, hosts.num_hosts);
  return all_gather(own_host) + cross_host_check_s(hosts, net, 1) + all_gather(bytes - own_host);
}

AcrossHostsChoice choose_gather_scatter_across_hosts(GatherScatterKind kind,
                                                     const HostLayout& hosts, int64_t bytes,
                                                     int64_t elem_bytes, const NetworkParams& net,
                                                     const MachineModel& host) {
  const double ring = predict_flat_ring_gather_scatter_s(hosts, bytes, net);
  double two = predict_two_level_gather_scatter_s(kind, hosts, bytes, elem_bytes, net, host);
  bool leader = false;
  if (hosts.ranks_per_host > 1 && gather_scatter_leader_fits(kind, hosts, bytes)) {
    const double s = predict_two_level_gather_scatter_leader_s(kind, hosts, bytes, net, host);
    leader = s < two;
    two = std::min(two, s);
  }
  AcrossHostsChoice c;
  c.two_level = two < ring;
  c.two_level_s = two;
  c.leader = leader;
  c.predicted_s = std::min(two, ring);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%d hosts x %d ranks: two-level %s (the engine across hosts, shared memory "
                "inside them) predicted %.1f us%s, the engine's ring over all ranks %.1f us",
                hosts.num_hosts, hosts.ranks_per_host, to_string(kind), two * 1e6,
                leader ? " (leader form: one rank per host crosses)" : "", ring * 1e6);
  c.reason = buf;
  return c;
}

void keep_nan_across_hosts(AcrossHostsChoice& c) {
  if (c.two_level) return;
  c.two_level = true;
  c.predicted_s = c.two_level_s;
  c.reason +=
      "; two levels all the same: a floating-point MIN or MAX keeps a NaN there, which the "
      "engine's ring can drop";
}

double predict_flat_broadcast_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net) {
  check(hosts);
  const double size = static_cast<double>(bytes);
  const int across = hosts.num_hosts > 1 ? tree_steps(hosts.num_hosts) : 0;
  const int inside = std::max(0, tree_steps(hosts.world_size()) - across);
  double t = 0;
  for (int k = 0; k < inside; ++k) {
    // 2^k of the root host's ranks send to the others of that host.
    const int streams = std::min(1 << k, hosts.ranks_per_host);
    t += message_latency(net, streams) + size / stream_rate(net, streams, 0);
  }
  // Every rank of a holding host sends to its counterpart on another host.
  const int streams = std::min(1 << inside, hosts.ranks_per_host);
  t += across * (message_latency(net, streams) + size / stream_rate(net, streams, streams));
  return t;
}

double predict_two_level_broadcast_s(const HostLayout& hosts, int64_t bytes,
                                     const NetworkParams& net, const MachineModel& host) {
  check(hosts);
  check_host_model(hosts, host);
  const double inside = hosts.ranks_per_host > 1
                            ? predict_gather_scatter(host, GatherScatterKind::kAllGather,
                                                     GatherScatterCandidate{}, bytes, 1)
                                  .seconds
                            : 0.0;
  const double across =
      carried_across_hosts(bytes)
          ? 0.0
          : tree_steps(hosts.num_hosts) *
                (message_latency(net, 1) + static_cast<double>(bytes) / stream_rate(net, 1, 1));
  return cross_host_check_s(hosts, net, 1) + across + inside;
}

AcrossHostsChoice choose_broadcast_across_hosts(const HostLayout& hosts, int64_t bytes,
                                                const NetworkParams& net,
                                                const MachineModel& host) {
  const double tree = predict_flat_broadcast_s(hosts, bytes, net);
  const double two = predict_two_level_broadcast_s(hosts, bytes, net, host);
  AcrossHostsChoice c;
  c.two_level = two < tree;
  c.predicted_s = std::min(two, tree);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%d hosts x %d ranks: two-level broadcast (one rank per host crosses, shared "
                "memory inside hosts) predicted %.1f us, the engine's tree over all ranks %.1f us",
                hosts.num_hosts, hosts.ranks_per_host, two * 1e6, tree * 1e6);
  c.reason = buf;
  return c;
}

}  // namespace xdev::plan
