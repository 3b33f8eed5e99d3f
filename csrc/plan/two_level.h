// Allreduce across hosts: the fallback engine's flat ring over every rank,
// against xdev's two-level plan, the structure of Horovod's hierarchical
// allreduce and of TensorFlow's HierarchicalCopyAllReduce one level up:
//   1. inside each host, a reduce-scatter over shared memory: local rank l
//      ends with the host's sum of slice l (of L slices);
//   2. across hosts, an allreduce of slice l by the engine (Gloo), among the
//      ranks of local index l on every host: L such groups run at once, each
//      on 1/L of the payload;
//   3. inside each host, an all-gather of the L slices.
// Hosts must hold the same number of ranks, so that slice l means the same
// elements on every host. Both plans are modelled with a network of per-host
// link rates and per-message latency, so that auto can say which is faster
// and the README can show where the bytes go.
//
// Pure C++17, no torch.
#pragma once

#include <cstdint>
#include <string>

#include "cost_model.h"
#include "gather_scatter_plan.h"

namespace xdev::plan {

// The defaults describe a 100 Gb/s Ethernet link per host, driven through TCP
// sockets by one core per stream as Gloo does. A cost-model file
// (XDEV_CPU_MODEL) may replace them with measured values.
namespace network_default {
inline constexpr double kHostGbps = 12.5;   // one host's link to the others, each direction
inline constexpr double kStreamGbps = 3.0;  // one TCP stream, as one core drives it
inline constexpr double kLatencyUs = 30.0;  // one message between two ranks through the engine
}  // namespace network_default

struct NetworkParams {
  double host_bytes_per_s = network_default::kHostGbps * 1e9;
  double stream_bytes_per_s = network_default::kStreamGbps * 1e9;
  double latency_s = network_default::kLatencyUs * 1e-6;
  // The host's memory, which every byte through a socket crosses
  // kSocketMemoryPasses times (into the kernel and out: a read and a write
  // each), shared by all its ranks' streams; 0: not modelled. The backend
  // sets it from its CPU model.
  double host_memory_bytes_per_s = 0;
  // The cores of one host, which run both the engine's streams and the steps
  // inside the host; 0: not modelled. A message through sockets is a core's
  // work at each end (system calls, the engine's threads), so streams beyond
  // the host's cores take turns: each gets cores/streams of a core, its
  // latency grows and its rate shrinks by that share. A pipelined two-level
  // allreduce overlaps the two only where each local rank has a core for each.
  int host_cores = 0;
};
inline constexpr double kSocketMemoryPasses = 4;

struct HostLayout {
  int num_hosts = 1;
  int ranks_per_host = 1;
  int world_size() const { return num_hosts * ranks_per_host; }
};

// Where a plan's bytes go, per host, for an allreduce of `bytes`.
struct Traffic {
  double inter_host_bytes = 0;   // bytes each host sends to other hosts
  int64_t inter_host_steps = 0;  // sequential steps whose messages cross hosts
  int64_t inter_host_streams = 0;
  double intra_host_socket_bytes = 0;  // bytes between ranks of one host through sockets
};

// The engine's ring over all ranks, host by host (Gloo's default allreduce):
// 2(P-1) steps of bytes/P per rank; one link per host leaves it, and at each
// step all L ranks of a host push their message through sockets at once.
Traffic flat_ring_traffic(const HostLayout& hosts, int64_t bytes);
// The two-level plan: nothing through sockets inside a host; across hosts L
// rings of H ranks, each on bytes/L.
Traffic two_level_traffic(const HostLayout& hosts, int64_t bytes);

// Every two-level collective exchanges its call with the ranks of its local
// index on the other hosts before any of its data crosses, so that a call
// whose shapes differ between hosts fails on every rank instead of waiting.
// That message has one size whatever the call: a header with the call's
// fields, then room for kCrossHostCarryBytes of payload. A fixed size is what
// keeps the check safe, since Gloo aborts the process when a message is longer
// than the buffer its receiver posted. A payload that fits (the host's
// partial sums of a small allreduce, a small all-gather's blocks) rides in the
// message, so a small two-level collective crosses the network once: one
// all-gather of H ranks instead of that and the engine's own steps.
inline constexpr int64_t kCrossHostHeaderBytes = 128;
inline constexpr int64_t kCrossHostCarryBytes = 64 * 1024;
inline constexpr int64_t kCrossHostMessageBytes = kCrossHostHeaderBytes + kCrossHostCarryBytes;

// Whether a payload of `bytes` (what one rank sends across hosts) rides in
// the exchange of calls.
inline bool carried_across_hosts(int64_t bytes) {
  return bytes <= kCrossHostCarryBytes;
}

// Whether a step inside a host (the reduce-scatter or all-gather of a
// two-level allreduce) reads its peers' tensors in place, for a tensor at one
// place of every local rank's symmetric heap, rather than staging it through
// slots. In place skips every staging copy but ends with a barrier of its
// own, so peers stop reading before anyone writes; staged passes one barrier
// per window. So in place pays where staging takes two windows or more.
inline bool in_host_step_in_place(int64_t staged_windows) {
  return staged_windows >= 2;
}

// The exchange of calls: an all-gather of H ranks, H-1 steps of one message,
// with `streams` ranks of a host sending at once (the L local ranks; the
// leader form below: one).
double cross_host_check_s(const HostLayout& hosts, const NetworkParams& net, int streams);

// The leader form, for a payload that rides whole in the exchange of calls:
// inside each host a reduce-scatter and an all-gather leave every local rank
// with the host's sum; local rank 0 alone exchanges it (with the call) with
// the other hosts' local ranks 0 and sums the hosts' sums in host order; a
// broadcast inside the host hands the result to the others. One message
// leaves a host instead of L of the same fixed size, and the host's cores run
// one engine's stream instead of L; it pays a third step inside the host
// (costed as the all-gather: the payload copied out of one rank's slots).
inline bool leader_form_fits(int64_t bytes) {
  return carried_across_hosts(bytes);
}
double predict_two_level_leader_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net,
                                  const MachineModel& host);

