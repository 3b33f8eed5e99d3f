#include "nccl_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace xdev::plan {
namespace {

// NCCL 2.20.3, src/graph/tuning.cc. Indexed [algorithm][protocol] in the
// orders of NcclAlgo and NcclProto. Latencies in microseconds.
constexpr double kBaseLatencyUs[4][3] = {
    {6.6, 14.0, 8.4}, {6.8, 14.0, 0.0}, {0.0, 0.0, 0.0}, {0.0, 0.0, 0.0}};
// Per step over NVLink, over PCIe, and across the network. NVLS's NVLink
// figure is its whole latency inside a node.
constexpr double kNvlinkLatencyUs[4][3] = {
    {0.6, 1.9, 3.4}, {0.6, 1.25, 28.0}, {0.0, 0.0, 23.0}, {0.0, 0.0, 23.0}};
constexpr double kPcieLatencyUs[4][3] = {
    {1.0, 2.5, 5.7}, {1.0, 1.9, 28.0}, {0.0, 0.0, 0.0}, {0.0, 0.0, 0.0}};
constexpr double kNetLatencyUs[4][3] = {
    {2.7, 4.0, 14.0}, {5.0, 8.5, 28.0}, {0.0, 0.0, 18.0}, {0.0, 0.0, 14.0}};

// Caps, indexed [GPU generation: Volta, Ampere, Hopper][nodes: 1, 2, more]
// (GB/s). LL's whole bandwidth is indexed by the generation on one node and
// by the CPU vendor (0: Intel and others, 1: AMD) across nodes; the others
// are per channel: ring LL128, tree, tree LL128.
constexpr double kLlMaxGbps[3][3] = {{39.0, 39.0, 20.4}, {87.7, 22.5, 19.0}, {87.7, 22.5, 19.0}};
constexpr double kRingLl128ChannelGbps[3][3] = {
    {20.0, 20.0, 20.0}, {20.0, 20.0, 20.0}, {36.7, 36.7, 36.7}};
constexpr double kTreeChannelGbps[3][3] = {
    {26.5, 18.5, 10.0}, {24.0, 23.6, 17.8}, {38.7, 41.4, 36.0}};
constexpr double kTreeLl128ChannelGbps[3][3] = {
    {20.0, 20.0, 20.0}, {20.0, 20.0, 20.0}, {36.7, 36.7, 29.0}};

// Trees stray from the model at medium sizes; NCCL scales their bandwidth by
// these factors, per protocol, for payloads of 64 B << i.
constexpr double kTreeCorrection[3][23] = {
    {1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7,  .7,  .7,  .6, .5,
     .4,  .4,  .5,  .6,  .7, .8, .9, 1.0, 1.0, 1.0, 1.0},
    {1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7,  .6, .6,
     .6,  .6,  .6,  .6,  .8,  .9, .9, .9, .9, 1.0, 1.0},
    {.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9}};

int generation(int compute_capability) {
  return compute_capability >= 90 ? 2 : compute_capability >= 80 ? 1 : 0;
}

int log2_floor(int64_t v) {
  int l = 0;
  while (v > 1) {
    v >>= 1;
    ++l;
  }
  return l;
}

void check_call(const NcclHost& host, const NcclNetwork& net, int ranks, int64_t bytes,
                const std::string& name) {
  if (!host.present) throw std::invalid_argument(name + ": no NCCL on this host");
  if (ranks < 2) throw std::invalid_argument(name + ": needs at least two ranks");
  if (bytes < 0) throw std::invalid_argument(name + ": bytes must be >= 0");
  if (net.nodes < 1 || ranks % net.nodes != 0) {
    throw std::invalid_argument(name + ": ranks must be a multiple of the nodes (" +
                                std::to_string(ranks) + " ranks, " + std::to_string(net.nodes) +
                                " nodes)");
  }
  if (net.nodes > 1 && (net.nics < 1 || net.nic_gbps <= 0)) {
    throw std::invalid_argument(name + ": several nodes need NICs with a bandwidth");
  }
}

// NCCL 2.20.3's ncclTopoTuneModel and ncclTopoGetAlgoTime: an allreduce, or
// (gather_scatter) a reduce-scatter or an all-gather.
NcclPrediction predict(const NcclHost& host, const NcclNetwork& net, bool gather_scatter,
                       const NcclCandidate& c, int ranks, int64_t bytes, const char* who) {
  const std::string name = who;
  check_call(host, net, ranks, bytes, name);
  const int nodes = net.nodes;
  const bool across = nodes > 1;
  const bool runs = c.algo == NcclAlgo::kRing || (c.algo == NcclAlgo::kTree && !gather_scatter) ||
                    (c.algo == NcclAlgo::kNvls && !across) ||
                    (c.algo == NcclAlgo::kNvlsTree && across && !gather_scatter);
  if (!runs) {
    throw std::invalid_argument(name + ": NCCL runs no " + to_string(c.algo) +
                                " for this call on " + std::to_string(nodes) + " node(s)");
  }
  const bool nvls = c.algo == NcclAlgo::kNvls || c.algo == NcclAlgo::kNvlsTree;
  if (nvls && host.nvls_channels <= 0) {
    throw std::invalid_argument(name + ": this host has no NVLS");
  }
  const int a = static_cast<int>(c.algo), p = static_cast<int>(c.proto);
  const int gen = generation(host.compute_capability);
  const int node_class = std::min(nodes, 3) - 1;  // NCCL's index: 1 node, 2, more
  const double ll_max_gbps = kLlMaxGbps[across ? (net.amd_cpu ? 1 : 0) : gen][node_class];
  const int steps = gather_scatter ? ranks - 1 : 2 * (ranks - 1);
  const int inter_steps = !across ? 0 : gather_scatter ? nodes - 1 : 2 * nodes;
  const double ppn = static_cast<double>(ranks) / nodes;
  const bool simple = c.proto == NcclProto::kSimple;
  const int channels = nvls ? host.nvls_channels : host.channels;
  const double intra_channel_gbps = nvls ? host.nvls_channel_gbps : host.channel_gbps;
  double channel_gbps = intra_channel_gbps;
  if (across) {
    // NVLS tree beyond two nodes: half the network's rate per channel.
    const double share = c.algo == NcclAlgo::kNvlsTree && nodes > 2 ? 0.5 : 1.0;
    channel_gbps = net.channel_gbps_across(channels, intra_channel_gbps / share) * share;
  }
  double intra_us = (host.nvlink || nvls) ? kNvlinkLatencyUs[a][p] : kPcieLatencyUs[a][p];
  const double inter_us = kNetLatencyUs[a][p] + net.latency_us * (simple ? 2 : 1);

  double bus_gbps = channels * channel_gbps, latency_us = kBaseLatencyUs[a][p], to_algbw = 1;
  switch (c.algo) {
    case NcclAlgo::kRing:
      if (c.proto == NcclProto::kLL) {
        bus_gbps = std::min(ll_max_gbps, bus_gbps / (gather_scatter && !across ? 3 : 4));
      }
      if (c.proto == NcclProto::kLL128) {
        bus_gbps = std::min(bus_gbps * (ppn < 2 ? 0.7 : 0.92),
                            channels * kRingLl128ChannelGbps[gen][node_class]);
      }
      to_algbw = static_cast<double>(ranks) / steps;
      if (across) {
        // Even the steps inside a node post to the network: at least NCCL's
        // per-post overhead (Intel 1 us, AMD 2 us; Simple posts three times).
        intra_us = std::max(intra_us, (net.amd_cpu ? 2.0 : 1.0) * (simple ? 3 : 1));
      }
      latency_us += (steps - inter_steps) * intra_us + inter_steps * inter_us;
      break;
    case NcclAlgo::kTree:
      bus_gbps = std::min(bus_gbps * 0.92, channels * kTreeChannelGbps[gen][node_class]);
      if (c.proto == NcclProto::kLL) bus_gbps = std::min(bus_gbps / 3.8, ll_max_gbps);
      if (c.proto == NcclProto::kLL128) {
        bus_gbps = std::min(bus_gbps * (across ? 120.0 / 128.0 : 7.0 / 9.0),
                            channels * kTreeLl128ChannelGbps[gen][node_class]);
      }
      to_algbw = 0.5;
      latency_us += 2.0 * ((ppn - 1) * intra_us + log2_floor(nodes) * inter_us);
      break;
    case NcclAlgo::kNvls:
      to_algbw = 5.0 / 6.0;
      latency_us = intra_us;
      break;
    case NcclAlgo::kNvlsTree:
      to_algbw = 5.0 / 6.0;
      latency_us += intra_us + 2.0 * log2_floor(nodes) * inter_us;
      break;
  }
  double algbw_gbps = bus_gbps * to_algbw;
  const int size_class = log2_floor(bytes >> 6);
  if (c.algo == NcclAlgo::kTree && size_class < 23) algbw_gbps *= kTreeCorrection[p][size_class];
  if (c.algo == NcclAlgo::kRing && simple && across && !gather_scatter &&
      bytes / (static_cast<int64_t>(host.channels) * ranks) >= 64) {
    // The ring's plateau across nodes (NCCL's own correction).
    latency_us *= host.compute_capability < 80 ? 1.9 : 1.4;
  }

  NcclPrediction out;
  out.candidate = c;
  out.latency_s = latency_us * 1e-6;
  out.algbw = algbw_gbps * 1e9;
  out.seconds = out.latency_s + (out.algbw > 0 ? static_cast<double>(bytes) / out.algbw : 0.0);
  return out;
}

NcclPrediction fastest(const NcclHost& host, const NcclNetwork& net,
                       const std::vector<NcclCandidate>& candidates, bool gather_scatter, int ranks,
                       int64_t bytes, const char* who) {
  if (candidates.empty()) throw std::invalid_argument(std::string(who) + ": no NCCL on this host");
  NcclPrediction best;
  for (const NcclCandidate& c : candidates) {
    const NcclPrediction p = predict(host, net, gather_scatter, c, ranks, bytes, who);
    if (&c == &candidates.front() || p.seconds < best.seconds) best = p;
  }
  return best;
}

}  // namespace

