#include "nccl_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace xdev::plan {
namespace {

// NCCL 2.20.3, src/graph/tuning.cc, for one node. Indexed [algorithm][protocol]
// in the orders of NcclAlgo and NcclProto. Latencies in microseconds.
constexpr double kBaseLatencyUs[3][3] = {{6.6, 14.0, 8.4}, {6.8, 14.0, 0.0}, {0.0, 0.0, 0.0}};
// Per step, over NVLink and over PCIe. NVLS's is its whole latency on one node.
constexpr double kNvlinkLatencyUs[3][3] = {{0.6, 1.9, 3.4}, {0.6, 1.25, 28.0}, {0.0, 0.0, 23.0}};
constexpr double kPcieLatencyUs[3][3] = {{1.0, 2.5, 5.7}, {1.0, 1.9, 28.0}, {0.0, 0.0, 0.0}};

// Per GPU generation (Volta, Ampere, Hopper), one node: LL's bandwidth cap,
// and the per-channel caps of ring LL128, tree and tree LL128 (GB/s).
constexpr double kLlMaxGbps[3] = {39.0, 87.7, 87.7};
constexpr double kRingLl128ChannelGbps[3] = {20.0, 20.0, 36.7};
constexpr double kTreeChannelGbps[3] = {26.5, 24.0, 38.7};
constexpr double kTreeLl128ChannelGbps[3] = {20.0, 20.0, 36.7};

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

// NCCL 2.20.3's ncclTopoTuneModel and ncclTopoGetAlgoTime for one node: an
// allreduce, or (gather_scatter) a reduce-scatter or an all-gather.
NcclPrediction predict(const NcclHost& host, bool gather_scatter, const NcclCandidate& c, int ranks,
                       int64_t bytes, const char* who) {
  const std::string name = who;
  if (!host.present) throw std::invalid_argument(name + ": no NCCL on this host");
  if (ranks < 2) throw std::invalid_argument(name + ": needs at least two ranks");
  if (bytes < 0) throw std::invalid_argument(name + ": bytes must be >= 0");
  if (gather_scatter && c.algo == NcclAlgo::kTree) {
    throw std::invalid_argument(name + ": NCCL runs no tree for a reduce-scatter or all-gather");
  }
  const int a = static_cast<int>(c.algo), p = static_cast<int>(c.proto);
  const int gen = generation(host.compute_capability);
  const int steps = gather_scatter ? ranks - 1 : 2 * (ranks - 1);
  const double hop_us = host.nvlink ? kNvlinkLatencyUs[a][p] : kPcieLatencyUs[a][p];

  double bus_gbps = 0, latency_us = 0, to_algbw = 1;
  switch (c.algo) {
    case NcclAlgo::kRing:
      bus_gbps = host.channels * host.channel_gbps;
      if (c.proto == NcclProto::kLL) {
        bus_gbps = std::min(kLlMaxGbps[gen], bus_gbps / (gather_scatter ? 3 : 4));
      }
      if (c.proto == NcclProto::kLL128) {
        bus_gbps = std::min(bus_gbps * 0.92, host.channels * kRingLl128ChannelGbps[gen]);
      }
      to_algbw = static_cast<double>(ranks) / steps;
      latency_us = kBaseLatencyUs[a][p] + steps * hop_us;
      break;
    case NcclAlgo::kTree:
      bus_gbps =
          std::min(host.channels * host.channel_gbps * 0.92, host.channels * kTreeChannelGbps[gen]);
      if (c.proto == NcclProto::kLL) bus_gbps = std::min(bus_gbps / 3.8, kLlMaxGbps[gen]);
      if (c.proto == NcclProto::kLL128) {
        bus_gbps = std::min(bus_gbps * 7.0 / 9.0, host.channels * kTreeLl128ChannelGbps[gen]);
      }
      to_algbw = 0.5;
      latency_us = kBaseLatencyUs[a][p] + 2.0 * (ranks - 1) * hop_us;
      break;
    case NcclAlgo::kNvls:
      if (host.nvls_channels <= 0) throw std::invalid_argument(name + ": this host has no NVLS");
      bus_gbps = host.nvls_channels * host.nvls_channel_gbps;
      to_algbw = 5.0 / 6.0;
      latency_us = kNvlinkLatencyUs[a][p];
      break;
  }
  double algbw_gbps = bus_gbps * to_algbw;
  const int size_class = log2_floor(bytes >> 6);
  if (c.algo == NcclAlgo::kTree && size_class < 23) algbw_gbps *= kTreeCorrection[p][size_class];

  NcclPrediction out;
  out.candidate = c;
  out.latency_s = latency_us * 1e-6;
  out.algbw = algbw_gbps * 1e9;
  out.seconds = out.latency_s + (out.algbw > 0 ? static_cast<double>(bytes) / out.algbw : 0.0);
  return out;
}

NcclPrediction fastest(const NcclHost& host, const std::vector<NcclCandidate>& candidates,
                       bool gather_scatter, int ranks, int64_t bytes, const char* who) {
  if (candidates.empty()) throw std::invalid_argument(std::string(who) + ": no NCCL on this host");
  NcclPrediction best;
  for (const NcclCandidate& c : candidates) {
    const NcclPrediction p = predict(host, gather_scatter, c, ranks, bytes, who);
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

std::vector<NcclCandidate> nccl_candidates(const NcclHost& host) {
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
  if (host.nvls_channels > 0) out.push_back({NcclAlgo::kNvls, NcclProto::kSimple});
  return out;
}

NcclPrediction predict_nccl_allreduce(const NcclHost& host, const NcclCandidate& c, int ranks,
                                      int64_t bytes) {
  return predict(host, false, c, ranks, bytes, "predict_nccl_allreduce");
}

NcclPrediction best_nccl_allreduce(const NcclHost& host, int ranks, int64_t bytes) {
  return fastest(host, nccl_candidates(host), false, ranks, bytes, "best_nccl_allreduce");
}

std::vector<NcclCandidate> nccl_gather_scatter_candidates(const NcclHost& host) {
  std::vector<NcclCandidate> out;
  for (const NcclCandidate& c : nccl_candidates(host)) {
    if (c.algo != NcclAlgo::kTree) out.push_back(c);
  }
  return out;
}

NcclPrediction predict_nccl_gather_scatter(const NcclHost& host, const NcclCandidate& c, int ranks,
                                           int64_t bytes) {
  return predict(host, true, c, ranks, bytes, "predict_nccl_gather_scatter");
}

NcclPrediction best_nccl_gather_scatter(const NcclHost& host, int ranks, int64_t bytes) {
  return fastest(host, nccl_gather_scatter_candidates(host), true, ranks, bytes,
                 "best_nccl_gather_scatter");
}

}  // namespace xdev::plan