// A large two-level allreduce runs as a pipeline: the payload is cut into
// pieces (each cut into L slices as above), and while the engine allreduces
// piece k across hosts, each rank reduce-scatters piece k+1 and then
// all-gathers piece k-1 inside its host. The network and the host's memory
// then work at once; each piece pays the steps' fixed costs (barriers, the
// engine's latency) again. Only a payload of one piece rides in the exchange
// of calls.
//
// Predicted seconds. `host` models one host's shared-memory path for
// ranks_per_host ranks (a piece's reduce-scatter and all-gather each cost
// half its flat allreduce). The two-level plans include the exchange of
// calls above, and the engine's steps only for a payload it does not carry
// (the reduction of carried payloads is left out: H small sums in memory).
// The exchange for a payload the engine sends travels while the host
// reduce-scatters the first piece, and pieces overlap, as far as the host
// has cores for both the engine's streams and the steps inside it
// (NetworkParams::host_cores); where it has not, one waits for the other.
double predict_flat_ring_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net);
double predict_two_level_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net,
                           const MachineModel& host, int pieces = 1);

// The most pieces the model considers, and the least a piece's slice (what one
// rank's engine sends) may hold: smaller ones would ride in the exchange of
// calls if they were a payload of their own, and gain nothing by overlapping.
inline constexpr int kMaxTwoLevelPieces = 16;
inline constexpr int64_t kMinPieceSliceBytes = kCrossHostCarryBytes;

struct TwoLevelSchedule {
  int pieces = 1;
  bool leader = false;  // the leader form (one piece)
  double predicted_s = 0;
};

// The number of pieces (1, 2, 4, ... kMaxTwoLevelPieces, each piece's slice
// above kMinPieceSliceBytes) with the least predicted time, or `forced_pieces`
// (>= 1) when it is set (Options.two_level_pieces; 0: the model's choice). A
// payload whose slice rides in the exchange of calls stays whole either way,
// and one that rides whole takes the leader form where that is faster.
TwoLevelSchedule schedule_two_level(const HostLayout& hosts, int64_t bytes,
                                    const NetworkParams& net, const MachineModel& host,
                                    int forced_pieces = 0);

struct AcrossHostsChoice {
  bool two_level = false;
  double predicted_s = 0;
  double two_level_s = 0;  // the two-level plan's prediction, chosen or not
  int pieces = 1;          // the two-level allreduce's pipeline (schedule_two_level)
  bool leader = false;     // its leader form (schedule_two_level; a gather/scatter's own)
  std::string reason;
};

// The faster of the two plans for `bytes`, with both predictions in the reason.
AcrossHostsChoice choose_across_hosts(const HostLayout& hosts, int64_t bytes,
                                      const NetworkParams& net, const MachineModel& host,
                                      int forced_pieces = 0);

// Two levels whatever the model predicts, the reason says why: for a
// floating-point MIN or MAX, whose NaN the two-level plans keep (xdev's kernels
// reduce across hosts) and the engine's ring can drop, so that the result does
// not depend on the size.
void keep_nan_across_hosts(AcrossHostsChoice& c);

