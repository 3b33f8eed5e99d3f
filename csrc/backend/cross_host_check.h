// The mismatch check of the two-level collectives across hosts.
//
// Inside a host, every rank publishes its call's descriptor before the first
// barrier of a step and all compare them (ShmChannel::check_same_descriptor);
// that sees only one host's ranks. The engine (Gloo) checks nothing: ranks of
// different hosts passing different sizes would leave some of them waiting on
// the engine until the timeout, read a wrong result, or abort in Gloo (it
// kills the process when a message is longer than the receiver's buffer). So
// before any of its data crosses hosts a two-level collective exchanges its
// call's descriptor with the ranks of its local index on the other hosts: one
// all-gather by the engine of a message of fixed size
// (plan::kCrossHostMessageBytes), which may carry the collective's payload as
// well (plan/two_level.h). When the calls differ:
//   1. every rank of that cross-host group sees the same H descriptors, so all
//      of them refuse, and none runs the engine's data step;
//   2. where a step inside the host follows, each takes part in its host's
//      next descriptor check with a descriptor no call has (num_tensors -1),
//      so that its host's other ranks, whose groups agreed, fail there too
//      rather than wait for it;
//   3. it throws MismatchError naming every host's call.
// Ranks of one host that disagree among themselves are caught by the host's
// own check. A collective whose first step is inside the host then sends its
// exchange as a refusal (refuse()), so that the other hosts' ranks fail too
// rather than wait for it. In a leader form, where only local rank 0
// exchanges, every other rank that a mismatch stops sends a refusal as well,
// so each rank crosses once whichever form each host ran. Either way every
// rank stops at the same step with an error and the group stays usable.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../transport/shm_channel.h"
#include "cross_host_engine.h"
#include "group_context.h"

namespace xdev::backend {

class CrossHostCheck {
 public:
  // engine: this rank's cross-host group (its ranks there are host indices).
  CrossHostCheck(GroupContext& group, std::shared_ptr<CrossHostEngine> engine);

  // On the op thread, before any data of the collective crosses hosts. `call`
  // describes this rank's call (its seq is ignored); `what` names the
  // collective in errors. When `payload_bytes` fits
  // (plan::carried_across_hosts), the payload rides along. Returns every
  // host's message, host by host (payload_of), once every host's rank of
  // this local index made the same call; otherwise runs steps 2 (when
  // `host_step_follows`) and 3 above and throws transport::MismatchError.
  at::Tensor exchange(const transport::OpDescriptor& call, const void* payload,
                      int64_t payload_bytes, bool host_step_follows, const char* what,
                      transport::Clock::time_point deadline) {
    Exchange sent = start(call, payload, payload_bytes, deadline);
    return finish(sent, host_step_follows, what, deadline);
  }

  // exchange() around a collective's first step, inside the host (a
  // reduce-scatter): calls `host_step` with the after_check it must hand that
  // step (GatherScatterRequest::after_check). Where the payload rides along
  // (`carried`: what `payload` holds once the step is done), the exchange
  // follows the step. Otherwise the call leaves from after_check, once the
  // host's ranks agree on it, and travels while they move their data. Where
  // the host's own check fails before the call left, sends a refusal
  // (refuse()) and rethrows, so that every rank crosses hosts once.
  at::Tensor exchange_around_host_step(
      const transport::OpDescriptor& call, bool carried, const void* payload, int64_t payload_bytes,
      bool host_step_follows, const char* what, transport::Clock::time_point deadline,
      const std::function<void(std::function<void()> after_check)>& host_step);

  // exchange() without a payload, before the collective's first step.
  void check(const transport::OpDescriptor& call, const char* what,
             transport::Clock::time_point deadline) {
    exchange(call, nullptr, 0, /*host_step_follows=*/true, what, deadline);
  }

  // For a rank whose host's own check failed before its exchange: sends the
  // exchange as a refusal, so that the other hosts' ranks of its local index
  // fail instead of waiting for it. The caller then rethrows its error.
  void refuse(transport::Clock::time_point deadline);

  // Runs `check` (this rank's own checks of its arguments) before a two-level
  // collective is queued, as GroupContext::check_with_peers does on one host.
  // When it throws, this rank still takes its part in the call, in order with
  // its other collectives: it opens its host's check with a descriptor saying
  // it refused (kRefusedCall), which fails every local peer that called
  // validly, and crosses hosts once with a refusal (refuse()), as a rank a
  // mismatch stops does in every two-level collective. So the peers on
  // every host fail at this call instead of pairing it with this rank's next
  // one; ranks that all refused pass alike and each raises its own error.
  // Then the check's error goes up.
  void check_with_peers(Collective collective, const char* name, std::chrono::milliseconds timeout,
                        const std::function<void()>& check);

  // Host h's payload in exchange()'s result.
  static const char* payload_of(const at::Tensor& messages, int host);

  // out (a contiguous tensor of `out`'s dtype) = op over the H hosts' payloads,
  // each read from `offset_bytes` into it, in host order, so that every rank
  // that received the same messages holds the same bits. An AVG divides by
  // the group's size (every rank's contribution is in the hosts' partial sums).
  void reduce_payloads(const at::Tensor& messages, int64_t offset_bytes, kernels::ReduceOp op,
                       const at::Tensor& out) const;

  void shutdown() { engine_.reset(); }

 private:
  // exchange() in two halves: start() sends this rank's message and returns
  // at once; finish() waits for every host's and compares them. A rank that
  // started one must finish it, or fail the group.
  struct Exchange {
    transport::OpDescriptor call;
    std::vector<int64_t> fields;  // this rank's header
    at::Tensor all;               // every host's message, host by host
    c10::intrusive_ptr<c10d::Work> work;
  };
  Exchange start(const transport::OpDescriptor& call, const void* payload, int64_t payload_bytes,
                 transport::Clock::time_point deadline);
  at::Tensor finish(Exchange& sent, bool host_step_follows, const char* what,
                    transport::Clock::time_point deadline);

  // Starts refuse()'s all-gather (its `call` and `fields` left empty).
  Exchange start_refusal(transport::Clock::time_point deadline);
  // Starts the engine's all-gather of every host's message; `all` receives them.
  c10::intrusive_ptr<c10d::Work> start_all_gather(const at::Tensor& message, const at::Tensor& all,
                                                  transport::Clock::time_point deadline);
  static void wait_all_gather(const c10::intrusive_ptr<c10d::Work>& work,
                              transport::Clock::time_point deadline);

  GroupContext& group_;
  std::shared_ptr<CrossHostEngine> engine_;
};

}  // namespace xdev::backend
