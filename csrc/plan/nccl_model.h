// NCCL as a candidate: the time NCCL's own tuning model predicts for an
// allreduce, reduce-scatter or all-gather on one host, so that
// algorithm="auto" on CUDA tensors can weigh xdev's plans against the engine
// it would otherwise hand the call to.
//
// The model is NCCL's, not ours: NCCL 2.20.3's src/graph/tuning.cc
// (ncclTopoTuneModel and ncclTopoGetAlgoTime). On one node every algorithm
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
// Across nodes (NcclNetwork) the same file's multi-node branch applies: a
// ring's steps that cross the network cost the network's hop latency (2 x
// nodes of an allreduce's, nodes - 1 of a reduce-scatter's) and its other
// steps at least NCCL's per-post network overhead; a tree crosses the network
// 2 log2(nodes) times; NVLS becomes NVLS tree (NVSwitch inside each node, a
// tree across nodes) and runs only for the allreduce; the caps on LL, LL128
// and tree bandwidth take their two-node or more-nodes values. What NCCL's
// search would find for the channels across nodes is our assumption, stated
// at NcclNetwork.
//
// Pure C++17, no torch, CUDA or NCCL.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace xdev::plan {

enum class NcclAlgo { kRing, kTree, kNvls, kNvlsTree };
enum class NcclProto { kLL, kLL128, kSimple };

const char* to_string(NcclAlgo a);   // "ring", "tree", "nvls", "nvls_tree"
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

// The nodes an NCCL communicator spans and the network between them; one node
// (the default) is the single-host model above. Every node holds the same
// number of ranks and the same NcclHost. Our assumption for what NCCL's
// search finds across nodes: the host's channels (NVLS channels for NVLS
// tree) each leave the node through a NIC, the NICs' bandwidth split evenly
// among them, each channel capped at its rate inside the node. NCCL's
// multi-node graphs start from the NIC's speed and duplicate channels, which
// splits a NIC's bandwidth the same way. LL128 keeps its single-node rule
// (NICs near the GPUs, as on DGX and HGX systems).
struct NcclNetwork {
  int nodes = 1;
  int nics = 0;           // per node
  double nic_gbps = 0;    // each NIC, each direction (GB/s; 400 Gb/s InfiniBand: 50)
  bool amd_cpu = false;   // NCCL's net overhead (2 us, else 1) and LL caps follow the CPU vendor
  double latency_us = 0;  // the net plugin's own latency (NCCL's latencyInter; IB and sockets: 0)
  // Each channel's bandwidth across nodes (GB/s) for `channels` channels of
  // `channel_gbps` inside the node.
  double channel_gbps_across(int channels, double channel_gbps) const;
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

// The algorithm/protocol pairs NCCL enables for an allreduce on these hosts:
// ring and tree with LL and Simple always, with LL128 over NVLink on Volta,
// Ampere and Hopper; where the host has NVLS (Simple only), NVLS on one node
// and NVLS tree across nodes.
std::vector<NcclCandidate> nccl_candidates(const NcclHost& host, const NcclNetwork& net = {});

// NCCL's predicted time for one candidate; `ranks` counts every node's.
// Throws std::invalid_argument when the host has no NCCL, ranks < 2, bytes <
// 0, the candidate does not run on these nodes, ranks are not a multiple of
// the nodes, or several nodes have no NICs.
NcclPrediction predict_nccl_allreduce(const NcclHost& host, const NcclCandidate& c, int ranks,
                                      int64_t bytes, const NcclNetwork& net = {});

// NCCL's own choice: the fastest of nccl_candidates.
NcclPrediction best_nccl_allreduce(const NcclHost& host, int ranks, int64_t bytes,
                                   const NcclNetwork& net = {});

// The pairs NCCL enables for a reduce-scatter or an all-gather on these hosts:
// the ring with LL, LL128 (as for the allreduce) and Simple; NVLS on one node
// where the host has it.
std::vector<NcclCandidate> nccl_gather_scatter_candidates(const NcclHost& host,
                                                          const NcclNetwork& net = {});

// NCCL's predicted time for a reduce-scatter or an all-gather whose full
// tensor (all N blocks) holds `bytes`. Throws as predict_nccl_allreduce does.
NcclPrediction predict_nccl_gather_scatter(const NcclHost& host, const NcclCandidate& c, int ranks,
                                           int64_t bytes, const NcclNetwork& net = {});

// NCCL's own choice: the fastest of nccl_gather_scatter_candidates.
NcclPrediction best_nccl_gather_scatter(const NcclHost& host, int ranks, int64_t bytes,
                                        const NcclNetwork& net = {});

}  // namespace xdev::plan
