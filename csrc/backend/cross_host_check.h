// The mismatch check of the two-level collectives across hosts.
//
// Inside a host, every rank publishes its call's descriptor before the first
// barrier of a step and all compare them (ShmChannel::check_same_descriptor);
// that sees only one host's ranks. The engine (Gloo) checks nothing: ranks of
// different hosts passing different sizes would leave some of them waiting on
// the engine until the timeout, or read a wrong result. So before its first
// step a two-level collective exchanges its call's descriptor with the ranks
// of its local index on the other hosts (one all-gather of a few integers by
// the engine). When they differ:
//   1. every rank of that cross-host group sees the same H descriptors, so all
//      of them refuse, and none runs the engine's data step;
//   2. each takes part in its host's next descriptor check with a descriptor
//      no call has (num_tensors -1), so that its host's other ranks, whose
//      groups agreed, fail there too rather than wait for it;
//   3. it throws MismatchError naming every host's call.
// Ranks of one host that disagree among themselves are caught by the host's
// own check as before. Either way every rank stops at the same step with an
// error and the group stays usable.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>

#include "../transport/shm_channel.h"
#include "group_context.h"

namespace xdev::backend {

class CrossHostCheck {
 public:
  // engine: this rank's cross-host group (its ranks there are host indices).
  CrossHostCheck(GroupContext& group, c10::intrusive_ptr<c10d::Backend> engine);

  // On the op thread, before the collective's first step. `call` describes
  // this rank's call (its seq is ignored); `what` names the collective in errors.
  // Returns when every host's rank of this local index made the same call;
  // otherwise runs steps 2 and 3 above and throws transport::MismatchError.
  void check(const transport::OpDescriptor& call, const char* what,
             transport::Clock::time_point deadline);

  void shutdown() { engine_.reset(); }

 private:
  GroupContext& group_;
  c10::intrusive_ptr<c10d::Backend> engine_;
};

}  // namespace xdev::backend