const char* to_string(NcclAlgo a) {
  switch (a) {
    case NcclAlgo::kRing:
      return "ring";
    case NcclAlgo::kTree:
      return "tree";
    case NcclAlgo::kNvls:
      return "nvls";
    case NcclAlgo::kNvlsTree:
      return "nvls_tree";
  }
  return "?";
}

const char* to_string(NcclProto p) {
  switch (p) {
    case NcclProto::kLL:
      return "LL";
    case NcclProto::kLL128:
      return "LL128";
    case NcclProto::kSimple:
      return "Simple";
  }
  return "?";
}

std::string NcclCandidate::label() const {
  return std::string("nccl_") + to_string(algo) + "/" + to_string(proto);
}

double NcclNetwork::channel_gbps_across(int channels, double channel_gbps) const {
  if (channels < 1) return 0;
  return std::min(channel_gbps, nics * nic_gbps / channels);
}

std::vector<NcclCandidate> nccl_candidates(const NcclHost& host, const NcclNetwork& net) {
  std::vector<NcclCandidate> out;
  if (!host.present) return out;
  // LL128 is on by default only over NVLink, on GPUs NCCL has tested it on.
  const int cc = host.compute_capability;
  const bool ll128 = host.nvlink && (cc == 70 || cc == 80 || cc == 90);
  for (NcclAlgo a : {NcclAlgo::kRing, NcclAlgo::kTree}) {
    for (NcclProto p : {NcclProto::kLL, NcclProto::kLL128, NcclProto::kSimple}) {
      if (p != NcclProto::kLL128 || ll128) out.push_back({a, p});
    }
  }
  if (host.nvls_channels > 0) {
    out.push_back({net.nodes > 1 ? NcclAlgo::kNvlsTree : NcclAlgo::kNvls, NcclProto::kSimple});
  }
  return out;
}

