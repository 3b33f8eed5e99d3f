#include "xdev_work.h"

#include <utility>

#include "scoped_thread_local.h"
#include "work_queue.h"

namespace xdev::backend {
namespace {

thread_local const XdevWork* t_completing = nullptr;

// Marks this thread as running `work`'s future callbacks for its lifetime (nests).
class Completing : public ScopedThreadLocal<const XdevWork*> {
 public:
  explicit Completing(const XdevWork* work) : ScopedThreadLocal(t_completing, work) {}
};

}  // namespace

void TaskRelease::released() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
  }
  cv_.notify_all();
}

void TaskRelease::wait() {
  if (runner_.load() == std::this_thread::get_id()) return;
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return released_; });
}

XdevWork::XdevWork(int rank, c10d::OpType op_type, const char* profiling_title,
                   std::vector<at::Tensor> outputs, std::vector<c10::Device> devices)
    : c10d::Work(rank, op_type, profiling_title, outputs),
      outputs_(std::move(outputs)),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), std::move(devices))),
      callbacks_place_(WorkQueue::kEverything) {}

bool XdevWork::wait(std::chrono::milliseconds timeout) {
  // Not from this Work's own callbacks: it completes once they return, and no
  // queued task brings that closer.
  if (t_completing != this) {
    // The host part's flag: a CUDA Work's isCompleted() also asks the GPU.
    WorkQueue::run_queued_while_waiting(submitted_.get(), [this] { return Work::isCompleted(); });
  }
  // Once complete, the task lets go of the call's tensors within moments
  // (its Work's callbacks have run by then): wait for that, so that the task
  // does not hold back what the caller frees after wait().
  try {
    const bool completed = Work::wait(timeout);
    task_release_->wait();
    return completed;
  } catch (...) {
    if (Work::isCompleted()) task_release_->wait();  // failed, not timed out
    throw;
  }
}

c10::intrusive_ptr<c10::ivalue::Future> XdevWork::getFuture() {
  uint64_t unset = WorkQueue::kEverything;
  if (submitted_) callbacks_place_.compare_exchange_strong(unset, submitted_->load());
  return future_;
}

void XdevWork::place_callbacks_at_get_future(
    std::shared_ptr<const std::atomic<uint64_t>> submitted) {
  submitted_ = std::move(submitted);
}

uint64_t XdevWork::callbacks_place_here() {
  return t_completing != nullptr ? t_completing->callbacks_place_.load() : WorkQueue::kEverything;
}

// The future first: wait() returns once finish() has run, and a caller may
// read the future right after (Gloo's work completes in this order too).
void XdevWork::complete() {
  Completing completing(this);
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void XdevWork::fail(std::exception_ptr error) {
  Completing completing(this);
  future_->setError(error);
  finish(error);
}

ShownResultWork::ShownResultWork(c10::intrusive_ptr<c10d::Work> inner, c10d::OpType op_type,
                                 std::vector<at::Tensor> result, c10::IValue future_value)
    : c10d::Work(-1, op_type),
      inner_(std::move(inner)),
      result_(std::move(result)),
      future_value_(std::move(future_value)) {}

ShownResultWork::ShownResultWork(c10::intrusive_ptr<c10d::Work> inner, c10d::OpType op_type,
                                 ShowTensor show)
    : c10d::Work(-1, op_type), inner_(std::move(inner)), show_(std::move(show)) {}

namespace {

// `value` with every tensor in it, at any depth of lists, passed through `show`.
c10::IValue shown_value(const c10::IValue& value, const ShownResultWork::ShowTensor& show) {
  if (value.isTensor()) return show(value.toTensor());
  if (value.isTensorList()) {
    std::vector<at::Tensor> shown;
    for (const at::Tensor& t : value.toTensorVector()) shown.push_back(show(t));
    return shown;
  }
  if (value.isList()) {
    c10::List<c10::IValue> list = value.toList();
    c10::impl::GenericList shown(list.elementType());
    for (const c10::IValue& element : list) shown.push_back(shown_value(element, show));
    return shown;
  }
  return value;
}

}  // namespace

std::vector<at::Tensor> ShownResultWork::result() {
  if (!show_) return result_;
  std::vector<at::Tensor> shown;
  for (const at::Tensor& t : inner_->result()) shown.push_back(show_(t));
  return shown;
}

c10::intrusive_ptr<c10::ivalue::Future> ShownResultWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_) {
    // Asked of the inner Work only now: its getFuture() is where a native
    // Work places the callbacks attached to it (XdevWork::getFuture). The
    // inner future's error passes on as the callback's (then() sets the
    // child's error only from an exception the callback throws).
    c10::intrusive_ptr<c10::ivalue::Future> inner = inner_->getFuture();
    if (show_) {
      future_ = inner->then(
          [show = show_](c10::ivalue::Future& done) {
            if (done.hasError()) std::rethrow_exception(done.exception_ptr());
            return shown_value(done.value(), show);
          },
          inner->elementType());
    } else {
      future_ = inner->then(
          [value = future_value_](c10::ivalue::Future& done) {
            if (done.hasError()) std::rethrow_exception(done.exception_ptr());
            return value;
          },
          future_value_.type());
    }
  }
  return future_;
}

}  // namespace xdev::backend
