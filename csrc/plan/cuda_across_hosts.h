// Several hosts with CUDA tensors: NCCL over every rank against a two-level
// allreduce, so that whether such a plan would pay is a prediction rather
// than a guess. xdev has no two-level CUDA plan; the selection leaves CUDA
// tensors across hosts to NCCL (selection.cc says why).
//
// NCCL already runs hierarchically across nodes: its tree is a chain inside
// each node and a double binary tree across nodes, and its rings cross the
// network once per node and direction. The two-level plan here is the CPU
// path's structure (plan/two_level.h) on GPUs:
//   1. inside each host, a reduce-scatter of the L local GPUs (xdev's staged
//      CUDA form or NCCL's, whichever the host's model predicts faster);
//   2. across hosts, NCCL allreduces slice l among the H ranks of local index
//      l (one rank per node): L such communicators at once, sharing the
//      host's NICs evenly;
//   3. inside each host, an all-gather of the L slices.
// The steps run one after another (no pipelining), as the CPU path does where
// the host has no spare core.
//
// Wherever NCCL runs, on either side, it is predicted by its own tuning model
// (nccl_model.h), so the comparison carries NCCL's assumptions on both sides.
//
// Pure C++17, no torch or CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "cost_model.h"
#include "gather_scatter_predict.h"
#include "nccl_model.h"

namespace xdev::plan {

struct CudaAcrossHostsPrediction {
  int hosts = 0;
  int ranks_per_host = 0;
  NcclPrediction nccl;                     // NCCL's own choice over all ranks
  GatherScatterPrediction reduce_scatter;  // step 1, inside one host
  NcclPrediction across;                   // step 2, one of the L communicators
  GatherScatterPrediction all_gather;      // step 3, inside one host
  double two_level_s = 0;                  // the three steps
  bool two_level_faster = false;
  std::string reason;  // both predictions and the two-level plan's steps
};

// The NCCL view of one of the L communicators of step 2: one GPU per node, so
// no NVLS; the host's channels and NICs shared evenly among the L of them.
NcclHost across_hosts_nccl_host(const NcclHost& host, int ranks_per_host);
NcclNetwork across_hosts_nccl_network(const NcclNetwork& net, int ranks_per_host);

// Both plans for an allreduce of `bytes` on net.nodes hosts, each the machine
// `host` (its GPUs are one host's ranks; it must have NCCL). Throws
// std::invalid_argument for fewer than two hosts, a host of one GPU or
// without NCCL, or a network without NICs.
CudaAcrossHostsPrediction predict_cuda_across_hosts(const MachineModel& host,
                                                    const NcclNetwork& net, int64_t bytes);

}  // namespace xdev::plan