// ---- Reduce-scatter and all-gather across hosts ----
//
// `bytes` is the full tensor: all P blocks, one per rank (a reduce-scatter's
// input, an all-gather's output). The two-level all-gather is
//   1. across hosts, the engine all-gathers each rank's block among the ranks
//      of its local index (L groups of H ranks at once): every rank then holds
//      the H blocks of its local index;
//   2. inside each host, an all-gather of those H blocks over shared memory.
// The two-level reduce-scatter is its mirror: inside each host a
// reduce-scatter leaves local rank l with the host's partial sums of the H
// blocks of local index l, then the engine reduce-scatters them among the
// ranks of local index l. Either way half an allreduce's traffic: the
// engine's flat form is half its ring ((P-1) steps of bytes/P), the two-level
// form (H-1) steps of bytes/P across hosts, L streams at once. An engine
// that runs its reduce-scatter as a whole allreduce only costs more than
// modelled, so the model errs toward the engine.
Traffic flat_ring_gather_scatter_traffic(const HostLayout& hosts, int64_t bytes);
Traffic two_level_gather_scatter_traffic(const HostLayout& hosts, int64_t bytes);

// Predicted seconds. `host` models one host's shared-memory path for
// ranks_per_host ranks; its staged form runs the half inside the host (a
// reduce-scatter reducing elements of elem_bytes, an all-gather moving bytes).
// The two-level forms include the exchange of calls, which a reduce-scatter
// whose partial sums the engine sends overlaps with its step inside the host
// as the allreduce's first piece does.
double predict_flat_ring_gather_scatter_s(const HostLayout& hosts, int64_t bytes,
                                          const NetworkParams& net);
double predict_two_level_gather_scatter_s(GatherScatterKind kind, const HostLayout& hosts,
                                          int64_t bytes, int64_t elem_bytes,
                                          const NetworkParams& net, const MachineModel& host);

// The leader form of each, where what a host sends across rides whole in the
// exchange of calls, as for the allreduce:
//   all-gather: inside each host an all-gather of its ranks' blocks; local
//     rank 0 alone exchanges the host's L blocks (with the call) with the
//     other hosts' local ranks 0; a broadcast inside the host hands out the
//     other hosts' blocks (costed as an all-gather of those bytes);
//   reduce-scatter: the allreduce's leader form on the whole input, of which
//     each rank keeps its block.
// It fits where the host's blocks (an all-gather: bytes / H) or the host's
// sum of the whole input (a reduce-scatter: bytes) ride whole.
bool gather_scatter_leader_fits(GatherScatterKind kind, const HostLayout& hosts, int64_t bytes);
double predict_two_level_gather_scatter_leader_s(GatherScatterKind kind, const HostLayout& hosts,
                                                 int64_t bytes, const NetworkParams& net,
                                                 const MachineModel& host);

// The fastest of the engine's ring and the two forms for `bytes`, with the
// predictions in the reason.
AcrossHostsChoice choose_gather_scatter_across_hosts(GatherScatterKind kind,
                                                     const HostLayout& hosts, int64_t bytes,
                                                     int64_t elem_bytes, const NetworkParams& net,
                                                     const MachineModel& host);

// ---- Broadcast across hosts ----
//
// The engine's broadcast is Gloo's binomial tree over all P ranks: ceil(log2
// P) steps, each a whole message from every rank that holds the data to one
// that does not, nearest ranks first. With ranks numbered host by host, the
// first steps stay inside the root's host (through sockets) and the last
// ceil(log2 H) cross hosts, every rank of a host that holds the data sending
// at once.
//
// The two-level broadcast: the local ranks 0, one per host, exchange the call
// (the payload riding along when it fits), else the engine broadcasts among
// them (a tree of H ranks, one stream per host); then each host broadcasts
// over shared memory (costed as an all-gather of the payload, as the leader
// forms' last step is). A root that is not its host's local rank 0 first
// broadcasts inside its host: a step the prediction leaves out. It never sends
// more across hosts than the engine, but pays the exchange's fixed-size
// message and a step inside the host: with few ranks per host and a fast
// network the engine can win.
double predict_flat_broadcast_s(const HostLayout& hosts, int64_t bytes, const NetworkParams& net);
double predict_two_level_broadcast_s(const HostLayout& hosts, int64_t bytes,
                                     const NetworkParams& net, const MachineModel& host);
// The faster of the two for `bytes`, with both predictions in the reason.
AcrossHostsChoice choose_broadcast_across_hosts(const HostLayout& hosts, int64_t bytes,
                                                const NetworkParams& net, const MachineModel& host);

}  // namespace xdev::plan
