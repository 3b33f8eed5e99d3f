// NCCL as a candidate: the time NCCL's own tuning model predicts for an
// allreduce, reduce-scatter or all-gather on one host, so that
// algorithm="auto" on CUDA tensors can weigh xdev's plans against the engine
// it would otherwise hand the call to.
//
// The model is NCCL's, not ours: NCCL 2.20.3's src/graph/tuning.cc
// (ncclTopoTuneModel and ncclTopoGetAlgoTime) for one node. Every algorithm
// (ring, tree, NVLS) and protocol (LL, LL128, Simple) NCCL would enable gets a
// latency (a base per algorithm and protocol, plus one hardware latency per
// step: 2 (N - 1) steps for a ring, 2 (N - 1) hops for the chain NCCL's tree
// is inside one node) and a bandwidth (the topology search's channels times
// each channel's bandwidth, cut by per-protocol factors and caps), and
// predicts latency + bytes / bandwidth. NCCL picks the minimum of these; so do
// we. What NCCL's search would find on a machine (channels, bandwidth per
// channel, whether NVLS runs) is given per machine in NcclHost.
//
// A reduce-scatter or an all-gather (the same model in NCCL) runs as a ring
// of N - 1 steps or, on one node with NVSwitch multicast, as NVLS; never as a
// tree. Its size is the whole tensor, N blocks, as NCCL's model and
// nccl-tests count it. The ring's LL protocol there keeps a third of the bus
// bandwidth (an allreduce's a quarter).
//
// Pure C++17, no torch, CUDA or NCCL.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace xdev::plan {

enum class NcclAlgo { kRing, kTree, kNvls };
enum class NcclProto { kLL, kLL128, kSimple };

const char* to_string(NcclAlgo a);   // "ring", "tree", "nvls"
const char* to_string(NcclProto p);  // "LL", "LL128", "Simple"

// What NCCL's topology search finds on one host, as its tuning model reads it.
struct NcclHost {
  bool present = false;         // false: NCCL does not run here (CPU hosts)
  int compute_capability = 90;  // 60, 70, 80, 90 (x 10 + minor, as NCCL's minCompCap)
  bool nvlink = true;           // the ring and tree graphs run over NVLink (else PCIe)
  int channels = 0;             // the ring and tree graphs' channels
  double channel_gbps = 0;      // each channel's bandwidth (GB/s, NCCL's bwIntra)
  int nvls_channels = 0;        // NVLink SHARP (NVSwitch multicast); 0: not available
  double nvls_channel_gbps = 0;
  std::string source;  // where the numbers come from
};

struct NcclCandidate {
  NcclAlgo algo = NcclAlgo::kRing;
  NcclProto proto = NcclProto::kSimple;
  std::string label() const;  // "nccl_ring/LL", "nccl_nvls/Simple"
};

struct NcclPrediction {
  NcclCandidate candidate;
  double latency_s = 0;  // the model's fixed part
  double algbw = 0;      // bytes / s the model divides the payload by
  double seconds = 0;    // latency_s + bytes / algbw
};

// The algorithm/protocol pairs NCCL enables for an allreduce on this host:
// ring and tree with LL and Simple always, with LL128 over NVLink on Volta,
// Ampere and Hopper; NVLS (Simple only) where the host has it.
std::vector<NcclCandidate> nccl_candidates(const NcclHost& host);

// NCCL's predicted time for one candidate. Throws std::invalid_argument when
// the host has no NCCL, ranks < 2 or bytes < 0.
NcclPrediction predict_nccl_allreduce(const NcclHost& host, const NcclCandidate& c, int ranks,
                                      int64_t bytes);

// NCCL's own choice: the fastest of nccl_candidates.
NcclPrediction best_nccl_allreduce(const NcclHost& host, int ranks, int64_t bytes);

// The pairs NCCL enables for a reduce-scatter or an all-gather on this host:
// the ring with LL, LL128 (as for the allreduce) and Simple; NVLS where the
// host has it.
std::vector<NcclCandidate> nccl_gather_scatter_candidates(const NcclHost& host);

// NCCL's predicted time for a reduce-scatter or an all-gather whose full
// tensor (all N blocks) holds `bytes`. Throws as predict_nccl_allreduce does,
// and for a tree candidate.
NcclPrediction predict_nccl_gather_scatter(const NcclHost& host, const NcclCandidate& c, int ranks,
                                           int64_t bytes);

// NCCL's own choice: the fastest of nccl_gather_scatter_candidates.
NcclPrediction best_nccl_gather_scatter(const NcclHost& host, int ranks, int64_t bytes);

}  // namespace xdev::plan
