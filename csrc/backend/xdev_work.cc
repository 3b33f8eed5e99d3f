#include "xdev_work.h"

namespace xdev::backend {

XdevWork::XdevWork(int rank, c10d::OpType op_type, const char* profiling_title,
                   std::vector<at::Tensor> outputs, std::vector<c10::Device> devices)
    : c10d::Work(rank, op_type, profiling_title, outputs),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(),
                                                       std::move(devices))) {}

// The future first: wait() returns once finish() has run, and a caller may
// read the future right after (Gloo's work completes in this order too).
void XdevWork::complete() {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void XdevWork::fail(std::exception_ptr error) {
  future_->setError(error);
  finish(error);
}

}  // namespace xdev::backend
