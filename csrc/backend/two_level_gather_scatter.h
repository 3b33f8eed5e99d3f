// All-gather and reduce-scatter of CPU tensors across hosts by the two-level
// plan (plan/two_level.h), for groups whose H hosts hold the same number
// L > 1 of ranks.
//
// Words used here. A rank's *block* is its C elements of a *full* tensor of P
// blocks in group-rank order (an all-gather's output, a reduce-scatter's
// input). The ranks of local index l, one per host in host order, form this
// rank's *cross-host group*: the engine (Gloo) this rank talks to there, as
// rank host_index. *Host-major order* lists the ranks host by host, each
// host's in rank order: host h's ranks are positions [h*L, (h+1)*L).
//
// All-gather: (1) the engine all-gathers this rank's block in its cross-host
// group, leaving the H blocks of local index l in host order; (2) an
// all-gather over the host's channel moves those H blocks to every local
// rank. Step 2 runs as H tensors, tensor h being host h's L blocks, so that
// every block lands at its rank's place in the full tensor.
// Reduce-scatter is its mirror: (1) a reduce-scatter over the host's channel
// of the same H tensors leaves local rank l with its host's partial sums of
// the H blocks of local index l, packed in host order; (2) the engine
// reduce-scatters them in the cross-host group. Sums inside a host go in
// local-rank order, across hosts in the engine's order.
// What a rank sends across hosts rides in the exchange of calls when it fits
// (plan::carried_across_hosts): then the engine's step is that exchange, and
// a reduce-scatter's rank sums its block from every host's partial sums
// itself, in host order.
//
// The leader form (plan::gather_scatter_leader_fits), where what a host
// sends across rides whole in the exchange: an all-gather inside the host
// puts the host's L blocks on every local rank, local rank 0 alone exchanges
// them with the other hosts' local ranks 0, and a broadcast inside the host
// hands out the other hosts' blocks. A reduce-scatter's leader form is the
// allreduce's (TwoLevelAllreduce::run_leader) on a copy of the whole input,
// of which each rank keeps its block.
//
// Host h's blocks are one piece of the full tensor when its ranks are
// consecutive, as torchrun numbers them. When the group's ranks are not in
// host-major order, the full tensor goes through a host-major copy: permuted
// after the all-gather, before the reduce-scatter.
//
// A full tensor from the host's symmetric heap (FSDP2's all-gather output and
// reduce-scatter input with set_allocate_memory_from_process_group_for_comm;
// one tensor, ranks in host-major order) is read in place by the step inside
// the host, where staging it would take several windows and every local
// rank's lies at the same place (run_in_host_step).
//
// Runs on the group's queue like every native collective, so it keeps their
// order; the engine's part blocks the op thread until the engine is done.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/gather_scatter_plan.h"
#include "../transport/gather_scatter_executor.h"
#include "../transport/shm_executor.h"
#include "cross_host_check.h"
#include "group_context.h"
#include "shared_buffers.h"
#include "two_level_allreduce.h"

namespace xdev::backend {

class TwoLevelGatherScatter {
 public:
  // The group must have a host channel (GroupContext::host_channel). shared:
  // says which tensors lie in this host's symmetric heap. engine: this rank's
  // cross-host group (its ranks there are host indices). allreduce: the
  // group's two-level allreduce, which runs the reduce-scatter's leader form
  // (it must outlive this object).
  TwoLevelGatherScatter(GroupContext& group, const SharedBuffers& shared,
                        std::shared_ptr<CrossHostEngine> engine, TwoLevelAllreduce& allreduce);

  // outputs[i] (P * C_i elements) = every rank's inputs[i] (C_i elements) in
  // rank order. Any dtype: bytes move. `leader`: in the leader form (the
  // selection's two_level_leader, which checked that it fits).
  c10::intrusive_ptr<c10d::Work> all_gather(std::vector<at::Tensor> outputs,
                                            std::vector<at::Tensor> inputs, c10d::OpType type,
                                            bool leader, std::chrono::milliseconds timeout,
                                            bool async_op);
  // outputs[i] (C_i elements) = op over ranks of block `rank` of inputs[i]
  // (P * C_i elements). One native dtype for every tensor; AVG is a SUM,
  // then a division by P (integers truncated, as the kernels do).
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor> outputs,
                                                std::vector<at::Tensor> inputs,
                                                kernels::ReduceOp op, c10d::OpType type,
                                                bool leader, std::chrono::milliseconds timeout,
                                                bool async_op);