NcclPrediction predict_nccl_allreduce(const NcclHost& host, const NcclCandidate& c, int ranks,
                                      int64_t bytes, const NcclNetwork& net) {
  return predict(host, net, false, c, ranks, bytes, "predict_nccl_allreduce");
}

NcclPrediction best_nccl_allreduce(const NcclHost& host, int ranks, int64_t bytes,
                                   const NcclNetwork& net) {
  return fastest(host, net, nccl_candidates(host, net), false, ranks, bytes, "best_nccl_allreduce");
}

std::vector<NcclCandidate> nccl_gather_scatter_candidates(const NcclHost& host,
                                                          const NcclNetwork& net) {
  std::vector<NcclCandidate> out;
  for (const NcclCandidate& c : nccl_candidates(host, net)) {
    if (c.algo == NcclAlgo::kRing || c.algo == NcclAlgo::kNvls) out.push_back(c);
  }
  return out;
}

NcclPrediction predict_nccl_gather_scatter(const NcclHost& host, const NcclCandidate& c, int ranks,
                                           int64_t bytes, const NcclNetwork& net) {
  return predict(host, net, true, c, ranks, bytes, "predict_nccl_gather_scatter");
}

NcclPrediction best_nccl_gather_scatter(const NcclHost& host, int ranks, int64_t bytes,
                                        const NcclNetwork& net) {
  return fastest(host, net, nccl_gather_scatter_candidates(host, net), true, ranks, bytes,
                 "best_nccl_gather_scatter");
}

}  // namespace xdev::plan
