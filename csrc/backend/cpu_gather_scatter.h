// Native reduce-scatter and all-gather on CPU tensors of ranks that share a
// host: the tensor, coalesced and list forms of c10d, all run as one
// GatherScatterPlan per dtype (per call for all-gather, which moves bytes)
// over the group's shared-memory channel, on the group's queue like the
// allreduce. In a world of one (no channel) the output is a copy of the input.
// The backend selects (plan::select_gather_scatter); this runs. A tensor form
// whose full tensor (reduce-scatter input, all-gather output) lies in the
// group's symmetric heap runs in place when every rank's lies at the same
// place (GatherScatterExecutor), as FSDP2's buffers do with
// set_allocate_memory_from_process_group_for_comm(True).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/gather_scatter_plan.h"
#include "../plan/selection.h"
#include "../transport/gather_scatter_executor.h"
#include "group_context.h"
#include "shared_buffers.h"

namespace xdev::backend {

// How a gather/scatter request offered the heap place of its full tensor ran.
enum class HeapRun {
  kNotInHeap,     // no place offered, or a peer's copy out of reach: staged
  kInPlace,       // every rank's tensor at the same place: nothing staged
  kPlacesDiffer,  // some rank's tensor elsewhere (peers compared): staged
};

// Runs `req` (its context made) on `executor`, lending it every rank's copy of
// full tensor 0 where `placement` is in the symmetric heap shared by the ranks
// of `channel`; the executor runs in place only if every rank's lies at the
// same place, which peers compare after the first barrier.
HeapRun run_from_heap(GroupContext& group, transport::GatherScatterExecutor& executor,
                      transport::GatherScatterRequest& req, const SharedPlacement& placement,
                      const transport::ShmChannel& channel);

class CpuGatherScatter {
 public:
  // Uses the group's channel when it has one (several ranks on this host).
  // shared (not used before the first collective) says which tensors lie in
  // the group's symmetric heap.
  CpuGatherScatter(GroupContext& group, const SharedBuffers& shared);

  // outputs[i] (C_i elements) = op over ranks of block `rank` of inputs[i]
  // (world * C_i elements, blocks in rank order). Native dtypes; dtypes may mix.
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor> outputs,
                                                std::vector<at::Tensor> inputs,
                                                kernels::ReduceOp op, c10d::OpType type,
                                                std::chrono::milliseconds timeout, bool async_op,
                                                const plan::GatherScatterSelection& how);
  // outputs[i] (world * C_i elements) = every rank's inputs[i] (C_i elements)
  // in rank order. Any dtype: bytes move. `how` is plan::select_gather_scatter's
  // form: staged, single copy (one tensor: peers read inputs with
  // process_vm_readv) or in place (one tensor of the symmetric heap: staged
  // after all unless it lies at the same place on every rank).
  c10::intrusive_ptr<c10d::Work> all_gather(std::vector<at::Tensor> outputs,
                                            std::vector<at::Tensor> inputs, c10d::OpType type,
                                            std::chrono::milliseconds timeout, bool async_op,
                                            const plan::GatherScatterSelection& how);

  // The list forms: inputs (reduce-scatter) or outputs (all-gather) given as
  // one tensor per rank, copied through a contiguous tensor of the tensor
  // form. Sizes may differ between ranks (uneven) where there is one list.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_list(std::vector<at::Tensor> outputs,
                                                     std::vector<std::vector<at::Tensor>> inputs,
                                                     kernels::ReduceOp op,
                                                     std::chrono::milliseconds timeout,
                                                     bool async_op);
  c10::intrusive_ptr<c10d::Work> all_gather_list(std::vector<std::vector<at::Tensor>> outputs,
                                                 std::vector<at::Tensor> inputs,
                                                 std::chrono::milliseconds timeout, bool async_op);

 private:
  // On the op thread. outputs and inputs are contiguous.
  void run_reduce_scatter(const std::vector<at::Tensor>& outputs,
                          const std::vector<at::Tensor>& inputs, kernels::ReduceOp op,
                          std::chrono::milliseconds timeout,
                          const plan::GatherScatterSelection& how);
  void run_all_gather(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                      std::chrono::milliseconds timeout, const plan::GatherScatterSelection& how);

  // One list of uneven sizes: rank j's block holds sizes[j] elements of full.
  // list_hash: of the list's shapes, the same on every rank.
  void run_uneven(plan::GatherScatterKind kind, const at::Tensor& full, const at::Tensor& block,
                  const std::vector<int64_t>& sizes, uint64_t list_hash, kernels::ReduceOp op,
                  std::chrono::milliseconds timeout);

  // Runs req; with in_place, in place from the heap when `full` (the one full
  // tensor) lies there on every rank at the same place; logs which, once.
  void run_request(transport::GatherScatterRequest& req, const at::Tensor& full, const char* name,
                   bool in_place);

  GroupContext& group_;
  const SharedBuffers& shared_;
  std::unique_ptr<transport::GatherScatterExecutor> executor_;  // null without a channel
};

}  // namespace xdev::backend
