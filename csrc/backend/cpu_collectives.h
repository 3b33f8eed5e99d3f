// The backend's CPU side: native collectives on CPU tensors of ranks that
// share a host, over the group's shared-memory channel.
//
// One entry point per collective chooses among three executors, all torch-free
// (csrc/transport): staged (ShmExecutor: tensors are copied through the
// channel's slots, any schedule, any tensor list), single copy
// (SingleCopyExecutor: peers read one large tensor in place with
// process_vm_readv, when every rank may) and in place (SharedBufferExecutor:
// the tensor lies in a shared_empty buffer every rank maps). It mirrors
// CudaCollectives: the backend selects, this runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/cpu_reduce.h"
#include "../plan/cost_model.h"
#include "../plan/selection.h"
#include "../transport/shared_buffer.h"
#include "../transport/shm_executor.h"
#include "../transport/single_copy_executor.h"
#include "allreduce_call.h"
#include "group_context.h"
#include "shared_buffers.h"

namespace xdev::backend {

class CpuCollectives {
 public:
  // The group must have a shared-memory channel. Collective: every rank
  // probes whether it may read its peers, and all agree through the Store.
  explicit CpuCollectives(GroupContext& group);

  bool single_copy_available() const { return single_copy_ != nullptr; }
  const std::string& single_copy_note() const { return single_copy_note_; }
  // The cost model of this host's shared-memory path that algorithm="auto" chooses by.
  const plan::MachineModel& model() const { return model_; }

  // Native allreduce (native dtypes; may mix dtypes), as sel says; in place
  // when shared holds the one tensor's buffer.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> tensors, kernels::ReduceOp op,
                                           plan::Selection sel, std::chrono::milliseconds timeout,
                                           bool async_op, SharedPlacement shared);
  // Any dtype: broadcast moves bytes.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor> tensors, int root,
                                           std::chrono::milliseconds timeout, bool async_op);
  // Runs before() on the op thread first (XdevBackend's: waiting for the work
  // handed to the engines and for this rank's GPU work).
  c10::intrusive_ptr<c10d::Work> barrier(std::chrono::milliseconds timeout, bool async_op,
                                         std::function<void()> before);

 private:
  void run_allreduce(const std::vector<at::Tensor>& tensors, kernels::ReduceOp op,
                     const plan::Selection& sel, std::chrono::milliseconds timeout,
                     const SharedPlacement& shared);

  GroupContext& group_;
  plan::MachineModel model_;
  transport::ShmExecutor staged_;
  transport::SharedBufferExecutor in_place_;
  std::unique_ptr<transport::SingleCopyExecutor> single_copy_;
  std::string single_copy_note_;  // why single copy is on or off
  AllreducePlanner planner_;      // op thread only
};

}  // namespace xdev::backend
