// Broadcast of CPU tensors across hosts in two levels, for groups whose hosts
// hold the same number L > 1 of ranks: each host's ranks check their call
// among themselves; on the root's host, a root that is not local rank 0
// broadcasts to its host's ranks; the local ranks 0, one per host, check the
// call across hosts, the root's data riding along when it fits
// (plan::carried_across_hosts), or else followed by the engine's (Gloo's)
// broadcast among them; then each host broadcasts over its shared-memory
// channel from local rank 0. One rank per host crosses hosts: H-1 copies
// leave the root's host, none between ranks of one host through sockets. Any
// dtype: bytes move, and are only copied.
//
// Runs on the group's queue like every native collective, so it keeps their
// order; the engine's part blocks the op thread until the engine is done.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "../transport/shm_executor.h"
#include "cross_host_check.h"
#include "group_context.h"

namespace xdev::backend {

class TwoLevelBroadcast {
 public:
  // The group must have a host channel (GroupContext::host_channel). engine:
  // the ranks of this rank's local index, one per host (their ranks there are
  // host indices).
  TwoLevelBroadcast(GroupContext& group, std::shared_ptr<CrossHostEngine> engine);

  // Every rank's tensors become root's (group rank).
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor> tensors, int root,
                                           std::chrono::milliseconds timeout, bool async_op);

 private:
  GroupContext& group_;
  transport::ShmExecutor executor_;
  std::shared_ptr<CrossHostEngine> engine_;
  CrossHostCheck check_;
  std::string what_;  // how errors name the step inside the host
};

}  // namespace xdev::backend