  // The list forms, one tensor per rank in each list, every entry the size of
  // this rank's (uneven lists go to the engine; the backend sends them there):
  // outputs[i][r] = rank r's inputs[i] (all_gather, allgather_coalesced), and
  // outputs[i] = op over ranks of inputs[i][rank] (reduce_scatter). Each list
  // is one flat copy of the tensor form, in before a reduce-scatter, out after
  // an all-gather.
  c10::intrusive_ptr<c10d::Work> all_gather_list(std::vector<std::vector<at::Tensor>> outputs,
                                                 std::vector<at::Tensor> inputs, c10d::OpType type,
                                                 bool leader, std::chrono::milliseconds timeout,
                                                 bool async_op);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_list(std::vector<at::Tensor> outputs,
                                                     std::vector<std::vector<at::Tensor>> inputs,
                                                     kernels::ReduceOp op, bool leader,
                                                     std::chrono::milliseconds timeout,
                                                     bool async_op);

 private:
  // On the op thread; outputs and inputs are contiguous.
  void run_all_gather(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                      bool leader, transport::Clock::time_point deadline, uint64_t hash);
  void run_reduce_scatter(const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& inputs, kernels::ReduceOp op, bool leader,
                          transport::Clock::time_point deadline, uint64_t hash);
  // The all-gather's leader form; `full` is host-major, `call` the call.
  void run_all_gather_leader(const std::vector<at::Tensor>& full,
                             const std::vector<at::Tensor>& inputs,
                             const transport::OpDescriptor& call,
                             transport::Clock::time_point deadline, uint64_t hash);
  // Step inside the host: tensor t's L blocks of layout.numel(t) elements
  // start at full[t] (local rank l's at l times that), its block of this
  // rank at block[t]. `placement`: where full[0] lies in the host's heap
  // (every full[t] then lies within that one heap tensor), if it does. A
  // reduce-scatter runs `op` inside the host; the host's ranks check the op
  // the call asked for, `asked` (an AVG runs as a SUM here, so a rank asking
  // SUM would otherwise pass). `after_check`, if set, runs once the host's
  // check has passed, before this rank reads any peer's data.
  void run_in_host(plan::GatherScatterKind kind, const std::vector<char*>& full,
                   const std::vector<char*>& block, const plan::FlatLayout& layout,
                   kernels::DType dtype, int64_t elem_size, kernels::ReduceOp op,
                   kernels::ReduceOp asked, uint64_t hash, transport::Clock::time_point deadline,
                   const SharedPlacement& placement, std::function<void()> after_check = {});
  // Where the one full tensor of a call lies in the host's heap, when the step
  // inside the host may read it in place there (ranks in host-major order).
  SharedPlacement heap_placement(const std::vector<at::Tensor>& full) const;
  // The full tensor `full` (P blocks) as a host-major copy, or the reverse.
  at::Tensor to_host_major(const at::Tensor& full) const;
  void from_host_major(const at::Tensor& host_major, const at::Tensor& full) const;
  // A full tensor's bytes as P rows, one block each.
  at::Tensor blocks_of(const at::Tensor& full) const;

  GroupContext& group_;
  const SharedBuffers& shared_;
  transport::GatherScatterExecutor executor_;
  transport::ShmExecutor broadcast_executor_;  // the all-gather leader form's last step
  std::shared_ptr<CrossHostEngine> engine_;
  TwoLevelAllreduce& allreduce_;
  CrossHostCheck check_;
  // Group ranks in host-major order; undefined when that is rank order.
  at::Tensor host_major_ranks_;
  std::string what_reduce_scatter_;  // how errors name the step inside the host
  std::string what_all_gather_;
  std::string what_broadcast_;
};

}  // namespace xdev::backend
