// Allreduce of CPU tensors across hosts by the two-level plan
// (plan/two_level.h): a reduce-scatter over this host's shared-memory channel
// leaves local rank l with its host's sum of slice l; the engine (Gloo)
// allreduces slice l among the ranks of local index l, one per host (or, for
// a slice small enough to ride in the exchange of calls across hosts, every
// rank of that group sums the hosts' partial sums it received, in host
// order); an all-gather over the host's channel puts the slices together.
// Every rank ends with the same bits: the engine's result is only copied, and
// the sums of carried slices are made alike on every rank. A tensor from the
// host's symmetric heap (a DDP bucket) is read in place inside the host where
// staging would take several windows (plan::in_host_step_in_place). A large
// payload may run as a pipeline of pieces (plan::schedule_two_level): the op
// thread works inside the host on the pieces after and before the one the
// engine carries across hosts. A payload that rides whole in the exchange may
// take the leader form (plan::predict_two_level_leader_s): only local rank 0
// crosses hosts, and a broadcast inside the host hands out its result.
//
// Runs on the group's queue like every native collective, so it keeps their
// order; the op thread waits for the engine's last piece before it ends.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/cost_model.h"
#include "../plan/two_level.h"
#include "../transport/gather_scatter_executor.h"
#include "../transport/shm_executor.h"
#include "cross_host_check.h"
#include "group_context.h"
#include "shared_buffers.h"

namespace xdev::backend {

// Shared by the two-level collectives. The engine's op for a native op: AVG
// is a SUM across hosts (see TwoLevelOps for where it divides).
c10d::ReduceOp two_level_engine_op(kernels::ReduceOp op);

// How a two-level collective runs a native op at each level. AVG of float16
// divides by the group's size in the reduce-scatter inside the host, before
// anything crosses hosts, and only sums after: a host's partial sum can pass
// float16's largest value (65504) where every average fits, which the native
// kernels of one host, accumulating in float32, would not let happen. Every
// other dtype sums everywhere and divides once at the end (integers
// truncating as the kernels do), as a sum then a division gives the same bits
// as on one host; their range leaves the partial sums room.
struct TwoLevelOps {
  kernels::ReduceOp in_host;  // the reduce-scatter inside the host; its AVG
                              // divides by the group's size (avg_divisor)
  kernels::ReduceOp across;   // of the hosts' partial results (reduce_payloads)
  bool divide_after = false;  // the engine's SUM still needs the division
};
TwoLevelOps two_level_ops(kernels::ReduceOp op, c10::ScalarType dtype);
// Whether the step across hosts gathers every host's slice and reduces them
// with xdev's kernels, in host order, rather than the engine's allreduce: for
// MIN and MAX of floating-point dtypes, whose NaN the kernels keep (as
// torch.amax) and Gloo's comparison can drop. An all-gather moves what a
// ring allreduce does between two hosts, (H-1)/2 times more across H
// (MIN and MAX are rare beyond a few scalars; those ride in the exchange).
bool gathers_across_hosts(kernels::ReduceOp op, c10::ScalarType dtype);
// out (contiguous) = op over the `hosts` rows of `rows` (contiguous, each
// out's size), in host order: the same bits on every rank that holds them.
// op is not AVG.
void reduce_rows_in_host_order(const at::Tensor& rows, int hosts, kernels::ReduceOp op,
                               const at::Tensor& out);
// The time an engine's call may take: what is left until `deadline`, at least 1 ms.
std::chrono::milliseconds engine_timeout(transport::Clock::time_point deadline);
// "host 'NAME', whose local ranks are group ranks 0, 1": errors of the host's
// channel number its ranks locally, so the two-level collectives say which
// group ranks they are.
std::string host_and_its_ranks(const GroupContext& group);
// Waits for an engine's call; throws transport::PeerError naming `what`, the
// engine's reason and what may keep a peer away when it fails or times out.
void wait_for_engine(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout,
                     const char* what);
// Runs a step inside the host (req's context made): in place from the host's
// symmetric heap where `placement` (of req's full tensor 0) is in it, staging
// would take several windows (plan::in_host_step_in_place) and every local
// rank's tensor lies at the same place; staged otherwise. Logs once which,
// naming the step `name`.
void run_in_host_step(GroupContext& group, transport::GatherScatterExecutor& executor,
                      transport::GatherScatterRequest& req, const SharedPlacement& placement,
                      const std::string& name);

class TwoLevelAllreduce {
 public:
  // The group must have a host channel (GroupContext::host_channel). engine:
  // the ranks of this local rank on every host, in host order (their ranks
  // there are host indices).
  // shared: says which tensors lie in this host's symmetric heap.
  TwoLevelAllreduce(GroupContext& group, const SharedBuffers& shared,
                    std::shared_ptr<CrossHostEngine> engine);

