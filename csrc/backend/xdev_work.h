// The Work handle of a native xdev collective. The backend's worker thread
// completes it; wait() (inherited) blocks on it and rethrows a failure as the
// DistBackendError it was stored as; getFuture() is what DDP's comm hooks use,
// and its value is the list of result tensors.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <vector>

namespace xdev::backend {

class XdevWork : public c10d::Work {
 public:
  // devices: where the outputs live, for a future with CUDA stream semantics
  // (empty for CPU tensors).
  XdevWork(int rank, c10d::OpType op_type, const char* profiling_title,
           std::vector<at::Tensor> outputs, std::vector<c10::Device> devices = {});

  // Called on the thread that ran the collective (the CUDA work marks its
  // future with its stream current, see CudaWork).
  virtual void complete();
  void fail(std::exception_ptr error);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace xdev::backend
