// Learns a group's GPUs through its Store, the first step of the CUDA path's
// rendezvous: every rank's GPU (PCI bus id) and compute capability, whether
// every rank sees a CUDA MPS daemon, which GPUs reach which, the ranks on each
// GPU, and the NVLinks (an injected XDEV_TOPO_FILE, else NVML as rank 0 sees
// them), classified, with a machine model where every rank of the one host has
// a GPU of its own. Built only when torch has CUDA.
#pragma once

#include <string>

#include "../cuda_collectives.h"
#include "../group_context.h"

namespace xdev::backend {

// Collective over the group (through its Store only, under `key`): fills
// every field of *info that describes the GPUs (not device, the transport or
// the heap). Every rank derives the same answer from the same Store values.
// Returns whether every rank's GPU reaches every other's.
bool learn_gpus(GroupContext& group, const std::string& key, int device, CudaGroupInfo* info);

}  // namespace xdev::backend