  const plan::MachineModel& host_model() const { return host_model_; }
  const plan::NetworkParams& network() const { return network_; }

  // Tensors of one native dtype; op as the native kernels run it (AVG: SUM
  // everywhere, then a division by the world size of the slice before the
  // all-gather, integers truncated as the kernels do: divide_for_avg). The
  // payload is pipelined in `pieces` pieces (plan::schedule_two_level), at
  // most one per element of a local rank's slice, or, with `leader`, runs in
  // the leader form (a payload that fits plan::leader_form_fits).
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> tensors, kernels::ReduceOp op,
                                           int pieces, bool leader,
                                           std::chrono::milliseconds timeout, bool async_op);

  // The leader form of one piece on the op thread: the host's sum on every
  // local rank, local rank 0's exchange across hosts, a broadcast inside the
  // host. `flat` is contiguous and holds the whole payload; `call` describes
  // the call for the checks (a two-level reduce-scatter runs its leader form
  // here with its own call), and `what` names it in errors; `placement` says
  // where flat lies in this host's symmetric heap, if it does.
  void run_leader(const at::Tensor& flat, kernels::ReduceOp op, transport::OpDescriptor call,
                  transport::Clock::time_point deadline, const SharedPlacement& placement,
                  const char* what);

  // On the op thread, at a barrier of the group: returns once every rank of
  // the group has got there, and so has finished the collectives it queued
  // before it. This host's ranks meet on the host channel, then the ranks of
  // this local index on every host meet on the engine (each having passed its
  // own host's barrier first).
  void barrier(transport::Clock::time_point deadline);

  // This rank's own checks of a call its peers run in two levels
  // (CrossHostCheck::check_with_peers).
  void check_with_peers(Collective collective, const char* name, std::chrono::milliseconds timeout,
                        const std::function<void()>& check) {
    check_.check_with_peers(collective, name, timeout, check);
  }

  // Drops the engine (its destructor joins its threads).
  void shutdown() {
    engine_.reset();
    check_.shutdown();
  }

 private:
  // On the op thread: `flat` is contiguous and holds the whole payload;
  // `call` describes the call for the check across hosts; `placement` says
  // where flat lies in this host's symmetric heap, if it does. Pieces after
  // the first are reduce-scattered and all-gathered inside the host while the
  // engine allreduces the one before across hosts.
  void run(const at::Tensor& flat, kernels::ReduceOp op, int pieces, transport::OpDescriptor call,
           transport::Clock::time_point deadline, const SharedPlacement& placement);
  // One half over the host channel: reduce-scatter `flat` into `slice`
  // (this local rank's), or all-gather the slices back into `flat`. The
  // host's ranks check that they all make `call` (`what` names it). In place
  // (nothing staged) when flat lies at one place of every local rank's heap.
  // `after_check`, if set, runs once the host's check has passed, before
  // this rank reads any peer's data (GatherScatterRequest::after_check).
  void run_in_host(plan::GatherScatterKind kind, const at::Tensor& flat, const at::Tensor& slice,
                   kernels::ReduceOp op, const transport::OpDescriptor& call,
                   transport::Clock::time_point deadline, const SharedPlacement& placement,
                   const char* what, std::function<void()> after_check = {});

  GroupContext& group_;
  const SharedBuffers& shared_;
  plan::MachineModel host_model_;
  plan::NetworkParams network_;
  transport::GatherScatterExecutor executor_;
  transport::ShmExecutor broadcast_executor_;  // the leader form's last step
  std::shared_ptr<CrossHostEngine> engine_;
  CrossHostCheck check_;
  std::string where_;  // how errors name this host and its ranks
};

}  // namespace xdev::backend
